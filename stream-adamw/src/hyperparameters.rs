//! Hyperparameters with `torch.optim.AdamW` semantics, and the per-step scalars derived from them
//! in f64 on the host (as torch does) and cast once to f32 for the kernel.

use crate::error::{Error, Result};

/// Plain Adam second moment, or AMSGrad's running maximum of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Variant {
    /// `denom` uses the current second moment v.
    #[default]
    Adam,
    /// `denom` uses max over steps of the raw v (before bias correction), as torch does.
    AmsGrad,
}

/// Whether the step descends or ascends the objective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Objective {
    /// Descend (g as given).
    #[default]
    Minimize,
    /// Ascend (g ← −g before anything else, torch's `maximize=True`).
    Maximize,
}

/// Gradient clipping applied on load, with `torch.nn.utils.clip_grad_norm_` semantics.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum GradClip {
    /// No clipping.
    #[default]
    None,
    /// Scale every gradient by `min(1, max_norm / (‖g‖₂ + 1e-6))`, ‖g‖₂ over all parameters.
    GlobalNorm {
        /// The norm bound (> 0).
        max_norm: f64,
    },
}

/// `torch.optim.AdamW` hyperparameters (a param group's `lr`, `betas`, `eps`, `weight_decay`,
/// `amsgrad`, `maximize`), which may change every step. Defaults are torch's.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct Hyperparameters {
    /// Learning rate (≥ 0).
    pub lr: f64,
    /// First-moment decay β1 ∈ [0, 1).
    pub beta1: f64,
    /// Second-moment decay β2 ∈ [0, 1).
    pub beta2: f64,
    /// Added to the bias-corrected √v (> 0).
    pub eps: f64,
    /// Decoupled weight decay λ (≥ 0): θ ← θ·(1 − lr·λ) before the update.
    pub weight_decay: f64,
    /// Adam or AMSGrad.
    pub variant: Variant,
    /// Minimize or maximize.
    pub objective: Objective,
    /// Gradient clipping.
    pub clip: GradClip,
}

impl Default for Hyperparameters {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
            variant: Variant::Adam,
            objective: Objective::Minimize,
            clip: GradClip::None,
        }
    }
}

fn check(name: &'static str, value: f64, ok: bool, expected: &'static str) -> Result<()> {
    if ok && !value.is_nan() { Ok(()) } else { Err(Error::invalid_config(name, value, expected)) }
}

impl Hyperparameters {
    flatpeak_common::setters! {
        /// These hyperparameters with learning rate `lr`.
        lr: f64,
    }
    /// These hyperparameters with `(β1, β2)`.
    pub fn betas(self, beta1: f64, beta2: f64) -> Self {
        Self { beta1, beta2, ..self }
    }
    flatpeak_common::setters! {
        /// These hyperparameters with ε.
        eps: f64,
        /// These hyperparameters with decoupled weight decay λ.
        weight_decay: f64,
        /// These hyperparameters with this variant (Adam or AMSGrad).
        variant: Variant,
        /// These hyperparameters minimizing or maximizing.
        objective: Objective,
        /// These hyperparameters with this gradient clipping.
        clip: GradClip,
    }

    /// Checks every hyperparameter's domain, in the precision the kernel uses (f32); NaN is
    /// never valid.
    pub fn validate(&self) -> Result<()> {
        check("lr", self.lr, self.lr >= 0.0 && self.lr.is_finite(), "a finite value ≥ 0")?;
        check("beta1", self.beta1, (0.0..1.0).contains(&self.beta1), "a value in [0, 1)")?;
        check("beta2", self.beta2, (0.0..1.0).contains(&self.beta2), "a value in [0, 1)")?;
        check("eps", self.eps, self.eps > 0.0 && self.eps.is_finite(), "a finite value > 0")?;
        check(
            "weight_decay",
            self.weight_decay,
            self.weight_decay >= 0.0 && self.weight_decay.is_finite(),
            "a finite value ≥ 0",
        )?;
        if let GradClip::GlobalNorm { max_norm } = self.clip {
            check("max_norm", max_norm, max_norm > 0.0 && max_norm.is_finite(), "a finite value > 0")?;
        }
        // The kernel computes in f32: each scalar it is handed (see `StepScalars`) must survive
        // the cast, or every parameter would silently become NaN. ε must stay a normal f32 > 0
        // (a subnormal one is flushed to 0 by a kernel built with fast math); lr/(1 − β1) is the
        // largest step size (step 1) and lr·λ the decay's term.
        let f32_finite = |x: f64| (x as f32).is_finite();
        check("lr", self.lr, f32_finite(self.lr), "finite in f32 (≤ 3.4e38)")?;
        check("eps", self.eps, self.eps as f32 >= f32::MIN_POSITIVE, "≥ 1.2e-38 (a normal f32)")?;
        let step_size = self.lr / (1.0 - self.beta1);
        check("lr", self.lr, f32_finite(step_size), "lr/(1 − β1), the first step size, finite in f32")?;
        let decay_term = self.lr * self.weight_decay;
        check("weight_decay", self.weight_decay, f32_finite(decay_term), "lr·weight_decay finite in f32")?;
        Ok(())
    }
}

