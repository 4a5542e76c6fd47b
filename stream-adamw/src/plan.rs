//! Pure sizing of the offloaded step: bucket partition, staging bytes per schedule, and the
//! pipeline's time model. No device, no allocation beyond the plan itself.
//!
//! Memory: the serial schedule (ZeRO-Offload, FSDP2 `CPUOffloadPolicy`) stages every gradient
//! and every updated parameter at once, `N·(b_g + b_p)` bytes of pinned host memory. The
//! pipeline stages R slots per direction, `R·N_b·(b_g + b_p)`, independent of N.
//!
//! Time: with per-bucket D2H, Adam and H2D times a, c, h over B buckets,
//! `T_serial = B·(a + c + h)` and `T_pipe ≈ (a + c + h) + (B − 1)·max(a, c, h)`, so the speedup
//! tends to `(a + c + h) / max(a, c, h) ≤ 3`.

use std::ops::Range;

use flatpeak_common::{Budget, DType};

pub use crate::config::BUCKET_ALIGN;
use crate::config::{Config, StepSchedule};
use crate::error::{Error, Result};

/// What one optimizer steps: N parameters, with gradients and device parameters of the given
/// dtypes on the link.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// N: parameters.
    pub params: usize,
    /// Gradient dtype on the link (b_g bytes).
    pub grad_dtype: DType,
    /// Device parameter dtype on the link (b_p bytes).
    pub param_dtype: DType,
}

/// The partition of N parameters into buckets and the bytes each schedule stages, with the
/// [`Config`] it was made from (an optimizer made from the plan uses that config: the two
/// cannot disagree).
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    config: Config,
    shape: Shape,
}

impl Plan {
    /// Validates `config` and checks that the pinned staging,
    /// [`workspace_bytes`](Plan::workspace_bytes), fits `budget` ([`Error::BudgetTooSmall`]
    /// otherwise). Every size product is checked.
    pub fn new(config: &Config, shape: Shape, budget: Budget) -> Result<Self> {
        config.validate()?;
        let plan = Self { config: *config, shape };
        let per_elem = shape.grad_dtype.size_in_bytes() + shape.param_dtype.size_in_bytes();
        let staging =
            plan.staged_slots().checked_mul(plan.slot_elems()).and_then(|e| e.checked_mul(per_elem));
        let staging =
            staging.ok_or(Error::Common(flatpeak_common::Error::SizeOverflow { what: "staging bytes" }))?;
        // The link's bytes per step and the host state (f32 master, moments, AMSGrad's max).
        if shape.params.checked_mul(per_elem.max(16)).is_none() {
            return Err(Error::Common(flatpeak_common::Error::SizeOverflow { what: "parameter bytes" }));
        }
        if !budget.admits(staging) {
            return Err(Error::BudgetTooSmall {
                budget: budget.bytes(),
                needed: staging,
                what: "the staging slots",
            });
        }
        Ok(plan)
    }

    /// The config the plan was made from.
    pub fn config(&self) -> &Config {
        &self.config
    }
    /// The shape the plan was made for.
    pub fn shape(&self) -> Shape {
        self.shape
    }
    /// Parameters covered.
    pub fn n_params(&self) -> usize {
        self.shape.params
    }
    /// The schedule.
    pub fn schedule(&self) -> StepSchedule {
        self.config.schedule
    }
    /// Staging slots per direction.
    pub fn slots(&self) -> usize {
        self.config.slots
    }
    /// Number of buckets B = ⌈N / N_b⌉.
    pub fn n_buckets(&self) -> usize {
        self.shape.params.div_ceil(self.config.bucket_elems)
    }
    /// Element range of bucket `k` (the last one may be short; empty past the end).
    pub fn bucket(&self, k: usize) -> Range<usize> {
        let (n, bucket_elems) = (self.shape.params, self.config.bucket_elems);
        let start = k.saturating_mul(bucket_elems).min(n);
        start..(start + bucket_elems).min(n)
    }
    /// Elements of one staging slot: a whole bucket (pipelined) or everything (serial).
    pub fn slot_elems(&self) -> usize {
        match self.config.schedule {
            StepSchedule::Pipelined => self.config.bucket_elems.min(self.shape.params),
            StepSchedule::Serial => self.shape.params,
        }
    }
    /// Staging slots allocated per direction: R (pipelined) or 1 (serial).
    pub fn staged_slots(&self) -> usize {
        match self.config.schedule {
            StepSchedule::Pipelined => self.config.slots.min(self.n_buckets().max(1)),
            StepSchedule::Serial => 1,
        }
    }
    /// The working set: pinned host staging, both directions, `slots·slot_elems·(b_g + b_p)`
    /// (the same as [`staging_bytes`](Plan::staging_bytes)).
    pub fn workspace_bytes(&self) -> usize {
        self.staging_bytes()
    }
    /// Pinned host staging bytes, both directions: `slots·slot_elems·(b_g + b_p)`.
    pub fn staging_bytes(&self) -> usize {
        self.staged_slots()
            * self.slot_elems()
            * (self.shape.grad_dtype.size_in_bytes() + self.shape.param_dtype.size_in_bytes())
    }
    /// Bytes each step moves over the link: gradients down, parameters up.
    pub fn link_bytes(&self) -> (usize, usize) {
        let n = self.shape.params;
        (n * self.shape.grad_dtype.size_in_bytes(), n * self.shape.param_dtype.size_in_bytes())
    }
}

