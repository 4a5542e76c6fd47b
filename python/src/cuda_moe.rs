//! The CUDA path of `moe_swiglu` (feature `cuda`): llep's device schedule (`llep::cuda::CudaOps`)
//! on CUDA tensors, **on torch's current stream**, expert-parallel over the caller's group.
//!
//! - The schedule's host metadata (the agreed verdicts and shapes, the route and row counts) goes
//!   through the group itself ([`TorchGroup`]; over an NCCL group it is staged through small
//!   CUDA tensors). The routing (`topk_ids`, `topk_weights`) comes from the host: the Python side
//!   copies those `T × k` values there, as the schedule is planned on the host.
//! - The token rows and weights move over the NCCL communicator of the group's ranks that
//!   [`crate::cuda_group`] keeps per (group, device), ordered on torch's current stream; llep's
//!   device state (compiled kernels, cuBLAS handle, streams) is kept beside it.
//! - The inputs are torch tensors read in place; y and the gradients are copied from llep's
//!   buffers into the float32 tensors the Python side allocated, on the same stream.

use std::mem::ManuallyDrop;
use std::sync::Arc;

use flatpeak_common::Communicator;
use flatpeak_common::comm::agree_on_inputs;
use flatpeak_common::cuda::cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use flatpeak_common::nccl::{DeviceCommunicator, NcclComm};
use half::bf16;
use llep::cuda::{CudaBuf, CudaOps};
use llep::device::{DeviceInputs, DeviceOps};
use llep::{DType, Device, Mode, Plan, Routing};
use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::prelude::*;

use crate::cuda::{Borrowed, borrow_on_or_empty, torch_stream};
use crate::cuda_group::{agree_ready, borrow_slice, copy_prefix, cuda_states, enter, group_key, leave};
use crate::error::{Refusal, to_py};
use crate::moe::{ForwardStats, MoEOptions, executor_for, locked};
use crate::moe_call::{Backward, MoEArgs, Sizes, agreed_shape};
use crate::tensor::{TensorDevice, TensorRef, TorchElement, checked, device_of};
use crate::torch_group::{Comm, communicator, detached};

/// A torch CUDA tensor's memory as one of llep's device buffers, for one call: built from the
/// tensor's data pointer and leaked back at drop, never freed by cudarc (the tensor owns it).
struct BorrowedBuf(ManuallyDrop<CudaBuf>);

impl BorrowedBuf {
    fn buf(&self) -> &CudaBuf {
        &self.0
    }
}

impl Drop for BorrowedBuf {
    fn drop(&mut self) {
        // SAFETY: the buffer is taken exactly once, here, and not used after.
        let buf = unsafe { ManuallyDrop::take(&mut self.0) };
        // The memory is the tensor's: give the pointers back instead of freeing them.
        match buf {
            CudaBuf::F32(s) => {
                let _ = s.leak();
            }
            CudaBuf::Bf16(s) => {
                let _ = s.leak();
            }
        }
    }
}

/// A checked CUDA tensor of `T` (an empty one included: a rank may bring no tokens) as a
/// [`BorrowedBuf`] on `stream`.
///
/// # Safety
/// The tensor must outlive the returned value and nothing else may write it during the call.
unsafe fn borrow_buf<T: TorchElement + DeviceRepr>(
    stream: &Arc<CudaStream>,
    tensor: (&'static str, &Bound<'_, PyAny>),
    shape: &[Option<usize>],
    ordinal: usize,
    wrap: fn(CudaSlice<T>) -> CudaBuf,
) -> PyResult<BorrowedBuf> {
    // SAFETY: the caller's contract; `BorrowedBuf`'s drop leaks the slice, never frees it.
    let slice = unsafe { borrow_slice::<T>(stream, tensor, shape, ordinal)? };
    Ok(BorrowedBuf(ManuallyDrop::new(wrap(slice))))
}

