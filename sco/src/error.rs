//! The one error type of `sco`; every variant carries the offending values.

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Misuse of the offloader, bad options, or a failed copy engine.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A layer index past the plan's depth.
    #[error("layer {layer} out of range for a stack of {layers} layers")]
    LayerOutOfRange {
        /// The layer given.
        layer: usize,
        /// The plan's depth L.
        layers: usize,
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
    /// `offload` of a layer whose boundary is already held.
    #[error("layer {layer} was already offloaded this step")]
    AlreadyOffloaded {
        /// The layer.
        layer: usize,
    },
    /// `prefetch`/`fetch` of a layer that was never offloaded this step.
    #[error("layer {layer} has no boundary to fetch: it was not offloaded this step")]
    NotOffloaded {
        /// The layer.
        layer: usize,
    },
    /// Every device slot is held by a boundary that will not be released: the schedule asks
    /// for more resident boundaries than the plan reserved.
    #[error("all {slots} device slots are held by resident boundaries (layers {held:?})")]
    RingFull {
        /// Slots in the ring.
        slots: usize,
        /// The layers holding them.
        held: Vec<usize>,
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
    /// A copy engine stopped.
    #[error("copy engine `{engine}` stopped: {reason}")]
    EngineStopped {
        /// d2h or h2d.
        engine: &'static str,
        /// Why.
        reason: String,
    },
    /// The OS refused page-locked memory for the host arena.
    #[error(
        "could not pin {bytes} B of host memory for the arena ({reason}); check the memlock limit (`ulimit -l`)"
    )]
    PinnedAlloc {
        /// Bytes requested.
        bytes: usize,
        /// The driver's error.
        reason: String,
    },
    /// An error from the shared foundation.
    #[error(transparent)]
    Common(#[from] flatpeak_common::Error),
}

impl Error {
    /// [`Error::InvalidConfig`] for `field = value` outside the domain `reason`.
    pub fn invalid_config(field: &'static str, value: impl std::fmt::Debug, reason: &'static str) -> Self {
        Self::InvalidConfig { field, value: format!("{value:?}"), reason }
    }
}
