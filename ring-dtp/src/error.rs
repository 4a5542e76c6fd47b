//! The one error type of `ring-dtp`; every variant carries the offending values.

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Bad input, a budget too small for any schedule, or a failure below.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A target outside `0..V` that is not `ignore_index`.
    #[error("target {target} of token {token} is outside 0..{vocab} and is not ignore_index")]
    TargetOutOfRange {
        /// The token (row of X).
        token: usize,
        /// Its target.
        target: i64,
        /// The vocabulary size V.
        vocab: usize,
    },
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
    /// X and W of different element types.
    #[error("dtype mismatch: x is {x}, w is {w}")]
    DtypeMismatch {
        /// X's dtype.
        x: flatpeak_common::DType,
        /// W's dtype.
        w: flatpeak_common::DType,
    },
    /// The byte budget cannot hold even the smallest schedule.
    #[error("budget of {budget} B is below the smallest schedule's {needed} B ({what})")]
    BudgetTooSmall {
        /// The budget given.
        budget: usize,
        /// What the smallest schedule needs.
        needed: usize,
        /// Which schedule that is.
        what: &'static str,
    },
    /// `grad_output` of the wrong kind for the reduction.
    #[error("grad_output must be {expected} for this reduction")]
    GradOutputKind {
        /// What the reduction needs.
        expected: &'static str,
    },
    /// Tensors on one device handed to an executor on another (nothing is copied silently).
    #[error("executor on {executor} was handed tensors on {inputs}")]
    WrongDevice {
        /// The executor's device.
        executor: flatpeak_common::Device,
        /// Where the tensors are.
        inputs: flatpeak_common::Device,
    },
    /// An error from the shared foundation (workspace, communicator, CUDA).
    #[error(transparent)]
    Common(#[from] flatpeak_common::Error),
}

impl Error {
    /// [`Error::InvalidConfig`] for `field = value` outside the domain `reason`.
    pub fn invalid_config(field: &'static str, value: impl std::fmt::Debug, reason: &'static str) -> Self {
        Self::InvalidConfig { field, value: format!("{value:?}"), reason }
    }
}
