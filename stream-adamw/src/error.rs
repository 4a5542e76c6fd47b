//! The one error type of `stream-adamw`; every variant carries the offending values.

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong configuring or stepping the optimizer.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A hyperparameter outside its domain (NaN included).
    #[error("hyperparameter {name} = {value} is invalid: expected {expected}")]
    InvalidHyperparameter {
        /// Which hyperparameter.
        name: &'static str,
        /// The value given.
        value: f64,
        /// Its domain, in words.
        expected: &'static str,
    },
    /// Two buffers that must have the same length do not.
    #[error("length mismatch for {what}: expected {expected}, found {found}")]
    LengthMismatch {
        /// Which buffer.
        what: &'static str,
        /// The length the optimizer holds.
        expected: usize,
        /// The length given.
        found: usize,
    },
    /// A pipeline option outside its domain.
    #[error("invalid pipeline option {name} = {value}: expected {expected}")]
    InvalidPipeline {
        /// Which option.
        name: &'static str,
        /// The value given.
        value: usize,
        /// Its domain, in words.
        expected: &'static str,
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
