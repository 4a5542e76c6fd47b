//! `linear_cross_entropy` on torch tensors: ring-dtp's [`LinearCrossEntropy`] over the tensors'
//! own storage, one entry per operation whatever the device (CUDA tensors take `loss_cuda.rs`).
//!
//! Forward writes the loss and the per-row lse into tensors the Python side allocated; backward
//! writes dX, dW (and dbias) into gradient tensors it allocated (fp32, or on the CPU the inputs'
//! bf16: the crate accumulates in f32 and rounds once), so the only memory the call adds is the
//! plan's working set, fixed before any data is read. A gradient Python does not want is passed
//! as `None`: neither allocated nor computed. The executors (their working sets) are kept between
//! calls ([`crate::cache`]); the GIL is released while a call runs.

use half::bf16;
use pyo3::prelude::*;
use ring_dtp::{
    Bf16GradientsMut, Device, Forward, GradOutput, GradientSelection, GradientsMut, LinearCrossEntropy, Plan,
    Shape, Upstream, Want,
};

use crate::cache::{self, Executor, Key};
use crate::error::to_py;
use crate::loss_args::{
    ForwardOuts, GradArgs, LossArgs, LossIns, LossOptions, UpstreamArgs, grad_output, loss_shape,
    write_forward,
};
use crate::tensor::{Lend, Lent, Out, Register, device_of, is_dtype};

/// The selection of the gradients given (`None`: not wanted).
fn wanted(grads: &GradArgs<'_>) -> GradientSelection {
    let want = |given: bool| if given { Want::Compute } else { Want::Skip };
    GradientSelection::ALL
        .dx(want(grads.dx.is_some()))
        .dw(want(grads.dw.is_some()))
        .dbias(want(grads.dbias.is_some()))
}

/// dX and dW as the caller allocated them (of one dtype: the first given decides, the other is
/// checked against it), and dbias.
enum GradOuts {
    F32(Option<Out<f32>>, Option<Out<f32>>, Option<Out<f32>>),
    Bf16(Option<Out<bf16>>, Option<Out<bf16>>, Option<Out<f32>>),
}

impl GradOuts {
    fn new<'t, 'py>(lend: &mut Lend<'t, 'py>, grads: &'t GradArgs<'py>, shape: Shape) -> PyResult<Self> {
        let Shape { tokens: n, hidden: d, vocab: v, .. } = shape;
        let (dx, dw) = ([Some(n), Some(d)], [Some(v), Some(d)]);
        let first = grads.dx.as_ref().or(grads.dw.as_ref());
        let bf16_given = first.map(is_dtype::<bf16>).transpose()?.unwrap_or(false);
        let dbias = lend.output_opt("dbias", grads.dbias.as_ref(), &[Some(v)])?;
        Ok(if bf16_given {
            Self::Bf16(
                lend.output_opt("dx", grads.dx.as_ref(), &dx)?,
                lend.output_opt("dw", grads.dw.as_ref(), &dw)?,
                dbias,
            )
        } else {
            Self::F32(
                lend.output_opt("dx", grads.dx.as_ref(), &dx)?,
                lend.output_opt("dw", grads.dw.as_ref(), &dw)?,
                dbias,
            )
        })
    }

