//! The CUDA path of `linear_cross_entropy` (feature `cuda`): ring-dtp's CUDA executor on the
//! tensors' device, **on torch's current stream** (so it is ordered after the torch work that
//! produced the inputs and before the torch work that reads the outputs, with no added
//! synchronisation), over torch's own memory:
//!
//! - the inputs and the gradient outputs are torch tensors, read and written in place;
//! - the plan's block buffers are carved from one `uint8` tensor the Python side allocates
//!   through torch's caching allocator (`LossOptions.cuda_workspace_bytes` bytes), so
//!   `torch.cuda.max_memory_allocated()` sees the working set;
//! - only O(N) per-token state (resolved targets, fold statistics, row scales) is allocated by
//!   the crate itself, on the same stream.
//!
//! The crate finishes the loss on the host (its statistics are downloaded once per call, which
//! waits for the stream), so forward's loss and lse come back in CPU tensors and backward takes
//! the lse from the CPU. Executors (kernels compiled once, a cuBLAS handle) are kept per
//! device, stream, config and plan.
//!
//! A torch tensor's memory enters cudarc as a [`Borrowed`] slice: built from the tensor's data
//! pointer for one call and *leaked* back at its end, never freed by cudarc.

use std::collections::HashMap;
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, OnceLock};

use flatpeak_common::cuda::cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, sys};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use ring_dtp::cuda::{BlockBuffers, CudaLinearCrossEntropy, DeviceGradientsMut, DeviceInputs, DeviceMatrix};
use ring_dtp::{DType, GradOutput, Plan, Reduction, Shape, bf16};

use crate::error::to_py;
use crate::loss::{GradArgs, LossOptions, TensorArgs, check_fused, selection, write_forward};
use crate::tensor::{Span, TensorDevice, TensorRef, TorchElement, check_disjoint, checked, device_of};

/// Executors kept at most (a training loop uses a handful of shapes).
const CACHED_EXECUTORS: usize = 16;
/// Alignment of each block buffer carved from the workspace tensor.
const CARVE_ALIGN: usize = 256;

/// A torch CUDA tensor's memory as a cudarc slice for one call. cudarc never frees it: dropping
/// a `Borrowed` leaks the slice back (`CudaSlice::leak`), the tensor keeps owning the memory.
pub(crate) struct Borrowed<T> {
    slice: ManuallyDrop<CudaSlice<T>>,
    name: &'static str,
    address: usize,
}

impl<T: DeviceRepr> Borrowed<T> {
    /// `len` elements of `T` from device address `address` on `stream`.
    ///
    /// # Safety
    /// `[address, address + len·size_of::<T>())` must be device memory of `stream`'s context
    /// holding `len` valid `T`s, alive (held by a torch tensor the caller keeps) until this
    /// `Borrowed` drops, and written by nothing else while the call uses it.
    unsafe fn new(stream: &Arc<CudaStream>, name: &'static str, address: usize, len: usize) -> Self {
        // SAFETY: the caller's contract is `upgrade_device_ptr`'s (a valid allocation of at
        // least `len` elements); the slice is never dropped as owned memory (see `Drop`).
        let slice = unsafe { stream.upgrade_device_ptr::<T>(address as sys::CUdeviceptr, len) };
        Self { slice: ManuallyDrop::new(slice), name, address }
    }

    pub(crate) fn span(&self) -> Span {
        Span::raw(self.name, self.address, self.slice.len() * std::mem::size_of::<T>())
    }
}

impl<T> Deref for Borrowed<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T> DerefMut for Borrowed<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}

impl<T> Drop for Borrowed<T> {
    fn drop(&mut self) {
        // SAFETY: `slice` is taken exactly once, here, and not used after.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        // The memory is the tensor's: give the pointer back instead of freeing it.
        let _ = slice.leak();
    }
}

/// An empty slice standing for a gradient that is not computed: no memory behind it.
fn no_buffer(stream: &Arc<CudaStream>, name: &'static str) -> Borrowed<f32> {
    // SAFETY: zero elements: nothing is read or written through the slice (the crate checks a
    // skipped gradient's buffer is empty and never touches it), and dropping it leaks the null
    // pointer back instead of freeing it.
    unsafe { Borrowed::new(stream, name, 0, 0) }
}

