//! A tiny long-context MoE language model trained on P simulated ranks ([`LocalGroup`]) with all
//! four crates, and the same model on the baselines, to prove the schedules exact end to end.
//!
//! Model: token embedding (V×H), L blocks `x ← x + MoE(RMSNorm(x))` whose router picks the top-k
//! of E experts per token (softmax renormalized over the k) and whose experts are SwiGLU FFNs
//! (H→I→H), a final RMSNorm, and the vocabulary projection W_out (V×H) with a mean next-token
//! cross-entropy. The sequence of P·N tokens is split over the ranks (N each), experts are
//! expert-parallel (E/P native per rank), W_out is vocabulary-sharded, and everything else is
//! replicated (its gradients all-reduced). One step per rank:
//!
//! - forward: each block's input is a checkpoint boundary ([`Checkpoints`]: kept on the device,
//!   or offloaded by [`sco::CheckpointOffloader`]); the MoE layer runs `llep::Executor::forward`
//!   (standard EP or PipelinedLLEP) and keeps nothing;
//! - loss: materialized logits ([`ops::materialized_loss`]) or `ring_dtp::RingLinearCrossEntropy::forward_backward`;
//! - backward: blocks in reverse, each recomputed from its boundary (`llep::Executor::backward`
//!   recomputes its rounds), router and RMSNorm backward by hand;
//! - optimizer: one flat `stream_adamw::StreamAdamW` per rank, serial or pipelined.

pub mod ops;

use flatpeak::common::gemm::Accumulate;
use flatpeak::common::{
    Communicator, DType, HeapSize, LocalGroup, LocalGroupOptions, PeakMeter, ReduceOp, SplitMix64,
};
use flatpeak::llep::{
    Config as LlepConfig, ExpertWeights, PairCap, Pass, RankInputs, Routing, Scheme, Shape,
};
use flatpeak::ring_dtp::{Config, GradOutput, Loss, Matrix, RingOptions, RingPlan};
use flatpeak::sco::CheckpointOffloader;
use flatpeak::stream_adamw::{HostDevice, Hyperparameters, Link, StepOptions, StreamAdamW};
use flatpeak::{llep, ring_dtp, sco, stream_adamw};

use ops::{Trans, gemm, materialized_loss, rmsnorm, rmsnorm_backward, top_k, top_k_backward};

/// Errors of a training run: the first error of any rank, as text with its crate.
pub type Result<T> = std::result::Result<T, String>;

fn err<E: std::fmt::Display>(what: &'static str) -> impl Fn(E) -> String {
    move |e| format!("{what}: {e}")
}

/// The model's and the run's sizes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeConfig {
    /// Ranks P.
    pub ranks: usize,
    /// Tokens per rank N.
    pub tokens: usize,
    /// Vocabulary V.
    pub vocab: usize,
    /// Hidden size H.
    pub hidden: usize,
    /// Expert intermediate size I.
    pub intermediate: usize,
    /// Experts E (a multiple of P).
    pub experts: usize,
    /// Routes per token k.
    pub top_k: usize,
    /// Blocks L.
    pub layers: usize,
    /// AdamW learning rate.
    pub lr: f64,
    /// Seed of the weights and the token sequence.
    pub seed: u64,
}

impl Default for MoeConfig {
    fn default() -> Self {
        Self {
            ranks: 4,
            tokens: 48,
            vocab: 97,
            hidden: 16,
            intermediate: 8,
            experts: 8,
            top_k: 2,
            layers: 3,
            lr: 3e-3,
            seed: 7,
        }
    }
}

/// Where the checkpoint boundaries live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Checkpoints {
    /// All L on the device (plain activation checkpointing).
    OnDevice,
    /// Selective checkpoint offload.
    Offload,
}

/// How the loss is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LossSchedule {
    /// Each rank materializes its tokens' fp32 logits against the gathered vocabulary.
    Materialized,
    /// Ring-DTP.
    Ring,
}

/// The four schedule choices of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schedules {
    /// Expert dispatch.
    pub dispatch: Scheme,
    /// The vocabulary projection and loss.
    pub loss: LossSchedule,
    /// Checkpoint boundaries.
    pub checkpoints: Checkpoints,
    /// The offloaded optimizer step.
    pub optimizer: stream_adamw::StepSchedule,
}

