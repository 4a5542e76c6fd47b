//! `linear_cross_entropy(..., group=, ring=)`: ring-dtp's vocabulary-parallel rings over the
//! caller's `torch.distributed` group ([`TorchGroup`], whose point-to-point messages travel in
//! `all_to_all_single` exchanges).
//!
//! Each rank brings its own tokens (`input [n_r, D]`, `target [n_r]`) and its shard of the
//! vocabulary (`weight [v_r, D]`, rank r holding rows r·⌈V/P⌉ … of the whole V = Σ v_r); the loss
//! is the one over every rank's tokens and the whole vocabulary, the same on every rank, and
//! backward writes this rank's tokens' dX and its shard's dW (and dbias). The ring plans
//! ⌈N/P⌉ tokens per rank: ranks with equal token counts are read in place; when the counts
//! differ, a rank with fewer than the most pads its tokens to that count with ignored rows (a
//! copy of its `input`, which contributes nothing to the loss or the gradients).
//!
//! Before any data moves, every rank checks its own tensors and the group agrees on the
//! verdicts, then on the shapes (one all-gather of each rank's sizes): bad input on one rank
//! raises on every rank, naming that rank and its values.

use flatpeak_common::comm::{agree_on_inputs, all_gather_words};
use flatpeak_common::{Communicator, ErrorKind};
use pyo3::prelude::*;
use ring_dtp::ring::{self, RankInputs};
use ring_dtp::{
    DType, Forward, GradOutput, GradientsMut, Loss, Matrix, Reduction, RingChoice, RingKind, RingOptions,
    RingPlan, Shape, Upstream, bf16,
};

use crate::error::{Refusal, to_py};
use crate::loss::{Checked, LossOptions, Operands, TensorArgs};
use crate::tensor::{Span, TensorDevice, TensorRef, check_disjoint};
use crate::torch_group::{Comm, communicator, detached};

/// The ring named by the Python argument (`None`: the plan's choice); checked with the rank's
/// tensors, so a bad name on one rank raises on every rank.
pub(crate) fn ring_choice(ring: Option<&str>) -> PyResult<RingChoice> {
    match ring {
        None => Ok(RingChoice::Auto),
        Some("weight") => Ok(RingChoice::Force(RingKind::Weight)),
        Some("activation") => Ok(RingChoice::Force(RingKind::Activation)),
        Some(other) => Err(pyo3::exceptions::PyValueError::new_err(format!(
            "ring: expected 'weight', 'activation' or None, got {other:?}"
        ))),
    }
}

/// The sizes every rank shares for the all-gather: n_r, D, v_r, the dtype (1: bf16) and where
/// the tensors are (1: a CUDA device; the two paths run different exchanges).
fn words(shape: Shape, on_cuda: bool) -> [u64; 5] {
    [shape.tokens, shape.hidden, shape.vocab, usize::from(shape.dtype == DType::Bf16), usize::from(on_cuda)]
        .map(|v| v as u64)
}

/// The CUDA ring's rows per rank are a multiple of this (see [`agreed_plan`]).
pub(crate) const CUDA_ROWS_QUANTUM: usize = 128;

/// Where a rank's tensors are, by its all-gathered code.
pub(crate) fn device_name(code: u64) -> &'static str {
    if code == 1 { "CUDA" } else { "CPU" }
}

