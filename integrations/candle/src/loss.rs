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

use candle_core::{DType as CandleDType, Device as CandleDevice, DeviceLocation, Tensor};
use ring_dtp::{Config, DType, Device, LossBudget, Plan, Reduction, Shape, Softcap};

use crate::error::{Error, Result};
use crate::host;
use crate::op::{FusedLinearCrossEntropy, PerToken};

/// The loss's options: ring-dtp's [`Config`] (the PyTorch wrapper's names: `ignore_index`,
/// `reduction`, `label_smoothing`, `z_loss`, `softcap`) and the working-set budget.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossOptions {
    /// The loss's semantics.
    pub config: Config,
    /// The most bytes the schedule's working set may take: by default ring-dtp's policy for
    /// the inputs' device (the same as every flatpeak caller's).
    pub budget: LossBudget,
}

impl Default for LossOptions {
    /// ignore_index −100, mean, no smoothing, no z-loss, no softcap, the device's default
    /// working set ([`LossBudget::Default`]).
    fn default() -> Self {
        Self { config: Config::default(), budget: LossBudget::Default }
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
        Self { budget: LossBudget::Bytes(bytes), ..self }
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

/// ring-dtp's device for a candle device.
fn device_of(device: &CandleDevice) -> Result<Device> {
    match device.location() {
        DeviceLocation::Cpu => Ok(Device::Cpu),
        DeviceLocation::Cuda { gpu_id } => Ok(Device::Cuda(gpu_id)),
        other => {
            Err(Error::Device { what: "input", expected: "cpu or cuda".into(), got: format!("{other:?}") })
        }
    }
}

fn apply(
    x: &Tensor,
    w: &Tensor,
    targets: &Tensor,
    extras: Extras<'_>,
    options: &LossOptions,
) -> Result<Tensor> {
    let Checked { lead, shape } = check(x, w, targets, extras)?;
    let device = device_of(x.device())?;
    // Sized before any data is read: a bad option or an impossible budget fails here.
    let plan = Plan::for_device(&options.config, shape, options.budget, device)?;
    let per_token = match device {
        Device::Cpu => PerToken::Host {
            targets: host::target_values(targets)?,
            weights: extras.token_weights.map(|t| host::f32_values(t, "token_weights")).transpose()?,
        },
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => PerToken::Device(crate::cuda::per_token(targets, extras.token_weights)?),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => return Err(Error::CudaNotBuilt { what: "input" }),
    };
    let op = FusedLinearCrossEntropy::new(plan, options.config.reduction, per_token);
    let (n, d) = (shape.tokens, shape.hidden);
    let x = operand(&x.reshape((n, d))?)?;
    let w = operand(w)?;
    let loss = match extras.bias {
        // The bias as f32 (V elements): the cast is a candle op, so its gradient flows back.
        Some(bias) => x.apply_op3(&w, &operand(&bias.to_dtype(CandleDType::F32)?)?, op)?,
        None => x.apply_op2(&w, op)?,
    };
    Ok(if options.config.reduction == Reduction::None { loss.reshape(lead)? } else { loss })
}

/// A differentiable argument as the op reads it: contiguous on the CPU; on CUDA also a whole
/// storage from offset 0 (the casts and copies are candle ops, so the gradient flows back
/// through them).
fn operand(tensor: &Tensor) -> Result<Tensor> {
    match tensor.device() {
        #[cfg(feature = "cuda")]
        CandleDevice::Cuda(_) => crate::cuda::whole(tensor),
        _ => Ok(tensor.contiguous()?),
    }
}
