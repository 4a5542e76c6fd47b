//! Ring-DTP over P ranks through a [`Communicator`]: each rank owns ⌈N/P⌉ tokens and a
//! vocabulary shard of ⌈V/P⌉ rows of W (see [`RingPlan`] for the layout), and the loss and
//! gradients are those of the whole N×V problem, exactly: every logit is formed once per pass,
//! by the rank that holds its token and (for that step) its vocabulary rows.
//!
//! - [`RingKind::Weight`]: W sub-blocks circulate; every rank folds each into its own tokens'
//!   statistics. Backward circulates them again with an fp32 dW accumulator beside each, which
//!   takes one extra hop home; dX never leaves its rank.
//! - [`RingKind::Activation`]: token blocks circulate with their running statistics; W and dW
//!   never leave their rank; one extra hop brings each block's statistics (forward) or dX
//!   accumulator (backward) home.
//!
//! Both take 4 GEMMs per forward + backward (the loss over the whole vocabulary is known only
//! after a full turn of the ring, so backward recomputes the logits). The immutable part of a
//! step's message (W, or X and the targets) is sent before the step's GEMMs, so it travels while
//! they run; the accumulators follow when the step is done. Accumulation orders are fixed by the
//! ring, so results are bitwise reproducible run to run. The mean's denominator and the scalar
//! loss are summed over ranks in f64, in rank order, identically on every rank.
//!
//! [`RingLinearCrossEntropy`] is the executor (host or CUDA, its working set reserved once);
//! [`agree()`] agrees a call of each rank's own tokens across the group and plans it.

mod activation;
pub mod agree;
mod executor;
mod schedule;
mod weight;

pub use agree::{AgreedRing, CUDA_ROWS_QUANTUM, RankShare, RingCall, agree};
pub use executor::{RingLinearCrossEntropy, RingRank};

pub(crate) use schedule::run_ring;
#[cfg(feature = "cuda")]
pub(crate) use schedule::{RingOps, Step};

use flatpeak_common::comm::{Communicator, CommunicatorExt, agree_on_inputs, all_gather_words};
use flatpeak_common::{DType, Workspace};

use crate::config::Config;
use crate::cpu::{
    BlockGrads, ColumnGrads, TokenBlock, VocabBlock, accumulate_grads, gradient, round_gradient_to_bf16,
    rounds_gradient,
};
use crate::error::{Error, Result};
use crate::gradients::GradientsMut;
use crate::inputs::{Forward, GradOutput, Inputs, Matrix, Upstream};
use crate::loss::{self, Stats};
use crate::plan::{RegionKind, RegionSource, RingKind, RingPlan};

/// The validated view one rank works on: its own tokens as an [`Inputs`] whose `w`/`bias` are
/// the shard and whose `v` is the whole vocabulary (targets are global).
struct Rank<'a> {
    rank: usize,
    local: Inputs<'a>,
}

fn check(what: &'static str, expected: usize, found: usize) -> Result<()> {
    if expected == found { Ok(()) } else { Err(Error::ShapeMismatch { what, expected, got: found }) }
}

/// Checks one rank's share (`inputs`: its n_r tokens, its v_r-row shard) against the plan.
fn validate<'a, C: Communicator + ?Sized>(
    comm: &C,
    plan: &RingPlan,
    inputs: &Inputs<'a>,
) -> Result<Rank<'a>> {
    let config = plan.config();
    config.validate()?;
    config.check_host_precision(plan.dtype(), "the host ring")?;
    check("world size", plan.world(), comm.world_size())?;
    let rank = comm.rank();
    let (n, v, d) = (plan.tokens(rank).len(), plan.shard(rank).len(), plan.hidden());
    check("hidden size (d)", d, inputs.d)?;
    check("x (n_r·d)", n * d, inputs.x.len())?;
    check("w shard (v_r·d)", v * d, inputs.w.len())?;
    check("targets (n_r)", n, inputs.targets.len())?;
    if let Some(b) = inputs.bias {
        check("bias shard (v_r)", v, b.len())?;
    }
    if let Some(w) = inputs.weights {
        check("weights (n_r)", n, w.len())?;
        crate::inputs::check_weights(w)?;
    }
    for dtype in [inputs.x.dtype(), inputs.w.dtype()] {
        if dtype != plan.dtype() {
            return Err(Error::DtypeMismatch { x: inputs.x.dtype(), w: inputs.w.dtype() });
        }
    }
    crate::inputs::check_targets(inputs.targets, plan.vocab(), config.ignore_index)?;
    Ok(Rank { rank, local: Inputs { n, v: plan.vocab(), ..*inputs } })
}

