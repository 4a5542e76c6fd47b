//! `linear_cross_entropy(..., group=, ring=)` on CUDA tensors (feature `cuda`): ring-dtp's
//! `CudaRing` over the NCCL communicator of the group's ranks ([`crate::cuda_group`]), on torch's
//! current stream.
//!
//! The checks and the plan are those of the CPU ring ([`crate::ring_loss`]): every rank checks
//! its tensors, the group agrees on the verdicts and on the shapes (the ring's vocabulary
//! layout, N = P × the most tokens a rank brings), then every rank checks its targets and token
//! weights against the whole vocabulary and the group agrees again, all before the first NCCL
//! call (NCCL has no timeout to end a wait on a rank that refused). The targets and token
//! weights come from the host (the Python side copies those n_r values there); a rank with fewer
//! tokens than the plan's rows pads them on the device (zero rows, ignored targets). Making the
//! ring (its buffers fixed at its plan's size, kept per plan) and the padded buffers is agreed on
//! too, so a rank that fails there raises on every rank instead of leaving them in NCCL. The
//! communicator's stream waits for torch's current stream on entry, and torch's waits for it on
//! exit; every copy of the call is issued on the communicator's stream.

use std::sync::Arc;

use flatpeak_common::Communicator;
use flatpeak_common::comm::agree_on_inputs;
use flatpeak_common::cuda::cudarc::driver::{CudaSlice, CudaStream};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use ring_dtp::cuda::DeviceMatrix;
use ring_dtp::cuda::ring::{CudaRing, DeviceRankInputs};
use ring_dtp::{
    DType, Forward, GradOutput, Loss, Reduction, RingPlan, Upstream, bf16, check_targets, check_weights,
};

use crate::cuda::{Borrowed, borrow_on_or_empty, torch_stream};
use crate::cuda_group::{SharedNccl, agree_ready, copy_prefix, cuda_states, enter, group_key, leave};
use crate::error::{Refusal, to_py};
use crate::loss::{LossOptions, TensorArgs};
use crate::ring_loss::{Upstreams, agreed_plan, ring_choice, write_own_rows};
use crate::tensor::{TensorDevice, TensorRef, checked, device_of};
use crate::torch_group::{Comm, communicator, detached};
use flatpeak_common::nccl::DeviceCommunicator;

fn cuda_error(op: &'static str) -> impl Fn(flatpeak_common::cuda::cudarc::driver::DriverError) -> PyErr {
    move |e| PyRuntimeError::new_err(format!("{op}: {e:?}"))
}

/// X rows on the device, the tensor in place.
enum Rows {
    F32(Borrowed<f32>),
    Bf16(Borrowed<bf16>),
}

/// X rows padded to the plan's rows, in a buffer of the call's.
enum Padded {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<bf16>),
}

impl Rows {
    fn matrix(&self) -> DeviceMatrix<'_> {
        match self {
            Rows::F32(b) => DeviceMatrix::F32(b),
            Rows::Bf16(b) => DeviceMatrix::Bf16(b),
        }
    }
}

impl Padded {
    fn matrix(&self) -> DeviceMatrix<'_> {
        match self {
            Padded::F32(s) => DeviceMatrix::F32(s),
            Padded::Bf16(s) => DeviceMatrix::Bf16(s),
        }
    }
}

/// W's shard on the device, in place.
enum Shard {
    F32(Borrowed<f32>),
    Bf16(Borrowed<bf16>),
}

/// One rank's checked CUDA call: its device tensors (borrowed), its host targets and weights
/// (padded to the plan's rows), the agreed plan, and its tokens (brought, and planned).
struct CudaRingCall {
    x: Rows,
    w: Shard,
    bias: Option<Borrowed<f32>>,
    targets: Vec<i64>,
    weights: Option<Vec<f32>>,
    plan: RingPlan,
    own: usize,
    rows: usize,
    ordinal: usize,
    stream: Arc<CudaStream>,
    /// (group, device): the communicator's key.
    key: String,
}

/// The per-call device buffers: the padded rows (when the rank brings fewer than the plan's),
/// the targets and the token weights.
struct Uploaded {
    padded: Option<Padded>,
    targets: CudaSlice<i64>,
    weights: Option<CudaSlice<f32>>,
}

