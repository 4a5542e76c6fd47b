//! The loss and its gradient scales from the per-token statistics, on the host: what every
//! backend (CPU, emulated, CUDA) and both rings finish a call with, once.
//!
//! The fold leaves per token `M` (running max), `S = Σ e^(z − M)`, the target logit `z_y`
//! and `Σz` (for label smoothing α); then `lse = M + ln S` and
//! `ℓ_i = ω_i·(lse − (1−α)·z_y − (α/V)·Σz + λ·lse²)` (0 for ignored rows). The gradient of a
//! row is scaled by `c_i = g·ω_i / Σω` (mean), `g·ω_i` (sum) or `g_i·ω_i` (none).

use crate::config::{Config, Reduction};
use crate::error::{Error, Result};
use crate::inputs::{GradOutput, Inputs, Loss};

/// The fold's per-token running statistics, one entry per row in each field, held as `F` (the
/// f32 fields) and `D` (the f64 ones): owned ([`Stats`]), borrowed ([`StatsMut`]), or on a CUDA
/// device.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RowStats<F, D> {
    /// The running max `M`.
    pub max: F,
    /// `S = Σ e^(z − M)`.
    pub sum: D,
    /// The target logit `z_y`.
    pub target_logit: F,
    /// `Σz` (for label smoothing).
    pub logit_sum: D,
}

/// Per-token running statistics of the fold, owned.
pub(crate) type Stats = RowStats<Vec<f32>, Vec<f64>>;

impl Stats {
    pub fn new(n: usize) -> Self {
        Self {
            max: vec![f32::NEG_INFINITY; n],
            sum: vec![0.0; n],
            target_logit: vec![0.0; n],
            logit_sum: vec![0.0; n],
        }
    }
    /// The statistics of rows `t0..t0 + c`.
    pub fn rows_mut(&mut self, t0: usize, c: usize) -> StatsMut<'_> {
        StatsMut {
            max: &mut self.max[t0..t0 + c],
            sum: &mut self.sum[t0..t0 + c],
            target_logit: &mut self.target_logit[t0..t0 + c],
            logit_sum: &mut self.logit_sum[t0..t0 + c],
        }
    }
    /// `lse = M + ln S` of row `t`.
    pub fn lse(&self, t: usize) -> f64 {
        self.max[t] as f64 + self.sum[t].ln()
    }
}

/// A token block's statistics, borrowed (from [`Stats`] or a ring packet).
pub(crate) type StatsMut<'a> = RowStats<&'a mut [f32], &'a mut [f64]>;

/// Per-row gradient scale c_i from the reduction and the upstream gradient (0 for ignored rows).
/// `mean_denominator` is Σ of the valid rows' weights (over every rank, for a ring).
pub(crate) fn coefficients(
    config: &Config,
    inputs: &Inputs<'_>,
    grad: GradOutput<'_>,
    mean_denominator: f64,
) -> Result<Vec<f32>> {
    let scale = |i: usize, g: f32, denom: Option<f64>| -> f32 {
        match (inputs.target(config, i), denom) {
            (Some(_), Some(denom)) => (g as f64 * inputs.weight(i) as f64 / denom) as f32,
            _ => 0.0,
        }
    };
    match (config.reduction, grad) {
        (Reduction::Mean, GradOutput::Scalar(g)) => {
            Ok((0..inputs.n).map(|i| scale(i, g, normaliser(mean_denominator))).collect())
        }
        (Reduction::Sum, GradOutput::Scalar(g)) => {
            Ok((0..inputs.n).map(|i| scale(i, g, Some(1.0))).collect())
        }
        (Reduction::None, GradOutput::PerToken(g)) => {
            if g.len() != inputs.n {
                return Err(Error::ShapeMismatch {
                    what: "grad_output (n)",
                    expected: inputs.n,
                    got: g.len(),
                });
            }
            Ok((0..inputs.n).map(|i| scale(i, g[i], Some(1.0))).collect())
        }
        (Reduction::None, _) => Err(Error::GradOutputKind { expected: "per-token for reduction none" }),
        _ => Err(Error::GradOutputKind { expected: "a scalar for reduction mean or sum" }),
    }
}

/// Per-token losses `ℓ_i = ω_i·(lse − (1−α)·z_y − (α/V)·Σz + λ·lse²)` (0 for ignored rows) and
/// the lse of every row, from finished statistics over a vocabulary of `v` rows.
pub(crate) fn per_token_losses(
    config: &Config,
    inputs: &Inputs<'_>,
    v: usize,
    stats: &Stats,
) -> (Vec<f32>, Vec<f32>) {
    let (alpha, lambda, v) = (config.label_smoothing as f64, config.z_loss as f64, v as f64);
    let lse: Vec<f32> = (0..inputs.n).map(|t| stats.lse(t) as f32).collect();
    let per_token = (0..inputs.n)
        .map(|t| match inputs.target(config, t) {
            None => 0.0,
            Some(_) => {
                let l = stats.lse(t);
                let ce = l - (1.0 - alpha) * stats.target_logit[t] as f64 - alpha / v * stats.logit_sum[t];
                (inputs.weight(t) as f64 * (ce + lambda * l * l)) as f32
            }
        })
        .collect();
    (per_token, lse)
}

/// The reduced loss from per-token losses, given the (global) sum of losses and of the valid
/// rows' weights.
pub(crate) fn reduce_loss(config: &Config, per_token: Vec<f32>, total: f64, denom: f64) -> Loss {
    match config.reduction {
        Reduction::None => Loss::PerToken(per_token),
        Reduction::Sum => Loss::Scalar(total),
        Reduction::Mean => Loss::Scalar(normaliser(denom).map_or(0.0, |denom| total / denom)),
    }
}

/// The mean's normaliser Σω over the valid rows, or `None` when no row counts (then the loss is
/// 0 and so is every gradient). The loss and the gradient scales both take it from here.
fn normaliser(valid_weight: f64) -> Option<f64> {
    (valid_weight > 0.0).then_some(valid_weight)
}
