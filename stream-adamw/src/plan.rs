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

use crate::error::{Error, Result};

/// Buckets start on multiples of this many elements (one cache line of f32, and the alignment
/// a device copy wants).
pub const BUCKET_ALIGN: usize = 64;

/// The order of copies and updates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Schedule {
    /// All D2H, then Adam over everything, then all H2D: the serial offload baseline.
    Serial,
    /// D2H of bucket k ‖ Adam of bucket k−1 ‖ H2D of bucket k−2, from R staging slots.
    #[default]
    Pipelined,
}

/// What a step that fails partway (a copy engine or the device failing after some buckets'
/// update ran) leaves behind. Errors found before any update (bad input, non-finite gradients)
/// change nothing either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnFailure {
    /// The optimizer refuses to step ([`Error::Poisoned`](crate::Error::Poisoned)) until a
    /// consistent state is imported. Costs nothing.
    #[default]
    Poison,
    /// The step is all or nothing: the old values of each bucket are journaled before its
    /// update, and a failed step restores them (master state, moments, and the device
    /// parameters as the master's narrowing). Costs a journal the size of the state (12 B/param,
    /// 16 with AMSGrad) of host memory, reserved at construction.
    Rollback,
}

/// How the offloaded step is scheduled: the launch-time sizing of the pipeline. (The update's
/// hyperparameters, which may change every step, are [`Hyperparameters`](crate::Hyperparameters).)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Config {
    /// Serial or pipelined.
    pub schedule: Schedule,
    /// Elements per bucket (a multiple of [`BUCKET_ALIGN`]).
    pub bucket_elems: usize,
    /// Staging slots per direction, R ≥ 1 (2 already overlaps all three stages; 3 lets the copy
    /// engines run a bucket ahead).
    pub slots: usize,
    /// What a step failing partway leaves behind.
    pub on_failure: OnFailure,
}

impl Default for Config {
    fn default() -> Self {
        Self { schedule: Schedule::Pipelined, bucket_elems: 1 << 22, slots: 3, on_failure: OnFailure::Poison }
    }
}

impl Config {
    /// This config with this schedule.
    pub fn schedule(self, schedule: Schedule) -> Self {
        Self { schedule, ..self }
    }
    /// This config with buckets of `bucket_elems` elements.
    pub fn bucket_elems(self, bucket_elems: usize) -> Self {
        Self { bucket_elems, ..self }
    }
    /// This config with `slots` staging slots per direction.
    pub fn slots(self, slots: usize) -> Self {
        Self { slots, ..self }
    }
    /// This config leaving `on_failure` behind a step that fails partway.
    pub fn on_failure(self, on_failure: OnFailure) -> Self {
        Self { on_failure, ..self }
    }

    /// Checks every field's domain: `bucket_elems` a positive multiple of [`BUCKET_ALIGN`],
    /// `slots ≥ 1`.
    pub fn validate(&self) -> Result<()> {
        if self.bucket_elems == 0 || !self.bucket_elems.is_multiple_of(BUCKET_ALIGN) {
            return Err(Error::invalid_config(
                "bucket_elems",
                self.bucket_elems,
                "a positive multiple of 64",
            ));
        }
        if self.slots == 0 {
            return Err(Error::invalid_config("slots", self.slots, "at least 1"));
        }
        Ok(())
    }
}

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

/// The partition of N parameters into buckets and the bytes each schedule stages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    n_params: usize,
    bucket_elems: usize,
    slots: usize,
    schedule: Schedule,
    grad_dtype: DType,
    param_dtype: DType,
}

impl Plan {
    /// Validates `config` and checks that the pinned staging,
    /// [`workspace_bytes`](Plan::workspace_bytes), fits `budget` ([`Error::BudgetTooSmall`]
    /// otherwise). Every size product is checked.
    pub fn new(config: &Config, shape: Shape, budget: Budget) -> Result<Self> {
        config.validate()?;
        let plan = Self {
            n_params: shape.params,
            bucket_elems: config.bucket_elems,
            slots: config.slots,
            schedule: config.schedule,
            grad_dtype: shape.grad_dtype,
            param_dtype: shape.param_dtype,
        };
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

    /// Parameters covered.
    pub fn n_params(&self) -> usize {
        self.n_params
    }
    /// The schedule.
    pub fn schedule(&self) -> Schedule {
        self.schedule
    }
    /// Staging slots per direction.
    pub fn slots(&self) -> usize {
        self.slots
    }
    /// Number of buckets B = ⌈N / N_b⌉.
    pub fn n_buckets(&self) -> usize {
        self.n_params.div_ceil(self.bucket_elems)
    }
    /// Element range of bucket `k` (the last one may be short; empty past the end).
    pub fn bucket(&self, k: usize) -> Range<usize> {
        let start = k.saturating_mul(self.bucket_elems).min(self.n_params);
        start..(start + self.bucket_elems).min(self.n_params)
    }
    /// Elements of one staging slot: a whole bucket (pipelined) or everything (serial).
    pub fn slot_elems(&self) -> usize {
        match self.schedule {
            Schedule::Pipelined => self.bucket_elems.min(self.n_params),
            Schedule::Serial => self.n_params,
        }
    }
    /// Staging slots allocated per direction: R (pipelined) or 1 (serial).
    pub fn staged_slots(&self) -> usize {
        match self.schedule {
            Schedule::Pipelined => self.slots.min(self.n_buckets().max(1)),
            Schedule::Serial => 1,
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
            * (self.grad_dtype.size_in_bytes() + self.param_dtype.size_in_bytes())
    }
    /// Bytes each step moves over the link: gradients down, parameters up.
    pub fn link_bytes(&self) -> (usize, usize) {
        (self.n_params * self.grad_dtype.size_in_bytes(), self.n_params * self.param_dtype.size_in_bytes())
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
            Plan::new(&config.schedule(Schedule::Serial), shape(1 << 30), Budget::Unlimited).unwrap();
        assert_eq!(serial.staging_bytes(), (1 << 30) * 6);
        assert_eq!(
            Plan::new(&config.schedule(Schedule::Serial), shape(1 << 30), Budget::mib(18)),
            Err(Error::BudgetTooSmall { budget: 18 << 20, needed: 6 << 30, what: "the staging slots" })
        );
    }

    #[test]
    fn sizes_that_overflow_are_an_error_not_a_panic() {
        for params in [usize::MAX, usize::MAX / 8] {
            for config in [Config::default(), Config::default().schedule(Schedule::Serial)] {
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
