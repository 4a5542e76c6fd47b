//! What the loss computes: `Config`, with the features users of Cut Cross-Entropy
//! and Liger expect, each off by default.
//!
//! For a valid token i (target y ≠ ignore_index) with logits `z = softcap(x_i·Wᵀ + b)`:
//! `lse = log Σ_j e^{z_j}`,
//! `ℓ_i = ω_i·(lse − (1−α)·z_y − (α/V)·Σ_j z_j + λ·lse²)` (α label smoothing, λ z-loss,
//! ω per-token weight, 1 by default); ignored tokens contribute 0. Mean divides Σℓ by the sum of
//! the valid tokens' weights (0 when there is none: an all-ignored batch has loss 0, no NaN).

use flatpeak_common::gemm_bf16::Bf16Kernel;
use flatpeak_common::{Digest, Precision};

use crate::error::{Error, Result};

/// How per-token losses are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reduction {
    /// Σℓ_i / Σ_valid ω_i.
    #[default]
    Mean,
    /// Σℓ_i.
    Sum,
    /// Per-token ℓ_i, with a per-token `grad_output` in backward.
    None,
}

/// Logit soft-capping (Gemma 2): `z = cap·tanh(u/cap)`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Softcap {
    /// Logits as projected.
    #[default]
    Off,
    /// `z = cap·tanh(u/cap)`, cap > 0.
    Tanh {
        /// The cap.
        cap: f32,
    },
}

/// The loss's options. Defaults: ignore_index −100, mean, no smoothing, no z-loss, no softcap,
/// no shift, GEMMs in the inputs' dtype ([`Precision::Native`]) on the CPU's bf16 instructions where
/// it has them.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct Config {
    /// Targets equal to this are skipped (loss 0, gradient 0).
    pub ignore_index: i64,
    /// Mean, sum or none.
    pub reduction: Reduction,
    /// Label smoothing α ∈ [0, 1] (torch's range).
    pub label_smoothing: f32,
    /// z-loss coefficient λ ≥ 0 (adds λ·lse² per token).
    pub z_loss: f32,
    /// Logit soft-capping.
    pub softcap: Softcap,
    /// Row i predicts `targets[i + shift]` (the last `shift` rows predict nothing), without
    /// copying X: a causal LM's shift.
    pub shift: usize,
    /// The GEMMs' arithmetic ([`Precision`]): by default the inputs' dtype with f32
    /// accumulation; with bf16 inputs, backward rounds the logit gradient G to bf16 before
    /// its two GEMMs (as autograd of a bf16 matmul), [`Precision::F32`] keeps it f32;
    /// [`Precision::Tf32`] (not exact) runs f32 inputs on a GPU's tensor cores and is
    /// [`Error::UnsupportedPrecision`] anywhere else.
    pub precision: Precision,
    /// The CPU kernel of bf16 GEMMs ([`Bf16Kernel`]): by default AMX tiles or AVX512-BF16,
    /// where the CPU has them; [`Bf16Kernel::Widened`] runs the widening fallback on any CPU. Device paths ignore it.
    pub bf16_kernel: Bf16Kernel,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            ignore_index: -100,
            reduction: Reduction::Mean,
            label_smoothing: 0.0,
            z_loss: 0.0,
            softcap: Softcap::Off,
            shift: 0,
            precision: Precision::Native,
            bf16_kernel: Bf16Kernel::Detect,
        }
    }
}

impl Config {
    flatpeak_common::setters! {
        /// This config skipping targets equal to `ignore_index`.
        ignore_index: i64,
        /// This config with this reduction.
        reduction: Reduction,
        /// This config with label smoothing α.
        label_smoothing: f32,
        /// This config with z-loss coefficient λ.
        z_loss: f32,
        /// This config with this logit soft-capping.
        softcap: Softcap,
        /// This config predicting `targets[i + shift]` from row i.
        shift: usize,
        /// This config with these GEMMs ([`Precision`]).
        precision: Precision,
        /// This config with this CPU kernel for bf16 GEMMs ([`Bf16Kernel`]).
        bf16_kernel: Bf16Kernel,
    }

    /// The precision on a host backend (the CPU path, the host ring, the emulator): every
    /// [`Precision`] but [`Precision::Tf32`], a tensor-core format
    /// ([`Error::UnsupportedPrecision`] naming `backend`).
    pub(crate) fn check_host_precision(
        &self,
        dtype: flatpeak_common::DType,
        backend: &'static str,
    ) -> Result<()> {
        match self.precision {
            Precision::Tf32 => Err(Error::UnsupportedPrecision { precision: self.precision, dtype, backend }),
            _ => Ok(()),
        }
    }

