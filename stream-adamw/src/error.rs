//! The one error type of `stream-adamw`; every variant carries the offending values.

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong configuring or stepping the optimizer.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An option or dimension outside its domain (NaN is never in one).
    #[error("invalid config: {field} = {value}: expected {reason}")]
    InvalidConfig {
        /// Which option or dimension.
        field: &'static str,
        /// The value given, as `{:?}` writes it.
        value: String,
        /// Its domain, in words.
        reason: &'static str,
    },
    /// A buffer or dimension of the wrong size.
    #[error("shape mismatch for {what}: expected {expected}, got {got}")]
    ShapeMismatch {
        /// Which buffer or dimension.
        what: &'static str,
        /// What the plan or the other inputs call for.
        expected: usize,
        /// What was given.
        got: usize,
    },
    /// The budget cannot hold the working set the config implies.
    #[error("budget of {budget} B is below the {needed} B of {what}")]
    BudgetTooSmall {
        /// The budget given.
        budget: usize,
        /// What the plan needs.
        needed: usize,
        /// Which buffer that is.
        what: &'static str,
    },
    /// An imported state does not fit this optimizer.
    #[error("state mismatch: {reason}")]
    StateMismatch {
        /// What does not fit.
        reason: String,
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
    /// The step was called on the wrong backend for this optimizer's staging.
    #[error("wrong backend: call {expected}")]
    WrongBackend {
        /// What to call instead.
        expected: &'static str,
    },
    /// The OS refused page-locked host memory for the staging slots.
    #[error(
        "could not pin {bytes} B of host memory for staging ({reason}); check the memlock limit (`ulimit -l`)"
    )]
    PinnedAlloc {
        /// Bytes of the failed allocation.
        bytes: usize,
        /// The driver's error.
        reason: String,
    },
    /// An error from the shared foundation (device probe, CUDA calls, workspace).
    #[error(transparent)]
    Common(#[from] flatpeak_common::Error),
}

impl Error {
    /// [`Error::InvalidConfig`] for `field = value` outside the domain `reason`.
    pub fn invalid_config(field: &'static str, value: impl std::fmt::Debug, reason: &'static str) -> Self {
        Self::InvalidConfig { field, value: format!("{value:?}"), reason }
    }
}
