//! The CUDA path of `linear_cross_entropy` (feature `cuda`): ring-dtp's [`LinearCrossEntropy`]
//! on the tensors' device, **on torch's current stream** (no added synchronisation), over torch's
//! own memory: the inputs and the gradient outputs are torch tensors read and written in place,
//! and the plan's block buffers are carved (where the crate lays them out) from one `uint8`
//! tensor allocated through torch's caching allocator, so `torch.cuda.max_memory_allocated()`
//! sees the working set. The crate finishes the loss on the host (its statistics come down once
//! per call), so forward's loss and lse are host tensors and backward takes the lse and the
//! upstream gradients from the host. Executors (no block buffers of their own; the device's
//! kernels and cuBLAS handle, shared) are kept per device, stream and plan.

use pyo3::prelude::*;
use pyo3::types::PyDict;
use ring_dtp::cuda::{BlockBuffers, CarvedLayout, DeviceGradientsMut};
use ring_dtp::{Device, GradOutput, GradientSelection, LinearCrossEntropy, Plan, Shape, Upstream, Want};

use crate::cache::{self, Executor, Key};
use crate::cuda_tensor::{DOut, DeviceLend, DeviceLent};
use crate::error::to_py;
use crate::loss_args::{
    ForwardOuts, GradArgs, LossArgs, LossOptions, UpstreamArgs, grad_output, loss_shape, write_forward,
};
use crate::loss_device::DeviceLossIns;
use crate::tensor::{Lend, Register};

/// One call's device tensors and the workspace its plan's block buffers are carved from,
/// allocated through torch, registered.
struct DeviceIns {
    ins: DeviceLossIns,
    workspace: DOut<u8>,
    plan: Plan,
    layout: CarvedLayout,
}

impl DeviceIns {
    /// The tensors of `args` on device `ordinal` and a workspace tensor of the plan's bytes
    /// (kept alive by the caller's `workspace`), registered with `lend`.
    fn new<'t, 'py>(
        py: Python<'py>,
        lend: &mut DeviceLend<'t, 'py>,
        options: &LossOptions,
        args: &'t LossArgs<'py>,
        workspace: &'t mut Option<Bound<'py, PyAny>>,
    ) -> PyResult<Self> {
        let ins = DeviceLossIns::new(lend, args)?;
        let plan = options.plan(ins.shape, Device::Cuda(lend.ordinal()))?;
        let layout = BlockBuffers::carved(&plan).map_err(to_py)?;
        let torch = py.import("torch")?;
        let kwargs = PyDict::new(py);
        kwargs.set_item("dtype", torch.getattr("uint8")?)?;
        kwargs.set_item("device", args.input.getattr("device")?)?;
        let tensor = workspace.insert(torch.call_method("empty", (layout.bytes,), Some(&kwargs))?);
        let workspace = lend.output::<u8>("workspace", tensor, &[Some(layout.bytes)])?;
        Ok(Self { ins, workspace, plan, layout })
    }
}

/// Runs `f` on the kept executor of `plan` on torch's current stream (made at the first call of
/// that plan on that stream), with the GIL released.
fn on_stream<R: Send>(
    py: Python<'_>,
    lent: &DeviceLent<'_, '_>,
    plan: Plan,
    f: impl FnOnce(&mut LinearCrossEntropy) -> ring_dtp::Result<R> + Send,
) -> PyResult<R> {
    let stream = lent.stream().clone();
    let device = Device::Cuda(stream.context().ordinal());
    py.detach(|| {
        let key = Key::Loss { device, stream: stream.cu_stream() as usize, plan };
        let entry =
            cache::entry(key, 0, || LinearCrossEntropy::on_stream(plan, stream.clone()).map(Executor::Loss))?;
        let mut executor = entry.lock();
        match &mut *executor {
            Executor::Loss(lce) => f(lce),
            _ => Err(ring_dtp::Error::internal("a loss entry holds a loss executor")),
        }
    })
    .map_err(to_py)
}

/// The gradient outputs of one call on the device (fp32), each `None` when not wanted.
struct DeviceGradOuts {
    /// `[N, D]`.
    dx: Option<DOut<f32>>,
    /// `[V, D]`.
    dw: Option<DOut<f32>>,
    /// `[V]`.
    dbias: Option<DOut<f32>>,
}

fn grad_outs<'t, 'py>(
    lend: &mut DeviceLend<'t, 'py>,
    grads: &'t GradArgs<'py>,
    shape: Shape,
) -> PyResult<DeviceGradOuts> {
    let Shape { tokens: n, hidden: d, vocab: v, .. } = shape;
    Ok(DeviceGradOuts {
        dx: lend.output_opt("dx", grads.dx.as_ref(), &[Some(n), Some(d)])?,
        dw: lend.output_opt("dw", grads.dw.as_ref(), &[Some(v), Some(d)])?,
        dbias: lend.output_opt("dbias", grads.dbias.as_ref(), &[Some(v)])?,
    })
}

/// The selection of the gradients given.
fn wanted(outs: &DeviceGradOuts) -> GradientSelection {
    let want = |given: bool| if given { Want::Compute } else { Want::Skip };
    GradientSelection::ALL
        .dx(want(outs.dx.is_some()))
        .dw(want(outs.dw.is_some()))
        .dbias(want(outs.dbias.is_some()))
}