    /// The precision on a CUDA device: [`Precision::Tf32`] for f32 inputs only.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn check_cuda_precision(&self, dtype: flatpeak_common::DType) -> Result<()> {
        match (self.precision, dtype) {
            (Precision::Tf32, d) if d != flatpeak_common::DType::F32 => Err(Error::UnsupportedPrecision {
                precision: self.precision,
                dtype,
                backend: "a CUDA device",
            }),
            _ => Ok(()),
        }
    }

    /// A digest of the options every rank of a ring must share, field by field (stable across
    /// processes and builds, never over the `Debug` text). [`Config::bf16_kernel`] is left out:
    /// it chooses how a rank's CPU runs its own GEMMs, and may differ by rank.
    pub fn digest(&self) -> u64 {
        let softcap = match self.softcap {
            Softcap::Off => Digest::new().u64(0),
            Softcap::Tanh { cap } => Digest::new().u64(1).f64(f64::from(cap)),
        };
        Digest::new()
            .str("ring_dtp::Config")
            .i64(self.ignore_index)
            .u64(match self.reduction {
                Reduction::Mean => 0,
                Reduction::Sum => 1,
                Reduction::None => 2,
            })
            .f64(f64::from(self.label_smoothing))
            .f64(f64::from(self.z_loss))
            .u64(softcap.finish())
            .usize(self.shift)
            .u64(match self.precision {
                Precision::Native => 0,
                Precision::F32 => 1,
                Precision::Tf32 => 2,
                _ => 3,
            })
            .finish()
    }

    /// Checks every option's domain (NaN is never valid).
    pub fn validate(&self) -> Result<()> {
        let bad = |name, value: f32, expected| Err(Error::invalid_config(name, value, expected));
        // torch's range: at 1 every row's target is the uniform distribution, and the loss and
        // its gradient stay defined (no term divides by 1 − α).
        if !(0.0..=1.0).contains(&self.label_smoothing) {
            return bad("label_smoothing", self.label_smoothing, "a value in [0, 1]");
        }
        if !(self.z_loss >= 0.0 && self.z_loss.is_finite()) {
            return bad("z_loss", self.z_loss, "a finite value ≥ 0");
        }
        if let Softcap::Tanh { cap } = self.softcap
            && !(cap > 0.0 && cap.is_finite())
        {
            return bad("softcap", cap, "a finite value > 0");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The digest is the same in every process and build (a fixed value for the defaults), moves
    /// with every field the ranks share and stays put for the rank-local one.
    #[test]
    fn the_digest_is_stable_and_follows_the_shared_fields_only() {
        let d = Config::default();
        assert_eq!(d.digest(), 0x967d_a0ce_53d5_b1a4, "the default config's digest changed");
        let shared = [
            d.ignore_index(-1),
            d.reduction(Reduction::Sum),
            d.reduction(Reduction::None),
            d.label_smoothing(0.1),
            d.z_loss(1e-4),
            d.softcap(Softcap::Tanh { cap: 30.0 }),
            d.softcap(Softcap::Tanh { cap: 15.0 }),
            d.shift(1),
            d.precision(Precision::F32),
            d.precision(Precision::Tf32),
        ];
        let mut seen = vec![d.digest()];
        for c in shared {
            assert!(!seen.contains(&c.digest()), "{c:?}");
            seen.push(c.digest());
        }
        assert_eq!(d.bf16_kernel(Bf16Kernel::Widened).digest(), d.digest());
    }

    #[test]
    fn validation() {
        assert!(Config::default().validate().is_ok());
        let mut c = Config { label_smoothing: 1.0, ..Default::default() };
        assert!(c.validate().is_ok(), "torch's range includes 1");
        for bad in [1.0 + f32::EPSILON, -0.0 - f32::MIN_POSITIVE, f32::NAN] {
            c.label_smoothing = bad;
            assert!(
                matches!(c.validate(), Err(Error::InvalidConfig { field: "label_smoothing", .. })),
                "{bad}"
            );
        }
        c.label_smoothing = 0.1;
        c.z_loss = f32::NAN;
        assert!(matches!(c.validate(), Err(Error::InvalidConfig { field: "z_loss", .. })));
        c.z_loss = 0.0;
        c.softcap = Softcap::Tanh { cap: 0.0 };
        assert!(matches!(c.validate(), Err(Error::InvalidConfig { field: "softcap", .. })));
    }
}
