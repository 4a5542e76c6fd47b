//! The oracle: materialized logits in f64, the loss and its gradient straight from the
//! definitions in `config.rs`. O(N·V) memory; for tests and error measurement only.

use crate::config::{Config, Reduction, Softcap};
use crate::error::{Error, Result};
use crate::inputs::{GradOutput, Inputs, Matrix, Upstream};

/// f64 results of the reference.
#[derive(Debug, Clone, PartialEq)]
pub struct Reference {
    /// Per-token losses ℓ_i (0 when ignored).
    pub per_token: Vec<f64>,
    /// Reduced loss (for mean/sum; the sum for none).
    pub loss: f64,
    /// Per-token lse (every row, ignored ones too).
    pub lse: Vec<f64>,
    /// dX, N×D.
    pub dx: Vec<f64>,
    /// dW, V×D.
    pub dw: Vec<f64>,
    /// dbias, V.
    pub dbias: Vec<f64>,
    /// Magnitudes the loss sums (ω·(|lse| + (1−α)|z_y| + (α/V)·Σ|z| + λ·lse²) per token, then
    /// reduced like the loss): the scale of an f32 implementation's forward error, which the
    /// loss itself is not when it cancels (a certain prediction has loss ≈ 0, lse ≈ z_y).
    pub loss_scale: f64,
    /// Per-token loss magnitudes (see `loss_scale`).
    pub per_token_scale: Vec<f64>,
    /// Σ_j |G_ij|·|w_j| with |G| the sum of the magnitudes of G's terms: the scale of dX's
    /// rounding error (G itself cancels to ≈ 0 for certain predictions, its terms do not).
    pub dx_scale: Vec<f64>,
    /// Σ_i |G_ij|·|x_i| (see `dx_scale`).
    pub dw_scale: Vec<f64>,
    /// Σ_i |G_ij| (see `dx_scale`).
    pub dbias_scale: Vec<f64>,
}

/// Which arithmetic the reference models (each in f64 but for the roundings it names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Rounding {
    /// f64 throughout.
    #[default]
    Exact,
    /// The logit gradient G rounded to bf16 before it is multiplied into dX and dW (dbias sums
    /// the unrounded G): what ring-dtp computes for bf16 inputs under
    /// [`Precision::Native`](flatpeak_common::Precision::Native), up to f32 rounding.
    Bf16Gradient,
    /// The naive same-dtype computation of a bf16 model: logits stored in bf16 after their
    /// GEMM, the loss from them, G rounded to bf16, and dX, dW and dbias stored in bf16.
    NaiveBf16,
}

fn to_bf16(x: f64) -> f64 {
    half::bf16::from_f64(x).to_f64()
}

fn to_f64(m: &Matrix<'_>) -> Vec<f64> {
    match m {
        Matrix::F32(v) => v.iter().map(|&x| x as f64).collect(),
        Matrix::Bf16(v) => v.iter().map(|x| x.to_f64()).collect(),
    }
}

/// Forward and backward in f64. `grad` is the upstream gradient (its kind must fit the
/// reduction); `dlse` an optional gradient of the lse output. The inputs are checked as the
/// fast path checks them (shapes, targets, weights, config), so bad input is the same typed
/// error here.
pub fn run(
    inputs: &Inputs<'_>,
    config: &Config,
    grad: GradOutput<'_>,
    dlse: Option<&[f32]>,
) -> Result<Reference> {
    run_rounded(inputs, config, Upstream::loss(grad).with_dlse(dlse), Rounding::Exact)
}