/// A checked CUDA tensor of `T` on device `ordinal`, borrowed for the call.
///
/// # Safety
/// The tensor must outlive the returned value and nothing else may write it during the call
/// (the Python frame holds every tensor of the call; outputs are checked disjoint).
pub(crate) unsafe fn borrow_on<T: TorchElement + DeviceRepr>(
    stream: &Arc<CudaStream>,
    (name, tensor): (&'static str, &Bound<'_, PyAny>),
    shape: &[Option<usize>],
    ordinal: usize,
) -> PyResult<Borrowed<T>> {
    // SAFETY: the caller's contract, which is `borrow_on_or_empty`'s.
    let borrowed = unsafe { borrow_on_or_empty(stream, (name, tensor), shape, ordinal)? };
    if borrowed.is_empty() {
        return Err(PyValueError::new_err(format!("{name}: empty CUDA tensors are not supported")));
    }
    Ok(borrowed)
}

/// As [`borrow_on`], an empty tensor included (a rank of a group may bring no tokens): its
/// slice has no elements and is never dereferenced.
///
/// # Safety
/// As [`borrow_on`].
pub(crate) unsafe fn borrow_on_or_empty<T: TorchElement + DeviceRepr>(
    stream: &Arc<CudaStream>,
    (name, tensor): (&'static str, &Bound<'_, PyAny>),
    shape: &[Option<usize>],
    ordinal: usize,
) -> PyResult<Borrowed<T>> {
    let (address, len) = checked::<T>(name, tensor, shape, TensorDevice::Cuda(ordinal))?;
    // SAFETY: `checked` proved a live, contiguous CUDA tensor of `len` elements of `T` on this
    // device at `address`; the caller keeps it alive and unaliased for the call; an empty slice
    // (len 0) is never read or written.
    Ok(unsafe { Borrowed::new(stream, name, address, len) })
}

/// Torch's current stream on device `ordinal`, wrapped for cudarc (not owned: never destroyed).
pub(crate) fn torch_stream(py: Python<'_>, ordinal: usize) -> PyResult<Arc<CudaStream>> {
    let ctx = flatpeak_common::cuda::context(ordinal).map_err(to_py)?;
    let stream = py.import("torch.cuda")?.call_method1("current_stream", (ordinal,))?;
    let raw: usize = stream.getattr("cuda_stream")?.extract()?;
    // SAFETY: torch's current stream of device `ordinal` is a valid stream of the device's
    // primary context (the one `context` retains); torch keeps it alive for the process, and
    // every use of the wrapper is on this stream, so ordering with torch's work is the stream's.
    Ok(unsafe { ctx.wrap_borrowed_stream(raw as sys::CUstream) })
}

type Cache = Mutex<HashMap<String, CudaLinearCrossEntropy>>;

fn cache() -> &'static Cache {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Runs `f` on the cached executor for (device, stream, config, plan), creating it once.
fn with_executor<R>(
    (ordinal, stream): (usize, &Arc<CudaStream>),
    options: &LossOptions,
    plan: Plan,
    f: impl FnOnce(&mut CudaLinearCrossEntropy) -> ring_dtp::Result<R>,
) -> ring_dtp::Result<R> {
    let key = format!("{ordinal}/{:p}/{:?}/{plan:?}", stream.cu_stream(), options.config);
    let mut executors = cache().lock().unwrap_or_else(|p| p.into_inner());
    if executors.len() >= CACHED_EXECUTORS && !executors.contains_key(&key) {
        executors.clear();
    }
    let lce = match executors.entry(key) {
        std::collections::hash_map::Entry::Occupied(cached) => cached.into_mut(),
        std::collections::hash_map::Entry::Vacant(slot) => {
            slot.insert(CudaLinearCrossEntropy::on_stream(plan, stream.clone())?)
        }
    };
    f(lce)
}

/// Byte offsets of the three block buffers in the workspace tensor (each at least one element,
/// ring-dtp's layout), their lengths, and the tensor's size.
fn carve(plan: &Plan) -> ring_dtp::Result<([usize; 3], [usize; 3], usize)> {
    let (offsets, bytes) = BlockBuffers::packed(plan, CARVE_ALIGN)?;
    Ok((offsets, BlockBuffers::lens(plan).map(|l| l.max(1)), bytes))
}