impl CudaRingCall {
    fn new(
        py: Python<'_>,
        host: &dyn Communicator,
        (options, ring): (&LossOptions, Option<&str>),
        args: &TensorArgs<'_>,
        group: &Option<Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        let TensorDevice::Cuda(ordinal) = device_of("input", &args.input)? else {
            return Err(PyRuntimeError::new_err("input: the CUDA ring was called with a CPU tensor"));
        };
        // First verdict: this rank's tensors (devices, dtypes, shapes) and the ring's name.
        let local = (|| -> PyResult<_> {
            let ring = ring_choice(ring)?;
            let shape = args.shape()?;
            let (n, d, v) = (shape.tokens, shape.hidden, shape.vocab);
            let on = TensorDevice::Cuda(ordinal);
            if shape.dtype == DType::Bf16 {
                checked::<bf16>("input", &args.input, &[Some(n), Some(d)], on)?;
                checked::<bf16>("weight", &args.weight, &[Some(v), Some(d)], on)?;
            } else {
                checked::<f32>("input", &args.input, &[Some(n), Some(d)], on)?;
                checked::<f32>("weight", &args.weight, &[Some(v), Some(d)], on)?;
            }
            if let Some(b) = &args.bias {
                checked::<f32>("bias", b, &[Some(v)], on)?;
            }
            let targets = TensorRef::<i64>::new("target (on the host)", &args.target, &[Some(n)])?;
            let weights = args
                .token_weights
                .as_ref()
                .map(|w| TensorRef::<f32>::new("token_weights (on the host)", w, &[Some(n)]))
                .transpose()?;
            Ok((ring, shape, targets, weights))
        })();
        let (ring, shape, targets, weights) =
            agree_on_inputs(host, local.map_err(|e| Refusal::from_py(py, e))).map_err(Refusal::into_py)?;
        let plan = agreed_plan(host, options, ring, (shape, true)).map_err(Refusal::into_py)?;
        // SAFETY: the Python frame holds both host tensors for the call; nothing writes them.
        let (targets, weights) = unsafe { (targets.as_slice(), weights.map(|w| w.as_slice())) };
        // Second verdict: the targets against the whole vocabulary, the token weights.
        let local = check_targets(targets, plan.vocab(), options.config.ignore_index)
            .and_then(|()| weights.map_or(Ok(()), check_weights))
            .map_err(|e| Refusal { kind: e.kind(), message: e.to_string() });
        agree_on_inputs(host, local).map_err(Refusal::into_py)?;

        let stream = torch_stream(py, ordinal)?;
        let (own, rows, d, v) = (shape.tokens, plan.tokens(host.rank()).len(), shape.hidden, shape.vocab);
        let pad = rows - own;
        // SAFETY: the Python frame holds every tensor for the call; nothing writes them. The
        // shapes were checked (and agreed) above, so these borrows cannot fail on one rank only.
        let (x, w, bias) = unsafe {
            let (x, w) = match shape.dtype {
                DType::Bf16 => (
                    Rows::Bf16(borrow_on_or_empty(
                        &stream,
                        ("input", &args.input),
                        &[Some(own), Some(d)],
                        ordinal,
                    )?),
                    Shard::Bf16(borrow_on_or_empty(
                        &stream,
                        ("weight", &args.weight),
                        &[Some(v), Some(d)],
                        ordinal,
                    )?),
                ),
                _ => (
                    Rows::F32(borrow_on_or_empty(
                        &stream,
                        ("input", &args.input),
                        &[Some(own), Some(d)],
                        ordinal,
                    )?),
                    Shard::F32(borrow_on_or_empty(
                        &stream,
                        ("weight", &args.weight),
                        &[Some(v), Some(d)],
                        ordinal,
                    )?),
                ),
            };
            let bias = args
                .bias
                .as_ref()
                .map(|b| borrow_on_or_empty(&stream, ("bias", b), &[Some(v)], ordinal))
                .transpose()?;
            (x, w, bias)
        };
        Ok(Self {
            x,
            w,
            bias,
            targets: targets
                .iter()
                .copied()
                .chain(std::iter::repeat_n(options.config.ignore_index, pad))
                .collect(),
            weights: weights.map(|w| w.iter().copied().chain(std::iter::repeat_n(0.0, pad)).collect()),
            plan,
            own,
            rows,
            ordinal,
            key: group_key(group, ordinal),
            stream,
        })
    }