/// The scalars of step `t`, computed in f64 and cast once to f32.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepScalars {
    /// Multiplies every gradient on load: clip coefficient × 1/loss_scale.
    pub grad_scale: f32,
    /// −1 for maximize, else +1 (an exact sign flip).
    pub sign: f32,
    /// 1 − lr·λ.
    pub decay: f32,
    /// 1 − β1, the `lerp` weight of the first moment.
    pub lerp_weight: f32,
    /// β2.
    pub beta2: f32,
    /// 1 − β2.
    pub one_minus_beta2: f32,
    /// 1 / √(1 − β2^t), the second moment's bias correction as a factor.
    pub inv_bias_correction2_sqrt: f32,
    /// ε.
    pub eps: f32,
    /// lr / (1 − β1^t).
    pub step_size: f32,
}

impl StepScalars {
    /// Scalars for step `t ≥ 1` with gradients multiplied by `grad_scale` on load.
    pub fn new(config: &Hyperparameters, t: u64, grad_scale: f64) -> Self {
        let t = t.min(i32::MAX as u64) as i32;
        let bias_correction1 = 1.0 - config.beta1.powi(t);
        let bias_correction2 = 1.0 - config.beta2.powi(t);
        Self {
            grad_scale: grad_scale as f32,
            sign: match config.objective {
                Objective::Minimize => 1.0,
                Objective::Maximize => -1.0,
            },
            decay: (1.0 - config.lr * config.weight_decay) as f32,
            lerp_weight: (1.0 - config.beta1) as f32,
            beta2: config.beta2 as f32,
            one_minus_beta2: (1.0 - config.beta2) as f32,
            inv_bias_correction2_sqrt: (1.0 / bias_correction2.sqrt()) as f32,
            eps: config.eps as f32,
            step_size: (config.lr / bias_correction1) as f32,
        }
    }
}

/// The clip coefficient of `clip_grad_norm_` for a global norm `total_norm`: 1 when not clipping.
pub fn clip_coefficient(clip: GradClip, total_norm: f64) -> f64 {
    match clip {
        GradClip::None => 1.0,
        GradClip::GlobalNorm { max_norm } => (max_norm / (total_norm + 1e-6)).min(1.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_names_the_bad_value() {
        assert!(Hyperparameters::default().validate().is_ok());
        let bad = [
            Hyperparameters { beta1: 1.0, ..Default::default() },
            Hyperparameters { beta2: -0.1, ..Default::default() },
            Hyperparameters { eps: 0.0, ..Default::default() },
            Hyperparameters { lr: f64::NAN, ..Default::default() },
            Hyperparameters { weight_decay: -1.0, ..Default::default() },
            Hyperparameters { clip: GradClip::GlobalNorm { max_norm: 0.0 }, ..Default::default() },
            // Valid in f64, lost in the kernel's f32: ε flushes to 0, lr overflows, and so do the
            // first step size and the decay term.
            Hyperparameters { eps: 1e-50, ..Default::default() },
            Hyperparameters { lr: 1e300, ..Default::default() },
            Hyperparameters { lr: 1e30, beta1: 1.0 - 1e-12, ..Default::default() },
            Hyperparameters { lr: 1e20, weight_decay: 1e20, ..Default::default() },
        ];
        let names =
            ["beta1", "beta2", "eps", "lr", "weight_decay", "max_norm", "eps", "lr", "lr", "weight_decay"];
        for (cfg, name) in bad.iter().zip(names) {
            match cfg.validate() {
                Err(Error::InvalidConfig { field: n, .. }) => assert_eq!(n, name),
                other => panic!("{name}: {other:?}"),
            }
        }
    }

    #[test]
    fn scalars_follow_torch() {
        let cfg = Hyperparameters {
            lr: 0.1,
            weight_decay: 0.5,
            objective: Objective::Maximize,
            ..Default::default()
        };
        let s = StepScalars::new(&cfg, 2, 0.5);
        assert_eq!(s.sign, -1.0);
        assert_eq!(s.decay, 0.95);
        assert_eq!(s.step_size, (0.1 / (1.0 - 0.9f64 * 0.9)) as f32);
        assert_eq!(s.inv_bias_correction2_sqrt, (1.0 / (1.0 - 0.999f64 * 0.999).sqrt()) as f32);
        assert_eq!(clip_coefficient(GradClip::GlobalNorm { max_norm: 1.0 }, 4.0), 1.0 / (4.0 + 1e-6));
        assert_eq!(clip_coefficient(GradClip::GlobalNorm { max_norm: 10.0 }, 4.0), 1.0);
    }
}
