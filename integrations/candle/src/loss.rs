//! The fused linear cross-entropy as a candle op: ring-dtp's schedule over candle's own storage.
//!
//! `loss = CE(x·Wᵀ + b, targets)` with ring-dtp's options (ignore_index, mean/sum/none, label
//! smoothing, z-loss, softcap, per-token weights). The `[N, V]` logits never exist: forward folds
//! `[N_b, V_b]` blocks into an online log-sum-exp and keeps only the per-row lse (4 B per token,
//! saved in the op for backward); backward recomputes each block's logits from it and projects
//! the logit gradient straight into dX and dW. The call's transient memory is the plan's working
//! set (at most `budget` bytes, fixed before any data is read) plus ring-dtp's per-token state,
//! against the `8·N·V` bytes (logits and their gradient, f32) of `cross_entropy(x.matmul(Wᵀ))`.
//!
//! Targets and token weights take no gradient, so they live in the op (copied to the host as
//! i64 and f32: 8–12 B per token); X, W and the bias are the op's differentiable arguments,
//! read in place (a `CustomOp2` on `(x, w)`, or a `CustomOp3` on `(x, w, bias)`).

use std::sync::{Mutex, PoisonError};

use candle_core::{
    CpuStorage, CustomOp2, CustomOp3, DType as CandleDType, Device as CandleDevice, Layout, Storage, Tensor,
};
use ring_dtp::{
    Budget, Config, DType, Device, GradOutput, GradientsMut, Inputs, LinearCrossEntropy, Loss, Matrix, Plan,
    Reduction, Shape, Softcap,
};

use crate::error::{Error, Result};
use crate::host;

/// The default working-set budget: 64 MiB, ample for GEMM-sized blocks at any shape (the same
/// default as the PyTorch package).
pub const DEFAULT_BUDGET_BYTES: usize = 64 << 20;

/// The loss's options: ring-dtp's [`Config`] (the PyTorch wrapper's names: `ignore_index`,
/// `reduction`, `label_smoothing`, `z_loss`, `softcap`) and the working-set budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossOptions {
    /// The loss's semantics.
    pub config: Config,
    /// The most bytes the schedule's working set may take.
    pub budget: Budget,
}

impl Default for LossOptions {
    /// ignore_index −100, mean, no smoothing, no z-loss, no softcap, a 64 MiB working set.
    fn default() -> Self {
        Self { config: Config::default(), budget: Budget::Bytes(DEFAULT_BUDGET_BYTES) }
    }
}

impl LossOptions {
    /// Targets equal to `ignore_index` are skipped (loss 0, gradient 0).
    pub fn ignore_index(self, ignore_index: i64) -> Self {
        Self { config: self.config.ignore_index(ignore_index), ..self }
    }
    /// Mean (over non-ignored tokens), sum, or none (one loss per token, shaped like `targets`).
    pub fn reduction(self, reduction: Reduction) -> Self {
        Self { config: self.config.reduction(reduction), ..self }
    }
    /// Label smoothing α ∈ [0, 1).
    pub fn label_smoothing(self, label_smoothing: f32) -> Self {
        Self { config: self.config.label_smoothing(label_smoothing), ..self }
    }
    /// z-loss coefficient λ ≥ 0 (adds λ·lse² per token).
    pub fn z_loss(self, z_loss: f32) -> Self {
        Self { config: self.config.z_loss(z_loss), ..self }
    }
    /// Logit soft-capping `z = cap·tanh(u/cap)`.
    pub fn softcap(self, softcap: Softcap) -> Self {
        Self { config: self.config.softcap(softcap), ..self }
    }
    /// The working set's budget in bytes.
    pub fn budget_bytes(self, bytes: usize) -> Self {
        Self { budget: Budget::Bytes(bytes), ..self }
    }
}