/// Runs `f` on the lent gradient outputs as ring-dtp's device gradients, selecting the given
/// ones (an empty buffer stands for one not wanted: never touched).
fn with_grads<R>(
    lent: &DeviceLent<'_, '_>,
    outs: DeviceGradOuts,
    f: impl FnOnce(DeviceGradientsMut<'_>) -> PyResult<R>,
) -> PyResult<R> {
    let selection = wanted(&outs);
    let (mut dx, mut dw) = (lent.get_mut_opt(outs.dx)?, lent.get_mut_opt(outs.dw)?);
    let (mut no_dx, mut no_dw) = (lent.empty_f32(), lent.empty_f32());
    let mut dbias = lent.get_mut_opt(outs.dbias)?;
    f(DeviceGradientsMut::new(
        dx.as_deref_mut().unwrap_or(&mut no_dx),
        dw.as_deref_mut().unwrap_or(&mut no_dw),
        dbias.as_deref_mut(),
    )
    .selecting(selection))
}

/// The CUDA forward: the loss and lse into the host fp32 tensors `outputs`.
pub(crate) fn forward(
    py: Python<'_>,
    options: &LossOptions,
    args: &LossArgs<'_>,
    ordinal: usize,
    outputs: &ForwardOuts<'_>,
) -> PyResult<()> {
    let mut workspace = None;
    let mut lend = DeviceLend::new(py, ordinal)?;
    let ins = DeviceIns::new(py, &mut lend, options, args, &mut workspace)?;
    let n = ins.ins.shape.tokens;
    let mut host = Lend::new();
    let loss_out = host.output::<f32>("loss_out", &outputs.loss, &loss_shape(options, n))?;
    let lse_out = host.output::<f32>("lse_out", &outputs.lse, &[Some(n)])?;
    let (lent, host) = (lend.lent()?, host.lent()?);
    let slices = ins.ins.slices(&lent)?;
    let inputs = slices.inputs();
    let mut blocks = lent.block_buffers(ins.workspace, ins.layout)?;
    let forward = on_stream(py, &lent, ins.plan, |lce| lce.forward_with(&mut blocks, &inputs))?;
    write_forward(forward, host.get_mut(loss_out)?, host.get_mut(lse_out)?);
    Ok(())
}

/// The CUDA backward: `lse` and the upstream gradients on the host (fp32), dX, dW (and dbias)
/// written into the device fp32 tensors `grads_out`.
pub(crate) fn backward(
    py: Python<'_>,
    options: &LossOptions,
    args: &LossArgs<'_>,
    ordinal: usize,
    lse: &Bound<'_, PyAny>,
    upstream: &UpstreamArgs<'_>,
    grads_out: &GradArgs<'_>,
) -> PyResult<()> {
    let mut workspace = None;
    let mut lend = DeviceLend::new(py, ordinal)?;
    let ins = DeviceIns::new(py, &mut lend, options, args, &mut workspace)?;
    let n = ins.ins.shape.tokens;
    let outs = grad_outs(&mut lend, grads_out, ins.ins.shape)?;
    let mut host = Lend::new();
    let lse = host.input::<f32>("lse", lse, &[Some(n)])?;
    let grad = host.input::<f32>("grad_output", &upstream.grad, &loss_shape(options, n))?;
    let dlse = host.input_opt::<f32>("grad_lse", upstream.grad_lse.as_ref(), &[Some(n)])?;
    let (lent, host) = (lend.lent()?, host.lent()?);
    let (lse, grad, dlse) = (host.get(lse)?, host.get(grad)?, host.get_opt(dlse)?);
    let upstream = Upstream::loss(grad_output(options, grad)).with_dlse(dlse);
    let slices = ins.ins.slices(&lent)?;
    let inputs = slices.inputs();
    let mut blocks = lent.block_buffers(ins.workspace, ins.layout)?;
    with_grads(&lent, outs, |out| {
        on_stream(py, &lent, ins.plan, |lce| lce.backward_into_with(&mut blocks, &inputs, lse, upstream, out))
    })
}

/// The CUDA forward and backward in one pass for a reduced loss: the loss and lse into host
/// tensors, dX, dW (and dbias) for an upstream gradient of 1 into the device `grads_out`.
pub(crate) fn forward_backward(
    py: Python<'_>,
    options: &LossOptions,
    args: &LossArgs<'_>,
    ordinal: usize,
    outputs: &ForwardOuts<'_>,
    grads_out: &GradArgs<'_>,
) -> PyResult<()> {
    let mut workspace = None;
    let mut lend = DeviceLend::new(py, ordinal)?;
    let ins = DeviceIns::new(py, &mut lend, options, args, &mut workspace)?;
    let n = ins.ins.shape.tokens;
    let outs = grad_outs(&mut lend, grads_out, ins.ins.shape)?;
    let mut host = Lend::new();
    let loss_out = host.output::<f32>("loss_out", &outputs.loss, &[])?;
    let lse_out = host.output::<f32>("lse_out", &outputs.lse, &[Some(n)])?;
    let (lent, host) = (lend.lent()?, host.lent()?);
    let slices = ins.ins.slices(&lent)?;
    let inputs = slices.inputs();
    let mut blocks = lent.block_buffers(ins.workspace, ins.layout)?;
    let grad = GradOutput::Scalar(1.0);
    let forward = with_grads(&lent, outs, |out| {
        on_stream(py, &lent, ins.plan, |lce| lce.forward_backward_into_with(&mut blocks, &inputs, grad, out))
    })?;
    write_forward(forward, host.get_mut(loss_out)?, host.get_mut(lse_out)?);
    Ok(())
}
