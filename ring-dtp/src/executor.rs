//! [`LinearCrossEntropy`]: the single-device executor, chosen by one [`Device`]. It owns its
//! plan (and with it the config) and the plan's working set, reserved once at construction and
//! reused by every call: a host [`Workspace`] on the CPU, the block buffers on a CUDA device.
//!
//! One `forward`, `backward` and `forward_backward` whatever the device: tensors carry theirs
//! ([`LossInputs`]): host [`Inputs`] run on a CPU executor, device inputs
//! (`cuda::DeviceInputs`, feature `cuda`) on a CUDA one; the other combination is
//! [`Error::WrongDevice`], never a silent copy.

use flatpeak_common::{Device, Workspace};

use crate::config::Config;
use crate::cpu;
use crate::driver::{Call, Saved};
use crate::error::{Error, Result};
use crate::gradients::{GradientBuffers, Gradients};
use crate::inputs::{Forward, GradOutput, Inputs, Upstream};
use crate::plan::Plan;

/// Where an executor runs, with what it reserved there.
#[derive(Debug)]
enum Backend {
    Cpu(Workspace),
    #[cfg(feature = "cuda")]
    Cuda(Box<crate::cuda::CudaLinearCrossEntropy>),
}

/// What a [`LinearCrossEntropy`] runs on, by device: host [`Inputs`] on a CPU executor,
/// `cuda::DeviceInputs` on a CUDA one (feature `cuda`). `Gradients` is what backward returns
/// there (host vectors, or device buffers that stay on the device).
pub trait LossInputs {
    /// The gradients backward returns on this device.
    type Gradients;
    /// The device the tensors live on.
    fn device(&self) -> Device;
    /// The forward pass on `lce`'s backend (its device checked). Called by
    /// [`LinearCrossEntropy::forward`].
    #[doc(hidden)]
    fn forward_on(&self, lce: &mut LinearCrossEntropy) -> Result<Forward>;
    /// The backward pass. Called by [`LinearCrossEntropy::backward`].
    #[doc(hidden)]
    fn backward_on(
        &self,
        lce: &mut LinearCrossEntropy,
        forward: &Forward,
        upstream: Upstream<'_>,
    ) -> Result<Self::Gradients>;
    /// Both in one pass. Called by [`LinearCrossEntropy::forward_backward`].
    #[doc(hidden)]
    fn forward_backward_on(
        &self,
        lce: &mut LinearCrossEntropy,
        grad: GradOutput<'_>,
    ) -> Result<(Forward, Self::Gradients)>;
}

impl LossInputs for Inputs<'_> {
    type Gradients = Gradients;

    fn device(&self) -> Device {
        Device::Cpu
    }
    fn forward_on(&self, lce: &mut LinearCrossEntropy) -> Result<Forward> {
        let plan = lce.plan;
        cpu::forward_in(lce.host_workspace()?, Call::new(&plan, self))
    }
    fn backward_on(
        &self,
        lce: &mut LinearCrossEntropy,
        forward: &Forward,
        upstream: Upstream<'_>,
    ) -> Result<Gradients> {
        let plan = lce.plan;
        let ((), grads) = crate::driver::with_gradients(&plan, self, |out| {
            lce.backward_into(self, &forward.lse, upstream, out)
        })?;
        Ok(grads)
    }
    fn forward_backward_on(
        &self,
        lce: &mut LinearCrossEntropy,
        grad: GradOutput<'_>,
    ) -> Result<(Forward, Gradients)> {
        let plan = lce.plan;
        crate::driver::with_gradients(&plan, self, |out| lce.forward_backward_into(self, grad, out))
    }
}

/// Linear cross-entropy on one device within its [`Plan`]: `loss = CE(x·Wᵀ + b, targets)`
/// with the plan's blocks, its working set reserved once (see the module docs).
#[derive(Debug)]
pub struct LinearCrossEntropy {
    plan: Plan,
    device: Device,
    backend: Backend,
}

