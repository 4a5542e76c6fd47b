//! [`agree`]: a ring call of each rank's own tokens, as a framework makes it, agreed across the
//! group and planned ([`AgreedRing`]).
//!
//! Each rank brings its own tokens (any count, zero included) and its vocabulary shard in the
//! ring's layout (rank r holds rows r·⌈V/P⌉ … of the vocabulary, V = Σ v_r). Before any data
//! moves the group agrees on every rank's share ([`agree_records`]): the kind of device, the
//! dtype, D, the options' digest, the ring asked for, a bias on every rank or on none, and the
//! shards against the layout; a rank whose own checks failed (a binding's
//! [`Refusal`](flatpeak_common::comm::Refusal)) enters the agreement too, so bad input on one
//! rank is an error on every rank, naming that rank and its values. The plan has ⌈N/P⌉ tokens per
//! rank with N = P × the most any rank brings; a rank that brings fewer is padded to that count
//! with ignored rows (zero rows, ignored targets, zero weights), which add nothing to the loss or
//! the gradients, and its outputs are its own rows'.
//!
//! ```
//! use flatpeak_common::{Communicator, Device, LocalGroup, LocalGroupOptions, SplitMix64};
//! use ring_dtp::ring::{RankShare, RingCall, agree};
//! use ring_dtp::{DType, Inputs, Loss, Matrix, RingLinearCrossEntropy};
//!
//! let (d, shards) = (8, [3usize, 3, 2]); // V = 8 over 3 ranks: ⌈8/3⌉ = 3 rows each, 2 on the last
//! let out = LocalGroup::run(3, LocalGroupOptions::default(), |comm| {
//!     let r = comm.rank();
//!     let tokens = [5, 0, 2][r]; // uneven: rank 1 brings none
//!     let mut rng = SplitMix64::new(r as u64);
//!     let (x, w) = (rng.normal_f32(tokens * d, 0.0, 1.0), rng.normal_f32(shards[r] * d, 0.0, 0.3));
//!     let targets: Vec<i64> = (0..tokens as i64).map(|t| t % 8).collect();
//!     let share = RankShare { tokens, hidden: d, shard: shards[r], dtype: DType::F32, device: Device::Cpu, bias: false };
//!     let run = || -> ring_dtp::Result<_> {
//!         let agreed = agree(comm, &RingCall::default(), Ok::<_, ring_dtp::Error>(share))?;
//!         let mut ring = RingLinearCrossEntropy::new(*agreed.plan(), Device::Cpu)?;
//!         let inputs = Inputs::new(Matrix::F32(&x), Matrix::F32(&w), &targets, d);
//!         let forward = agreed.forward(&mut ring, comm, &inputs)?;
//!         Ok((forward.lse.len(), agreed.plan().n_tokens()))
//!     };
//!     Ok(run())
//! });
//! let out: Vec<_> = out.into_iter().map(|r| r.unwrap().unwrap()).collect();
//! assert_eq!(out, vec![(5, 15), (0, 15), (2, 15)]); // each rank's own lse; N = 3 × 5
//! ```

use flatpeak_common::comm::{Agreed, Call, RankRecord, Words, agree_on_inputs, agree_records};
use flatpeak_common::{Communicator, DType, DTypeNames, Device, ErrorKind};
use half::bf16;

use super::RingLinearCrossEntropy;
use crate::budget::LossBudget;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::gradients::GradientsMut;
use crate::inputs::{Forward, GradOutput, Inputs, Loss, Matrix, Upstream};
use crate::plan::{RingChoice, RingKind, RingOptions, RingPlan, Shape};

/// On a CUDA device the rows per rank are a multiple of this: rings are kept per plan, so batches
/// whose lengths vary a little share one (the extra rows are padded, ignored rows).
pub const CUDA_ROWS_QUANTUM: usize = 128;

/// What one rank brings to a ring call: its tokens (n_r), D, its vocabulary shard's rows (v_r),
/// the dtype of X and W, where they live, and whether it has a bias shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankShare {
    /// n_r: this rank's tokens (ranks may differ, zero included).
    pub tokens: usize,
    /// D.
    pub hidden: usize,
    /// v_r: rows of this rank's vocabulary shard.
    pub shard: usize,
    /// The dtype of X and W.
    pub dtype: DType,
    /// Where X and W live.
    pub device: Device,
    /// Whether this rank passes a bias shard (every rank or none).
    pub bias: bool,
}

/// How a ring call is made: what every rank passes the same.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
#[non_exhaustive]
pub struct RingCall {
    /// The loss's options.
    pub config: Config,
    /// The working-set budget per rank.
    pub budget: LossBudget,
    /// The ring (`Auto`: the plan's choice).
    pub ring: RingChoice,
    /// How messages name dtypes.
    pub names: DTypeNames,
}

