//! The one error type of `llep`; every variant carries the offending values.
//! Besides its own variants it has the four every crate shares (`InvalidConfig`,
//! `ShapeMismatch`, `BudgetTooSmall`, `Common`), declared by
//! [`flatpeak_common::error_vocabulary!`].

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

flatpeak_common::error_vocabulary! {
/// Bad routing, bad shapes or options, a budget too small for any schedule, or a failure of
/// the communicator below.
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
    /// The experts cannot be split evenly over the ranks (expert e lives on rank e / (E/P)).
    #[error("{experts} experts cannot be split evenly over {ranks} ranks")]
    ExpertsNotDivisible {
        /// E.
        experts: usize,
        /// P.
        ranks: usize,
    },
    /// A call's expert count that is not E_local × P (expert e lives on rank e / E_local).
    #[error(
        "num_experts={experts} is not E_local × group size = {local_experts} × {ranks}: expert e lives on rank e // E_local"
    )]
    ExpertsPerRank {
        /// E, as the call gave it.
        experts: usize,
        /// E_local, the experts each rank brings.
        local_experts: usize,
        /// P.
        ranks: usize,
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
    /// A storage type the backend does not run.
    #[error("{backend} does not run {dtype} layers (it runs {supported})")]
    UnsupportedDtype {
        /// The dtype asked for (the shape's).
        dtype: flatpeak_common::DType,
        /// The backend.
        backend: &'static str,
        /// What it runs.
        supported: &'static str,
    },
    /// A tensor or buffer of another element type than the one the plan or the operation
    /// needs.
    #[error("{what} is {found}, expected {expected}")]
    DtypeMismatch {
        /// Which tensor or operation.
        what: &'static str,
        /// The type needed.
        expected: flatpeak_common::DType,
        /// The type given.
        found: flatpeak_common::DType,
    },
}
kinds {
    Value: ExpertOutOfRange, NegativeExpert, NonFiniteWeight, ExpertsNotDivisible, ExpertsPerRank, InvalidProfile,
        ScheduleMismatch;
    Type: UnsupportedDtype, DtypeMismatch;
}
}
