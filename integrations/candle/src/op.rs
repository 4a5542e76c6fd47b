//! The candle custom op of one loss call: its plan and non-differentiable inputs, forward's
//! saved log-sum-exp, and the forward and backward on either device (the CPU here, CUDA in
//! [`crate::cuda`]).

use std::sync::{Mutex, PoisonError};

use candle_core::{CpuStorage, CustomOp2, CustomOp3, DType as CandleDType, Layout, Tensor};
use ring_dtp::{Device, GradOutput, GradientsMut, Inputs, LinearCrossEntropy, Loss, Matrix, Plan, Reduction};

use crate::error::{Error, Result};
use crate::grads::Grads;
use crate::host;

/// What the op keeps of the non-differentiable inputs, on the inputs' device.
#[derive(Debug)]
pub(crate) enum PerToken {
    /// CPU inputs: target ids and token weights on the host.
    Host {
        /// Target ids, N.
        targets: Vec<i64>,
        /// Token weights, N.
        weights: Option<Vec<f32>>,
    },
    /// CUDA inputs: the same on the device.
    #[cfg(feature = "cuda")]
    Device(crate::cuda::DevicePerToken),
}

/// The op: one forward (and its backward) of one call.
#[derive(Debug)]
pub(crate) struct FusedLinearCrossEntropy {
    plan: Plan,
    reduction: Reduction,
    per_token: PerToken,
    /// Forward's per-row log-sum-exp (on the host: ring-dtp finishes the loss there on either
    /// device), written by forward, read by every backward of this call's graph.
    lse: Mutex<Option<Vec<f32>>>,
}

/// The op's name in candle's errors.
pub(crate) const NAME: &str = "flatpeak-linear-cross-entropy";

/// The inputs' device is not the one the op's per-token tensors were captured on.
fn moved(got: &'static str) -> Error {
    Error::Device { what: "input", expected: "the device forward ran on".into(), got: got.into() }
}

impl FusedLinearCrossEntropy {
    pub(crate) fn new(plan: Plan, reduction: Reduction, per_token: PerToken) -> Self {
        Self { plan, reduction, per_token, lse: Mutex::new(None) }
    }

    fn save(&self, lse: Vec<f32>) {
        // A poisoned lock held a value a panicking thread left; it is overwritten whole.
        *self.lse.lock().unwrap_or_else(PoisonError::into_inner) = Some(lse);
    }

    /// Runs `body` on forward's saved lse.
    fn with_lse<R>(&self, body: impl FnOnce(&[f32]) -> Result<R>) -> Result<R> {
        let saved = self.lse.lock().unwrap_or_else(PoisonError::into_inner);
        body(saved.as_deref().ok_or(Error::MissingForward { op: NAME })?)
    }

    /// The loss's shape: a scalar, or one per token.
    fn loss_shape(&self) -> candle_core::Shape {
        match self.reduction {
            Reduction::None => candle_core::Shape::from(self.plan.shape().tokens),
            _ => candle_core::Shape::from(()),
        }
    }

    /// The loss's values on the host: one, or one per token.
    fn loss_values(loss: Loss) -> Vec<f32> {
        match loss {
            Loss::Scalar(loss) => vec![loss as f32],
            Loss::PerToken(per_token) => per_token,
        }
    }

    /// The upstream gradient on the host (one value, or one per token), as ring-dtp takes it.
    fn with_upstream<R>(
        &self,
        grad_res: &Tensor,
        body: impl FnOnce(GradOutput<'_>) -> Result<R>,
    ) -> Result<R> {
        let host = grad_res.to_dtype(CandleDType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        body(match self.reduction {
            Reduction::None => GradOutput::PerToken(&host),
            _ => GradOutput::Scalar(host.first().copied().unwrap_or(0.0)),
        })
    }

    fn host_inputs<'a>(
        &'a self,
        x: Matrix<'a>,
        w: Matrix<'a>,
        bias: Option<&'a [f32]>,
    ) -> Result<Inputs<'a>> {
        #[cfg_attr(not(feature = "cuda"), allow(irrefutable_let_patterns))]
        let PerToken::Host { targets, weights } = &self.per_token else {
            return Err(moved("cpu"));
        };
        let mut inputs = Inputs::new(x, w, targets, self.plan.shape().hidden);
        inputs.bias = bias;
        inputs.weights = weights.as_deref();
        Ok(inputs)
    }