impl LinearCrossEntropy {
    /// Reserves `plan`'s working set on `device`, to run the plan's config. A CUDA device
    /// without the `cuda` feature, the driver or the device is `Common(CudaUnavailable)`,
    /// saying why; a precision the device does not run for the plan's dtype
    /// ([`Precision::Tf32`] anywhere but on CUDA with f32 inputs) is
    /// [`Error::UnsupportedPrecision`].
    ///
    /// [`Precision::Tf32`]: flatpeak_common::Precision::Tf32
    pub fn new(plan: Plan, device: Device) -> Result<Self> {
        let config = plan.config();
        let backend = match device {
            Device::Cpu => {
                config.check_host_precision(plan.dtype(), "the CPU")?;
                plan.check_host()?;
                Backend::Cpu(Workspace::new(plan.workspace_bytes())?)
            }
            Device::Cuda(ordinal) => {
                // Refused before any device is touched, so the refusal holds without one.
                config.check_cuda_precision(plan.dtype())?;
                device.ensure_available()?;
                cuda_backend(plan, ordinal)?
            }
        };
        Ok(Self { plan, device, backend })
    }

    /// The config (the plan's).
    pub fn config(&self) -> &Config {
        self.plan.config()
    }
    /// The plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }
    /// The device it runs on.
    pub fn device(&self) -> Device {
        self.device
    }
    /// Bytes of the working set it reserved ([`Plan::workspace_bytes`]).
    pub fn workspace_bytes(&self) -> usize {
        self.plan.workspace_bytes()
    }

    fn host_workspace(&mut self) -> Result<&mut Workspace> {
        match &mut self.backend {
            Backend::Cpu(ws) => Ok(ws),
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => Err(Error::WrongDevice { executor: self.device, inputs: Device::Cpu }),
        }
    }

    /// [`Error::WrongDevice`] unless tensors on `on` run here.
    pub(crate) fn check_device(&self, on: Device) -> Result<()> {
        if on == self.device { Ok(()) } else { Err(Error::WrongDevice { executor: self.device, inputs: on }) }
    }

    /// The loss and per-row lse of `inputs` (one GEMM per block), on this executor's device.
    pub fn forward<I: LossInputs + ?Sized>(&mut self, inputs: &I) -> Result<Forward> {
        self.check_device(inputs.device())?;
        inputs.forward_on(self)
    }

    /// dX, dW (and dbias) of `inputs` from forward's lse, recomputing each block's logits, for
    /// the upstream gradients of the loss (a [`GradOutput`] converts) and, optionally, of the
    /// lse output. On a CUDA device the gradients stay there.
    pub fn backward<I: LossInputs + ?Sized>(
        &mut self,
        inputs: &I,
        forward: &Forward,
        upstream: Upstream<'_>,
    ) -> Result<I::Gradients> {
        self.check_device(inputs.device())?;
        inputs.backward_on(self, forward, upstream)
    }

    /// Forward and backward of `inputs` in one pass when the loss is the last op (3 GEMMs per
    /// block on the full-vocabulary schedule of the CPU path).
    pub fn forward_backward<I: LossInputs + ?Sized>(
        &mut self,
        inputs: &I,
        grad: GradOutput<'_>,
    ) -> Result<(Forward, I::Gradients)> {
        self.check_device(inputs.device())?;
        inputs.forward_backward_on(self, grad)
    }

    /// [`backward`](Self::backward) from forward's per-row `lse`, writing dX, dW (and dbias)
    /// into `out`, which is overwritten: the caller owns the gradient buffers (a binding's own
    /// tensors). Into fp32 buffers ([`GradientsMut`]) nothing is allocated or copied per call
    /// beyond the plan's working set; into bf16 ones ([`Bf16GradientsMut`]) the gradients are
    /// accumulated in f32 and rounded once, with the f32 memory that documents.
    ///
    /// [`GradientsMut`]: crate::GradientsMut
    /// [`Bf16GradientsMut`]: crate::Bf16GradientsMut
    pub fn backward_into(
        &mut self,
        inputs: &Inputs<'_>,
        lse: &[f32],
        upstream: Upstream<'_>,
        out: impl GradientBuffers,
    ) -> Result<()> {
        let plan = self.plan;
        let ws = self.host_workspace()?;
        out.write_f32((inputs.n, inputs.d, inputs.v), inputs.bias.is_some(), |out| {
            cpu::backward_into(ws, Call::new(&plan, inputs), Saved::of(lse, upstream), out)
        })
    }