    /// The padded rows, targets and weights on the device, on `on` (the communicator's stream).
    fn upload(&self, on: &Arc<CudaStream>) -> PyResult<Uploaded> {
        let d = self.plan.hidden();
        let padded = if self.rows == self.own { None } else { Some(pad_rows(on, &self.x, self.rows * d)?) };
        let targets = on.clone_htod(&self.targets).map_err(cuda_error("cuMemcpyHtoD"))?;
        let weights = self
            .weights
            .as_ref()
            .map(|w| on.clone_htod(w))
            .transpose()
            .map_err(cuda_error("cuMemcpyHtoD"))?;
        Ok(Uploaded { padded, targets, weights })
    }

    fn inputs<'a>(&'a self, up: &'a Uploaded) -> DeviceRankInputs<'a> {
        DeviceRankInputs {
            x: up.padded.as_ref().map_or_else(|| self.x.matrix(), Padded::matrix),
            w_shard: match &self.w {
                Shard::F32(b) => DeviceMatrix::F32(b),
                Shard::Bf16(b) => DeviceMatrix::Bf16(b),
            },
            bias_shard: self.bias.as_deref(),
            targets: &up.targets,
            weights: up.weights.as_ref(),
        }
    }

    /// Runs `f` on this call's ring (made at the first call of its plan) and device buffers, once
    /// every rank has them, between [`enter`] and [`leave`] on torch's stream. Called with the
    /// GIL released.
    fn with_ring<R>(
        &self,
        host: &dyn Communicator,
        f: impl FnOnce(&mut CudaRing<SharedNccl>, &Uploaded) -> PyResult<R>,
    ) -> PyResult<R> {
        let mut states = cuda_states();
        let prepared = (|| {
            let comm = states.comm(host, &self.key, self.ordinal)?;
            enter(&self.stream, &[comm.stream()])?;
            states.ring(host, (&self.key, self.ordinal), self.plan)?;
            Ok((comm, self.upload(comm.stream())?))
        })();
        let (comm, uploaded) = agree_ready(host, prepared)?;
        let ring = states.ring(host, (&self.key, self.ordinal), self.plan)?;
        let out = f(ring, &uploaded);
        // The ring ends with its compute stream and the communicator's waiting for each other.
        leave(&self.stream, &[comm.stream()], out)
    }
}

/// `x`'s rows copied into zeroed rows of `len` elements (a rank with fewer tokens than the plan's
/// rows, none included), on `on`.
fn pad_rows(on: &Arc<CudaStream>, x: &Rows, len: usize) -> PyResult<Padded> {
    Ok(match x {
        Rows::F32(b) => {
            let mut p = on.alloc_zeros::<f32>(len).map_err(cuda_error("cuMemAlloc"))?;
            if !b.is_empty() {
                on.memcpy_dtod(&**b, &mut p.slice_mut(..b.len())).map_err(cuda_error("cuMemcpyDtoD"))?;
            }
            Padded::F32(p)
        }
        Rows::Bf16(b) => {
            let mut p = on.alloc_zeros::<bf16>(len).map_err(cuda_error("cuMemAlloc"))?;
            if !b.is_empty() {
                on.memcpy_dtod(&**b, &mut p.slice_mut(..b.len())).map_err(cuda_error("cuMemcpyDtoD"))?;
            }
            Padded::Bf16(p)
        }
    })
}

/// Forward on CUDA tensors over `group`: the loss (0-dim for mean and sum, `[n_r]` for none) and
/// this rank's lse (`[n_r]`) into the host float32 tensors `outputs`.
#[pyfunction]
#[pyo3(signature = (options, group, ring, args, outputs))]
pub fn lce_ring_forward_cuda(
    py: Python<'_>,
    options: &LossOptions,
    group: Bound<'_, PyAny>,
    ring: Option<&str>,
    args: TensorArgs<'_>,
    outputs: (Bound<'_, PyAny>, Bound<'_, PyAny>),
) -> PyResult<()> {
    let group = Some(group);
    let mut comm: Comm = Some(communicator(py, group.clone())?);
    let host = comm.as_deref().ok_or_else(|| PyRuntimeError::new_err("no communicator"))?;
    let call = CudaRingCall::new(py, host, (options, ring), &args, &group)?;
    let n = call.own;
    let per_token = options.config.reduction == Reduction::None;
    let loss_shape: &[Option<usize>] = if per_token { &[Some(n)] } else { &[] };
    let loss_out = TensorRef::<f32>::new("loss_out", &outputs.0, loss_shape)?;
    let lse_out = TensorRef::<f32>::new("lse_out", &outputs.1, &[Some(n)])?;
    let forward = detached(py, &mut comm, |host| {
        call.with_ring(host, |ring, uploaded| ring.forward(&call.inputs(uploaded)).map_err(to_py))
    })??;
    write_own_rows(forward, n, (&loss_out, &lse_out));
    Ok(())
}