impl RingCall {
    flatpeak_common::setters! {
        /// This call with these loss options.
        config: Config,
        /// This call within this budget.
        budget: LossBudget,
        /// This call on this ring.
        ring: RingChoice,
        /// This call naming dtypes as `names` does.
        names: DTypeNames,
    }
}

/// A rank's record of a ring call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ShareWords {
    tokens: usize,
    hidden: usize,
    shard: usize,
    options: u64,
    ring: u64,
    bias: bool,
}

impl Words for ShareWords {
    const LEN: usize = 6;
    fn write(&self, out: &mut [u64]) {
        out.copy_from_slice(&[
            self.tokens as u64,
            self.hidden as u64,
            self.shard as u64,
            self.options,
            self.ring,
            u64::from(self.bias),
        ]);
    }
    fn read(w: &[u64]) -> Self {
        Self {
            tokens: w[0] as usize,
            hidden: w[1] as usize,
            shard: w[2] as usize,
            options: w[3],
            ring: w[4],
            bias: w[5] == 1,
        }
    }
}

fn ring_code(ring: RingChoice) -> u64 {
    match ring {
        RingChoice::Auto => 0,
        RingChoice::Force(RingKind::Weight) => 1,
        RingChoice::Force(RingKind::Activation) => 2,
    }
}

fn ring_name(code: u64) -> &'static str {
    match code {
        1 => "the weight ring",
        2 => "the activation ring",
        _ => "the plan's choice of ring",
    }
}

/// The name the agreement gives a ring call.
const CALL: &str = "ring-dtp ring";

/// Agrees on a ring call of every rank's own share (`local`, or why this rank has none) and plans
/// it (see the module docs). Every rank of `comm`'s group calls it at the same point; a refusal
/// names the rank that differs: its tensors on another kind of device or of another dtype than
/// rank 0's ([`ErrorKind::Type`]); another D, other options or budget, another ring, a bias where
/// rank 0 has none (or none where it has one), or a shard off the ring's layout
/// ([`ErrorKind::Value`]).
pub fn agree<C, E>(comm: &C, call: &RingCall, local: std::result::Result<RankShare, E>) -> Result<AgreedRing>
where
    C: Communicator + ?Sized,
    E: Into<Error>,
{
    let options = flatpeak_common::Digest::new().u64(call.config.digest()).u64(call.budget.digest()).finish();
    let local = local.map_err(Into::into);
    let device = local.as_ref().map_or(Device::Cpu, |share| share.device);
    let record = local.map(|share| RankRecord {
        device: share.device.into(),
        dtype: share.dtype,
        sizes: ShareWords {
            tokens: share.tokens,
            hidden: share.hidden,
            shard: share.shard,
            options,
            ring: ring_code(call.ring),
            bias: share.bias,
        },
    });
    let agreed = agree_records(comm, Call { name: CALL, names: call.names }, record)?;
    let plan = agreed_plan(&agreed, call, device)?;
    let (rank, own) = (agreed.rank(), agreed.mine().sizes.tokens);
    let rows = plan.tokens(rank).len();
    Ok(AgreedRing { plan, own, rows, device })
}