impl Schedules {
    /// Standard EP, materialized logits, on-device checkpoints, serial offload step.
    pub fn baseline() -> Self {
        Self {
            dispatch: Scheme::StandardEp,
            loss: LossSchedule::Materialized,
            checkpoints: Checkpoints::OnDevice,
            optimizer: stream_adamw::StepSchedule::Serial,
        }
    }
    /// PipelinedLLEP, Ring-DTP, selective checkpoint offload, OffloadStreamAdamW.
    pub fn flattened() -> Self {
        Self {
            dispatch: Scheme::PipelinedLlep,
            loss: LossSchedule::Ring,
            checkpoints: Checkpoints::Offload,
            optimizer: stream_adamw::StepSchedule::Pipelined,
        }
    }
}

/// Each component's working set on one rank, bytes (max over ranks and the steps after the
/// first). `dispatch` and
/// `vocab` are measured: the counting allocator's high-water of what the rank's thread
/// allocates during the call (plan, workspace and buffers included), less the call's outputs
/// ([`PeakMeter::measure_thread`]; the binary must install `CountingAllocator`).
/// `checkpoints` is counted by the store and `optimizer` is the staging its plan reserves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Peaks {
    /// The MoE layer's forward or backward (the larger), measured.
    pub dispatch: usize,
    /// The loss's forward + backward, measured.
    pub vocab: usize,
    /// Most checkpoint-boundary bytes on the device at once, counted by the store.
    pub checkpoints: usize,
    /// Pinned optimizer staging, from the optimizer's plan.
    pub optimizer: usize,
}

/// The loss's outputs on one rank: global mean loss, dL/d(final hidden states), dW_out shard.
type LossOut = (f64, Vec<f32>, Vec<f32>);

/// `f`'s value and its transient bytes on this rank's thread.
fn measured<R: HeapSize>(what: &'static str, f: impl FnOnce() -> Result<R>) -> Result<(R, usize)> {
    let m = PeakMeter::measure_thread(f).map_err(err(what))?;
    Ok((m.value?, m.peak_bytes))
}

impl Peaks {
    fn max(self, o: Self) -> Self {
        Self {
            dispatch: self.dispatch.max(o.dispatch),
            vocab: self.vocab.max(o.vocab),
            checkpoints: self.checkpoints.max(o.checkpoints),
            optimizer: self.optimizer.max(o.optimizer),
        }
    }
}

/// A whole run: the loss after every step, every rank's final parameters, the peaks.
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    /// Global mean loss of each step.
    pub losses: Vec<f64>,
    /// Each rank's flat parameters after the last step.
    pub params: Vec<Vec<f32>>,
    /// The components' working sets.
    pub peaks: Peaks,
}

/// One block's parameters on one rank: RMSNorm gain, router (replicated), native experts.
#[derive(Debug, Clone)]
struct Block {
    gain: Vec<f32>,
    router: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    down: Vec<f32>,
}

/// One rank's parameters.
#[derive(Debug, Clone)]
struct Params {
    emb: Vec<f32>,
    blocks: Vec<Block>,
    final_gain: Vec<f32>,
    w_out: Vec<f32>,
}

impl Params {
    /// The rank's slice of the model all ranks draw from the same seed.
    fn init(c: &MoeConfig, rank: usize, shard: std::ops::Range<usize>) -> Self {
        let (h, i, e, m) = (c.hidden, c.intermediate, c.experts, c.experts / c.ranks);
        let mut rng = SplitMix64::new(c.seed);
        let emb = rng.normal_f32(c.vocab * h, 0.0, 1.0);
        let w_all = rng.normal_f32(c.vocab * h, 0.0, (1.0 / h as f32).sqrt());
        let blocks = (0..c.layers)
            .map(|_| {
                let router = rng.normal_f32(h * e, 0.0, 0.5);
                let gate = rng.normal_f32(e * h * i, 0.0, (1.0 / h as f32).sqrt());
                let up = rng.normal_f32(e * h * i, 0.0, (1.0 / h as f32).sqrt());
                let down = rng.normal_f32(e * i * h, 0.0, (0.5 / i as f32).sqrt());
                let native = |w: &[f32]| w[rank * m * h * i..(rank + 1) * m * h * i].to_vec();
                Block {
                    gain: vec![1.0; h],
                    router,
                    gate: native(&gate),
                    up: native(&up),
                    down: native(&down),
                }
            })
            .collect();
        Self { emb, blocks, final_gain: vec![1.0; h], w_out: w_all[shard.start * h..shard.end * h].to_vec() }
    }

