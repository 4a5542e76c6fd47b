//! `flatpeak run ring-dtp`: the vocabulary projection + cross-entropy, forward then backward.
//!
//! Inputs: `x` \[N, D\] F32 or BF16, `w` \[V, D\] (the dtype of `x`), `targets` \[N\] I64; optional
//! `bias` \[V\] F32, `weights` \[N\] F32 (per-token loss weights), `grad_output` (F32: \[\] for
//! reduction mean or sum, default 1; \[N\] for none, default ones) and `dlse` \[N\] F32 (upstream
//! gradient of the lse output). Outputs: `loss` (F64 \[\] for mean or sum, F32 \[N\] for none),
//! `lse` \[N\], `dx` \[N, D\], `dw` \[V, D\] and, with a bias, `dbias` \[V\], all F32.

use ring_dtp::{
    Config, Device, GradOutput, Inputs, Loss, LossBudget, Matrix, Plan, Reduction, Shape, Softcap, Upstream,
    cpu,
};
use serde::Deserialize;

use super::{Dim, Floats, Outputs, RunError, TensorFile};
use flatpeak_common::DType;

/// The reduction, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReductionName {
    /// Σℓ / Σω over valid rows.
    #[default]
    Mean,
    /// Σℓ.
    Sum,
    /// Per-token losses.
    None,
}

/// The GEMMs' arithmetic in a config file (see [`flatpeak_common::Precision`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrecisionName {
    /// The inputs' dtype with f32 accumulation; bf16 inputs round the logit gradient to bf16.
    #[default]
    Native,
    /// Every GEMM in f32 (bf16 widened, the logit gradient kept f32).
    F32,
}

/// The config file of `flatpeak run ring-dtp` (every field optional).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RingDtpConfig {
    /// Targets equal to this are skipped (default −100).
    pub ignore_index: i64,
    /// `"mean"` (default), `"sum"` or `"none"`.
    pub reduction: ReductionName,
    /// Label smoothing α ∈ [0, 1).
    pub label_smoothing: f32,
    /// z-loss coefficient λ ≥ 0.
    pub z_loss: f32,
    /// Logit softcap (`null`: off).
    pub softcap: Option<f32>,
    /// Row i predicts `targets[i + shift]`.
    pub shift: usize,
    /// Working-set budget of the plan in bytes (`null`, the default: ring-dtp's default on the
    /// CPU, `ring_dtp::LossBudget::Default`).
    pub budget_bytes: Option<usize>,
    /// `"native"` (default) or `"f32"` GEMMs.
    pub precision: PrecisionName,
}

impl Default for RingDtpConfig {
    fn default() -> Self {
        Self {
            ignore_index: -100,
            reduction: ReductionName::Mean,
            label_smoothing: 0.0,
            z_loss: 0.0,
            softcap: None,
            shift: 0,
            budget_bytes: None,
            precision: PrecisionName::Native,
        }
    }
}

impl RingDtpConfig {
    /// The crate's config.
    pub fn to_config(&self) -> Config {
        let mut c = Config::default();
        c.ignore_index = self.ignore_index;
        c.reduction = match self.reduction {
            ReductionName::Mean => Reduction::Mean,
            ReductionName::Sum => Reduction::Sum,
            ReductionName::None => Reduction::None,
        };
        c.label_smoothing = self.label_smoothing;
        c.z_loss = self.z_loss;
        c.softcap = self.softcap.map_or(Softcap::Off, |cap| Softcap::Tanh { cap });
        c.shift = self.shift;
        c.precision = match self.precision {
            PrecisionName::Native => flatpeak_common::Precision::Native,
            PrecisionName::F32 => flatpeak_common::Precision::F32,
        };
        c
    }
}

/// Runs forward and backward on the tensors of `t`.
pub fn run(t: &TensorFile, cfg: &RingDtpConfig) -> Result<Outputs, RunError> {
    let (x, xs) = t.floats("x", &[Dim::Any, Dim::Any])?;
    let (n, d) = (xs[0], xs[1]);
    let (w, ws) = t.floats("w", &[Dim::Any, Dim::Is(d)])?;
    let v = ws[0];
    let (xm, wm, dtype) = match (&x, &w) {
        (Floats::F32(x), Floats::F32(w)) => (Matrix::F32(x), Matrix::F32(w), DType::F32),
        (Floats::Bf16(x), Floats::Bf16(w)) => (Matrix::Bf16(x), Matrix::Bf16(w), DType::Bf16),
        (Floats::F32(_), Floats::Bf16(_)) => return Err(dtype_of_w("F32 (the dtype of x)", "BF16")),
        (Floats::Bf16(_), Floats::F32(_)) => return Err(dtype_of_w("BF16 (the dtype of x)", "F32")),
    };
    let (targets, _) = t.i64("targets", &[Dim::Is(n)])?;
    let bias = t.optional_f32("bias", &[Dim::Is(v)])?;
    let weights = t.optional_f32("weights", &[Dim::Is(n)])?;
    let dlse = t.optional_f32("dlse", &[Dim::Is(n)])?;
    let config = cfg.to_config();
    let per_token = cfg.reduction == ReductionName::None;
    let grad_output = if per_token {
        t.optional_f32("grad_output", &[Dim::Is(n)])?.unwrap_or_else(|| vec![1.0; n])
    } else {
        t.optional_f32("grad_output", &[])?.unwrap_or_else(|| vec![1.0])
    };
    let grad =
        if per_token { GradOutput::PerToken(&grad_output) } else { GradOutput::Scalar(grad_output[0]) };

    let mut inputs = Inputs::new(xm, wm, &targets, d);
    if let Some(b) = &bias {
        inputs = inputs.with_bias(b);
    }
    if let Some(wt) = &weights {
        inputs = inputs.with_weights(wt);
    }
    let budget = LossBudget::checked(cfg.budget_bytes)?.of(Device::Cpu);
    let plan = Plan::new(&config, Shape { tokens: n, hidden: d, vocab: v, dtype }, budget)?;
    let fwd = cpu::forward(&plan, &inputs)?;
    let grads = cpu::backward(&plan, &inputs, &fwd, Upstream::loss(grad).with_dlse(dlse.as_deref()))?;

    let mut out = Outputs::default();
    match &fwd.loss {
        Loss::Scalar(l) => out.f64("loss", &[], &[*l]),
        Loss::PerToken(l) => out.f32("loss", &[n], l),
    }
    out.f32("lse", &[n], &fwd.lse);
    out.f32("dx", &[n, d], &grads.dx);
    out.f32("dw", &[v, d], &grads.dw);
    if let Some(db) = &grads.dbias {
        out.f32("dbias", &[v], db);
    }
    Ok(out)
}

fn dtype_of_w(expected: &str, found: &str) -> RunError {
    RunError::WrongDtype { name: "w".into(), expected: expected.into(), found: found.into() }
}