/// The ring's plan from every rank's agreed share (the same verdict on every rank).
fn agreed_plan(agreed: &Agreed<ShareWords>, call: &RingCall, device: Device) -> Result<RingPlan> {
    let value = |r: usize, message: String| -> Error { agreed.refuse(r, ErrorKind::Value, message).into() };
    if let Some((r, theirs, zeros)) = agreed.first_differing(|w| w.hidden) {
        return Err(value(r, format!("rank {r} passed hidden size {theirs} where rank 0 passed {zeros}")));
    }
    if let Some((r, _, _)) = agreed.first_differing(|w| w.options) {
        return Err(value(
            r,
            format!(
                "rank {r} passed other loss options than rank 0 (ignore_index, reduction, label_smoothing, z_loss, \
                 softcap, budget_bytes, precision): every rank must run the same ring plan"
            ),
        ));
    }
    if let Some((r, theirs, zeros)) = agreed.first_differing(|w| w.ring) {
        return Err(value(
            r,
            format!(
                "rank {r} asked for {} where rank 0 asked for {}: every rank must run the same ring plan",
                ring_name(theirs),
                ring_name(zeros)
            ),
        ));
    }
    if let Some((r, theirs, _)) = agreed.first_differing(|w| w.bias) {
        let has = |b: bool| if b { "a bias shard" } else { "no bias" };
        return Err(value(
            r,
            format!(
                "rank {r} passed {} where rank 0 passed {}: a bias shard on every rank or on none",
                has(theirs),
                has(!theirs)
            ),
        ));
    }
    let ranks = agreed.ranks();
    let p = ranks.len();
    let shards: Vec<usize> = ranks.iter().map(|r| r.sizes.shard).collect();
    let vocab = shards.iter().try_fold(0usize, |v, &s| v.checked_add(s));
    let vocab = vocab.ok_or(flatpeak_common::Error::SizeOverflow { what: "the ranks' vocabulary shards" })?;
    let per_rank = vocab.div_ceil(p);
    let layout: Vec<usize> =
        (0..p).map(|r| (r * per_rank).min(vocab)..((r + 1) * per_rank).min(vocab)).map(|s| s.len()).collect();
    if let Some(r) = (0..p).find(|&r| shards[r] != layout[r]) {
        return Err(value(
            r,
            format!(
                "the ranks' weight shards have {shards:?} rows: the ring's layout of V = {vocab} over {p} ranks is \
                 {layout:?} (rank r holds rows r·⌈V/P⌉ … of the vocabulary)"
            ),
        ));
    }
    let most = ranks.iter().map(|r| r.sizes.tokens).max().unwrap_or(0);
    let most = match device {
        Device::Cpu => Some(most),
        Device::Cuda(_) => most.div_ceil(CUDA_ROWS_QUANTUM).checked_mul(CUDA_ROWS_QUANTUM),
    };
    let tokens = most.and_then(|m| m.checked_mul(p));
    let tokens = tokens.ok_or(flatpeak_common::Error::SizeOverflow {
        what: "the ring's tokens (P × the most a rank brings)",
    })?;
    let mine = agreed.mine();
    let shape = Shape { tokens, hidden: mine.sizes.hidden, vocab, dtype: mine.dtype };
    let mut options = RingOptions::default().ranks(p);
    options.ring = call.ring;
    RingPlan::new(&call.config, shape, call.budget.of(device), options)
}

/// A ring call agreed on and planned: its plan, and this rank's own tokens against the plan's
/// rows. Its calls run on a [`RingLinearCrossEntropy`] of the plan, with this rank's own tensors,
/// padded to the plan's rows where the rank brings fewer; their outputs are the rank's own rows'.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AgreedRing {
    plan: RingPlan,
    own: usize,
    rows: usize,
    device: Device,
}

impl AgreedRing {
    /// The plan (every rank's the same).
    pub fn plan(&self) -> &RingPlan {
        &self.plan
    }

    /// The device this rank's share lives on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// This rank's own tokens.
    pub fn own_tokens(&self) -> usize {
        self.own
    }

    /// The rows the plan gives this rank (its tokens, then padding).
    pub fn planned_tokens(&self) -> usize {
        self.rows
    }

    /// `made` (this rank's executor of the plan, or why it has none), agreed on by the group
    /// before the call's first message: a rank that could not make its executor (its device
    /// refused the memory) is an error on every rank, where a device communicator (NCCL) would
    /// wait without end.
    pub fn ready<C: Communicator + ?Sized, T>(&self, comm: &C, made: Result<T>) -> Result<T> {
        agree_on_inputs(comm, made)
    }

    /// The loss and this rank's own tokens' lse (and per-token losses): [`RingLinearCrossEntropy::forward`]
    /// of the rank's own tokens, padded to the plan's rows.
    pub fn forward<C: Communicator + ?Sized>(
        &self,
        ring: &mut RingLinearCrossEntropy,
        comm: &C,
        inputs: &Inputs<'_>,
    ) -> Result<Forward> {
        let local = self.check_own(inputs, None);
        let padding = match local {
            Ok(()) => Padding::of(self, inputs),
            Err(e) => return agree_on_inputs(comm, Err(e)),
        };
        let forward = ring.forward(comm, &padding.inputs(inputs))?;
        Ok(self.own_rows(forward))
    }

    /// [`RingLinearCrossEntropy::backward_into`] of the rank's own tokens: `lse` and the per-token
    /// upstream gradients of its own rows (n_r), dX into its own rows (n_r×D), dW and dbias of its
    /// shard; the padded rows' lse and gradients are zero.
    pub fn backward_into<C: Communicator + ?Sized>(
        &self,
        ring: &mut RingLinearCrossEntropy,
        comm: &C,
        inputs: &Inputs<'_>,
        lse: &[f32],
        upstream: Upstream<'_>,
        out: GradientsMut<'_>,
    ) -> Result<()> {
        let d = self.plan.hidden();
        let lens = (lse.len(), upstream, out.dx.len());
        if let Err(e) = self.check_own(inputs, Some(lens)) {
            return agree_on_inputs(comm, Err(e));
        }
        if self.rows == self.own {
            return ring.backward_into(comm, inputs, lse, upstream, out);
        }
        let padding = Padding::of(self, inputs);
        let rows = |v: &[f32]| self.padded(v);
        let (lse_rows, dlse_rows) = (rows(lse), upstream.dlse.map(rows));
        let grad_rows = match upstream.grad {
            GradOutput::PerToken(g) => Some(rows(g)),
            GradOutput::Scalar(_) => None,
        };
        let grad = grad_rows.as_deref().map_or(upstream.grad, GradOutput::PerToken);
        let upstream = Upstream::loss(grad).with_dlse(dlse_rows.as_deref());
        let GradientsMut { dx, dw, dbias, wanted, .. } = out;
        let mut dx_rows = vec![0.0f32; self.rows * d];
        let padded_out = GradientsMut::new(&mut dx_rows, dw, dbias).selecting(wanted);
        ring.backward_into(comm, &padding.inputs(inputs), &lse_rows, upstream, padded_out)?;
        dx.copy_from_slice(&dx_rows[..self.own * d]);
        Ok(())
    }