/// The ring's plan, agreed from every rank's sizes (the same verdict on every rank, computed
/// from the same all-gathered words): D and the dtype equal everywhere, the weight shards in
/// the ring's layout, ⌈N/P⌉ tokens per rank with N = P × the most any rank brings.
pub(crate) fn agreed_plan(
    comm: &dyn Communicator,
    options: &LossOptions,
    ring: RingChoice,
    (mine, on_cuda): (Shape, bool),
) -> Result<RingPlan, Refusal> {
    let p = comm.world_size();
    let all = all_gather_words(comm, &words(mine, on_cuda))?;
    let ranks: Vec<&[u64]> = all.chunks_exact(5).collect();
    for (r, w) in ranks.iter().enumerate() {
        if w[4] != ranks[0][4] {
            let (theirs, first) = (device_name(w[4]), device_name(ranks[0][4]));
            let message = format!("rank {r} passed {theirs} tensors where rank 0 passed {first} tensors");
            return Err(Refusal { kind: ErrorKind::Type, message });
        }
        if w[3] != ranks[0][3] {
            let name = |code: u64| if code == 1 { "torch.bfloat16" } else { "torch.float32" };
            let message =
                format!("rank {r} passed {} tensors where rank 0 passed {}", name(w[3]), name(ranks[0][3]));
            return Err(Refusal { kind: ErrorKind::Type, message });
        }
        if w[1] != ranks[0][1] {
            let message = format!("rank {r} passed hidden size {} where rank 0 passed {}", w[1], ranks[0][1]);
            return Err(Refusal { kind: ErrorKind::Value, message });
        }
    }
    let shards: Vec<usize> = ranks.iter().map(|w| w[2] as usize).collect();
    let vocab: usize = shards.iter().sum();
    let rows = vocab.div_ceil(p);
    let layout: Vec<usize> =
        (0..p).map(|r| (r * rows).min(vocab)..((r + 1) * rows).min(vocab)).map(|s| s.len()).collect();
    if shards != layout {
        let message = format!(
            "the ranks' weight shards have {shards:?} rows: the ring's layout of V = {vocab} over {p} ranks is \
             {layout:?} (rank r holds rows r·⌈V/P⌉ … of the vocabulary)"
        );
        return Err(Refusal { kind: ErrorKind::Value, message });
    }
    let most = ranks.iter().map(|w| w[0] as usize).max().unwrap_or(0);
    // On CUDA the ring (its buffers and compiled kernels) is kept per plan: the rows per rank are
    // rounded up to a multiple of CUDA_ROWS_QUANTUM, so batches whose lengths vary a little share
    // one ring (the extra rows are padded, ignored rows).
    let most =
        if on_cuda { most.div_ceil(CUDA_ROWS_QUANTUM).saturating_mul(CUDA_ROWS_QUANTUM) } else { most };
    let tokens = most.checked_mul(p).ok_or(Refusal {
        kind: ErrorKind::Value,
        message: format!("{most} tokens per rank × {p} ranks overflow"),
    })?;
    let shape = Shape { tokens, hidden: mine.hidden, vocab, dtype: mine.dtype };
    let mut ring_options = RingOptions::default().ranks(p);
    ring_options.ring = ring;
    // Every rank agreed on the device kind above; the default budget follows it (any GPU's is
    // the same: device 0 stands for it).
    let device = if on_cuda { TensorDevice::Cuda(0) } else { TensorDevice::Cpu };
    RingPlan::new(&options.config, shape, options.budget(device), ring_options)
        .map_err(|e| Refusal { kind: e.kind(), message: e.to_string() })
}

/// A rank's tokens padded to the plan's ⌈N/P⌉ rows (ignored targets, zero weights), when it
/// brings fewer.
enum PaddedX {
    F32(Vec<f32>),
    Bf16(Vec<bf16>),
}

struct Padded {
    x: PaddedX,
    targets: Vec<i64>,
    weights: Option<Vec<f32>>,
}

/// One rank's checked call: its tensors, the agreed plan, and its tokens (brought, and planned).
struct RingCall {
    checked: Checked,
    plan: RingPlan,
    own: usize,
    rows: usize,
    padded: Option<Padded>,
}

impl RingCall {
    /// Checks this rank's tensors, agrees on every rank's verdict and sizes, and plans the ring.
    fn new(
        py: Python<'_>,
        comm: &dyn Communicator,
        options: &LossOptions,
        ring: Option<&str>,
        args: &TensorArgs<'_>,
    ) -> PyResult<Self> {
        let local = ring_choice(ring).and_then(|ring| Ok((ring, Checked::new(args)?)));
        let (ring, checked) =
            agree_on_inputs(comm, local.map_err(|e| Refusal::from_py(py, e))).map_err(Refusal::into_py)?;
        let plan = agreed_plan(comm, options, ring, (checked.shape, false)).map_err(Refusal::into_py)?;
        let (own, rows) = (checked.shape.tokens, plan.tokens(comm.rank()).len());
        let mut call = Self { checked, plan, own, rows, padded: None };
        if own < rows {
            call.padded = Some(call.pad(options.config.ignore_index));
        }
        Ok(call)
    }