/// [`validate`] on every rank, agreed on by the group before any data moves: bad input on one
/// rank is an error on every rank ([`flatpeak_common::Error::PeerInput`] on the others), never a
/// wait. The ranks then check that they run one schedule: the same plan ([`RingPlan::digest`]),
/// and a bias on every rank or on none (it decides which messages the ring sends).
fn validate_agreed<'a, C: Communicator + ?Sized>(
    comm: &C,
    plan: &RingPlan,
    inputs: &Inputs<'a>,
    local_check: impl FnOnce(&Rank<'a>) -> Result<()>,
) -> Result<Rank<'a>> {
    let local = validate(comm, plan, inputs).and_then(|rank| local_check(&rank).map(|()| rank));
    let rank = agree_on_inputs(comm, local)?;
    let mine = [plan.digest(), u64::from(inputs.bias.is_some())];
    let all = all_gather_words(comm, &mine)?;
    let column = |i: usize| all.chunks_exact(mine.len()).map(|w| w[i]).collect::<Vec<u64>>();
    if column(0).iter().any(|&f| f != mine[0]) {
        return Err(Error::invalid_config(
            "plan",
            column(0),
            "the same ring plan on every rank (the ranks' shapes, budgets, rings or options differ)",
        ));
    }
    if column(1).iter().any(|&b| b != mine[1]) {
        return Err(Error::invalid_config("bias", column(1), "a bias shard on every rank or on none"));
    }
    Ok(rank)
}

/// Sums `values` over ranks in f64, in rank order, identically on every rank.
fn all_sum_f64<C: Communicator + ?Sized, const K: usize>(comm: &C, values: [f64; K]) -> Result<[f64; K]> {
    let p = comm.world_size();
    let send: Vec<f64> = (0..p).flat_map(|_| values).collect();
    let mut recv = vec![0f64; p * K];
    let counts = vec![K; p];
    comm.all_to_all_v(&send, &counts, &mut recv, &counts)?;
    let mut out = [0f64; K];
    for chunk in recv.chunks_exact(K) {
        for (o, x) in out.iter_mut().zip(chunk) {
            *o += x;
        }
    }
    Ok(out)
}

/// What a ring pass computes on a rank's own tokens.
enum Pass<'a> {
    /// Fold every logit into the statistics.
    Fold(&'a mut Stats),
    /// Form the logit gradient from the saved lse and project it.
    Grad { coef: &'a [f32], lse: &'a [f32], dlse: Option<&'a [f32]>, grads: GradientsMut<'a> },
}

fn run_pass<C: Communicator + ?Sized>(
    comm: &C,
    (plan, ws): (&RingPlan, &mut Workspace),
    rank: &Rank<'_>,
    pass: Pass<'_>,
) -> Result<()> {
    let config = plan.config();
    ws.reset();
    let ws: &Workspace = ws;
    let backward = matches!(pass, Pass::Grad { .. });
    // One backend per ring, the same call; only the buffers and the block scratch differ.
    macro_rules! drive {
        ($buffer:ident, $scratch:ident) => {{
            let mut ops = RingBackend {
                comm,
                config,
                plan,
                rank,
                pass,
                scratch: plan.$scratch(&mut Carve(ws))?,
                cur: plan.$buffer(&mut Carve(ws))?,
                inc: plan.$buffer(&mut Carve(ws))?,
                cols: ColumnGrads::with_capacity(plan.token_block()),
                credit: LinkCredit::default(),
            };
            run_ring(&mut ops, plan, rank.rank, backward)
        }};
    }
    match plan.kind() {
        RingKind::Weight => drive!(slot, weight_scratch),
        RingKind::Activation => drive!(packet, activation_scratch),
    }
}

/// A ring's CPU backend ([`RingOps`](schedule::RingOps)): the call, the two buffers `B` of its ring (the weight
/// ring's slots, the activation ring's packets) and its block scratch `S`, all carved from one
/// workspace of the plan's size, and the flow control of its links.
struct RingBackend<'a, C: ?Sized, B, S> {
    comm: &'a C,
    config: &'a Config,
    plan: &'a RingPlan,
    rank: &'a Rank<'a>,
    pass: Pass<'a>,
    scratch: S,
    cur: B,
    inc: B,
    cols: ColumnGrads,
    credit: LinkCredit,
}