/// The pipeline's limit speedup over serial, `(a + c + h) / max(a, c, h)`, for per-bucket stage
/// times a (D2H), c (Adam), h (H2D).
pub fn ideal_speedup(a: f64, c: f64, h: f64) -> f64 {
    (a + c + h) / a.max(c).max(h)
}

/// Modelled pipelined time over B buckets: `(a + c + h) + (B − 1)·max(a, c, h)`.
pub fn pipelined_time(buckets: usize, a: f64, c: f64, h: f64) -> f64 {
    if buckets == 0 { 0.0 } else { (a + c + h) + (buckets - 1) as f64 * a.max(c).max(h) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(params: usize) -> Shape {
        Shape { params, grad_dtype: DType::F32, param_dtype: DType::Bf16 }
    }

    #[test]
    fn buckets_cover_every_parameter_once() {
        for n in [0usize, 1, 63, 64, 65, 1000, 4096] {
            let plan = Plan::new(&Config::default().bucket_elems(128), shape(n), Budget::Unlimited).unwrap();
            let mut next = 0;
            for k in 0..plan.n_buckets() {
                let r = plan.bucket(k);
                assert_eq!(r.start, next);
                assert!(r.start.is_multiple_of(BUCKET_ALIGN) && !r.is_empty());
                next = r.end;
            }
            assert_eq!(next, n);
        }
    }

    #[test]
    fn staging_is_flat_in_parameters_when_pipelined() {
        let config = Config::default().bucket_elems(1 << 20);
        let small = Plan::new(&config, shape(1 << 24), Budget::Unlimited).unwrap();
        let large = Plan::new(&config, shape(1 << 30), Budget::mib(18)).unwrap();
        assert_eq!(small.staging_bytes(), 3 * (1 << 20) * 6);
        assert_eq!(small.staging_bytes(), large.staging_bytes());
        let serial =
            Plan::new(&config.schedule(StepSchedule::Serial), shape(1 << 30), Budget::Unlimited).unwrap();
        assert_eq!(serial.staging_bytes(), (1 << 30) * 6);
        assert_eq!(
            Plan::new(&config.schedule(StepSchedule::Serial), shape(1 << 30), Budget::mib(18)),
            Err(Error::BudgetTooSmall { budget: 18 << 20, needed: 6 << 30, what: "the staging slots" })
        );
    }

    #[test]
    fn sizes_that_overflow_are_an_error_not_a_panic() {
        for params in [usize::MAX, usize::MAX / 8] {
            for config in [Config::default(), Config::default().schedule(StepSchedule::Serial)] {
                let err = Plan::new(&config, shape(params), Budget::Unlimited).unwrap_err();
                assert!(matches!(err, Error::Common(flatpeak_common::Error::SizeOverflow { .. })), "{err}");
            }
        }
        let plan = Plan::new(&Config::default(), shape(10), Budget::Unlimited).unwrap();
        assert!(plan.bucket(usize::MAX).is_empty());
    }

    #[test]
    fn bad_options_are_typed_errors() {
        let e = Plan::new(&Config::default().bucket_elems(100), shape(10), Budget::Unlimited).unwrap_err();
        assert!(matches!(e, Error::InvalidConfig { field: "bucket_elems", ref value, .. } if value == "100"));
        let e = Plan::new(&Config::default().slots(0), shape(10), Budget::Unlimited).unwrap_err();
        assert!(matches!(e, Error::InvalidConfig { field: "slots", .. }));
    }

    #[test]
    fn time_model() {
        assert_eq!(ideal_speedup(1.0, 2.0, 1.0), 2.0);
        assert_eq!(ideal_speedup(1.0, 1.0, 1.0), 3.0);
        assert_eq!(pipelined_time(4, 1.0, 2.0, 1.0), 4.0 + 3.0 * 2.0);
    }
}