/// Backward on CUDA tensors over `group` from forward's host `lse` (`[n_r]`) and the host
/// upstream gradients: dX (`[n_r, D]`), dW (`[v_r, D]`) and dbias into the float32 device tensors
/// `grads_out`.
#[pyfunction]
#[pyo3(signature = (options, group, ring, args, lse, upstream, grads_out))]
#[allow(clippy::too_many_arguments)] // the loss's own backward's arguments, and the group's two
pub fn lce_ring_backward_cuda(
    py: Python<'_>,
    options: &LossOptions,
    group: Bound<'_, PyAny>,
    ring: Option<&str>,
    args: TensorArgs<'_>,
    lse: Bound<'_, PyAny>,
    upstream: (Bound<'_, PyAny>, Option<Bound<'_, PyAny>>),
    grads_out: (Bound<'_, PyAny>, Bound<'_, PyAny>, Option<Bound<'_, PyAny>>),
) -> PyResult<()> {
    let group = Some(group);
    let mut comm: Comm = Some(communicator(py, group.clone())?);
    let host = comm.as_deref().ok_or_else(|| PyRuntimeError::new_err("no communicator"))?;
    let call = CudaRingCall::new(py, host, (options, ring), &args, &group)?;
    let (n, rows, d) = (call.own, call.rows, call.plan.hidden());
    let v = call.plan.shard(host.rank()).len();
    let per_token = options.config.reduction == Reduction::None;
    let local = (|| -> PyResult<_> {
        let Upstreams { lse, grad, dlse } = Upstreams::new(n, per_token, &lse, &upstream)?;
        if grads_out.2.is_some() != call.bias.is_some() {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "dbias: expected exactly when there is a bias",
            ));
        }
        Ok((lse, grad, dlse))
    })();
    let (lse, grad, dlse) =
        agree_on_inputs(host, local.map_err(|e| Refusal::from_py(py, e))).map_err(Refusal::into_py)?;
    let (ordinal, stream) = (call.ordinal, call.stream.clone());
    // SAFETY: the Python frame holds every tensor for the call; the gradient tensors are the
    // caller's fresh outputs, each read by nothing else.
    let (mut dx, mut dw, mut dbias) = unsafe {
        (
            borrow_on_or_empty::<f32>(&stream, ("dx", &grads_out.0), &[Some(n), Some(d)], ordinal)?,
            borrow_on_or_empty::<f32>(&stream, ("dw", &grads_out.1), &[Some(v), Some(d)], ordinal)?,
            grads_out
                .2
                .as_ref()
                .map(|b| borrow_on_or_empty::<f32>(&stream, ("dbias", b), &[Some(v)], ordinal))
                .transpose()?,
        )
    };
    let padded = |values: &[f32]| -> Vec<f32> {
        values.iter().copied().chain(std::iter::repeat_n(0.0, rows - n)).collect()
    };
    // SAFETY: the host tensors are held by the Python frame for the call; nothing writes them.
    let (lse, grad, dlse) =
        unsafe { (padded(lse.as_slice()), grad.as_slice(), dlse.map(|g| padded(g.as_slice()))) };
    let grad_rows = if per_token { padded(grad) } else { Vec::new() };
    detached(py, &mut comm, |host| {
        call.with_ring(host, |ring, uploaded| {
            let grad = if per_token { GradOutput::PerToken(&grad_rows) } else { GradOutput::Scalar(grad[0]) };
            // Backward reads forward's lse only.
            let forward = Forward { loss: Loss::Scalar(0.0), lse };
            let g = ring
                .backward(&call.inputs(uploaded), &forward, Upstream::loss(grad).with_dlse(dlse.as_deref()))
                .map_err(to_py)?;
            // On the communicator's stream (whose context tracks the ring's buffers), which torch's
            // stream waits for on exit.
            let on = ring.comm().stream();
            copy_prefix(on, &g.dx, &mut dx, "dx")?;
            copy_prefix(on, &g.dw, &mut dw, "dw")?;
            if let (Some(src), Some(dst)) = (&g.dbias, dbias.as_mut()) {
                copy_prefix(on, src, dst, "dbias")?;
            }
            Ok(())
        })
    })?
}