    /// This rank's own tensors (n_r tokens) and, for a backward, the lengths of its lse (n_r), its
    /// upstream gradients and dX (n_r·D) before any is padded; a mismatch is a shape error the
    /// group then agrees on.
    fn check_own(&self, inputs: &Inputs<'_>, backward: Option<(usize, Upstream<'_>, usize)>) -> Result<()> {
        let (n, d) = (self.own, self.plan.hidden());
        let check = |what: &'static str, expected: usize, got: usize| {
            if expected == got { Ok(()) } else { Err(Error::ShapeMismatch { what, expected, got }) }
        };
        check("targets (this rank's tokens)", n, inputs.targets.len())?;
        check("x (this rank's tokens × d)", n.saturating_mul(d), inputs.x.len())?;
        if let Some(w) = inputs.weights {
            check("weights (this rank's tokens)", n, w.len())?;
        }
        if let Some((lse, upstream, dx)) = backward {
            check("lse (this rank's tokens)", n, lse)?;
            if let GradOutput::PerToken(g) = upstream.grad {
                check("grad_output (this rank's tokens)", n, g.len())?;
            }
            if let Some(g) = upstream.dlse {
                check("dlse (this rank's tokens)", n, g.len())?;
            }
            check("dx (this rank's tokens × d)", n.saturating_mul(d), dx)?;
        }
        Ok(())
    }

    /// `values` (one per own token) padded with zeros to the plan's rows.
    fn padded(&self, values: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; self.rows];
        out[..values.len()].copy_from_slice(values);
        out
    }

    /// `forward` of the plan's rows cut to this rank's own.
    pub(crate) fn own_rows(&self, mut forward: Forward) -> Forward {
        forward.lse.truncate(self.own);
        if let Loss::PerToken(per_token) = &mut forward.loss {
            per_token.truncate(self.own);
        }
        forward
    }
}

/// A rank's tokens padded to the plan's rows (zero rows, ignored targets, zero weights), when it
/// brings fewer; nothing when it brings them all.
enum Padding {
    None,
    Rows { x: PaddedRows, targets: Vec<i64>, weights: Option<Vec<f32>> },
}

enum PaddedRows {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

impl Padding {
    fn of(ring: &AgreedRing, inputs: &Inputs<'_>) -> Self {
        if ring.rows == ring.own {
            return Padding::None;
        }
        let (d, extra) = (ring.plan.hidden(), ring.rows - ring.own);
        let x = match inputs.x {
            Matrix::F32(x) => {
                PaddedRows::F32(x.iter().copied().chain(std::iter::repeat_n(0.0, extra * d)).collect())
            }
            Matrix::Bf16(x) => PaddedRows::Bf16(
                x.iter().copied().chain(std::iter::repeat_n(bf16::ZERO, extra * d)).collect(),
            ),
        };
        let ignore = ring.plan.config().ignore_index;
        let targets = inputs.targets.iter().copied().chain(std::iter::repeat_n(ignore, extra)).collect();
        let weights =
            inputs.weights.map(|w| w.iter().copied().chain(std::iter::repeat_n(0.0, extra)).collect());
        Padding::Rows { x, targets, weights }
    }

    /// `inputs` with the padded rows in place of the rank's own.
    fn inputs<'p>(&'p self, inputs: &Inputs<'p>) -> Inputs<'p> {
        match self {
            Padding::None => *inputs,
            Padding::Rows { x, targets, weights } => {
                let x = match x {
                    PaddedRows::F32(x) => Matrix::F32(x),
                    PaddedRows::Bf16(x) => Matrix::Bf16(x),
                };
                let mut padded = Inputs::new(x, inputs.w, targets, inputs.d);
                (padded.bias, padded.weights) = (inputs.bias, weights.as_deref());
                padded
            }
        }
    }
}