    fn cpu_forward(
        &self,
        x: Matrix<'_>,
        w: Matrix<'_>,
        bias: Option<&[f32]>,
    ) -> Result<(CpuStorage, candle_core::Shape)> {
        let inputs = self.host_inputs(x, w, bias)?;
        let forward = LinearCrossEntropy::new(self.plan, Device::Cpu)?.forward(&inputs)?;
        self.save(forward.lse);
        Ok((CpuStorage::F32(Self::loss_values(forward.loss)), self.loss_shape()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_forward(
        &self,
        x: (&candle_core::CudaStorage, &Layout),
        w: (&candle_core::CudaStorage, &Layout),
        bias: Option<(&candle_core::CudaStorage, &Layout)>,
    ) -> Result<(candle_core::CudaStorage, candle_core::Shape)> {
        let PerToken::Device(per_token) = &self.per_token else {
            return Err(moved("cuda"));
        };
        let forward = crate::cuda::forward(self.plan, per_token, crate::cuda::Operands { x, w, bias })?;
        self.save(forward.lse);
        let loss = crate::cuda::upload(&x.0.device, &Self::loss_values(forward.loss))?;
        Ok((loss, self.loss_shape()))
    }

    /// dX, dW (and dbias) in the arguments' dtypes.
    fn backward(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>, grad_res: &Tensor) -> Result<Grads> {
        match &self.per_token {
            PerToken::Host { .. } if x.device().is_cpu() => self.cpu_backward(x, w, bias, grad_res),
            #[cfg(feature = "cuda")]
            PerToken::Device(per_token) if x.device().is_cuda() => self.with_lse(|lse| {
                self.with_upstream(grad_res, |grad| {
                    crate::cuda::backward(
                        self.plan,
                        per_token,
                        crate::cuda::Tensors { x, w, bias },
                        lse,
                        grad,
                    )
                })
            }),
            _ => Err(moved(if x.device().is_cpu() { "cpu" } else { "cuda" })),
        }
    }

    fn cpu_backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        grad_res: &Tensor,
    ) -> Result<Grads> {
        let (n, d, v) = {
            let shape = self.plan.shape();
            (shape.tokens, shape.hidden, shape.vocab)
        };
        let (mut dx, mut dw) = (vec![0f32; n * d], vec![0f32; v * d]);
        let mut dbias = bias.map(|_| vec![0f32; v]);
        {
            let (xs, xl) = x.storage_and_layout();
            let (ws, wl) = w.storage_and_layout();
            let bias_storage = bias.map(|b| b.storage_and_layout());
            let bias_values = match &bias_storage {
                Some((storage, layout)) => {
                    Some(host::f32_vector(host::cpu_of("bias", storage)?, layout, "bias")?)
                }
                None => None,
            };
            let inputs = self.host_inputs(
                host::matrix(host::cpu_of("input", &xs)?, xl, "input")?,
                host::matrix(host::cpu_of("weight", &ws)?, wl, "weight")?,
                bias_values.as_deref(),
            )?;
            self.with_lse(|lse| {
                self.with_upstream(grad_res, |grad| {
                    let out = GradientsMut::new(&mut dx, &mut dw, dbias.as_deref_mut());
                    let mut lce = LinearCrossEntropy::new(self.plan, Device::Cpu)?;
                    Ok(lce.backward_into(&inputs, lse, ring_dtp::Upstream::loss(grad), out)?)
                })
            })?;
        }
        let cpu = candle_core::Device::Cpu;
        Ok(Grads {
            dx: Tensor::from_vec(dx, (n, d), &cpu)?.to_dtype(x.dtype())?,
            dw: Tensor::from_vec(dw, (v, d), &cpu)?.to_dtype(w.dtype())?,
            dbias: match (dbias, bias) {
                (Some(db), Some(b)) => Some(Tensor::from_vec(db, v, &cpu)?.to_dtype(b.dtype())?),
                _ => None,
            },
        })
    }
}

impl CustomOp2 for FusedLinearCrossEntropy {
    fn name(&self) -> &'static str {
        NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, candle_core::Shape)> {
        Ok(self.cpu_forward(host::matrix(s1, l1, "input")?, host::matrix(s2, l2, "weight")?, None)?)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
        Ok(self.cuda_forward((s1, l1), (s2, l2), None)?)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>)> {
        let grads = self.backward(x, w, None, grad_res)?;
        Ok((Some(grads.dx), Some(grads.dw)))
    }
}

impl CustomOp3 for FusedLinearCrossEntropy {
    fn name(&self) -> &'static str {
        NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> candle_core::Result<(CpuStorage, candle_core::Shape)> {
        let bias = host::f32_vector(s3, l3, "bias")?;
        Ok(self.cpu_forward(host::matrix(s1, l1, "input")?, host::matrix(s2, l2, "weight")?, Some(&bias))?)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, candle_core::Shape)> {
        Ok(self.cuda_forward((s1, l1), (s2, l2), Some((s3, l3)))?)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: &Tensor,
        _res: &Tensor,
        grad_res: &Tensor,
    ) -> candle_core::Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let grads = self.backward(x, w, Some(bias), grad_res)?;
        Ok((Some(grads.dx), Some(grads.dw), grads.dbias))
    }
}