impl<C: ?Sized, B, S> RingBackend<'_, C, B, S> {
    /// Bytes of one travelling row on the wire (an X row of the activation ring, a W row of
    /// the weight ring), and D.
    fn widths(&self) -> (usize, usize) {
        (elem_bytes(self.plan.dtype()), self.plan.hidden())
    }
}

/// The loss (over all ranks' tokens: the same scalar on every rank, or this rank's per-token
/// losses) and this rank's tokens' lse, on `ws` (the plan's working set). The inputs are checked
/// on every rank and the verdicts agreed on before the first message, so bad input on one rank
/// is an error on all of them.
pub(crate) fn forward<C: Communicator + ?Sized>(
    comm: &C,
    (plan, ws): (&RingPlan, &mut Workspace),
    inputs: &Inputs<'_>,
) -> Result<Forward> {
    let config = plan.config();
    let rank = validate_agreed(comm, plan, inputs, |_| Ok(()))?;
    let mut stats = Stats::new(rank.local.n);
    run_pass(comm, (plan, ws), &rank, Pass::Fold(&mut stats))?;
    let (per_token, lse) = loss::per_token_losses(config, &rank.local, plan.vocab(), &stats);
    let local_total: f64 = per_token.iter().map(|&x| x as f64).sum();
    let [total, denom] = all_sum_f64(comm, [local_total, rank.local.valid_weight(config)])?;
    Ok(Forward { loss: loss::reduce_loss(config, per_token, total, denom), lse })
}

/// This rank's dX (its tokens, n_r×D), dW and dbias (its shard, v_r×D and v_r) into
/// caller-owned fp32 buffers (overwritten), from forward's `lse` (n_r), on `ws`. The lengths
/// are checked with the inputs, on every rank, before the first message. The rings compute
/// every gradient: a selection that skips one ([`GradientsMut::wanted`]) is
/// [`Error::UnsupportedSelection`] (on every rank).
pub(crate) fn backward_into<C: Communicator + ?Sized>(
    comm: &C,
    (plan, ws): (&RingPlan, &mut Workspace),
    inputs: &Inputs<'_>,
    (lse, upstream): (&[f32], Upstream<'_>),
    out: GradientsMut<'_>,
) -> Result<()> {
    let config = plan.config();
    let rank = validate_agreed(comm, plan, inputs, |rank| {
        let (n, d, v_r) = (rank.local.n, plan.hidden(), plan.shard(rank.rank).len());
        check("lse (n_r)", n, lse.len())?;
        if let Some(g) = upstream.dlse {
            check("dlse (n_r)", n, g.len())?;
        }
        if let GradOutput::PerToken(g) = upstream.grad {
            check("grad_output (n_r)", n, g.len())?;
        }
        let has_bias = inputs.bias.is_some();
        if !out.wanted.is_all(has_bias) {
            return Err(Error::UnsupportedSelection { selection: out.wanted, backend: "the CPU rings" });
        }
        crate::gradients::check_gradient_lens((n, d, v_r), has_bias, out.lens())
    })?;
    let [denom] = all_sum_f64(comm, [rank.local.valid_weight(config)])?;
    let coef = loss::coefficients(config, &rank.local, upstream.grad, denom)?;
    // The rings accumulate into dW (and dX on the activation ring): they start from zero.
    let mut grads = out;
    grads.fill_zero();
    let pass = Pass::Grad { coef: &coef, lse, dlse: upstream.dlse, grads };
    run_pass(comm, (plan, ws), &rank, pass)
}

/// The CPU ring's regions: slices carved from its workspace.
pub(super) struct Host<'w>(std::marker::PhantomData<&'w ()>);

impl<'w> RegionKind for Host<'w> {
    type Raw = &'w mut [u8];
    type F32 = &'w mut [f32];
    type F64 = &'w mut [f64];
    type U32 = &'w mut [u32];
}

/// Carves regions from the ring's workspace (reserved at the plan's bytes).
pub(super) struct Carve<'w>(pub &'w Workspace);