    fn pad(&self, ignore_index: i64) -> Padded {
        let (d, extra) = (self.plan.hidden(), self.rows - self.own);
        let c = &self.checked;
        // SAFETY: the caller's frame holds the tensors for the call; nothing writes them.
        let (targets, weights) = unsafe { (c.target.as_slice(), c.weights.map(|w| w.as_slice())) };
        // SAFETY: as above.
        let x = unsafe {
            match &c.operands {
                Operands::F32(x, _) => {
                    PaddedX::F32(x.as_slice().iter().copied().chain(vec![0.0; extra * d]).collect())
                }
                Operands::Bf16(x, _) => {
                    PaddedX::Bf16(x.as_slice().iter().copied().chain(vec![bf16::ZERO; extra * d]).collect())
                }
            }
        };
        Padded {
            x,
            targets: targets.iter().copied().chain(std::iter::repeat_n(ignore_index, extra)).collect(),
            weights: weights.map(|w| w.iter().copied().chain(std::iter::repeat_n(0.0, extra)).collect()),
        }
    }

    /// The crate's inputs: the tensors in place, or this rank's padded tokens.
    ///
    /// # Safety
    /// The tensors must outlive the returned borrow, and nothing may write them meanwhile.
    unsafe fn inputs(&self) -> RankInputs<'_> {
        let c = &self.checked;
        // SAFETY: the caller keeps the tensors alive and unwritten for the borrow; each was
        // checked (CPU, contiguous, dtype, shape, alignment) by `Checked::new`.
        let (x, w, targets, bias, weights) = unsafe {
            let (x, w) = match &c.operands {
                Operands::F32(x, w) => (Matrix::F32(x.as_slice()), Matrix::F32(w.as_slice())),
                Operands::Bf16(x, w) => (Matrix::Bf16(x.as_slice()), Matrix::Bf16(w.as_slice())),
            };
            (x, w, c.target.as_slice(), c.bias.map(|b| b.as_slice()), c.weights.map(|t| t.as_slice()))
        };
        let mut inputs = RankInputs::new(x, w, targets);
        inputs.bias_shard = bias;
        inputs.weights = weights;
        if let Some(p) = &self.padded {
            inputs.x = match &p.x {
                PaddedX::F32(x) => Matrix::F32(x),
                PaddedX::Bf16(x) => Matrix::Bf16(x),
            };
            inputs.targets = &p.targets;
            inputs.weights = p.weights.as_deref();
        }
        inputs
    }

    /// `values` (one per brought token) padded with zeros to the planned rows.
    fn padded_rows(&self, values: &[f32], width: usize) -> Vec<f32> {
        let mut out = vec![0.0; self.rows * width];
        out[..values.len()].copy_from_slice(values);
        out
    }
}

/// The host tensors of backward's upstream, checked: forward's lse (`[n_r]`), the loss's
/// gradient (0-dim, or `[n_r]` for a per-token loss) and the lse's, if any.
pub(crate) struct Upstreams {
    pub(crate) lse: TensorRef<f32>,
    pub(crate) grad: TensorRef<f32>,
    pub(crate) dlse: Option<TensorRef<f32>>,
}

impl Upstreams {
    pub(crate) fn new(
        n: usize,
        per_token: bool,
        lse: &Bound<'_, PyAny>,
        (grad, dlse): &(Bound<'_, PyAny>, Option<Bound<'_, PyAny>>),
    ) -> PyResult<Self> {
        let grad_shape: &[Option<usize>] = if per_token { &[Some(n)] } else { &[] };
        Ok(Self {
            lse: TensorRef::new("lse", lse, &[Some(n)])?,
            grad: TensorRef::new("grad_output", grad, grad_shape)?,
            dlse: dlse.as_ref().map(|g| TensorRef::new("grad_lse", g, &[Some(n)])).transpose()?,
        })
    }
}