/// [`run`] with the roundings of `rounding` (the magnitudes are the exact run's).
pub fn run_rounded(
    inputs: &Inputs<'_>,
    config: &Config,
    upstream: Upstream<'_>,
    rounding: Rounding,
) -> Result<Reference> {
    let Upstream { grad, dlse } = upstream;
    let (round_logits, round_grad) = match rounding {
        Rounding::Exact => (false, false),
        Rounding::Bf16Gradient => (false, true),
        Rounding::NaiveBf16 => (true, true),
    };
    inputs.validate(config)?;
    if let Some(g) = dlse.filter(|g| g.len() != inputs.n) {
        return Err(Error::ShapeMismatch { what: "dlse (n)", expected: inputs.n, got: g.len() });
    }
    match (config.reduction, grad) {
        (Reduction::None, GradOutput::PerToken(g)) if g.len() != inputs.n => {
            return Err(Error::ShapeMismatch { what: "grad_output (n)", expected: inputs.n, got: g.len() });
        }
        (Reduction::None, GradOutput::Scalar(_)) => {
            return Err(Error::GradOutputKind { expected: "per-token for reduction none" });
        }
        (Reduction::Mean | Reduction::Sum, GradOutput::PerToken(_)) => {
            return Err(Error::GradOutputKind { expected: "a scalar for reduction mean or sum" });
        }
        _ => {}
    }
    let (n, d, v) = (inputs.n, inputs.d, inputs.v);
    let (x, w) = (to_f64(&inputs.x), to_f64(&inputs.w));
    let alpha = config.label_smoothing as f64;
    let lambda = config.z_loss as f64;
    let valid_weight = inputs.valid_weight(config);
    let mut r = Reference {
        per_token: vec![0.0; n],
        loss: 0.0,
        lse: vec![0.0; n],
        dx: vec![0.0; n * d],
        dw: vec![0.0; v * d],
        dbias: vec![0.0; v],
        loss_scale: 0.0,
        per_token_scale: vec![0.0; n],
        dx_scale: vec![0.0; n * d],
        dw_scale: vec![0.0; v * d],
        dbias_scale: vec![0.0; v],
    };
    let mut z = vec![0.0f64; v];
    let mut u = vec![0.0f64; v];
    for i in 0..n {
        let target = inputs.target(config, i);
        let extra = dlse.map_or(0.0, |g| g[i] as f64);
        for j in 0..v {
            u[j] = (0..d).map(|k| x[i * d + k] * w[j * d + k]).sum::<f64>()
                + inputs.bias.map_or(0.0, |b| b[j] as f64);
            if round_logits {
                u[j] = to_bf16(u[j]);
            }
            z[j] = match config.softcap {
                Softcap::Off => u[j],
                Softcap::Tanh { cap } => cap as f64 * (u[j] / cap as f64).tanh(),
            };
        }
        let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + z.iter().map(|&zj| (zj - m).exp()).sum::<f64>().ln();
        let omega = inputs.weight(i) as f64;
        let coef = match (target, config.reduction, grad) {
            (None, _, _) => 0.0,
            (Some(_), Reduction::Mean, GradOutput::Scalar(g)) if valid_weight > 0.0 => {
                g as f64 * omega / valid_weight
            }
            (Some(_), Reduction::Sum, GradOutput::Scalar(g)) => g as f64 * omega,
            (Some(_), Reduction::None, GradOutput::PerToken(g)) => g[i] as f64 * omega,
            _ => 0.0,
        };
        r.lse[i] = lse;
        if let Some(y) = target {
            let zsum: f64 = z.iter().sum();
            r.per_token[i] =
                omega * (lse - (1.0 - alpha) * z[y] - alpha / v as f64 * zsum + lambda * lse * lse);
            let zabs: f64 = z.iter().map(|x| x.abs()).sum();
            r.per_token_scale[i] = omega.abs()
                * (lse.abs() + (1.0 - alpha) * z[y].abs() + alpha / v as f64 * zabs + lambda * lse * lse);
        }
        for j in 0..v {
            let p = (z[j] - lse).exp();
            let onehot = if Some(j) == target { 1.0 } else { 0.0 };
            let mut g =
                coef * (p - (1.0 - alpha) * onehot - alpha / v as f64 + 2.0 * lambda * lse * p) + extra * p;
            let mut mag = coef.abs()
                * (p + (1.0 - alpha) * onehot + alpha / v as f64 + 2.0 * lambda * lse.abs() * p)
                + extra.abs() * p;
            if let Softcap::Tanh { cap } = config.softcap {
                let t = z[j] / cap as f64;
                g *= 1.0 - t * t;
                mag *= (1.0 - t * t).abs();
            }
            r.dbias[j] += if round_logits { to_bf16(g) } else { g };
            r.dbias_scale[j] += mag;
            if round_grad {
                g = to_bf16(g);
            }
            for k in 0..d {
                r.dx[i * d + k] += g * w[j * d + k];
                r.dw[j * d + k] += g * x[i * d + k];
                r.dx_scale[i * d + k] += mag * w[j * d + k].abs();
                r.dw_scale[j * d + k] += mag * x[i * d + k].abs();
            }
        }
    }
    let reduce = |per_token: &[f64]| {
        let total: f64 = per_token.iter().sum();
        match config.reduction {
            Reduction::Mean if valid_weight > 0.0 => total / valid_weight,
            Reduction::Mean => 0.0,
            Reduction::Sum | Reduction::None => total,
        }
    };
    if round_logits {
        for out in [&mut r.dx, &mut r.dw, &mut r.dbias] {
            out.iter_mut().for_each(|v| *v = to_bf16(*v));
        }
    }
    r.loss = reduce(&r.per_token);
    r.loss_scale = reduce(&r.per_token_scale);
    Ok(r)
}