/// Bytes of the `uint8` CUDA tensor the CUDA path carves `options`' block buffers from.
pub fn workspace_bytes(options: &LossOptions, shape: Shape) -> PyResult<usize> {
    // Every GPU has the same default budget: device 0 stands for any.
    let plan = options.plan(shape, TensorDevice::Cuda(0))?;
    Ok(carve(&plan).map_err(to_py)?.2)
}

/// One call's device tensors: X, W, targets, bias, weights.
struct DeviceArgs {
    x: Operand,
    w: Operand,
    targets: Borrowed<i64>,
    bias: Option<Borrowed<f32>>,
    weights: Option<Borrowed<f32>>,
    shape: Shape,
}

enum Operand {
    F32(Borrowed<f32>),
    Bf16(Borrowed<bf16>),
}

impl Operand {
    fn matrix(&self) -> DeviceMatrix<'_> {
        match self {
            Operand::F32(m) => DeviceMatrix::F32(m),
            Operand::Bf16(m) => DeviceMatrix::Bf16(m),
        }
    }
    fn span(&self) -> Span {
        match self {
            Operand::F32(m) => m.span(),
            Operand::Bf16(m) => m.span(),
        }
    }
}

impl DeviceArgs {
    /// # Safety
    /// As [`borrow_on`]: every tensor of `args` outlives the result and is not written meanwhile.
    unsafe fn new(stream: &Arc<CudaStream>, args: &TensorArgs<'_>, ordinal: usize) -> PyResult<Self> {
        let shape = args.shape()?;
        let Shape { tokens: n, hidden: d, vocab: v, dtype } = shape;
        let (x_shape, w_shape) = ([Some(n), Some(d)], [Some(v), Some(d)]);
        // SAFETY: the caller's contract (every tensor of `args` outlives the result, unwritten).
        let (x, w) = unsafe {
            match dtype {
                DType::Bf16 => (
                    Operand::Bf16(borrow_on(stream, ("input", &args.input), &x_shape, ordinal)?),
                    Operand::Bf16(borrow_on(stream, ("weight", &args.weight), &w_shape, ordinal)?),
                ),
                _ => (
                    Operand::F32(borrow_on(stream, ("input", &args.input), &x_shape, ordinal)?),
                    Operand::F32(borrow_on(stream, ("weight", &args.weight), &w_shape, ordinal)?),
                ),
            }
        };
        // SAFETY: as above.
        let targets = unsafe { borrow_on(stream, ("target", &args.target), &[Some(n)], ordinal)? };
        let bias = match &args.bias {
            // SAFETY: as above.
            Some(b) => Some(unsafe { borrow_on(stream, ("bias", b), &[Some(v)], ordinal)? }),
            None => None,
        };
        let weights = match &args.token_weights {
            // SAFETY: as above.
            Some(t) => Some(unsafe { borrow_on(stream, ("token_weights", t), &[Some(n)], ordinal)? }),
            None => None,
        };
        Ok(Self { x, w, targets, bias, weights, shape })
    }

    fn inputs(&self) -> DeviceInputs<'_> {
        let Shape { tokens: n, hidden: d, vocab: v, .. } = self.shape;
        DeviceInputs {
            x: self.x.matrix(),
            w: self.w.matrix(),
            bias: self.bias.as_deref(),
            targets: &self.targets,
            weights: self.weights.as_deref(),
            n,
            d,
            v,
        }
    }

    fn spans(&self) -> Vec<Span> {
        let mut spans = vec![self.x.span(), self.w.span(), self.targets.span()];
        spans.extend(self.bias.iter().map(Borrowed::span));
        spans.extend(self.weights.iter().map(Borrowed::span));
        spans
    }
}

/// The block buffers carved from the workspace tensor, as slices that are leaked back (never
/// freed) when this drops, on every path.
struct Carved(ManuallyDrop<BlockBuffers>);

impl Carved {
    fn buffers(&mut self) -> &mut BlockBuffers {
        &mut self.0
    }
}

