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
//! tokens than the plan's rows pads them on the device (zero rows, ignored targets). The ring
//! (its buffers fixed at its plan's size) is kept per (group, device, stream, plan).

use std::sync::Arc;

use flatpeak_common::Communicator;
use flatpeak_common::comm::agree_on_inputs;
use flatpeak_common::cuda::cudarc::driver::{CudaSlice, CudaStream};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use ring_dtp::cuda::DeviceMatrix;
use ring_dtp::cuda::ring::{CudaRing, DeviceRankInputs};
use ring_dtp::{DType, Forward, GradOutput, Loss, Reduction, RingPlan, bf16, check_targets, check_weights};

use crate::cuda::{Borrowed, borrow_on, torch_stream};
use crate::cuda_group::{cuda_states, group_key};
use crate::error::{Refusal, to_py};
use crate::loss::{LossOptions, TensorArgs};
use crate::ring_loss::{agreed_plan, ring_choice};
use crate::tensor::{TensorDevice, TensorRef, checked, device_of};
use crate::torch_group::{Comm, communicator, detached};

fn cuda_error(op: &'static str) -> impl Fn(flatpeak_common::cuda::cudarc::driver::DriverError) -> PyErr {
    move |e| PyRuntimeError::new_err(format!("{op}: {e:?}"))
}

/// X rows on the device: the tensor in place, or padded to the plan's rows.
enum Rows {
    F32(Borrowed<f32>),
    Bf16(Borrowed<bf16>),
    PaddedF32(CudaSlice<f32>),
    PaddedBf16(CudaSlice<bf16>),
}

impl Rows {
    fn matrix(&self) -> DeviceMatrix<'_> {
        match self {
            Rows::F32(b) => DeviceMatrix::F32(b),
            Rows::Bf16(b) => DeviceMatrix::Bf16(b),
            Rows::PaddedF32(s) => DeviceMatrix::F32(s),
            Rows::PaddedBf16(s) => DeviceMatrix::Bf16(s),
        }
    }
}

/// W's shard on the device, in place.
enum Shard {
    F32(Borrowed<f32>),
    Bf16(Borrowed<bf16>),
}

/// One rank's checked CUDA call: its device tensors, its host targets and weights (padded), the
/// agreed plan, and its tokens (brought, and planned).
struct CudaRingCall {
    x: Rows,
    w: Shard,
    bias: Option<Borrowed<f32>>,
    targets: CudaSlice<i64>,
    weights: Option<CudaSlice<f32>>,
    plan: RingPlan,
    own: usize,
    rows: usize,
    ordinal: usize,
    stream: Arc<CudaStream>,
    /// (group, device, stream): the communicator's key.
    comm_key: String,
    /// That and the plan: the ring's key.
    ring_key: String,
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
        let plan = agreed_plan(host, options, ring, shape).map_err(Refusal::into_py)?;
        // SAFETY: the Python frame holds both host tensors for the call; nothing writes them.
        let (targets, weights) = unsafe { (targets.as_slice(), weights.map(|w| w.as_slice())) };
        // Second verdict: the targets against the whole vocabulary, the token weights.
        let local = check_targets(targets, plan.vocab(), options.config.ignore_index)
            .and_then(|()| weights.map_or(Ok(()), check_weights))
            .map_err(|e| Refusal { kind: e.kind(), message: e.to_string() });
        agree_on_inputs(host, local).map_err(Refusal::into_py)?;

