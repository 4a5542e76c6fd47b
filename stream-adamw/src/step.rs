//! What one step is asked and what it did ([`StepOptions`], [`StepReport`]), and the decision
//! every step makes before it touches anything ([`StepDecision`]): the global gradient norm, the
//! skip on a non-finite gradient (GradScaler's `found_inf`), and the clip coefficient. It is
//! written once, here, and used by [`StreamAdamW::step`](crate::StreamAdamW::step) and by
//! [`step_in_place`](crate::step_in_place) (the frameworks' optimizers).

use std::time::Duration;

use crate::error::{Error, Result};
use crate::hyperparameters::{GradClip, Hyperparameters, StepScalars, clip_coefficient};

/// Per-step options.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct StepOptions {
    /// Multiplies every gradient before clipping and the update, e.g. `1 / loss_scale` to
    /// unscale loss-scaled gradients (finite, > 0).
    pub grad_scale: f64,
}

impl Default for StepOptions {
    fn default() -> Self {
        Self { grad_scale: 1.0 }
    }
}

impl StepOptions {
    /// Unscale gradients of a loss multiplied by `loss_scale`.
    pub fn unscale(loss_scale: f64) -> Self {
        Self { grad_scale: 1.0 / loss_scale }
    }
    /// Multiply gradients by `grad_scale`.
    pub fn with_grad_scale(grad_scale: f64) -> Self {
        Self { grad_scale }
    }
}

/// Whether a step was applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepOutcome {
    /// θ, m, v, the step count and the device parameters were updated.
    Applied,
    /// A gradient was NaN or infinite: nothing at all was touched (GradScaler's `found_inf`).
    SkippedNonFinite,
}

/// What a step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// Applied or skipped.
    pub outcome: StepOutcome,
    /// The step count after this call.
    pub step: u64,
    /// Global ‖g‖₂ of the (unscaled) gradients, before clipping; non-finite when skipped.
    pub grad_norm: f64,
    /// The clip coefficient applied (1 when not clipping).
    pub clip_coef: f64,
    /// Busy time per stage.
    pub times: StageTimes,
}

/// Busy time of each stage over one step.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StageTimes {
    /// The gradient statistics pass (norm and non-finite check).
    pub stats: Duration,
    /// Sum of D2H copy times.
    pub d2h: Duration,
    /// Sum of Adam times.
    pub adam: Duration,
    /// Sum of H2D copy times.
    pub h2d: Duration,
    /// Wall time of the whole step.
    pub total: Duration,
}

/// What a step will do, decided from the global Σg² before anything is touched: skip (a
/// gradient was NaN or infinite) or apply with this clip coefficient. Changes nothing itself.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepDecision {
    /// ‖g‖₂ of the unscaled gradients (`√Σg² · grad_scale`), before clipping.
    grad_norm: f64,
    /// The clip coefficient (1 when not clipping, or when skipping).
    clip_coef: f64,
    /// The factor every gradient is multiplied by: clip coefficient × `grad_scale`.
    grad_scale: f64,
    /// Applied or skipped.
    outcome: StepOutcome,
}

impl StepDecision {
    /// The decision for gradients whose squares sum to `grad_sq` (over every parameter the step
    /// updates, in f64: non-finite when any gradient is), under `options` and `clip`. An
    /// out-of-domain `grad_scale` is [`Error::InvalidConfig`].
    pub fn new(grad_sq: f64, options: StepOptions, clip: GradClip) -> Result<Self> {
        let scale = Self::checked_scale(options)?;
        let grad_norm = grad_sq.sqrt() * scale;
        if !grad_norm.is_finite() {
            return Ok(Self {
                grad_norm,
                clip_coef: 1.0,
                grad_scale: scale,
                outcome: StepOutcome::SkippedNonFinite,
            });
        }
        let clip_coef = clip_coefficient(clip, grad_norm);
        Ok(Self { grad_norm, clip_coef, grad_scale: clip_coef * scale, outcome: StepOutcome::Applied })
    }