/// Writes forward's loss (one value, or this rank's first `n` per-token losses) and its first
/// `n` lse into the checked host float32 tensors `outputs` (the rows past them are padding).
pub(crate) fn write_own_rows(
    forward: Forward,
    n: usize,
    (loss_out, lse_out): (&TensorRef<f32>, &TensorRef<f32>),
) {
    // SAFETY: the callers checked both as float32 CPU tensors of the loss's and lse's shapes,
    // made for this call and read by nothing else.
    let (loss, lse) = unsafe { (loss_out.as_mut_slice(), lse_out.as_mut_slice()) };
    lse.copy_from_slice(&forward.lse[..n]);
    match forward.loss {
        Loss::Scalar(l) => loss[0] = l as f32,
        Loss::PerToken(per_token) => loss.copy_from_slice(&per_token[..n]),
    }
}

/// Forward over `group` (`ring`: `"weight"`, `"activation"` or `None` for the plan's choice):
/// writes the loss (0-dim fp32 for mean and sum, `[n_r]` for none) and this rank's tokens' lse
/// (`[n_r]` fp32) into `outputs`.
#[pyfunction]
#[pyo3(signature = (options, group, ring, args, outputs))]
pub fn lce_ring_forward(
    py: Python<'_>,
    options: &LossOptions,
    group: Bound<'_, PyAny>,
    ring: Option<&str>,
    args: TensorArgs<'_>,
    outputs: (Bound<'_, PyAny>, Bound<'_, PyAny>),
) -> PyResult<()> {
    let mut comm: Comm = Some(communicator(py, Some(group))?);
    let group =
        comm.as_deref().ok_or_else(|| pyo3::exceptions::PyRuntimeError::new_err("no communicator"))?;
    let call = RingCall::new(py, group, options, ring, &args)?;
    let n = call.own;
    let loss_shape: &[Option<usize>] =
        if options.config.reduction == Reduction::None { &[Some(n)] } else { &[] };
    let loss_out = TensorRef::<f32>::new("loss_out", &outputs.0, loss_shape)?;
    let lse_out = TensorRef::<f32>::new("lse_out", &outputs.1, &[Some(n)])?;
    check_disjoint(&[(&loss_out).into(), (&lse_out).into()], &call.checked.spans())?;
    let forward = detached(py, &mut comm, |comm| {
        // SAFETY: the caller's frame holds every tensor for this call; the outputs were checked
        // disjoint from the inputs, so nothing writes what `inputs` reads.
        let inputs = unsafe { call.inputs() };
        ring::forward(comm, &call.plan, &inputs)
    })?
    .map_err(to_py)?;
    write_own_rows(forward, n, (&loss_out, &lse_out));
    Ok(())
}