    /// [`forward_backward`](Self::forward_backward) writing dX, dW (and dbias) into `out`,
    /// which is overwritten (fp32 or bf16 buffers, as in
    /// [`backward_into`](Self::backward_into)); returns the loss and lse.
    pub fn forward_backward_into(
        &mut self,
        inputs: &Inputs<'_>,
        grad: GradOutput<'_>,
        out: impl GradientBuffers,
    ) -> Result<Forward> {
        let plan = self.plan;
        let ws = self.host_workspace()?;
        out.write_f32((inputs.n, inputs.d, inputs.v), inputs.bias.is_some(), |out| {
            cpu::forward_backward_into(ws, Call::new(&plan, inputs), grad, out)
        })
    }
}

#[cfg(feature = "cuda")]
fn cuda_backend(plan: Plan, ordinal: usize) -> Result<Backend> {
    Ok(Backend::Cuda(Box::new(crate::cuda::CudaLinearCrossEntropy::new(plan, ordinal)?)))
}

#[cfg(not(feature = "cuda"))]
fn cuda_backend(_plan: Plan, ordinal: usize) -> Result<Backend> {
    // `ensure_available` already failed without the feature; this keeps the reason explicit.
    Err(Error::Common(flatpeak_common::Error::CudaUnavailable {
        reason: format!("cuda:{ordinal} requested, but ring-dtp was built without the `cuda` feature"),
    }))
}

#[cfg(feature = "cuda")]
impl LinearCrossEntropy {
    /// An executor of `plan` on the CUDA backend `lce` (on device `ordinal`).
    pub(crate) fn of_cuda(plan: Plan, ordinal: usize, lce: crate::cuda::CudaLinearCrossEntropy) -> Self {
        Self { plan, device: Device::Cuda(ordinal), backend: Backend::Cuda(Box::new(lce)) }
    }

    /// The CUDA backend (the inputs' device was checked against the executor's).
    pub(crate) fn cuda_backend(&mut self) -> Result<&mut crate::cuda::CudaLinearCrossEntropy> {
        match &mut self.backend {
            Backend::Cuda(lce) => Ok(lce),
            Backend::Cpu(_) => {
                Err(Error::internal("device inputs reached a CPU executor past the device check"))
            }
        }
    }
}

/// Device inputs run on a CUDA executor; the gradients stay on the device.
#[cfg(feature = "cuda")]
impl LossInputs for crate::cuda::DeviceInputs<'_> {
    type Gradients = crate::cuda::DeviceGradients;

    fn device(&self) -> Device {
        Device::Cuda(self.targets.context().ordinal())
    }
    fn forward_on(&self, lce: &mut LinearCrossEntropy) -> Result<Forward> {
        lce.cuda_backend()?.forward(self)
    }
    fn backward_on(
        &self,
        lce: &mut LinearCrossEntropy,
        forward: &Forward,
        upstream: Upstream<'_>,
    ) -> Result<crate::cuda::DeviceGradients> {
        lce.cuda_backend()?.backward(self, forward, upstream)
    }
    fn forward_backward_on(
        &self,
        lce: &mut LinearCrossEntropy,
        grad: GradOutput<'_>,
    ) -> Result<(Forward, crate::cuda::DeviceGradients)> {
        lce.cuda_backend()?.forward_backward(self, grad)
    }
}

#[cfg(test)]
mod tests {
    use flatpeak_common::{Budget, DType};

    use super::*;
    use crate::gradients::GradientsMut;
    use crate::inputs::{Loss, Matrix};
    use crate::plan::Shape;