    /// Every tensor in one fixed order, with whether it is replicated over ranks.
    fn tensors_mut(&mut self) -> Vec<(&mut Vec<f32>, bool)> {
        let mut out: Vec<(&mut Vec<f32>, bool)> = vec![(&mut self.emb, true)];
        for b in &mut self.blocks {
            out.extend([(&mut b.gain, true), (&mut b.router, true), (&mut b.gate, false)]);
            out.extend([(&mut b.up, false), (&mut b.down, false)]);
        }
        out.extend([(&mut self.final_gain, true), (&mut self.w_out, false)]);
        out
    }

    fn flatten(&mut self) -> Vec<f32> {
        self.tensors_mut().into_iter().flat_map(|(t, _)| t.to_vec()).collect()
    }

    fn assign(&mut self, flat: &[f32]) {
        let mut at = 0;
        for (t, _) in self.tensors_mut() {
            let len = t.len();
            t.copy_from_slice(&flat[at..at + len]);
            at += len;
        }
    }

    fn zeros_like(&self) -> Self {
        let z = |v: &Vec<f32>| vec![0.0; v.len()];
        Self {
            emb: z(&self.emb),
            blocks: self
                .blocks
                .iter()
                .map(|b| Block {
                    gain: z(&b.gain),
                    router: z(&b.router),
                    gate: z(&b.gate),
                    up: z(&b.up),
                    down: z(&b.down),
                })
                .collect(),
            final_gain: z(&self.final_gain),
            w_out: z(&self.w_out),
        }
    }
}

/// The token sequence (P·N ids) and its next-token targets (the last ignored).
pub fn sequence(c: &MoeConfig) -> (Vec<i64>, Vec<i64>) {
    let total = c.ranks * c.tokens;
    let mut rng = SplitMix64::new(c.seed ^ 0x5eed);
    // A skewed token distribution, so some experts run hot.
    let tokens: Vec<i64> =
        (0..total).map(|_| (rng.below(c.vocab as u64) % (c.vocab as u64 / 3 + 1)) as i64).collect();
    let targets = (0..total).map(|t| if t + 1 < total { tokens[t + 1] } else { -100 }).collect();
    (tokens, targets)
}

/// Boundaries between forward and backward.
enum Store {
    OnDevice(Vec<Vec<f32>>),
    Offload(CheckpointOffloader<f32>),
}

impl Store {
    fn save(&mut self, layer: usize, x: &[f32]) -> Result<()> {
        match self {
            Store::OnDevice(v) => {
                v[layer] = x.to_vec();
                Ok(())
            }
            Store::Offload(o) => o.offload_copy(layer, x).map_err(err("sco offload")),
        }
    }
    fn load(&self, layer: usize) -> Result<Vec<f32>> {
        match self {
            Store::OnDevice(v) => Ok(v[layer].clone()),
            Store::Offload(o) => {
                if layer > 0 {
                    o.prefetch(layer - 1).map_err(err("sco prefetch"))?;
                }
                let x = o.fetch(layer).map_err(err("sco fetch"))?.to_vec();
                o.release(layer).map_err(err("sco release"))?;
                Ok(x)
            }
        }
    }
    fn finish(&mut self) -> Result<usize> {
        match self {
            Store::OnDevice(v) => Ok(v.iter().map(|b| b.len() * 4).sum()),
            Store::Offload(o) => {
                let bytes = o.high_water_bytes();
                o.finish_step().map_err(err("sco finish_step"))?;
                Ok(bytes)
            }
        }
    }
}

