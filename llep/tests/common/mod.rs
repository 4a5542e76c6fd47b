//! Shared builders for the llep integration tests: a seeded MoE problem over P ranks, run on a
//! `LocalGroup`, and the dense f64 reference over the concatenated tokens.
#![allow(dead_code)]

use flatpeak_common::{Communicator, Device, LocalGroup, LocalGroupOptions, SplitMix64};
use llep::cpu::reference::{self, ReferenceGrads};
use llep::{
    Config, Executor, ExpertWeights, Gradients, Pass, RankInputs, Routing, Schedule, Scheme, Shape,
    WeightLayout, cpu,
};

use llep::paper::Profile;

/// A seeded problem: per-rank tokens, ids, weights and dY; all E experts' weights.
pub struct Problem {
    pub shape: Shape,
    pub x: Vec<Vec<f32>>,
    pub ids: Vec<Vec<i64>>,
    pub weights: Vec<Vec<f32>>,
    pub dy: Vec<Vec<f32>>,
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
    /// The layout `inputs` hands the weights in; under [`WeightLayout::Linear`] they are
    /// `gate_up` and `down_t`, the transposes of `gate`/`up` and `down`.
    pub layout: WeightLayout,
    pub gate_up: Vec<f32>,
    pub down_t: Vec<f32>,
}

/// How a problem's ids are drawn.
#[derive(Debug, Clone, Copy)]
pub enum Ids {
    /// The harness profile on every rank.
    Profile(Profile),
    /// Uniform random ids per slot (duplicates within a token happen).
    Random,
}

impl Problem {
    pub fn new(shape: Shape, ids: Ids, seed: u64) -> Self {
        let (p, n, h, i, e, k) =
            (shape.ranks, shape.tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k);
        let mut rng = SplitMix64::new(seed);
        let x = (0..p).map(|_| rng.normal_f32(n * h, 0.0, 1.0)).collect();
        let dy = (0..p).map(|_| rng.normal_f32(n * h, 0.0, 1.0)).collect();
        let ids = (0..p)
            .map(|_| match ids {
                Ids::Profile(profile) => profile.ids(&Shape { ranks: 1, ..shape }).unwrap(),
                Ids::Random => (0..n * k).map(|_| rng.below(e as u64) as i64).collect(),
            })
            .collect();
        let weights =
            (0..p).map(|s| llep::paper::routing_weights(n, k, seed ^ ((s as u64 + 1) * 0x9E37))).collect();
        let scale_in = 1.0 / (h as f32).sqrt();
        let scale_mid = 1.0 / (i as f32).sqrt();
        let gate = rng.normal_f32(e * h * i, 0.0, scale_in);
        let up = rng.normal_f32(e * h * i, 0.0, scale_in);
        let down = rng.normal_f32(e * i * h, 0.0, scale_mid);
        Self {
            shape,
            x,
            ids,
            weights,
            dy,
            gate,
            up,
            down,
            layout: WeightLayout::Split,
            gate_up: vec![],
            down_t: vec![],
        }
    }

    /// The same problem with the weights in torch's layout (transposed copies, made once).
    pub fn in_linear_layout(mut self) -> Self {
        let (e, h, i) = (self.shape.experts, self.shape.hidden, self.shape.intermediate);
        self.gate_up = vec![0.0; e * 2 * i * h];
        self.down_t = vec![0.0; e * h * i];
        for x in 0..e {
            for a in 0..h {
                for b in 0..i {
                    self.gate_up[x * 2 * i * h + b * h + a] = self.gate[x * h * i + a * i + b];
                    self.gate_up[x * 2 * i * h + (i + b) * h + a] = self.up[x * h * i + a * i + b];
                    self.down_t[x * h * i + a * i + b] = self.down[x * i * h + b * h + a];
                }
            }
        }
        self.layout = WeightLayout::Linear;
        self
    }