    /// Runs `f` with the crate's gradient buffers over the lent tensors.
    fn with<R>(
        self,
        lent: &Lent<'_, '_>,
        wanted: GradientSelection,
        f: impl FnOnce(GradBuffers<'_>) -> R,
    ) -> PyResult<R> {
        Ok(match self {
            Self::F32(dx, dw, dbias) => {
                let (dx, dw, dbias) =
                    (lent.get_mut_opt(dx)?, lent.get_mut_opt(dw)?, lent.get_mut_opt(dbias)?);
                let (dx, dw) = (dx.unwrap_or_default(), dw.unwrap_or_default());
                f(GradBuffers::F32(GradientsMut::new(dx, dw, dbias).selecting(wanted)))
            }
            Self::Bf16(dx, dw, dbias) => {
                let (dx, dw, dbias) =
                    (lent.get_mut_opt(dx)?, lent.get_mut_opt(dw)?, lent.get_mut_opt(dbias)?);
                let (dx, dw) = (dx.unwrap_or_default(), dw.unwrap_or_default());
                f(GradBuffers::Bf16(Bf16GradientsMut::new(dx, dw, dbias).selecting(wanted)))
            }
        })
    }
}

/// The crate's gradient buffers, of the caller's dtype.
enum GradBuffers<'a> {
    F32(GradientsMut<'a>),
    Bf16(Bf16GradientsMut<'a>),
}

/// Runs `f` on the kept CPU executor of `options`' plan for `shape` (made, its working set
/// reserved, at the first call of that plan), with the GIL released.
fn on_cpu<R: Send>(
    py: Python<'_>,
    options: &LossOptions,
    shape: Shape,
    f: impl FnOnce(&mut LinearCrossEntropy) -> ring_dtp::Result<R> + Send,
) -> PyResult<R> {
    let plan: Plan = options.plan(shape, Device::Cpu)?;
    py.detach(|| {
        let key = Key::Loss { device: Device::Cpu, stream: 0, plan };
        let entry = cache::entry(key, plan.workspace_bytes(), || {
            LinearCrossEntropy::new(plan, Device::Cpu).map(Executor::Loss)
        })?;
        let mut executor = entry.lock();
        match &mut *executor {
            Executor::Loss(lce) => f(lce),
            _ => Err(ring_dtp::Error::internal("a loss entry holds a loss executor")),
        }
    })
    .map_err(to_py)
}

/// The device of a call: its `input`'s (a CUDA one needs the `cuda` build).
fn call_device(args: &LossArgs<'_>) -> PyResult<Device> {
    let device = device_of("input", &args.input)?;
    if let (Device::Cuda(_), false) = (device, cfg!(feature = "cuda")) {
        return Err(crate::tensor::cuda_not_built("input"));
    }
    Ok(device)
}

/// Forward: writes the loss (a 0-dim fp32 tensor for mean and sum, `[N]` for none) and the
/// per-row lse (`[N]` fp32) into `outputs`, host tensors on either device.
#[pyfunction]
pub(crate) fn lce_forward(
    py: Python<'_>,
    options: &LossOptions,
    args: LossArgs<'_>,
    outputs: ForwardOuts<'_>,
) -> PyResult<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(ordinal) = call_device(&args)? {
        return crate::loss_cuda::forward(py, options, &args, ordinal, &outputs);
    }
    call_device(&args)?;
    let mut lend = Lend::new();
    let ins = LossIns::new(&mut lend, &args)?;
    let n = ins.shape.tokens;
    let loss_out = lend.output::<f32>("loss_out", &outputs.loss, &loss_shape(options, n))?;
    let lse_out = lend.output::<f32>("lse_out", &outputs.lse, &[Some(n)])?;
    let lent = lend.lent()?;
    let inputs = ins.inputs(&lent)?;
    let forward = on_cpu(py, options, ins.shape, |lce| lce.forward(&inputs))?;
    write_forward(forward, lent.get_mut(loss_out)?, lent.get_mut(lse_out)?);
    Ok(())
}

/// Backward from forward's `lse`: `upstream` is the gradient of the loss (0-dim for mean and
/// sum, `[N]` for none) and that of the lse output, if any (host tensors on either device); dX,
/// dW (and dbias) are written into `grads_out`, each `None` when not wanted (then not computed:
/// a frozen weight costs no dW GEMM).
#[pyfunction]
#[pyo3(signature = (options, args, lse, upstream, grads_out))]
pub(crate) fn lce_backward(
    py: Python<'_>,
    options: &LossOptions,
    args: LossArgs<'_>,
    lse: Bound<'_, PyAny>,
    upstream: UpstreamArgs<'_>,
    grads_out: GradArgs<'_>,
) -> PyResult<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(ordinal) = call_device(&args)? {
        return crate::loss_cuda::backward(py, options, &args, ordinal, &lse, &upstream, &grads_out);
    }
    call_device(&args)?;
    let mut lend = Lend::new();
    let ins = LossIns::new(&mut lend, &args)?;
    let n = ins.shape.tokens;
    let lse = lend.input::<f32>("lse", &lse, &[Some(n)])?;
    let grad = lend.input::<f32>("grad_output", &upstream.grad, &loss_shape(options, n))?;
    let dlse = lend.input_opt::<f32>("grad_lse", upstream.grad_lse.as_ref(), &[Some(n)])?;
    let outs = GradOuts::new(&mut lend, &grads_out, ins.shape)?;
    let lent = lend.lent()?;
    let (inputs, lse, grad, dlse) =
        (ins.inputs(&lent)?, lent.get(lse)?, lent.get(grad)?, lent.get_opt(dlse)?);
    let upstream = Upstream::loss(grad_output(options, grad)).with_dlse(dlse);
    outs.with(&lent, wanted(&grads_out), |out| {
        on_cpu(py, options, ins.shape, |lce| match out {
            GradBuffers::F32(out) => lce.backward_into(&inputs, lse, upstream, out),
            GradBuffers::Bf16(out) => lce.backward_into(&inputs, lse, upstream, out),
        })
    })?
}

