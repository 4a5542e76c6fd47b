//! The one error type of `stream-adamw`; every variant carries the offending values.
//! Besides its own variants it has the four every crate shares (`InvalidConfig`,
//! `ShapeMismatch`, `BudgetTooSmall`, `Common`), declared by
//! [`flatpeak_common::error_vocabulary!`].

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

flatpeak_common::error_vocabulary! {
/// Everything that can go wrong configuring or stepping the optimizer.
pub enum Error {
    /// An imported state does not fit this optimizer.
    #[error("state mismatch: {reason}")]
    StateMismatch {
        /// What does not fit.
        reason: String,
    },
    /// An imported second moment that is negative or not finite (√v would be NaN or the
    /// update silently wrong).
    #[error("imported {what}[{index}] = {value}: must be finite and ≥ 0")]
    InvalidState {
        /// The buffer (`exp_avg_sq` or `max_exp_avg_sq`).
        what: &'static str,
        /// The first offending element.
        index: usize,
        /// Its value.
        value: f32,
    },
    /// The step counter would overflow.
    #[error("step counter overflow at step {step}")]
    StepOverflow {
        /// The current step.
        step: u64,
    },
    /// A copy engine or worker of the pipeline stopped before finishing its work.
    #[error("pipeline stage `{stage}` failed: {reason}")]
    PipelineStage {
        /// The stage (d2h, adam, h2d).
        stage: &'static str,
        /// What happened.
        reason: String,
    },
    /// A gradient was NaN or infinite under [`OnNonFinite::Raise`](crate::OnNonFinite::Raise):
    /// the step was not taken, nothing was touched.
    #[error(
        "a gradient is not finite on rank {ranks} (Σg² = {grad_sq}): the step was not taken (on_nonfinite = raise)"
    )]
    NonFinite {
        /// The ranks whose gradients are not finite (`0` alone without a group), listed.
        ranks: String,
        /// The first such rank's Σg².
        grad_sq: f64,
    },
    /// A failed step had already updated some buckets (the pipeline stopped partway): the
    /// master state, and the device parameters of those buckets, are a mix of two steps, so the
    /// optimizer refuses to step again until a consistent state is imported.
    #[error(
        "a failed step updated {applied} of {buckets} buckets before it stopped (at step {step}); import_state a consistent state (a checkpoint) before stepping again"
    )]
    Poisoned {
        /// The step count before the failed step (it was not advanced).
        step: u64,
        /// Buckets whose update ran.
        applied: usize,
        /// Buckets of the step.
        buckets: usize,
    },
}
kinds {
    Value: StateMismatch, InvalidState, StepOverflow;
    Runtime: PipelineStage, Poisoned, NonFinite;
}
}