/// The optional tensors of the loss: a bias `[V]` (differentiable) and per-token weights
/// shaped like `targets` (not differentiable).
#[derive(Debug, Clone, Copy, Default)]
pub struct Extras<'a> {
    /// Added to every row of logits.
    pub bias: Option<&'a Tensor>,
    /// Each token's loss is multiplied by its weight (mean divides by their sum).
    pub token_weights: Option<&'a Tensor>,
}

/// `cross_entropy(x·Wᵀ, targets)` without the logits: `x` is `[N, D]` or `[B, S, D]` (f32 or
/// bf16), `w` is `[V, D]` in `x`'s dtype, `targets` is shaped like `x` without its last dim
/// (i64, u32 or i32). The result is an f32 scalar (mean, sum) or shaped like `targets` (none);
/// `backward()` through it yields dX and dW in their dtypes.
pub fn linear_cross_entropy(
    x: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    options: &LossOptions,
) -> candle_core::Result<Tensor> {
    linear_cross_entropy_with(x, w, targets, Extras::default(), options)
}

/// [`linear_cross_entropy`] with a bias and/or per-token weights.
pub fn linear_cross_entropy_with(
    x: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    extras: Extras<'_>,
    options: &LossOptions,
) -> candle_core::Result<Tensor> {
    Ok(apply(x, w, targets, extras, options)?)
}

/// The shapes of a call, checked.
struct Checked {
    /// `targets`' dims (the leading dims of `x`).
    lead: Vec<usize>,
    shape: Shape,
}

fn same_device(what: &'static str, tensor: &Tensor, x: &Tensor) -> Result<()> {
    if tensor.device().same_device(x.device()) {
        Ok(())
    } else {
        Err(Error::Device {
            what,
            expected: format!("{:?} (input's)", x.device()),
            got: format!("{:?}", tensor.device()),
        })
    }
}

fn check_dims(what: &'static str, tensor: &Tensor, expected: &[usize]) -> Result<()> {
    if tensor.dims() == expected {
        Ok(())
    } else {
        Err(Error::Shape { what, expected: format!("{expected:?}"), got: tensor.dims().to_vec() })
    }
}

fn check(x: &Tensor, w: &Tensor, targets: &Tensor, extras: Extras<'_>) -> Result<Checked> {
    let dims = x.dims();
    let Some((&d, lead)) = dims.split_last().filter(|_| dims.len() >= 2) else {
        return Err(Error::Shape {
            what: "input",
            expected: "[N, D] or [B, S, D]".into(),
            got: dims.to_vec(),
        });
    };
    let n: usize = lead.iter().product();
    let v = match w.dims() {
        &[v, dw] if dw == d => v,
        got => return Err(Error::Shape { what: "weight", expected: format!("[V, {d}]"), got: got.to_vec() }),
    };
    let dtype = match x.dtype() {
        CandleDType::F32 => DType::F32,
        CandleDType::BF16 => DType::Bf16,
        got => return Err(Error::DType { what: "input", expected: "f32 or bf16", got }),
    };
    if w.dtype() != x.dtype() {
        return Err(Error::DType { what: "weight", expected: "input's dtype", got: w.dtype() });
    }
    check_dims("targets", targets, lead)?;
    same_device("weight", w, x)?;
    same_device("targets", targets, x)?;
    if let Some(bias) = extras.bias {
        check_dims("bias", bias, &[v])?;
        same_device("bias", bias, x)?;
    }
    if let Some(weights) = extras.token_weights {
        check_dims("token_weights", weights, lead)?;
        same_device("token_weights", weights, x)?;
    }
    Ok(Checked { lead: lead.to_vec(), shape: Shape { tokens: n, hidden: d, vocab: v, dtype } })
}