/// Runs `f` on llep's CUDA ops of `key` (made at the first call on the group and device), once
/// every rank has them: the ops' compute stream and the communicator's wait for torch's `torch`
/// stream first, and `torch` waits for both after `f`, whatever its outcome. Called with the GIL
/// released.
fn with_device<R>(
    host: &dyn Communicator,
    (key, ordinal): (String, usize),
    torch: &Arc<CudaStream>,
    f: impl FnOnce(&CudaOps<'static, NcclComm>) -> PyResult<R>,
) -> PyResult<R> {
    let mut states = cuda_states();
    let made = states.moe_ops(host, &key, ordinal).map(|_| ());
    agree_ready(host, made)?;
    let comm = states.comm(host, &key, ordinal)?;
    let ops = states.moe_ops(host, &key, ordinal)?;
    let streams = [ops.stream().as_ref(), comm.stream().as_ref()];
    enter(torch, &streams)?;
    let out = f(ops);
    leave(torch, &streams, out)
}

/// Copies llep's f32 output `src` into the borrowed torch tensor `dst` on `stream`.
fn copy_out(
    stream: &Arc<CudaStream>,
    src: &CudaBuf,
    dst: &mut Borrowed<f32>,
    what: &'static str,
) -> PyResult<()> {
    copy_prefix(stream, f32_of(src, what)?, dst, what)
}

/// The checked tensors of one CUDA call: hidden states and weights on the device (read in
/// place), the routing on the host.
struct CudaTensors {
    ids: TensorRef<i64>,
    weights: TensorRef<f32>,
}

/// Every rank's checks, agreed on; then the agreed shape.
fn prepare(
    py: Python<'_>,
    comm: &dyn Communicator,
    options: &MoEOptions,
    args: &MoEArgs<'_>,
    num_experts: Option<usize>,
    ordinal: usize,
) -> PyResult<(CudaTensors, llep::Shape)> {
    let terms = options.terms(Backward::Recomputing);
    let local = Sizes::of(args).and_then(|s| {
        if options.config.mode == Mode::SaveActivations {
            return Err(PyTypeError::new_err(
                "activations='save' keeps its store in host memory and runs on CPU tensors: llep's CUDA \
                 executor recomputes in backward (pass activations='recompute' for CUDA tensors)",
            ));
        }
        let (t, h, i, m, k) = (s.tokens, s.hidden, s.intermediate, s.local_experts, s.top_k);
        let ids = TensorRef::new("topk_ids (on the host)", &args.ids, &[Some(t), Some(k)])?;
        let weights = TensorRef::new("topk_weights (on the host)", &args.weights, &[Some(t), Some(k)])?;
        let on = TensorDevice::Cuda(ordinal);
        match s.dtype {
            DType::Bf16 => {
                checked::<bf16>("hidden_states", &args.x, &[Some(t), Some(h)], on)?;
                checked::<bf16>("gate_up_proj", &args.gate_up, &[Some(m), Some(2 * i), Some(h)], on)?;
                checked::<bf16>("down_proj", &args.down, &[Some(m), Some(h), Some(i)], on)?;
            }
            _ => {
                checked::<f32>("hidden_states", &args.x, &[Some(t), Some(h)], on)?;
                checked::<f32>("gate_up_proj", &args.gate_up, &[Some(m), Some(2 * i), Some(h)], on)?;
                checked::<f32>("down_proj", &args.down, &[Some(m), Some(h), Some(i)], on)?;
            }
        }
        Ok((CudaTensors { ids, weights }, s))
    });
    let local = local.map_err(|e| Refusal::from_py(py, e));
    let (tensors, sizes) = agree_on_inputs(comm, local).map_err(Refusal::into_py)?;
    let shape = agreed_shape(comm, sizes, num_experts, true, terms).map_err(Refusal::into_py)?;
    Ok((tensors, shape))
}

/// The device ordinal of the call, its torch stream, and the cache key of its device state.
fn device_of_call(
    py: Python<'_>,
    args: &MoEArgs<'_>,
    group: &Option<Bound<'_, PyAny>>,
) -> PyResult<(usize, Arc<CudaStream>, String)> {
    let TensorDevice::Cuda(ordinal) = device_of("hidden_states", &args.x)? else {
        return Err(PyRuntimeError::new_err("hidden_states: the CUDA path was called with a CPU tensor"));
    };
    let stream = torch_stream(py, ordinal)?;
    Ok((ordinal, stream, group_key(group, ordinal)))
}

/// The f32 slice of one of llep's device outputs.
fn f32_of<'a>(buf: &'a CudaBuf, what: &'static str) -> PyResult<&'a CudaSlice<f32>> {
    match buf {
        CudaBuf::F32(s) => Ok(s),
        CudaBuf::Bf16(_) => {
            Err(PyRuntimeError::new_err(format!("{what}: llep returned bf16 where it returns f32")))
        }
    }
}

/// The routing of a call, on the host.
///
/// # Safety
/// The routing tensors must outlive the borrow, unwritten.
unsafe fn routing(t: &CudaTensors) -> Routing<'_> {
    // SAFETY: the caller's contract; both were checked (CPU, contiguous, dtype, shape).
    unsafe { Routing { ids: t.ids.as_slice(), weights: t.weights.as_slice() } }
}

