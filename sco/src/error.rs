//! The one error type of `sco`; every variant carries the offending values.
//! Besides its own variants it has the four every crate shares (`InvalidConfig`,
//! `ShapeMismatch`, `BudgetTooSmall`, `Common`), declared by
//! [`flatpeak_common::error_vocabulary!`].

/// Result alias of this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

flatpeak_common::error_vocabulary! {
/// Misuse of the offloader, bad options, or a failed copy engine.
pub enum Error {
    /// A layer index past the plan's depth.
    #[error("layer {layer} out of range for a stack of {layers} layers")]
    LayerOutOfRange {
        /// The layer given.
        layer: usize,
        /// The plan's depth L.
        layers: usize,
    },
    /// `offload` of a layer whose boundary is already held.
    #[error("layer {layer} was already offloaded this step")]
    AlreadyOffloaded {
        /// The layer.
        layer: usize,
    },
    /// `prefetch`/`fetch`/`release` of a layer that was never offloaded this step (or, on
    /// CUDA, `offload` of a layer no slot was written for with `slot_for`).
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
    /// A copy engine stopped.
    #[error("copy engine `{engine}` stopped: {reason}")]
    EngineStopped {
        /// d2h or h2d.
        engine: &'static str,
        /// Why.
        reason: String,
    },
    /// A wait of the offloader (for a copy to land or a slot to free) took longer than the
    /// config's `wait_timeout`: a copy engine is stuck. The offloader is failed from then on.
    #[error("waited {waited:?} for {what} (the config's wait_timeout): a copy engine is stuck")]
    Timeout {
        /// What was waited for.
        what: &'static str,
        /// How long.
        waited: std::time::Duration,
    },
}
kinds {
    Value: LayerOutOfRange, AlreadyOffloaded, NotOffloaded, RingFull;
    Runtime: EngineStopped, Timeout;
}
}
