//! The one error type of `llep`; every variant carries the offending values.

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Bad routing, bad shapes or options, a budget too small for any schedule, or a failure of
/// the communicator below.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A top-k expert id at or past the number of experts.
    #[error("expert id {expert} of token {token}, slot {slot} is outside 0..{experts}")]
    ExpertOutOfRange {
        /// The token (row of x).
        token: usize,
        /// The top-k slot.
        slot: usize,
        /// The id given.
        expert: i64,
        /// The number of experts E.
        experts: usize,
    },
    /// A negative top-k expert id.
    #[error("expert id {expert} of token {token}, slot {slot} is negative")]
    NegativeExpert {
        /// The token (row of x).
        token: usize,
        /// The top-k slot.
        slot: usize,
        /// The id given.
        expert: i64,
    },
    /// A routing weight that is NaN or infinite.
    #[error("routing weight {value} of token {token}, slot {slot} is not finite")]
    NonFiniteWeight {
        /// The token (row of x).
        token: usize,
        /// The top-k slot.
        slot: usize,
        /// The weight given.
        value: f32,
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
    /// The experts cannot be split evenly over the ranks (expert e lives on rank e / (E/P)).
    #[error("{experts} experts cannot be split evenly over {ranks} ranks")]
    ExpertsNotDivisible {
        /// E.
        experts: usize,
        /// P.
        ranks: usize,
    },
    /// The budget cannot hold the buffers of the pair cap (or of one row per rank pair).
    #[error("budget of {budget} B is below the {needed} B of {what}")]
    BudgetTooSmall {
        /// The budget given.
        budget: usize,
        /// Bytes the plan needs.
        needed: usize,
        /// Which buffers those are.
        what: &'static str,
    },
    /// A workload profile string that does not parse.
    #[error("invalid profile {spec:?}: {reason}")]
    InvalidProfile {
        /// The string given.
        spec: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The executor was handed a schedule made for other routing, or for another group.
    #[error("schedule does not match this call: {what} (schedule {planned}, call {found})")]
    ScheduleMismatch {
        /// What disagrees.
        what: &'static str,
        /// The schedule's value.
        planned: usize,
        /// The call's value.
        found: usize,
    },
    /// The CPU executor computes in f32 only.
    #[error("the CPU executor takes f32 tensors; the shape says {dtype}")]
    UnsupportedDtype {
        /// The dtype of the shape.
        dtype: flatpeak_common::DType,
    },
    /// An error from the shared foundation (workspace, communicator, GEMM).
    #[error(transparent)]
    Common(#[from] flatpeak_common::Error),
}

impl Error {
    /// [`Error::InvalidConfig`] for `field = value` outside the domain `reason`.
    pub fn invalid_config(field: &'static str, value: impl std::fmt::Debug, reason: &'static str) -> Self {
        Self::InvalidConfig { field, value: format!("{value:?}"), reason }
    }
}