/// Borrows the call's device inputs on `stream`: hidden states, gate_up and down (and an empty
/// up, which torch's fused layout does not have).
///
/// # Safety
/// As [`borrow_buf`].
unsafe fn device_inputs(
    stream: &Arc<CudaStream>,
    args: &MoEArgs<'_>,
    shape: llep::Shape,
    ordinal: usize,
) -> PyResult<[BorrowedBuf; 3]> {
    let (t, h, i, m) = (args_tokens(args)?, shape.hidden, shape.intermediate, shape.local_experts());
    let take = |name: &'static str, tensor: &Bound<'_, PyAny>, dims: &[Option<usize>]| {
        // SAFETY: the caller's contract (the Python frame holds the tensors, nothing writes them).
        unsafe {
            match shape.dtype {
                DType::Bf16 => borrow_buf::<bf16>(stream, (name, tensor), dims, ordinal, CudaBuf::Bf16),
                _ => borrow_buf::<f32>(stream, (name, tensor), dims, ordinal, CudaBuf::F32),
            }
        }
    };
    Ok([
        take("hidden_states", &args.x, &[Some(t), Some(h)])?,
        take("gate_up_proj", &args.gate_up, &[Some(m), Some(2 * i), Some(h)])?,
        take("down_proj", &args.down, &[Some(m), Some(h), Some(i)])?,
    ])
}

fn args_tokens(args: &MoEArgs<'_>) -> PyResult<usize> {
    Ok(crate::tensor::shape_of("hidden_states", &args.x)?.first().copied().unwrap_or(0))
}

/// What both passes start from: the device, torch's current stream on it and the group's key;
/// the group's communicator; the agreed tensors and shape, and the plan.
struct Begun {
    ordinal: usize,
    stream: Arc<CudaStream>,
    key: String,
    comm: Comm,
    tensors: CudaTensors,
    shape: llep::Shape,
    plan: Plan,
}

fn begin(
    py: Python<'_>,
    options: &MoEOptions,
    group: Option<Bound<'_, PyAny>>,
    args: &MoEArgs<'_>,
    num_experts: Option<usize>,
) -> PyResult<Begun> {
    let (ordinal, stream, key) = device_of_call(py, args, &group)?;
    let comm: Comm = Some(communicator(py, group)?);
    let host = comm.as_deref().ok_or_else(|| PyRuntimeError::new_err("no communicator"))?;
    let (tensors, shape) = prepare(py, host, options, args, num_experts, ordinal)?;
    let plan = options.plan(shape)?;
    Ok(Begun { ordinal, stream, key, comm, tensors, shape, plan })
}

/// Forward on CUDA tensors: writes y (`[T, H]` float32, on the device) into `y_out` and the
/// global routes per expert into the host `counts_out`; returns the forward's statistics.
#[pyfunction]
#[pyo3(signature = (options, group, args, num_experts, y_out, counts_out))]
pub fn moe_forward_cuda(
    py: Python<'_>,
    options: &MoEOptions,
    group: Option<Bound<'_, PyAny>>,
    args: MoEArgs<'_>,
    num_experts: Option<usize>,
    y_out: Bound<'_, PyAny>,
    counts_out: Bound<'_, PyAny>,
) -> PyResult<ForwardStats> {
    let Begun { ordinal, stream, key, mut comm, tensors, shape, plan } =
        begin(py, options, group, &args, num_experts)?;
    let n = tensors.ids.len() / shape.top_k.max(1);
    let counts_out = TensorRef::<i64>::new("counts_out", &counts_out, &[Some(shape.experts)])?;
    // SAFETY: the Python frame holds every tensor for this call; y_out is the caller's fresh
    // output, read by nothing else.
    let (inputs, mut y_dst) = unsafe {
        let y = ("y_out", &y_out);
        (
            device_inputs(&stream, &args, shape, ordinal)?,
            borrow_on_or_empty::<f32>(&stream, y, &[Some(n), Some(shape.hidden)], ordinal)?,
        )
    };
    let ran = detached(py, &mut comm, |host| -> PyResult<_> {
        let mut cached = locked(options);
        let executor = executor_for(&mut cached, plan, Device::Cuda(ordinal)).map_err(to_py)?;
        // SAFETY: the routing tensors are held by the Python frame for the call.
        let routing = unsafe { routing(&tensors) };
        let schedule = executor.schedule(host, &routing).map_err(to_py)?;
        with_device(host, (key, ordinal), &stream, |ops| {
            let empty = DeviceOps::alloc(ops, 0, shape.dtype).map_err(to_py)?;
            let [x, gate_up, down] = &inputs;
            let dev = DeviceInputs { x: x.buf(), routing, gate: gate_up.buf(), up: &empty, down: down.buf() };
            let y = executor.forward(ops, &schedule, &dev).map_err(to_py)?;
            copy_out(ops.stream(), &y, &mut y_dst, "y")
        })?;
        Ok((schedule, host.rank(), executor.workspace_bytes()))
    })?;
    let (schedule, me, workspace) = ran?;
    // SAFETY: the host counts tensor was made by the caller for this call, read by nothing else.
    let counts = unsafe { counts_out.as_mut_slice() };
    for (e, c) in counts.iter_mut().enumerate() {
        *c = schedule.assignment().counts().load(e) as i64;
    }
    let rows = crate::moe::received_rows_high_water(&schedule, me);
    Ok((schedule.rounds(), rows, rows * shape.hidden * shape.elem_bytes(), workspace, 0))
}