fn apply(
    x: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    extras: Extras<'_>,
    options: &LossOptions,
) -> Result<Tensor> {
    let Checked { lead, shape } = check(x, w, targets, extras)?;
    // Sized before any data is read: a bad option or an impossible budget fails here.
    let plan = Plan::new(&options.config, shape, options.budget)?;
    let per_token = match x.device() {
        CandleDevice::Cpu => PerToken::Host {
            targets: host::target_values(targets)?,
            weights: extras.token_weights.map(|t| host::f32_values(t, "token_weights")).transpose()?,
        },
        #[cfg(feature = "cuda")]
        CandleDevice::Cuda(_) => crate::cuda::per_token(targets, extras.token_weights)?,
        #[cfg(not(feature = "cuda"))]
        CandleDevice::Cuda(_) => return Err(Error::CudaNotBuilt { what: "input" }),
        other => {
            return Err(Error::Device {
                what: "input",
                expected: "cpu or cuda".into(),
                got: format!("{other:?}"),
            });
        }
    };
    let op = FusedLinearCrossEntropy { options: *options, plan, per_token, saved: Mutex::new(None) };
    let (n, d) = (shape.tokens, shape.hidden);
    let x = operand(&x.reshape((n, d))?)?;
    let w = operand(w)?;
    let loss = match extras.bias {
        Some(bias) => x.apply_op3(&w, &operand(bias)?, op)?,
        None => x.apply_op2(&w, op)?,
    };
    Ok(if options.config.reduction == Reduction::None { loss.reshape(lead)? } else { loss })
}

/// A differentiable argument as the op reads it: contiguous on the CPU; on CUDA also a whole
/// storage from offset 0, and the bias as f32 (the casts and copies are candle ops, so the
/// gradient flows back through them).
fn operand(tensor: &Tensor) -> Result<Tensor> {
    match tensor.device() {
        #[cfg(feature = "cuda")]
        CandleDevice::Cuda(_) => crate::cuda::whole(tensor),
        _ => Ok(tensor.contiguous()?),
    }
}

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

/// Forward's per-row log-sum-exp, kept for backward.
#[derive(Debug)]
pub(crate) enum SavedLse {
    /// On the host, from either device's forward (ring-dtp finishes the loss on the host).
    Host(Vec<f32>),
}

/// The op: one forward (and its backward) of one call.
#[derive(Debug)]
pub(crate) struct FusedLinearCrossEntropy {
    pub(crate) options: LossOptions,
    pub(crate) plan: Plan,
    pub(crate) per_token: PerToken,
    /// Written by forward, read by every backward of this call's graph.
    pub(crate) saved: Mutex<Option<SavedLse>>,
}

/// The op's name in candle's errors.
pub(crate) const NAME: &str = "flatpeak-linear-cross-entropy";

impl FusedLinearCrossEntropy {
    fn shape(&self) -> Shape {
        self.plan.shape()
    }

    pub(crate) fn executor(&self, device: Device) -> Result<LinearCrossEntropy> {
        Ok(LinearCrossEntropy::new(self.plan, device)?)
    }

    pub(crate) fn save(&self, lse: SavedLse) {
        // A poisoned lock held a value a panicking thread left; it is overwritten whole.
        *self.saved.lock().unwrap_or_else(PoisonError::into_inner) = Some(lse);
    }

    /// The loss's shape: a scalar, or one per token.
    pub(crate) fn loss_shape(&self) -> candle_core::Shape {
        match self.options.config.reduction {
            Reduction::None => candle_core::Shape::from(self.shape().tokens),
            _ => candle_core::Shape::from(()),
        }
    }