impl<'w> RegionSource<Host<'w>> for Carve<'w> {
    fn raw(&mut self, dtype: DType, elems: usize) -> Result<&'w mut [u8]> {
        Ok(self.0.take(elems * dtype.size_in_bytes())?)
    }
    fn f32(&mut self, len: usize) -> Result<&'w mut [f32]> {
        Ok(self.0.take(len)?)
    }
    fn f64(&mut self, len: usize) -> Result<&'w mut [f64]> {
        Ok(self.0.take(len)?)
    }
    fn u32(&mut self, len: usize) -> Result<&'w mut [u32]> {
        Ok(self.0.take(len)?)
    }
}

/// Turns a block's logits (vocabulary rows from `v0`) into G and projects it into `out` (dX
/// rows, dW block, dbias), rounding G to bf16 first for bf16 inputs as the single-device path
/// does. Both rings' backward step, for one block.
fn gradient_and_project(
    (config, plan): (&Config, &RingPlan),
    (tokens, vocab, v0): (TokenBlock<'_>, VocabBlock<'_>, usize),
    (logits, cols): (&mut [f32], &ColumnGrads),
    mut out: BlockGrads<'_>,
) -> Result<()> {
    let (c, vb) = (tokens.rows(), vocab.vb);
    gradient(config, tokens, (v0, vb), logits, cols, false);
    if rounds_gradient(config, plan.dtype()) {
        round_gradient_to_bf16(&mut logits[..vb * c], c, &mut out);
    }
    accumulate_grads(plan.hidden(), logits, tokens, vocab, out, plan.gemm_threads())
}

/// Element bytes of W/X rows on the wire.
fn elem_bytes(dtype: DType) -> usize {
    dtype.size_in_bytes()
}

/// Rows `rows` of `m` (width `d`) as raw bytes.
fn raw_rows<'a>(m: &Matrix<'a>, rows: std::ops::Range<usize>, d: usize) -> &'a [u8] {
    match *m {
        Matrix::F32(s) => bytemuck::cast_slice(&s[rows.start * d..rows.end * d]),
        Matrix::Bf16(s) => bytemuck::cast_slice(&s[rows.start * d..rows.end * d]),
    }
}

/// Raw bytes of `dtype` rows viewed as a [`Matrix`].
fn as_matrix(raw: &[u8], dtype: DType) -> Matrix<'_> {
    // `RingPlan::new` admits f32 and bf16 only.
    match dtype {
        DType::F32 => Matrix::F32(bytemuck::cast_slice(raw)),
        DType::Bf16 | DType::F16 => Matrix::Bf16(bytemuck::cast_slice(raw)),
    }
}

/// Flow control on the ring's links, in place of a barrier after every step: a rank posts a
/// step's messages to `next` only once `next` has taken the previous step's (its empty
/// acknowledgement has arrived), and acknowledges each step's messages from `prev` once it has
/// taken them. At most one step's messages are in flight per link (the bound the plan counts),
/// and a rank waits only for its neighbour, never for the slowest rank of the ring.
///
/// Every step in which a rank receives from `prev`, `prev` sent to it, and (the ring being
/// symmetric) the rank sent to `next`: acknowledgements pair one to one with steps. With P = 2
/// (`next == prev`) each rank's acknowledgement of step k precedes its messages of step k + 1 on
/// the one link, which is the order the peer takes them in.
#[derive(Debug, Default)]
struct LinkCredit {
    /// Messages this rank sent to `next` that `next` has not yet acknowledged.
    awaiting: bool,
}

impl LinkCredit {
    /// Before the first send of a step: waits until `next` has taken the previous step's.
    fn before_send<C: Communicator + ?Sized>(&mut self, comm: &C) -> Result<()> {
        if std::mem::take(&mut self.awaiting) {
            comm.recv::<u8>(comm.next_rank(), &mut [])?;
        }
        Ok(())
    }

    /// After the last send of a step.
    fn sent(&mut self) {
        self.awaiting = true;
    }

    /// After taking a step's messages from `prev`.
    fn received<C: Communicator + ?Sized>(&self, comm: &C) -> Result<()> {
        Ok(comm.send::<u8>(comm.prev_rank(), &[])?)
    }

    /// At the end of a pass: takes the last acknowledgement, so no message outlives the pass.
    fn finish<C: Communicator + ?Sized>(mut self, comm: &C) -> Result<()> {
        self.before_send(comm)
    }
}
