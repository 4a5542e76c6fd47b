//! The one error type of `ring-dtp`; every variant carries the offending values.
//! Besides its own variants it has the four every crate shares (`InvalidConfig`,
//! `ShapeMismatch`, `BudgetTooSmall`, `Common`), declared by
//! [`flatpeak_common::error_vocabulary!`].

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

flatpeak_common::error_vocabulary! {
/// Bad input, a budget too small for any schedule, or a failure below.
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
    /// A per-token weight that is negative or not finite: the loss would be silently wrong (a
    /// NaN weight gives a loss of 0 with NaN gradients; a negative one can cancel the mean's
    /// denominator).
    #[error("weight {weight} of token {token} must be finite and ≥ 0")]
    InvalidWeight {
        /// The token (row of X).
        token: usize,
        /// Its weight.
        weight: f32,
    },
    /// X and W of different element types.
    #[error("dtype mismatch: x is {x}, w is {w}")]
    DtypeMismatch {
        /// X's dtype.
        x: flatpeak_common::DType,
        /// W's dtype.
        w: flatpeak_common::DType,
    },
    /// `grad_output` of the wrong kind for the reduction.
    #[error("grad_output must be {expected} for this reduction")]
    GradOutputKind {
        /// What the reduction needs.
        expected: &'static str,
    },
    /// A GEMM precision the backend does not run for these inputs ([`Precision::Tf32`] runs
    /// on a CUDA device with f32 inputs only): never silently replaced by another.
    ///
    /// [`Precision::Tf32`]: flatpeak_common::Precision::Tf32
    #[error("{precision} GEMMs are not offered for {dtype} inputs on {backend} (TF32 runs on a CUDA device's tensor cores, for f32 inputs)")]
    UnsupportedPrecision {
        /// The precision asked for.
        precision: flatpeak_common::Precision,
        /// The inputs' dtype.
        dtype: flatpeak_common::DType,
        /// Where it was asked for.
        backend: &'static str,
    },
    /// A selection of gradients a schedule does not honour (the rings compute every gradient
    /// there is): refused, never silently computed in full or left unwritten.
    #[error("{backend} computes every gradient; it was asked for {selection:?}")]
    UnsupportedSelection {
        /// The selection asked for.
        selection: crate::selection::GradientSelection,
        /// The schedule that refused it.
        backend: &'static str,
    },
}
kinds {
    Value: TargetOutOfRange, InvalidWeight, GradOutputKind, UnsupportedPrecision, UnsupportedSelection;
    Type: DtypeMismatch;
}
}