/// Forward and backward in one pass, for a loss that is the last op before `.backward()`:
/// writes the loss and lse as [`lce_forward`] does and dX, dW (and dbias) for an upstream
/// gradient of 1 as [`lce_backward`] does. On the full-vocabulary schedule each block's logits
/// serve both passes: 3 GEMMs per block instead of 4. Mean and sum only (a per-token upstream
/// gradient is not known before backward: the crate refuses `none`).
#[pyfunction]
pub(crate) fn lce_forward_backward(
    py: Python<'_>,
    options: &LossOptions,
    args: LossArgs<'_>,
    outputs: ForwardOuts<'_>,
    grads_out: GradArgs<'_>,
) -> PyResult<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(ordinal) = call_device(&args)? {
        return crate::loss_cuda::forward_backward(py, options, &args, ordinal, &outputs, &grads_out);
    }
    call_device(&args)?;
    let mut lend = Lend::new();
    let ins = LossIns::new(&mut lend, &args)?;
    let n = ins.shape.tokens;
    let loss_out = lend.output::<f32>("loss_out", &outputs.loss, &[])?;
    let lse_out = lend.output::<f32>("lse_out", &outputs.lse, &[Some(n)])?;
    let outs = GradOuts::new(&mut lend, &grads_out, ins.shape)?;
    let lent = lend.lent()?;
    let inputs = ins.inputs(&lent)?;
    let grad = GradOutput::Scalar(1.0);
    let forward: Forward = outs.with(&lent, wanted(&grads_out), |out| {
        on_cpu(py, options, ins.shape, |lce| match out {
            GradBuffers::F32(out) => lce.forward_backward_into(&inputs, grad, out),
            GradBuffers::Bf16(out) => lce.forward_backward_into(&inputs, grad, out),
        })
    })??;
    write_forward(forward, lent.get_mut(loss_out)?, lent.get_mut(lse_out)?);
    Ok(())
}

/// How many loss executors (each with its reserved working set) are kept between calls.
#[pyfunction]
pub(crate) fn cached_loss_executors(py: Python<'_>) -> usize {
    cache::count(py, |k| matches!(k, Key::Loss { .. }))
}

/// Drops every kept loss executor and its working set.
#[pyfunction]
pub(crate) fn clear_loss_executors(py: Python<'_>) {
    cache::drop_where(py, |k| matches!(k, Key::Loss { .. }))
}
