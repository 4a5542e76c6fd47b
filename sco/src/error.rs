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
    /// A tensor of the wrong number of elements.
    #[error("boundary tensor of layer {layer} has {found} elements, the plan says {expected}")]
    WrongSize {
        /// The layer.
        layer: usize,
        /// Elements per boundary (the plan's s).
        expected: usize,
        /// Elements given.
        found: usize,
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
    /// An option outside its domain.
    #[error("invalid option {name} = {value}: expected {expected}")]
    InvalidOption {
        /// Which option.
        name: &'static str,
        /// The value given.
        value: usize,
        /// Its domain, in words.
        expected: &'static str,
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