/// A block's routing of its tokens: the normed input u, each row's 1/rms, the chosen expert
/// ids and their weights.
type Routed = (Vec<f32>, Vec<f32>, Vec<i64>, Vec<f32>);

struct Rank<'a, C: Communicator> {
    comm: &'a C,
    c: MoeConfig,
    s: Schedules,
    shape: Shape,
    llep: LlepConfig,
    ring: RingPlan,
}

impl<C: Communicator> Rank<'_, C> {
    /// RMSNorm, router and top-k of one block's input.
    fn route(&self, b: &Block, x: &[f32]) -> Result<Routed> {
        let (n, h, e, k) = (self.c.tokens, self.c.hidden, self.c.experts, self.c.top_k);
        let (u, inv) = rmsnorm(x, &b.gain, h);
        let mut z = vec![0.0; n * e];
        gemm(&mut z, (n, e, h), (&u, Trans::No), (&b.router, Trans::No), Accumulate::Replace)
            .map_err(err("router"))?;
        let (ids, w) = top_k(&z, e, k);
        Ok((u, inv, ids, w))
    }

    fn moe_inputs<'b>(&self, b: &'b Block, u: &'b [f32], ids: &'b [i64], w: &'b [f32]) -> RankInputs<'b> {
        RankInputs {
            x: u,
            routing: Routing { ids, weights: w },
            experts: ExpertWeights { gate: &b.gate, up: &b.up, down: &b.down },
        }
    }

    /// The llep launch plan of every MoE block (the schedule's pair cap and buffers).
    fn llep_plan(&self) -> Result<llep::Plan> {
        llep::Plan::new(&self.llep, self.shape, llep::Budget::Unlimited).map_err(err("llep plan"))
    }

    /// `x + MoE(RMSNorm(x))`, and the MoE layer's measured working set.
    fn block_forward(&self, b: &Block, x: &[f32]) -> Result<(Vec<f32>, usize)> {
        let (u, _, ids, w) = self.route(b, x)?;
        let inputs = self.moe_inputs(b, &u, &ids, &w);
        let (y, bytes) = measured("llep forward", || {
            let launch = self.llep_plan()?;
            let plan = llep::cpu::schedule(self.comm, &launch, &inputs.routing).map_err(err("llep plan"))?;
            let bytes = plan.max_workspace_bytes(Pass::Backward);
            let mut layer = llep::Executor::with_workspace_bytes(launch, llep::Device::Cpu, bytes)
                .map_err(err("llep executor"))?;
            layer.forward(self.comm, &plan, &inputs).map_err(err("llep forward"))
        })?;
        Ok((x.iter().zip(&y).map(|(a, b)| a + b).collect(), bytes))
    }

    /// The block's backward from its input x and dY: dX, and its gradients added to `g`; and
    /// the MoE layer's measured working set.
    fn block_backward(&self, b: &Block, x: &[f32], dy: &[f32], g: &mut Block) -> Result<(Vec<f32>, usize)> {
        let (n, h, e, k) = (self.c.tokens, self.c.hidden, self.c.experts, self.c.top_k);
        let (u, inv, ids, w) = self.route(b, x)?;
        let inputs = self.moe_inputs(b, &u, &ids, &w);
        let (moe, bytes) = measured("llep backward", || {
            let launch = self.llep_plan()?;
            let plan = llep::cpu::schedule(self.comm, &launch, &inputs.routing).map_err(err("llep plan"))?;
            let bytes = plan.max_workspace_bytes(Pass::Backward);
            let mut layer = llep::Executor::with_workspace_bytes(launch, llep::Device::Cpu, bytes)
                .map_err(err("llep executor"))?;
            layer.backward(self.comm, &plan, &inputs, dy).map_err(err("llep backward"))
        })?;
        let add = |acc: &mut Vec<f32>, d: &[f32]| acc.iter_mut().zip(d).for_each(|(a, b)| *a += b);
        add(&mut g.gate, &moe.d_gate);
        add(&mut g.up, &moe.d_up);
        add(&mut g.down, &moe.d_down);
        let dz = top_k_backward(&ids, &w, &moe.d_weights, e, k);
        gemm(&mut g.router, (h, e, n), (&u, Trans::Yes), (&dz, Trans::No), Accumulate::Add)
            .map_err(err("dW_r"))?;
        let mut du = moe.dx;
        gemm(&mut du, (n, h, e), (&dz, Trans::No), (&b.router, Trans::Yes), Accumulate::Add)
            .map_err(err("du"))?;
        let dx_norm = rmsnorm_backward(x, &b.gain, &inv, &du, h, &mut g.gain);
        Ok((dy.iter().zip(&dx_norm).map(|(a, b)| a + b).collect(), bytes))
    }

    /// The loss of the final hidden states `hn`, and its measured working set.
    fn loss(&self, p: &Params, hn: &[f32], targets: &[i64]) -> Result<(LossOut, usize)> {
        measured("loss", || self.loss_of(p, hn, targets))
    }

    fn loss_of(&self, p: &Params, hn: &[f32], targets: &[i64]) -> Result<LossOut> {
        let (n, h, v) = (self.c.tokens, self.c.hidden, self.c.vocab);
        match self.s.loss {
            LossSchedule::Materialized => {
                let shards: Vec<_> = (0..self.c.ranks).map(|r| self.ring.shard(r)).collect();
                materialized_loss(self.comm, hn, &p.w_out, &shards, targets, (n, h, v)).map_err(err("loss"))
            }
            LossSchedule::Ring => {
                let inputs = ring_dtp::Inputs::new(Matrix::F32(hn), Matrix::F32(&p.w_out), targets, h);
                let (fwd, g) = ring_dtp::RingLinearCrossEntropy::new(self.ring, flatpeak_common::Device::Cpu)
                    .and_then(|mut ring| ring.forward_backward(self.comm, &inputs, GradOutput::Scalar(1.0)))
                    .map_err(err("ring-dtp"))?;
                let Loss::Scalar(l) = fwd.loss else { return Err("ring-dtp: expected a scalar loss".into()) };
                Ok((l, g.dx, g.dw))
            }
        }
    }

    /// One training step; returns the loss and this step's peaks.
    fn step(
        &self,
        p: &mut Params,
        opt: &mut StreamAdamW<f32, f32>,
        store: &mut Store,
        (tokens, targets): (&[i64], &[i64]),
    ) -> Result<(f64, Peaks)> {
        let (h, layers) = (self.c.hidden, self.c.layers);
        let mut peaks = Peaks::default();
        let mut x: Vec<f32> =
            tokens.iter().flat_map(|&t| p.emb[t as usize * h..(t as usize + 1) * h].to_vec()).collect();
        for (l, b) in p.blocks.iter().enumerate() {
            store.save(l, &x)?;
            let (next, bytes) = self.block_forward(b, &x)?;
            peaks.dispatch = peaks.dispatch.max(bytes);
            x = next;
        }
        let (hn, inv) = rmsnorm(&x, &p.final_gain, h);
        let ((loss, dhn, dw_out), vocab_bytes) = self.loss(p, &hn, targets)?;
        peaks.vocab = vocab_bytes;
        let mut g = p.zeros_like();
        g.w_out = dw_out;
        let mut dx = rmsnorm_backward(&x, &p.final_gain, &inv, &dhn, h, &mut g.final_gain);
        for l in (0..layers).rev() {
            let x_l = store.load(l)?;
            let (next, bytes) = self.block_backward(&p.blocks[l], &x_l, &dx, &mut g.blocks[l])?;
            peaks.dispatch = peaks.dispatch.max(bytes);
            dx = next;
        }
        peaks.checkpoints = store.finish()?;
        for (row, &t) in dx.chunks_exact(h).zip(tokens) {
            g.emb[t as usize * h..(t as usize + 1) * h].iter_mut().zip(row).for_each(|(a, b)| *a += b);
        }
        for (t, replicated) in g.tensors_mut() {
            if replicated {
                self.comm.all_reduce_f32(t, ReduceOp::Sum).map_err(err("all-reduce"))?;
            }
        }
        let n_params = opt.state().len();
        let mut device = HostDevice::new(g.flatten(), vec![0f32; n_params], Link::Memcpy);
        opt.step(&mut device, StepOptions::default()).map_err(err("stream-adamw"))?;
        p.assign(opt.state().param());
        peaks.optimizer = opt.plan().staging_bytes();
        Ok((loss, peaks))
    }
}