    /// The decision of a step that read no gradient ([`OnNonFinite::Ignore`](crate::OnNonFinite)
    /// without clipping): applied, gradients scaled by `grad_scale` alone, the norm unknown
    /// (NaN). An out-of-domain `grad_scale` is [`Error::InvalidConfig`].
    pub fn unchecked(options: StepOptions) -> Result<Self> {
        let grad_scale = Self::checked_scale(options)?;
        Ok(Self { grad_norm: f64::NAN, clip_coef: 1.0, grad_scale, outcome: StepOutcome::Applied })
    }

    /// `options.grad_scale` where the kernels can use it, or [`Error::InvalidConfig`].
    fn checked_scale(options: StepOptions) -> Result<f64> {
        let scale = options.grad_scale;
        if !(scale.is_finite() && scale > 0.0) {
            return Err(Error::invalid_config("grad_scale", scale, "a finite value > 0"));
        }
        // The kernels multiply in f32: a scale past f32's range would become ∞ (every parameter
        // NaN) and one below its normal range 0 or a denormal (every gradient zeroed).
        let in_f32 = scale as f32;
        if !(in_f32.is_finite() && in_f32 >= f32::MIN_POSITIVE) {
            return Err(Error::invalid_config(
                "grad_scale",
                scale,
                "a value a normal f32 holds (1.2e-38 ≤ grad_scale ≤ 3.4e38)",
            ));
        }
        Ok(scale)
    }

    /// Whether the step is skipped (a non-finite gradient): nothing may be touched.
    pub fn skips(&self) -> bool {
        self.outcome == StepOutcome::SkippedNonFinite
    }
    /// ‖g‖₂ before clipping (non-finite when skipping, NaN when the step did not read the
    /// gradients: [`StepDecision::unchecked`]).
    pub fn grad_norm(&self) -> f64 {
        self.grad_norm
    }
    /// The clip coefficient applied (1 when not clipping).
    pub fn clip_coef(&self) -> f64 {
        self.clip_coef
    }

    /// The step number after a parameter at `step` takes this step, or
    /// [`Error::StepOverflow`].
    pub fn next_step(step: u64) -> Result<u64> {
        step.checked_add(1).ok_or(Error::StepOverflow { step })
    }

    /// The update's scalars for a parameter taking its step number `step` (≥ 1).
    pub fn scalars(&self, hyperparameters: &Hyperparameters, step: u64) -> StepScalars {
        StepScalars::new(hyperparameters, step, self.grad_scale)
    }

    /// The report of a step this decision made, now at step `step`.
    pub fn report(&self, step: u64, times: StageTimes) -> StepReport {
        StepReport {
            outcome: self.outcome,
            step,
            grad_norm: self.grad_norm,
            clip_coef: self.clip_coef,
            times,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_non_finite_norm_skips_and_a_bad_scale_is_refused() {
        let clip = GradClip::GlobalNorm { max_norm: 1.0 };
        let d = StepDecision::new(16.0, StepOptions::default(), clip).unwrap();
        assert!(!d.skips());
        assert_eq!((d.grad_norm(), d.clip_coef()), (4.0, 1.0 / (4.0 + 1e-6)));
        assert!(StepDecision::new(f64::NAN, StepOptions::default(), clip).unwrap().skips());
        assert!(StepDecision::new(f64::INFINITY, StepOptions::unscale(2.0), clip).unwrap().skips());
        // The last three are valid in f64 but ∞, a denormal and 0 in the kernels' f32.
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY, 1e39, 1e-39, 1e-46] {
            let e = StepDecision::new(1.0, StepOptions::with_grad_scale(bad), clip).unwrap_err();
            assert!(matches!(e, Error::InvalidConfig { field: "grad_scale", .. }), "{bad}: {e}");
        }
        for edge in [f64::from(f32::MIN_POSITIVE), f64::from(f32::MAX)] {
            assert!(StepDecision::new(1.0, StepOptions::with_grad_scale(edge), clip).is_ok(), "{edge}");
        }
        assert!(matches!(StepDecision::next_step(u64::MAX), Err(Error::StepOverflow { step: u64::MAX })));
    }
}