/// Backward over `group` from forward's `lse` (`[n_r]`): `upstream` is the gradient of the loss
/// (0-dim for mean and sum, `[n_r]` for none) and that of the lse, if any; writes this rank's
/// dX (`[n_r, D]`), its shard's dW (`[v_r, D]`) and dbias into the fp32 tensors `grads_out`.
#[pyfunction]
#[pyo3(signature = (options, group, ring, args, lse, upstream, grads_out))]
#[allow(clippy::too_many_arguments)] // the loss's own backward's arguments, and the group's two
pub fn lce_ring_backward(
    py: Python<'_>,
    options: &LossOptions,
    group: Bound<'_, PyAny>,
    ring: Option<&str>,
    args: TensorArgs<'_>,
    lse: Bound<'_, PyAny>,
    upstream: (Bound<'_, PyAny>, Option<Bound<'_, PyAny>>),
    grads_out: (Bound<'_, PyAny>, Bound<'_, PyAny>, Option<Bound<'_, PyAny>>),
) -> PyResult<()> {
    let mut comm: Comm = Some(communicator(py, Some(group))?);
    let group =
        comm.as_deref().ok_or_else(|| pyo3::exceptions::PyRuntimeError::new_err("no communicator"))?;
    let call = RingCall::new(py, group, options, ring, &args)?;
    let (n, d, v) = (call.own, call.plan.hidden(), call.checked.shape.vocab);
    let per_token = options.config.reduction == Reduction::None;
    // Shapes checked here are collective too: a rank whose upstream or outputs are wrong refuses
    // before its peers wait on the ring.
    let local = (|| -> PyResult<_> {
        let Upstreams { lse, grad: grad_loss, dlse: grad_lse } =
            Upstreams::new(n, per_token, &lse, &upstream)?;
        let dx = TensorRef::<f32>::new("dx", &grads_out.0, &[Some(n), Some(d)])?;
        let dw = TensorRef::<f32>::new("dw", &grads_out.1, &[Some(v), Some(d)])?;
        let dbias =
            grads_out.2.as_ref().map(|b| TensorRef::<f32>::new("dbias", b, &[Some(v)])).transpose()?;
        if dbias.is_some() != call.checked.bias.is_some() {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "dbias: expected exactly when there is a bias",
            ));
        }
        let mut input_spans = call.checked.spans();
        input_spans.extend([Span::from(&lse), (&grad_loss).into()]);
        input_spans.extend(grad_lse.iter().map(Span::from));
        let mut out_spans = vec![Span::from(&dx), (&dw).into()];
        out_spans.extend(dbias.iter().map(Span::from));
        check_disjoint(&out_spans, &input_spans)?;
        Ok((lse, grad_loss, grad_lse, dx, dw, dbias))
    })()
    .map_err(|e| Refusal::from_py(py, e));
    let group =
        comm.as_deref().ok_or_else(|| pyo3::exceptions::PyRuntimeError::new_err("no communicator"))?;
    let (lse, grad_loss, grad_lse, dx, dw, dbias) =
        agree_on_inputs(group, local).map_err(Refusal::into_py)?;
    // SAFETY: the caller's frame holds every tensor for this call; the outputs were checked
    // disjoint from each other and from every input, so the `&mut` are exclusive.
    let (lse, grad_loss, grad_lse, dx, dw, dbias) = unsafe {
        (
            lse.as_slice(),
            grad_loss.as_slice(),
            grad_lse.map(|g| g.as_slice()),
            dx.as_mut_slice(),
            dw.as_mut_slice(),
            dbias.map(|b| b.as_mut_slice()),
        )
    };
    // A padded rank's rows past its own: lse and upstream gradients 0, its dX into a buffer of
    // the planned rows whose first n_r rows are copied out.
    let pad = call.padded.is_some();
    let lse_rows = if pad { call.padded_rows(lse, 1) } else { Vec::new() };
    let grad_rows = if pad && per_token { call.padded_rows(grad_loss, 1) } else { Vec::new() };
    let dlse_rows = grad_lse.filter(|_| pad).map(|g| call.padded_rows(g, 1));
    let mut dx_rows = if pad { vec![0.0f32; call.rows * d] } else { Vec::new() };
    let ran = detached(py, &mut comm, |comm| {
        // SAFETY: as above: every input is alive and unwritten for the call.
        let inputs = unsafe { call.inputs() };
        let lse = if pad { &lse_rows[..] } else { lse };
        let grad_loss = if pad && per_token { &grad_rows[..] } else { grad_loss };
        let grad = if per_token { GradOutput::PerToken(grad_loss) } else { GradOutput::Scalar(grad_loss[0]) };
        let dlse = if pad { dlse_rows.as_deref() } else { grad_lse };
        let out = GradientsMut::new(if pad { &mut dx_rows[..] } else { &mut *dx }, dw, dbias);
        ring::backward_into(comm, &call.plan, &inputs, lse, Upstream::loss(grad).with_dlse(dlse), out)
    })?;
    ran.map_err(to_py)?;
    if pad {
        dx.copy_from_slice(&dx_rows[..n * d]);
    }
    Ok(())
}