    fn host_inputs<'a>(
        &'a self,
        x: Matrix<'a>,
        w: Matrix<'a>,
        bias: Option<&'a [f32]>,
    ) -> Result<Inputs<'a>> {
        #[cfg_attr(not(feature = "cuda"), allow(irrefutable_let_patterns))]
        let PerToken::Host { targets, weights } = &self.per_token else {
            return Err(Error::Device {
                what: "input",
                expected: "the device forward ran on".into(),
                got: "cpu".into(),
            });
        };
        let Shape { hidden, vocab, .. } = self.shape();
        let mut inputs = Inputs::new(x, w, targets, hidden);
        inputs.v = vocab;
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
        let forward = self.executor(Device::Cpu)?.forward(&inputs)?;
        self.save(SavedLse::Host(forward.lse));
        let loss = match forward.loss {
            Loss::Scalar(loss) => vec![loss as f32],
            Loss::PerToken(per_token) => per_token,
        };
        Ok((CpuStorage::F32(loss), self.loss_shape()))
    }

    /// The upstream gradient on the host, as ring-dtp takes it.
    pub(crate) fn grad_output(&self, grad_res: &Tensor) -> Result<Vec<f32>> {
        Ok(grad_res.to_dtype(CandleDType::F32)?.flatten_all()?.to_vec1::<f32>()?)
    }

    /// The upstream gradient as ring-dtp takes it: one value, or one per token.
    pub(crate) fn upstream<'a>(&self, host: &'a [f32]) -> GradOutput<'a> {
        match self.options.config.reduction {
            Reduction::None => GradOutput::PerToken(host),
            _ => GradOutput::Scalar(host.first().copied().unwrap_or(0.0)),
        }
    }

    /// dX, dW (and dbias) in the arguments' dtypes.
    fn backward(&self, x: &Tensor, w: &Tensor, bias: Option<&Tensor>, grad_res: &Tensor) -> Result<Grads> {
        match x.device() {
            CandleDevice::Cpu => self.cpu_backward(x, w, bias, grad_res),
            #[cfg(feature = "cuda")]
            CandleDevice::Cuda(_) => crate::cuda::backward(self, x, w, bias, grad_res),
            other => Err(Error::Device {
                what: "input",
                expected: "cpu or cuda".into(),
                got: format!("{other:?}"),
            }),
        }
    }

    fn cpu_backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: Option<&Tensor>,
        grad_res: &Tensor,
    ) -> Result<Grads> {
        let upstream = self.grad_output(grad_res)?;
        let grad = self.upstream(&upstream);
        let Shape { tokens: n, hidden: d, vocab: v, .. } = self.shape();
        let (mut dx, mut dw) = (vec![0f32; n * d], vec![0f32; v * d]);
        let mut dbias = bias.map(|_| vec![0f32; v]);
        {
            let (xs, xl) = x.storage_and_layout();
            let (ws, wl) = w.storage_and_layout();
            let bias_storage = bias.map(|b| b.storage_and_layout());
            let (Storage::Cpu(xs), Storage::Cpu(ws)) = (&*xs, &*ws) else {
                return Err(Error::Device {
                    what: "input",
                    expected: "cpu".into(),
                    got: format!("{:?}", x.device()),
                });
            };
            let bias_values = match &bias_storage {
                Some((storage, layout)) => match &**storage {
                    Storage::Cpu(cpu) => Some(host::f32_vector(cpu, layout, "bias")?),
                    _ => {
                        return Err(Error::Device {
                            what: "bias",
                            expected: "cpu".into(),
                            got: "another device".into(),
                        });
                    }
                },
                None => None,
            };
            let inputs = self.host_inputs(
                host::matrix(xs, xl, "input")?,
                host::matrix(ws, wl, "weight")?,
                bias_values.as_deref(),
            )?;
            let saved = self.saved.lock().unwrap_or_else(PoisonError::into_inner);
            let Some(SavedLse::Host(lse)) = saved.as_ref() else {
                return Err(Error::MissingForward { op: NAME });
            };
            let out = GradientsMut::new(&mut dx, &mut dw, dbias.as_deref_mut());
            self.executor(Device::Cpu)?.backward_into(&inputs, lse, ring_dtp::Upstream::loss(grad), out)?;
        }
        let cpu = CandleDevice::Cpu;
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

/// What backward hands candle.
pub(crate) struct Grads {
    pub(crate) dx: Tensor,
    pub(crate) dw: Tensor,
    pub(crate) dbias: Option<Tensor>,
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
        Ok(crate::cuda::forward(self, (s1, l1), (s2, l2), None)?)
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
        Ok(crate::cuda::forward(self, (s1, l1), (s2, l2), Some((s3, l3)))?)
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