        let stream = torch_stream(py, ordinal)?;
        let (own, rows, d) = (shape.tokens, plan.tokens(host.rank()).len(), shape.hidden);
        let pad = rows - own;
        let padded_targets: Vec<i64> =
            targets.iter().copied().chain(std::iter::repeat_n(options.config.ignore_index, pad)).collect();
        let padded_weights: Option<Vec<f32>> =
            weights.map(|w| w.iter().copied().chain(std::iter::repeat_n(0.0, pad)).collect());
        let v = shape.vocab;
        // SAFETY: the Python frame holds every tensor for the call; nothing writes them.
        let (x, w, bias) = unsafe {
            let (x, w) = match shape.dtype {
                DType::Bf16 => (
                    Rows::Bf16(borrow_on(&stream, ("input", &args.input), &[Some(own), Some(d)], ordinal)?),
                    Shard::Bf16(borrow_on(&stream, ("weight", &args.weight), &[Some(v), Some(d)], ordinal)?),
                ),
                _ => (
                    Rows::F32(borrow_on(&stream, ("input", &args.input), &[Some(own), Some(d)], ordinal)?),
                    Shard::F32(borrow_on(&stream, ("weight", &args.weight), &[Some(v), Some(d)], ordinal)?),
                ),
            };
            let bias = args
                .bias
                .as_ref()
                .map(|b| borrow_on(&stream, ("bias", b), &[Some(v)], ordinal))
                .transpose()?;
            (x, w, bias)
        };
        let x = if pad == 0 { x } else { pad_rows(&stream, x, rows * d)? };
        let targets = stream.clone_htod(&padded_targets).map_err(cuda_error("cuMemcpyHtoD"))?;
        let weights =
            padded_weights.map(|w| stream.clone_htod(&w)).transpose().map_err(cuda_error("cuMemcpyHtoD"))?;
        let comm_key = group_key(group, ordinal, &stream);
        let ring_key = format!("{comm_key}/{plan:?}");
        Ok(Self { x, w, bias, targets, weights, plan, own, rows, ordinal, stream, comm_key, ring_key })
    }

    fn inputs(&self) -> DeviceRankInputs<'_> {
        DeviceRankInputs {
            x: self.x.matrix(),
            w_shard: match &self.w {
                Shard::F32(b) => DeviceMatrix::F32(b),
                Shard::Bf16(b) => DeviceMatrix::Bf16(b),
            },
            bias_shard: self.bias.as_deref(),
            targets: &self.targets,
            weights: self.weights.as_ref(),
        }
    }

    /// Runs `f` on the cached ring of this call's plan (made at the first call), with the GIL
    /// released by the caller.
    fn with_ring<R>(
        &self,
        host: &dyn Communicator,
        f: impl FnOnce(&mut CudaRing<crate::cuda_group::SharedNccl>) -> PyResult<R>,
    ) -> PyResult<R> {
        let mut states = cuda_states();
        if !states.rings.contains_key(&self.ring_key) {
            let comm = states.comm(host, &self.comm_key, &self.stream)?;
            let ring = CudaRing::new(self.plan, comm).map_err(to_py)?;
            states.rings.insert(self.ring_key.clone(), ring);
        }
        let ring = states
            .rings
            .get_mut(&self.ring_key)
            .ok_or_else(|| PyRuntimeError::new_err("the CUDA ring was cached just above"))?;
        f(ring)
    }
}

/// `x` copied into zeroed rows of `len` elements (a rank with fewer tokens than the plan's rows).
fn pad_rows(stream: &Arc<CudaStream>, x: Rows, len: usize) -> PyResult<Rows> {
    Ok(match x {
        Rows::F32(b) => {
            let mut p = stream.alloc_zeros::<f32>(len).map_err(cuda_error("cuMemAlloc"))?;
            stream.memcpy_dtod(&*b, &mut p.slice_mut(..b.len())).map_err(cuda_error("cuMemcpyDtoD"))?;
            Rows::PaddedF32(p)
        }
        Rows::Bf16(b) => {
            let mut p = stream.alloc_zeros::<bf16>(len).map_err(cuda_error("cuMemAlloc"))?;
            stream.memcpy_dtod(&*b, &mut p.slice_mut(..b.len())).map_err(cuda_error("cuMemcpyDtoD"))?;
            Rows::PaddedBf16(p)
        }
        padded => padded,
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
        call.with_ring(host, |ring| ring.forward(&call.inputs()).map_err(to_py))
    })??;
    // SAFETY: both are host float32 tensors of the checked shapes, made by the caller for this
    // call and read by nothing else.
    let (loss, lse) = unsafe { (loss_out.as_mut_slice(), lse_out.as_mut_slice()) };
    lse.copy_from_slice(&forward.lse[..n]);
    match forward.loss {
        Loss::Scalar(l) => loss[0] = l as f32,
        Loss::PerToken(per) => loss.copy_from_slice(&per[..n]),
    }
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
        let lse = TensorRef::<f32>::new("lse", &lse, &[Some(n)])?;
        let grad_shape: &[Option<usize>] = if per_token { &[Some(n)] } else { &[] };
        let grad = TensorRef::<f32>::new("grad_output", &upstream.0, grad_shape)?;
        let dlse =
            upstream.1.as_ref().map(|g| TensorRef::<f32>::new("grad_lse", g, &[Some(n)])).transpose()?;
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
            borrow_on::<f32>(&stream, ("dx", &grads_out.0), &[Some(n), Some(d)], ordinal)?,
            borrow_on::<f32>(&stream, ("dw", &grads_out.1), &[Some(v), Some(d)], ordinal)?,
            grads_out
                .2
                .as_ref()
                .map(|b| borrow_on::<f32>(&stream, ("dbias", b), &[Some(v)], ordinal))
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
        call.with_ring(host, |ring| {
            let grad = if per_token { GradOutput::PerToken(&grad_rows) } else { GradOutput::Scalar(grad[0]) };
            // Backward reads forward's lse only.
            let forward = Forward { loss: Loss::Scalar(0.0), lse };
            let g = ring.backward(&call.inputs(), &forward, grad, dlse.as_deref()).map_err(to_py)?;
            stream.memcpy_dtod(&g.dx.slice(..n * d), &mut *dx).map_err(cuda_error("cuMemcpyDtoD (dx)"))?;
            stream.memcpy_dtod(&g.dw, &mut *dw).map_err(cuda_error("cuMemcpyDtoD (dw)"))?;
            if let (Some(src), Some(dst)) = (&g.dbias, dbias.as_mut()) {
                stream.memcpy_dtod(src, &mut **dst).map_err(cuda_error("cuMemcpyDtoD (dbias)"))?;
            }
            Ok(())
        })
    })?
}
