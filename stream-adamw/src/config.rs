//! [`Config`]: everything an optimizer is made with — the schedule of the offloaded step, its
//! buckets and staging slots, what a failed step leaves behind, and the starting
//! [`Hyperparameters`]. [`Plan::new`](crate::Plan::new) sizes the working set from it.

use crate::error::{Error, Result};
use crate::hyperparameters::Hyperparameters;

/// Buckets start on multiples of this many elements (one cache line of f32, and the alignment
/// a device copy wants).
pub const BUCKET_ALIGN: usize = 64;

/// The order of copies and updates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StepSchedule {
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
    /// The optimizer refuses to step ([`Error::Poisoned`]) until a
    /// consistent state is imported. Costs nothing.
    #[default]
    Poison,
    /// The step is all or nothing: the old values of each bucket are journaled before its
    /// update, and a failed step restores them (master state, moments, and the device
    /// parameters as the master's narrowing). Costs a journal the size of the state (12 B/param,
    /// 16 with AMSGrad) of host memory, reserved at construction.
    Rollback,
}

/// The optimizer's options: how the offloaded step is scheduled (the launch-time sizing of the
/// pipeline) and the update's [`Hyperparameters`] it starts with (an LR schedule may replace
/// them between steps, [`StreamAdamW::set_hyperparameters`](crate::StreamAdamW::set_hyperparameters);
/// their [`Variant`](crate::Variant) sizes the state and is fixed).
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct Config {
    /// Serial or pipelined.
    pub schedule: StepSchedule,
    /// Elements per bucket (a multiple of [`BUCKET_ALIGN`]).
    pub bucket_elems: usize,
    /// Staging slots per direction, R ≥ 1 (2 already overlaps all three stages; 3 lets the copy
    /// engines run a bucket ahead).
    pub slots: usize,
    /// What a step failing partway leaves behind.
    pub on_failure: OnFailure,
    /// The update's hyperparameters at the first step.
    pub hyperparameters: Hyperparameters,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            schedule: StepSchedule::Pipelined,
            bucket_elems: 1 << 22,
            slots: 3,
            on_failure: OnFailure::Poison,
            hyperparameters: Hyperparameters::default(),
        }
    }
}

impl Config {
    flatpeak_common::setters! {
        /// This config with this schedule.
        schedule: StepSchedule,
        /// This config with buckets of `bucket_elems` elements.
        bucket_elems: usize,
        /// This config with `slots` staging slots per direction.
        slots: usize,
        /// This config leaving `on_failure` behind a step that fails partway.
        on_failure: OnFailure,
        /// This config starting with `hyperparameters`.
        hyperparameters: Hyperparameters,
    }

    /// Checks every field's domain: `bucket_elems` a positive multiple of [`BUCKET_ALIGN`],
    /// `slots ≥ 1`, and the hyperparameters' ([`Hyperparameters::validate`]).
    pub fn validate(&self) -> Result<()> {
        self.hyperparameters.validate()?;
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