impl Drop for Carved {
    fn drop(&mut self) {
        // SAFETY: the buffers are taken exactly once, here, and not used after.
        let BlockBuffers { logits, x_wide, w_wide } = unsafe { ManuallyDrop::take(&mut self.0) };
        // The memory is the workspace tensor's: give the pointers back instead of freeing.
        let _ = (logits.leak(), x_wide.leak(), w_wide.leak());
    }
}

/// The block buffers carved from the workspace tensor, and the tensor's byte range.
///
/// # Safety
/// As [`borrow_on`] for `workspace`.
unsafe fn block_buffers(
    stream: &Arc<CudaStream>,
    workspace: &Bound<'_, PyAny>,
    plan: &Plan,
    ordinal: usize,
) -> PyResult<(Carved, Span)> {
    let (offsets, lens, bytes) = carve(plan).map_err(to_py)?;
    let (address, _) = checked::<u8>("workspace", workspace, &[Some(bytes)], TensorDevice::Cuda(ordinal))?;
    if !address.is_multiple_of(CARVE_ALIGN) {
        return Err(PyValueError::new_err(format!(
            "workspace: data pointer {address:#x} is not 256-byte aligned"
        )));
    }
    // `take` moves each slice into `Carved`, whose `Drop` leaks it back.
    let [logits, x_wide, w_wide] = std::array::from_fn(|i| {
        // SAFETY: each carve lies inside the checked workspace tensor (`carve` lays the three
        // out at aligned offsets within its `bytes`), at a 256-byte aligned address, and the
        // three are disjoint; the caller keeps the tensor alive and unaliased.
        let carved = unsafe { Borrowed::<f32>::new(stream, "workspace", address + offsets[i], lens[i]) };
        take(carved)
    });
    Ok((
        Carved(ManuallyDrop::new(BlockBuffers { logits, x_wide, w_wide })),
        Span::raw("workspace", address, bytes),
    ))
}

/// The slice of a `Borrowed`, moved into an owner that leaks it (never frees it): a [`Carved`],
/// or a step's `CudaDevice`.
pub(crate) fn take<T>(b: Borrowed<T>) -> CudaSlice<T> {
    let mut b = ManuallyDrop::new(b);
    // SAFETY: `b` is never dropped (ManuallyDrop), so its slice is taken out exactly once.
    unsafe { ManuallyDrop::take(&mut b.slice) }
}

/// The CUDA device of the call (its `input`'s).
fn cuda_ordinal(args: &TensorArgs<'_>) -> PyResult<usize> {
    match device_of("input", &args.input)? {
        TensorDevice::Cuda(ordinal) => Ok(ordinal),
        TensorDevice::Cpu => Err(PyValueError::new_err("input: expected a CUDA tensor")),
    }
}

/// The CUDA forward: the loss and lse into CPU fp32 tensors `loss_out` (0-dim, or `[N]` for
/// reduction none) and `lse_out` (`[N]`), the block buffers carved from `workspace`.
#[pyfunction]
pub fn lce_forward_cuda(
    py: Python<'_>,
    options: &LossOptions,
    args: TensorArgs<'_>,
    workspace: Bound<'_, PyAny>,
    outputs: (Bound<'_, PyAny>, Bound<'_, PyAny>),
) -> PyResult<()> {
    let ordinal = cuda_ordinal(&args)?;
    let stream = torch_stream(py, ordinal)?;
    // SAFETY: the Python frame holds `args` for the call; forward writes none of them.
    let device = unsafe { DeviceArgs::new(&stream, &args, ordinal)? };
    let n = device.shape.tokens;
    let per_token = options.config.reduction == Reduction::None;
    let loss_shape: &[Option<usize>] = if per_token { &[Some(n)] } else { &[] };
    let loss_out = TensorRef::<f32>::new("loss_out", &outputs.0, loss_shape)?;
    let lse_out = TensorRef::<f32>::new("lse_out", &outputs.1, &[Some(n)])?;
    check_disjoint(&[(&loss_out).into(), (&lse_out).into()], &[])?;
    let plan = options.plan(device.shape, TensorDevice::Cuda(ordinal))?;
    // SAFETY: the Python frame holds `workspace`; it is a fresh tensor no other tensor shares.
    let (mut carved, workspace_span) = unsafe { block_buffers(&stream, &workspace, &plan, ordinal)? };
    check_disjoint(&[workspace_span], &device.spans())?;
    let forward = py.detach(|| {
        let inputs = device.inputs();
        with_executor((ordinal, &stream), options, plan, |lce| lce.forward_with(carved.buffers(), &inputs))
    });
    drop(carved);
    write_forward(forward.map_err(to_py)?, (&loss_out, &lse_out));
    Ok(())
}