/// Trains the model `steps` steps on `c.ranks` LocalGroup ranks with the schedules `s`.
pub fn train(c: &MoeConfig, s: Schedules, steps: usize) -> Result<Run> {
    let shape = Shape {
        ranks: c.ranks,
        tokens: c.tokens,
        hidden: c.hidden,
        intermediate: c.intermediate,
        experts: c.experts,
        top_k: c.top_k,
        dtype: DType::F32,
    };
    // A small pair cap and chunk, so PipelinedLLEP runs several rounds on this tiny shape.
    let llep = LlepConfig::with_scheme(s.dispatch).min_chunk(4).pair_cap(PairCap::Rows(8));
    let ring_shape =
        ring_dtp::Shape { tokens: c.ranks * c.tokens, hidden: c.hidden, vocab: c.vocab, dtype: DType::F32 };
    let ring_options = RingOptions::default().ranks(c.ranks);
    let ring = RingPlan::new(&Config::default(), ring_shape, ring_dtp::Budget::mib(1), ring_options)
        .map_err(err("ring plan"))?;
    let (tokens, targets) = sequence(c);
    let results = LocalGroup::run(c.ranks, LocalGroupOptions::default(), |comm| {
        let rank = Rank { comm, c: *c, s, shape, llep, ring };
        let run = || -> Result<(Vec<f64>, Vec<f32>, Peaks)> {
            let r = comm.rank();
            let mut params = Params::init(c, r, ring.shard(r));
            let options = stream_adamw::Config::default()
                .schedule(s.optimizer)
                .bucket_elems(1024)
                .hyperparameters(Hyperparameters::default().lr(c.lr));
            let master = params.flatten();
            let shape = StreamAdamW::<f32, f32>::shape(master.len());
            let plan = stream_adamw::Plan::new(&options, shape, stream_adamw::Budget::Unlimited)
                .map_err(err("stream-adamw"))?;
            let mut opt = StreamAdamW::new(plan, stream_adamw::Device::Cpu).map_err(err("stream-adamw"))?;
            opt.load_master(&master).map_err(err("stream-adamw"))?;
            let mut store = match s.checkpoints {
                Checkpoints::OnDevice => Store::OnDevice(vec![Vec::new(); c.layers]),
                Checkpoints::Offload => {
                    let plan = sco::Plan::new(
                        &sco::Config::default(),
                        sco::Shape::of::<f32>(c.layers, c.tokens * c.hidden),
                        sco::Budget::Unlimited,
                    )
                    .map_err(err("sco plan"))?;
                    Store::Offload(
                        CheckpointOffloader::new(plan, Link::Memcpy).map_err(err("sco offloader"))?,
                    )
                }
            };
            let span = ring.tokens(r);
            let data = (&tokens[span.clone()], &targets[span]);
            let (mut losses, mut peaks) = (Vec::with_capacity(steps), Peaks::default());
            for step in 0..steps {
                let (loss, step_peaks) = rank.step(&mut params, &mut opt, &mut store, data)?;
                losses.push(loss);
                // The first step is a warm-up for the measured peaks: it also holds what the
                // libraries allocate once and keep (the GEMM's per-thread packing buffers).
                if step > 0 || steps == 1 {
                    peaks = peaks.max(step_peaks);
                }
            }
            Ok((losses, params.flatten(), peaks))
        };
        Ok(run())
    });
    let mut out = Run { losses: Vec::new(), params: Vec::new(), peaks: Peaks::default() };
    for (r, result) in results.into_iter().enumerate() {
        let (losses, params, peaks) = result.map_err(err("rank"))?.map_err(|e| format!("rank {r}: {e}"))?;
        if r == 0 {
            out.losses = losses;
        }
        out.params.push(params);
        out.peaks = out.peaks.max(peaks);
    }
    Ok(out)
}