/// Backward on CUDA tensors from `grad_output` (`[T, H]`, the input's dtype, on the device):
/// writes dX, d(topk_weights), d(gate_up_proj) and d(down_proj) into the float32 device tensors
/// `grads_out`.
#[pyfunction]
#[pyo3(signature = (options, group, args, num_experts, grad_output, grads_out))]
pub fn moe_backward_cuda(
    py: Python<'_>,
    options: &MoEOptions,
    group: Option<Bound<'_, PyAny>>,
    args: MoEArgs<'_>,
    num_experts: Option<usize>,
    grad_output: Bound<'_, PyAny>,
    grads_out: (Bound<'_, PyAny>, Bound<'_, PyAny>, Bound<'_, PyAny>, Bound<'_, PyAny>),
) -> PyResult<()> {
    let Begun { ordinal, stream, key, mut comm, tensors, shape, plan } =
        begin(py, options, group, &args, num_experts)?;
    let (h, i, m, k) = (shape.hidden, shape.intermediate, shape.local_experts(), shape.top_k);
    let n = tensors.ids.len() / k.max(1);
    // SAFETY: the Python frame holds every tensor for this call; the gradient tensors are the
    // caller's fresh outputs, each read by nothing else.
    let (inputs, dy, mut outs) = unsafe {
        let g = ("grad_output", &grad_output);
        let dy = match shape.dtype {
            DType::Bf16 => borrow_buf::<bf16>(&stream, g, &[Some(n), Some(h)], ordinal, CudaBuf::Bf16)?,
            _ => borrow_buf::<f32>(&stream, g, &[Some(n), Some(h)], ordinal, CudaBuf::F32)?,
        };
        let out = |name: &'static str, t: &Bound<'_, PyAny>, dims: &[Option<usize>]| {
            borrow_on_or_empty::<f32>(&stream, (name, t), dims, ordinal)
        };
        let outs = [
            out("dx", &grads_out.0, &[Some(n), Some(h)])?,
            out("d_topk_weights", &grads_out.1, &[Some(n), Some(k)])?,
            out("d_gate_up_proj", &grads_out.2, &[Some(m), Some(2 * i), Some(h)])?,
            out("d_down_proj", &grads_out.3, &[Some(m), Some(h), Some(i)])?,
        ];
        (device_inputs(&stream, &args, shape, ordinal)?, dy, outs)
    };
    detached(py, &mut comm, |host| -> PyResult<()> {
        let mut cached = locked(options);
        let executor = executor_for(&mut cached, plan, Device::Cuda(ordinal)).map_err(to_py)?;
        // SAFETY: the routing tensors are held by the Python frame for the call.
        let routing = unsafe { routing(&tensors) };
        let schedule = executor.schedule(host, &routing).map_err(to_py)?;
        with_device(host, (key, ordinal), &stream, |ops| {
            let empty = DeviceOps::alloc(ops, 0, shape.dtype).map_err(to_py)?;
            let [x, gate_up, down] = &inputs;
            let dev = DeviceInputs { x: x.buf(), routing, gate: gate_up.buf(), up: &empty, down: down.buf() };
            let g = executor.backward(ops, &schedule, &dev, dy.buf()).map_err(to_py)?;
            let sources =
                [(&g.dx, "dx"), (&g.d_weights, "d_weights"), (&g.d_gate, "d_gate_up"), (&g.d_down, "d_down")];
            for ((src, what), dst) in sources.into_iter().zip(outs.iter_mut()) {
                copy_out(ops.stream(), src, dst, what)?;
            }
            Ok(())
        })
    })?
}