/// The gradient outputs of one call on the device: dX and dW (an empty buffer for one not
/// wanted: no tensor, no GEMM), dbias where given, and the selection they make.
struct DeviceGradOutputs {
    dx: Borrowed<f32>,
    dw: Borrowed<f32>,
    dbias: Option<Borrowed<f32>>,
    wanted: ring_dtp::GradientSelection,
}

impl DeviceGradOutputs {
    /// Borrows the given CUDA fp32 tensors, dX `[N, D]`, dW `[V, D]`, dbias `[V]`.
    ///
    /// # Safety
    /// The Python frame holds the given tensors for the call and nothing else writes them; the
    /// caller checks them disjoint from each other and from every input ([`Self::spans`])
    /// before any launch.
    unsafe fn borrow(
        stream: &Arc<CudaStream>,
        grads_out: &GradArgs<'_>,
        device: &DeviceArgs,
        ordinal: usize,
    ) -> PyResult<Self> {
        let Shape { tokens: n, hidden: d, vocab: v, .. } = device.shape;
        let given = [&grads_out.0, &grads_out.1, &grads_out.2].map(Option::is_some);
        let wanted = selection(given, device.bias.is_some())?;
        let output = |name, t: &Option<Bound<'_, PyAny>>, shape: &[Option<usize>]| match t {
            // SAFETY: the caller's contract: held by the Python frame, written by nothing else.
            Some(t) => unsafe { borrow_on::<f32>(stream, (name, t), shape, ordinal) }.map(Some),
            None => Ok(None),
        };
        let dx = output("dx", &grads_out.0, &[Some(n), Some(d)])?.unwrap_or_else(|| no_buffer(stream, "dx"));
        let dw = output("dw", &grads_out.1, &[Some(v), Some(d)])?.unwrap_or_else(|| no_buffer(stream, "dw"));
        let dbias = output("dbias", &grads_out.2, &[Some(v)])?;
        Ok(Self { dx, dw, dbias, wanted })
    }

    fn spans(&self) -> Vec<Span> {
        let mut spans = vec![self.dx.span(), self.dw.span()];
        spans.extend(self.dbias.iter().map(Borrowed::span));
        spans
    }

    fn as_mut(&mut self) -> DeviceGradientsMut<'_> {
        DeviceGradientsMut::new(&mut self.dx, &mut self.dw, self.dbias.as_deref_mut()).selecting(self.wanted)
    }
}