    #[test]
    fn reuses_its_workspace_and_matches_the_free_functions() {
        let shape = Shape { tokens: 37, hidden: 8, vocab: 101, dtype: DType::F32 };
        let config = Config::default().label_smoothing(0.1);
        let plan = Plan::new(&config, shape, Budget::Bytes(16 << 10)).unwrap();
        let x: Vec<f32> = (0..37 * 8).map(|i| (i as f32 * 0.37).sin()).collect();
        let w: Vec<f32> = (0..101 * 8).map(|i| (i as f32 * 0.11).cos() * 0.3).collect();
        let targets: Vec<i64> = (0..37).map(|i| if i % 7 == 0 { -100 } else { i * 5 % 101 }).collect();
        let inputs = Inputs::new(Matrix::F32(&x), Matrix::F32(&w), &targets, 8);
        let mut lce = LinearCrossEntropy::new(plan, Device::Cpu).unwrap();
        let want = cpu::forward_backward(&plan, &inputs, GradOutput::Scalar(1.0)).unwrap();
        for _ in 0..2 {
            assert_eq!(lce.forward_backward(&inputs, GradOutput::Scalar(1.0)).unwrap(), want);
        }
        let fwd = lce.forward(&inputs).unwrap();
        assert!(matches!(fwd.loss, Loss::Scalar(l) if l > 0.0));
        let grads = lce.backward(&inputs, &fwd, GradOutput::Scalar(1.0).into()).unwrap();
        assert_eq!(grads, cpu::backward(&plan, &inputs, &fwd, GradOutput::Scalar(1.0).into()).unwrap());
        assert_eq!((lce.device(), lce.workspace_bytes()), (Device::Cpu, plan.workspace_bytes()));
        // A plan sized for a device's buffers is refused on the CPU, by the executor and by the
        // free functions alike.
        let device =
            Plan::sized_for(plan.config(), plan.shape(), Budget::Bytes(16 << 10), crate::Target::Device)
                .unwrap();
        let e = LinearCrossEntropy::new(device, Device::Cpu).unwrap_err();
        assert!(matches!(e, Error::InvalidConfig { field: "target", .. }), "{e}");
        assert!(matches!(cpu::forward(&device, &inputs), Err(Error::InvalidConfig { field: "target", .. })));
    }

    #[test]
    fn backward_into_overwrites_caller_buffers_with_backwards_gradients() {
        let shape = Shape { tokens: 23, hidden: 6, vocab: 57, dtype: DType::F32 };
        let config = Config::default().reduction(crate::Reduction::Sum);
        let plan = Plan::new(&config, shape, Budget::Bytes(8 << 10)).unwrap();
        let x: Vec<f32> = (0..23 * 6).map(|i| (i as f32 * 0.29).sin()).collect();
        let w: Vec<f32> = (0..57 * 6).map(|i| (i as f32 * 0.13).cos() * 0.4).collect();
        let bias: Vec<f32> = (0..57).map(|i| i as f32 * 0.01).collect();
        let targets: Vec<i64> = (0..23).map(|i| if i % 4 == 0 { -100 } else { i * 3 % 57 }).collect();
        let inputs = Inputs::new(Matrix::F32(&x), Matrix::F32(&w), &targets, 6).with_bias(&bias);
        let mut lce = LinearCrossEntropy::new(plan, Device::Cpu).unwrap();
        let fwd = lce.forward(&inputs).unwrap();
        let dlse: Vec<f32> = (0..23).map(|i| (i as f32 * 0.7).cos()).collect();
        let want = lce
            .backward(&inputs, &fwd, Upstream::loss(GradOutput::Scalar(0.5)).with_dlse(Some(&dlse)))
            .unwrap();
        // Stale values in the caller's buffers must not leak into the result.
        let (mut dx, mut dw, mut db) = (vec![f32::NAN; 23 * 6], vec![7.0; 57 * 6], vec![-1.0; 57]);
        let out = GradientsMut::new(&mut dx, &mut dw, Some(&mut db));
        lce.backward_into(
            &inputs,
            &fwd.lse,
            Upstream::loss(GradOutput::Scalar(0.5)).with_dlse(Some(&dlse)),
            out,
        )
        .unwrap();
        assert_eq!((dx, dw, Some(db)), (want.dx, want.dw, want.dbias));

        let (mut dx, mut dw) = (vec![0.0; 23 * 6], vec![0.0; 57 * 6 - 1]);
        let out = GradientsMut::new(&mut dx, &mut dw, None);
        let err =
            lce.backward_into(&inputs, &fwd.lse, Upstream::loss(GradOutput::Scalar(1.0)), out).unwrap_err();
        assert!(matches!(err, Error::ShapeMismatch { what: "dw (v·d)", expected: 342, got: 341 }), "{err:?}");
    }