    /// Rank s's weight gradients in llep's own layout (d_gate, d_up, d_down), from gradients
    /// in the problem's layout.
    pub fn split_grads(&self, g: &Gradients) -> [Vec<f32>; 3] {
        if self.layout == WeightLayout::Split {
            return [g.d_gate.clone(), g.d_up.clone(), g.d_down.clone()];
        }
        let (m, h, i) = (self.shape.local_experts(), self.shape.hidden, self.shape.intermediate);
        assert!(g.d_up.is_empty(), "d_up is empty in the Linear layout");
        let (mut dg, mut du, mut dd) = (vec![0.0; m * h * i], vec![0.0; m * h * i], vec![0.0; m * h * i]);
        for x in 0..m {
            for a in 0..h {
                for b in 0..i {
                    dg[x * h * i + a * i + b] = g.d_gate[x * 2 * i * h + b * h + a];
                    du[x * h * i + a * i + b] = g.d_gate[x * 2 * i * h + (i + b) * h + a];
                    dd[x * i * h + b * h + a] = g.d_down[x * h * i + a * i + b];
                }
            }
        }
        [dg, du, dd]
    }

    /// Rank s's inputs (its native experts' slices).
    pub fn inputs(&self, s: usize) -> RankInputs<'_> {
        let len = self.shape.local_experts() * self.shape.hidden * self.shape.intermediate;
        let experts = match self.layout {
            WeightLayout::Split => ExpertWeights {
                gate: &self.gate[s * len..(s + 1) * len],
                up: &self.up[s * len..(s + 1) * len],
                down: &self.down[s * len..(s + 1) * len],
            },
            _ => ExpertWeights::linear(
                &self.gate_up[2 * s * len..2 * (s + 1) * len],
                &self.down_t[s * len..(s + 1) * len],
            ),
        };
        RankInputs {
            x: &self.x[s],
            routing: Routing { ids: &self.ids[s], weights: &self.weights[s] },
            experts,
        }
    }

    /// Rank s brings only its first `n` tokens (each rank may bring its own batch, up to the
    /// plan's N).
    pub fn truncate(&mut self, s: usize, n: usize) {
        let (h, k) = (self.shape.hidden, self.shape.top_k);
        self.x[s].truncate(n * h);
        self.dy[s].truncate(n * h);
        self.ids[s].truncate(n * k);
        self.weights[s].truncate(n * k);
    }

    /// Tokens rank s brings.
    pub fn tokens_of(&self, s: usize) -> usize {
        self.ids[s].len() / self.shape.top_k
    }

    /// The single-process shape of the reference: every rank's tokens.
    pub fn global_shape(&self) -> Shape {
        let tokens = (0..self.shape.ranks).map(|s| self.tokens_of(s)).sum();
        Shape { ranks: 1, tokens, ..self.shape }
    }

    pub fn reference(&self) -> (Vec<f64>, ReferenceGrads) {
        let (x, ids, w, dy) = (self.x.concat(), self.ids.concat(), self.weights.concat(), self.dy.concat());
        let inputs = RankInputs {
            x: &x,
            routing: Routing { ids: &ids, weights: &w },
            experts: ExpertWeights { gate: &self.gate, up: &self.up, down: &self.down },
        };
        let shape = self.global_shape();
        (reference::forward(&shape, &inputs).unwrap(), reference::backward(&shape, &inputs, &dy).unwrap())
    }
}

/// One rank's results of a forward + backward.
pub struct RankRun {
    pub plan: Schedule,
    pub y: Vec<f32>,
    pub grads: Gradients,
    pub workspace_bytes: usize,
    pub high_water: usize,
}

/// Plans on every rank, runs forward and backward on a CPU [`Executor`] (its workspace
/// reserved once from the launch plan; a baseline's follows the routing).
pub fn run(problem: &Problem, config: &Config) -> Vec<llep::Result<RankRun>> {
    LocalGroup::run(problem.shape.ranks, LocalGroupOptions::default(), |comm| {
        Ok((|| {
            let me = comm.rank();
            let inputs = problem.inputs(me);
            let launch = llep::Plan::new(config, problem.shape, llep::Budget::Unlimited)?;
            let mut layer = Executor::new(launch, Device::Cpu)?;
            let plan = layer.schedule(comm, &inputs.routing)?;
            let bufs = plan.buffers(me, Pass::Backward);
            let y = layer.forward(comm, &plan, &inputs)?;
            let grads = layer.backward(comm, &plan, &inputs, &problem.dy[me])?;
            Ok(RankRun {
                workspace_bytes: bufs.workspace_bytes(),
                high_water: layer.high_water(),
                plan,
                y,
                grads,
            })
        })())
    })
    .into_iter()
    .map(|r| r.map_err(llep::Error::from).and_then(|inner| inner))
    .collect()
}

