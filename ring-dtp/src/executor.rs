//! [`LinearCrossEntropy`]: the single-device executor, chosen by one [`Device`]. It owns its
//! config, its plan and the plan's working set, reserved once at construction and reused by
//! every call: a host [`Workspace`] on the CPU, the block buffers on a CUDA device.
//!
//! Tensors carry their device: host [`Inputs`] run on a CPU executor, device inputs
//! (`cuda::DeviceInputs`, feature `cuda`) on a CUDA one; the other combination is
//! [`Error::WrongDevice`], never a silent copy.

use flatpeak_common::{Device, Workspace};

use crate::config::Config;
use crate::cpu;
use crate::error::{Error, Result};
use crate::inputs::{Forward, GradOutput, Gradients, GradientsMut, Inputs};
use crate::plan::Plan;

/// Where an executor runs, with what it reserved there.
#[derive(Debug)]
enum Backend {
    Cpu(Workspace),
    #[cfg(feature = "cuda")]
    Cuda(Box<crate::cuda::CudaLinearCrossEntropy>),
}

/// Linear cross-entropy on one device within its [`Plan`]: `loss = CE(x·Wᵀ + b, targets)`
/// with the plan's blocks, its working set reserved once (see the module docs).
#[derive(Debug)]
pub struct LinearCrossEntropy {
    config: Config,
    plan: Plan,
    device: Device,
    backend: Backend,
}

impl LinearCrossEntropy {
    /// Validates `config` and reserves `plan`'s working set on `device`. A CUDA device without
    /// the `cuda` feature, the driver or the device is `Common(CudaUnavailable)`, saying why; a
    /// precision the device does not run for the plan's dtype ([`Precision::Tf32`] anywhere
    /// but on CUDA with f32 inputs) is [`Error::UnsupportedPrecision`].
    ///
    /// [`Precision::Tf32`]: flatpeak_common::Precision::Tf32
    pub fn new(config: Config, plan: Plan, device: Device) -> Result<Self> {
        config.validate()?;
        let backend = match device {
            Device::Cpu => {
                config.check_host_precision(plan.dtype(), "the CPU")?;
                Backend::Cpu(Workspace::new(plan.workspace_bytes())?)
            }
            Device::Cuda(ordinal) => {
                device.ensure_available()?;
                cuda_backend(config, plan, ordinal)?
            }
        };
        Ok(Self { config, plan, device, backend })
    }