    #[test]
    fn forward_backward_into_overwrites_caller_buffers_on_both_schedules() {
        let shape = Shape { tokens: 23, hidden: 6, vocab: 57, dtype: DType::F32 };
        let config = Config::default().label_smoothing(0.05);
        let x: Vec<f32> = (0..23 * 6).map(|i| (i as f32 * 0.29).sin()).collect();
        let w: Vec<f32> = (0..57 * 6).map(|i| (i as f32 * 0.13).cos() * 0.4).collect();
        let bias: Vec<f32> = (0..57).map(|i| i as f32 * 0.01).collect();
        let targets: Vec<i64> = (0..23).map(|i| if i % 4 == 0 { -100 } else { i * 3 % 57 }).collect();
        let inputs = Inputs::new(Matrix::F32(&x), Matrix::F32(&w), &targets, 6).with_bias(&bias);
        // The whole vocabulary per token block (fused, 3 GEMMs) and vocabulary blocks (forward,
        // then backward).
        for blocks in [(8, 57), (8, 16)] {
            let plan = Plan::with_blocks(&config, shape, blocks).unwrap();
            let mut lce = LinearCrossEntropy::new(plan, Device::Cpu).unwrap();
            let (want_fwd, want) = lce.forward_backward(&inputs, GradOutput::Scalar(0.5)).unwrap();
            let (mut dx, mut dw, mut db) = (vec![f32::NAN; 23 * 6], vec![7.0; 57 * 6], vec![-1.0; 57]);
            let out = GradientsMut::new(&mut dx, &mut dw, Some(&mut db));
            let fwd = lce.forward_backward_into(&inputs, GradOutput::Scalar(0.5), out).unwrap();
            assert_eq!(fwd, want_fwd, "{blocks:?}");
            assert_eq!((dx, dw, Some(db)), (want.dx, want.dw, want.dbias), "{blocks:?}");
        }
    }

    #[test]
    fn a_working_set_the_system_refuses_is_a_typed_error_not_an_abort() {
        // The materialized shape N = V = 2^20: 4 TiB of logits.
        let shape = Shape { tokens: 1 << 20, hidden: 1, vocab: 1 << 20, dtype: DType::F32 };
        let plan = Plan::with_blocks(&Config::default(), shape, (1 << 20, 1 << 20)).unwrap();
        let refused = |r: Result<()>| match r {
            Err(Error::Common(flatpeak_common::Error::HostAlloc { bytes, .. })) => {
                assert!(bytes >= 1 << 42, "{bytes}")
            }
            other => panic!("expected HostAlloc, got {other:?}"),
        };
        refused(LinearCrossEntropy::new(plan, Device::Cpu).map(drop));
        let (x, w, targets) = (vec![0f32; 1 << 20], vec![0f32; 1 << 20], vec![0i64; 1 << 20]);
        let inputs = Inputs::new(Matrix::F32(&x), Matrix::F32(&w), &targets, 1);
        refused(cpu::forward(&plan, &inputs).map(drop));
    }

    #[test]
    fn a_cuda_device_that_is_not_there_is_an_error_that_says_why() {
        let shape = Shape { tokens: 4, hidden: 2, vocab: 3, dtype: DType::F32 };
        let plan = Plan::new(&Config::default(), shape, Budget::Unlimited).unwrap();
        match LinearCrossEntropy::new(plan, Device::Cuda(1 << 20)) {
            Err(Error::Common(flatpeak_common::Error::CudaUnavailable { reason })) => {
                assert!(!reason.is_empty())
            }
            other => panic!("expected CudaUnavailable, got {other:?}"),
        }
    }
}