/// As [`run`], in [`llep::Mode::SaveActivations`]: forward keeps its activations in a store
/// reserved at the plan's [`Schedule::saved_bytes`], backward runs from them. `high_water` is the
/// store's high-water plus the workspace's.
pub fn run_saved(problem: &Problem, config: &Config) -> Vec<llep::Result<RankRun>> {
    let config = config.mode(llep::Mode::SaveActivations);
    LocalGroup::run(problem.shape.ranks, LocalGroupOptions::default(), |comm| {
        Ok((|| {
            let me = comm.rank();
            let inputs = problem.inputs(me);
            let launch = llep::Plan::new(&config, problem.shape, llep::Budget::Unlimited)?;
            let mut layer = Executor::new(launch, Device::Cpu)?;
            let plan = layer.schedule(comm, &inputs.routing)?;
            let bufs = plan.buffers(me, Pass::Backward);
            let mut saved = cpu::SavedActivations::new(&plan, me)?;
            let y = layer.forward_saving(comm, &plan, &inputs, &mut saved)?;
            let grads = layer.backward_saved(comm, &plan, &inputs, &problem.dy[me], &mut saved)?;
            Ok(RankRun {
                workspace_bytes: bufs.workspace_bytes() + cpu::SavedActivations::bytes_for(&plan, me),
                high_water: layer.high_water() + saved.bytes(),
                plan,
                y,
                grads,
            })
        })())
    })
    .into_iter()
    .map(|r| r.map_err(llep::Error::from).and_then(|inner| inner))
    .collect()
}

/// Launch-time buffers of PipelinedLLEP (what a rank reserves before any routing is known).
pub fn launch_bytes(config: &Config, shape: &Shape) -> usize {
    llep::Plan::new(config, *shape, llep::Budget::Unlimited)
        .map(|plan| plan.buffers(Pass::Backward))
        .unwrap()
        .workspace_bytes()
}

/// A config that spills, caps and pipelines at test sizes.
pub fn small_config(scheme: Scheme) -> Config {
    Config::with_scheme(scheme).min_chunk(4).pair_cap(llep::PairCap::Rows(3)).foreign_slots(2)
}

/// One rank's forward and backward on a device backend (`ops`), y and the gradients
/// downloaded: with `saving`, the saving forward and the backward from its store (kept in the
/// inputs' dtype), else the checkpointed passes. Returns them with the host workspace's
/// high-water mark.
#[cfg(any(feature = "cuda-emu", feature = "cuda"))]
pub fn device_pass<O: llep::device::DeviceOps>(
    ops: &O,
    (plan, me, shape): (&Schedule, usize, Shape),
    dev: &llep::device::DeviceInputs<'_, O::Buf>,
    dy: &O::Buf,
    saving: bool,
) -> llep::Result<(Vec<f32>, Gradients, usize)> {
    use llep::device::{self, Store};
    use llep::plan::RouteMeta;
    let bytes = [Pass::Forward, Pass::Backward].map(|p| plan.buffers(me, p).host_workspace_bytes());
    let mut host = flatpeak_common::Workspace::new(bytes[0].max(bytes[1]))?;
    let (y, grads) = if saving {
        let dtype = ops.buf_dtype(dev.x);
        let (rows, routes) = (plan.recv_rows_total(me), plan.assignment().rank_load(me));
        let (mut sx, mut pre) =
            (ops.alloc(rows * shape.hidden, dtype)?, ops.alloc(routes * 2 * shape.intermediate, dtype)?);
        let (mut meta, mut starts) =
            (vec![RouteMeta::EMPTY; rows * shape.top_k], vec![0u32; plan.rounds() + 1]);
        let mut store = Store { x: &mut sx, meta: &mut meta, pre: &mut pre, route_start: &mut starts };
        let y = device::forward(ops, &host, plan, dev, Some(&mut store))?;
        host.reset();
        (y, device::backward(ops, &host, plan, dev, dy, Some(&mut store))?)
    } else {
        let y = device::forward(ops, &host, plan, dev, None)?;
        host.reset();
        (y, device::backward(ops, &host, plan, dev, dy, None)?)
    };
    let y = ops.download(&y, shape.tokens * shape.hidden)?;
    Ok((y, grads.download(ops)?, host.high_water()))
}