/// The CUDA backward: `lse` and the upstream gradients on the CPU (fp32), dX, dW (and dbias)
/// written into the CUDA fp32 tensors `grads_out`, the block buffers carved from `workspace`.
#[pyfunction]
#[pyo3(signature = (options, args, lse, upstream, workspace, grads_out))]
pub fn lce_backward_cuda(
    py: Python<'_>,
    options: &LossOptions,
    args: TensorArgs<'_>,
    lse: Bound<'_, PyAny>,
    upstream: (Bound<'_, PyAny>, Option<Bound<'_, PyAny>>),
    workspace: Bound<'_, PyAny>,
    grads_out: GradArgs<'_>,
) -> PyResult<()> {
    let ordinal = cuda_ordinal(&args)?;
    let stream = torch_stream(py, ordinal)?;
    // SAFETY: the Python frame holds `args`; backward writes none of them (the outputs are
    // checked disjoint below).
    let device = unsafe { DeviceArgs::new(&stream, &args, ordinal)? };
    let n = device.shape.tokens;
    let lse = TensorRef::<f32>::new("lse", &lse, &[Some(n)])?;
    let per_token = options.config.reduction == Reduction::None;
    let grad_shape: &[Option<usize>] = if per_token { &[Some(n)] } else { &[] };
    let grad_loss = TensorRef::<f32>::new("grad_output", &upstream.0, grad_shape)?;
    let grad_lse =
        upstream.1.as_ref().map(|g| TensorRef::<f32>::new("grad_lse", g, &[Some(n)])).transpose()?;
    // SAFETY: the Python frame holds the fresh output tensors; checked disjoint below.
    let mut grads = unsafe { DeviceGradOutputs::borrow(&stream, &grads_out, &device, ordinal)? };
    let plan = options.plan(device.shape, TensorDevice::Cuda(ordinal))?;
    // SAFETY: the Python frame holds `workspace`, a fresh tensor.
    let (mut carved, workspace_span) = unsafe { block_buffers(&stream, &workspace, &plan, ordinal)? };
    let mut outputs = grads.spans();
    outputs.push(workspace_span);
    check_disjoint(&outputs, &device.spans())?;
    // SAFETY: CPU tensors held by the Python frame, only read.
    let (lse, grad_loss, grad_lse) =
        unsafe { (lse.as_slice(), grad_loss.as_slice(), grad_lse.map(|g| g.as_slice())) };
    let result = py.detach(|| {
        let inputs = device.inputs();
        let grad = if per_token { GradOutput::PerToken(grad_loss) } else { GradOutput::Scalar(grad_loss[0]) };
        with_executor((ordinal, &stream), options, plan, |lce| {
            lce.backward_into_with(
                carved.buffers(),
                &inputs,
                lse,
                ring_dtp::Upstream::loss(grad).with_dlse(grad_lse),
                grads.as_mut(),
            )
        })
    });
    drop(carved);
    result.map_err(to_py)
}

/// The CUDA forward and backward in one pass for a reduced loss (`mean` or `sum`), the
/// gradients for an upstream gradient of 1: the loss and lse into CPU fp32 tensors `outputs`
/// (0-dim and `[N]`), dX, dW (and dbias) into the CUDA fp32 tensors `grads_out` (each `None`
/// when not wanted), the block buffers carved from `workspace`. On the full-vocabulary schedule
/// each block's logits serve both passes (3 GEMMs instead of 4).
#[pyfunction]
pub fn lce_forward_backward_cuda(
    py: Python<'_>,
    options: &LossOptions,
    args: TensorArgs<'_>,
    workspace: Bound<'_, PyAny>,
    outputs: (Bound<'_, PyAny>, Bound<'_, PyAny>),
    grads_out: GradArgs<'_>,
) -> PyResult<()> {
    check_fused(options)?;
    let ordinal = cuda_ordinal(&args)?;
    let stream = torch_stream(py, ordinal)?;
    // SAFETY: the Python frame holds `args`; the call writes none of them (the outputs are
    // checked disjoint below).
    let device = unsafe { DeviceArgs::new(&stream, &args, ordinal)? };
    let n = device.shape.tokens;
    let loss_out = TensorRef::<f32>::new("loss_out", &outputs.0, &[])?;
    let lse_out = TensorRef::<f32>::new("lse_out", &outputs.1, &[Some(n)])?;
    check_disjoint(&[(&loss_out).into(), (&lse_out).into()], &[])?;
    // SAFETY: the Python frame holds the fresh output tensors; checked disjoint below.
    let mut grads = unsafe { DeviceGradOutputs::borrow(&stream, &grads_out, &device, ordinal)? };
    let plan = options.plan(device.shape, TensorDevice::Cuda(ordinal))?;
    // SAFETY: the Python frame holds `workspace`, a fresh tensor.
    let (mut carved, workspace_span) = unsafe { block_buffers(&stream, &workspace, &plan, ordinal)? };
    let mut device_outputs = grads.spans();
    device_outputs.push(workspace_span);
    check_disjoint(&device_outputs, &device.spans())?;
    let forward = py.detach(|| {
        let inputs = device.inputs();
        with_executor((ordinal, &stream), options, plan, |lce| {
            lce.forward_backward_into_with(carved.buffers(), &inputs, GradOutput::Scalar(1.0), grads.as_mut())
        })
    });
    drop(carved);
    write_forward(forward.map_err(to_py)?, (&loss_out, &lse_out));
    Ok(())
}