    /// The config.
    pub fn config(&self) -> &Config {
        &self.config
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

    /// The loss and per-row lse of host `inputs` (one GEMM per block).
    pub fn forward(&mut self, inputs: &Inputs<'_>) -> Result<Forward> {
        let (config, plan) = (self.config, self.plan);
        cpu::forward_in(self.host_workspace()?, &config, &plan, inputs)
    }

    /// dX, dW (and dbias) of host `inputs` from forward's lse, recomputing each block's logits;
    /// `dlse` is an optional upstream gradient of the lse output.
    pub fn backward(
        &mut self,
        inputs: &Inputs<'_>,
        forward: &Forward,
        grad: GradOutput<'_>,
        dlse: Option<&[f32]>,
    ) -> Result<Gradients> {
        let (config, plan) = (self.config, self.plan);
        cpu::backward_in(self.host_workspace()?, (&config, &plan, inputs), &forward.lse, grad, dlse)
    }

    /// [`backward`](Self::backward) from forward's per-row `lse`, writing dX, dW (and dbias)
    /// into `out`, which is overwritten: the caller owns the gradient buffers (a binding's own
    /// tensors), so nothing is allocated or copied per call beyond the plan's working set.
    pub fn backward_into(
        &mut self,
        inputs: &Inputs<'_>,
        lse: &[f32],
        (grad, dlse): (GradOutput<'_>, Option<&[f32]>),
        out: GradientsMut<'_>,
    ) -> Result<()> {
        let (config, plan) = (self.config, self.plan);
        cpu::backward_into(self.host_workspace()?, (&config, &plan, inputs), (lse, grad, dlse), out)
    }

    /// Forward and backward of host `inputs` in one pass when the loss is the last op (3 GEMMs
    /// per block on the full-vocabulary schedule).
    pub fn forward_backward(
        &mut self,
        inputs: &Inputs<'_>,
        grad: GradOutput<'_>,
    ) -> Result<(Forward, Gradients)> {
        let (config, plan) = (self.config, self.plan);
        cpu::forward_backward_in(self.host_workspace()?, (&config, &plan, inputs), grad)
    }

    /// [`forward_backward`](Self::forward_backward) writing dX, dW (and dbias) into `out`,
    /// which is overwritten (a binding's own tensors, as in
    /// [`backward_into`](Self::backward_into)); returns the loss and lse.
    pub fn forward_backward_into(
        &mut self,
        inputs: &Inputs<'_>,
        grad: GradOutput<'_>,
        out: GradientsMut<'_>,
    ) -> Result<Forward> {
        let (config, plan) = (self.config, self.plan);
        cpu::forward_backward_into(self.host_workspace()?, (&config, &plan, inputs), grad, out)
    }
}

#[cfg(feature = "cuda")]
fn cuda_backend(config: Config, plan: Plan, ordinal: usize) -> Result<Backend> {
    Ok(Backend::Cuda(Box::new(crate::cuda::CudaLinearCrossEntropy::new(config, plan, ordinal)?)))
}

#[cfg(not(feature = "cuda"))]
fn cuda_backend(_config: Config, _plan: Plan, ordinal: usize) -> Result<Backend> {
    // `ensure_available` already failed without the feature; this keeps the reason explicit.
    Err(Error::Common(flatpeak_common::Error::CudaUnavailable {
        reason: format!("cuda:{ordinal} requested, but ring-dtp was built without the `cuda` feature"),
    }))
}

#[cfg(feature = "cuda")]
impl LinearCrossEntropy {
    fn device_backend(
        &mut self,
        inputs: &crate::cuda::DeviceInputs<'_>,
    ) -> Result<&mut crate::cuda::CudaLinearCrossEntropy> {
        let on = Device::Cuda(inputs.targets.context().ordinal());
        match &mut self.backend {
            Backend::Cuda(lce) if on == self.device => Ok(lce),
            _ => Err(Error::WrongDevice { executor: self.device, inputs: on }),
        }
    }

    /// [`forward`](Self::forward) of device inputs, on this executor's CUDA device.
    pub fn forward_cuda(&mut self, inputs: &crate::cuda::DeviceInputs<'_>) -> Result<Forward> {
        self.device_backend(inputs)?.forward(inputs)
    }

    /// [`backward`](Self::backward) of device inputs; the gradients stay on the device.
    pub fn backward_cuda(
        &mut self,
        inputs: &crate::cuda::DeviceInputs<'_>,
        forward: &Forward,
        grad: GradOutput<'_>,
        dlse: Option<&[f32]>,
    ) -> Result<crate::cuda::DeviceGradients> {
        self.device_backend(inputs)?.backward(inputs, forward, grad, dlse)
    }

    /// [`forward_backward`](Self::forward_backward) of device inputs.
    pub fn forward_backward_cuda(
        &mut self,
        inputs: &crate::cuda::DeviceInputs<'_>,
        grad: GradOutput<'_>,
    ) -> Result<(Forward, crate::cuda::DeviceGradients)> {
        self.device_backend(inputs)?.forward_backward(inputs, grad)
    }
}

#[cfg(test)]
mod tests {
    use flatpeak_common::{Budget, DType};

    use super::*;
    use crate::inputs::{GradientsMut, Loss, Matrix};
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
        let mut lce = LinearCrossEntropy::new(config, plan, Device::Cpu).unwrap();
        let want = cpu::forward_backward(&config, &plan, &inputs, GradOutput::Scalar(1.0)).unwrap();
        for _ in 0..2 {
            assert_eq!(lce.forward_backward(&inputs, GradOutput::Scalar(1.0)).unwrap(), want);
        }
        let fwd = lce.forward(&inputs).unwrap();
        assert!(matches!(fwd.loss, Loss::Scalar(l) if l > 0.0));
        let grads = lce.backward(&inputs, &fwd, GradOutput::Scalar(1.0), None).unwrap();
        assert_eq!(
            grads,
            cpu::backward(&config, &plan, &inputs, &fwd, GradOutput::Scalar(1.0), None).unwrap()
        );
        assert_eq!((lce.device(), lce.workspace_bytes()), (Device::Cpu, plan.workspace_bytes()));
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
        let mut lce = LinearCrossEntropy::new(config, plan, Device::Cpu).unwrap();
        let fwd = lce.forward(&inputs).unwrap();
        let dlse: Vec<f32> = (0..23).map(|i| (i as f32 * 0.7).cos()).collect();
        let want = lce.backward(&inputs, &fwd, GradOutput::Scalar(0.5), Some(&dlse)).unwrap();
        // Stale values in the caller's buffers must not leak into the result.
        let (mut dx, mut dw, mut db) = (vec![f32::NAN; 23 * 6], vec![7.0; 57 * 6], vec![-1.0; 57]);
        let out = GradientsMut { dx: &mut dx, dw: &mut dw, dbias: Some(&mut db) };
        lce.backward_into(&inputs, &fwd.lse, (GradOutput::Scalar(0.5), Some(&dlse)), out).unwrap();
        assert_eq!((dx, dw, Some(db)), (want.dx, want.dw, want.dbias));

        let (mut dx, mut dw) = (vec![0.0; 23 * 6], vec![0.0; 57 * 6 - 1]);
        let out = GradientsMut { dx: &mut dx, dw: &mut dw, dbias: None };
        let err = lce.backward_into(&inputs, &fwd.lse, (GradOutput::Scalar(1.0), None), out).unwrap_err();
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
            let mut lce = LinearCrossEntropy::new(config, plan, Device::Cpu).unwrap();
            let (want_fwd, want) = lce.forward_backward(&inputs, GradOutput::Scalar(0.5)).unwrap();
            let (mut dx, mut dw, mut db) = (vec![f32::NAN; 23 * 6], vec![7.0; 57 * 6], vec![-1.0; 57]);
            let out = GradientsMut { dx: &mut dx, dw: &mut dw, dbias: Some(&mut db) };
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
        refused(LinearCrossEntropy::new(Config::default(), plan, Device::Cpu).map(drop));
        let (x, w, targets) = (vec![0f32; 1 << 20], vec![0f32; 1 << 20], vec![0i64; 1 << 20]);
        let inputs = Inputs::new(Matrix::F32(&x), Matrix::F32(&w), &targets, 1);
        refused(cpu::forward(&Config::default(), &plan, &inputs).map(drop));
    }

    #[test]
    fn a_cuda_device_that_is_not_there_is_an_error_that_says_why() {
        let shape = Shape { tokens: 4, hidden: 2, vocab: 3, dtype: DType::F32 };
        let plan = Plan::new(&Config::default(), shape, Budget::Unlimited).unwrap();
        match LinearCrossEntropy::new(Config::default(), plan, Device::Cuda(1 << 20)) {
            Err(Error::Common(flatpeak_common::Error::CudaUnavailable { reason })) => {
                assert!(!reason.is_empty())
            }
            other => panic!("expected CudaUnavailable, got {other:?}"),
        }
    }
}
