//! The one error type of `flatpeak-common`. Every variant carries the offending values.

use std::time::Duration;

/// Result alias used throughout `flatpeak-common`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the shared foundation.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A carve asked for more than the reservation made at launch has left. Workspaces never grow.
    #[error("workspace exhausted: requested {requested} B with {used} B of {capacity} B already carved")]
    WorkspaceExhausted {
        /// Bytes the failing carve needed (element bytes plus alignment padding).
        requested: usize,
        /// Bytes already carved when the request came.
        used: usize,
        /// Total bytes reserved at launch.
        capacity: usize,
    },
    /// The system refused a reservation made at launch (a workspace, a ring, an arena): the
    /// plan asked for more host memory than there is. Nothing was reserved.
    #[error("could not reserve {bytes} B of host memory for {what}")]
    HostAlloc {
        /// What the reservation was for.
        what: &'static str,
        /// Bytes asked for.
        bytes: usize,
    },
    /// A size computation overflowed `usize`.
    #[error("size overflow while computing {what}")]
    SizeOverflow {
        /// Which size was being computed.
        what: &'static str,
    },
    /// Two shapes or lengths that must agree do not.
    #[error("shape mismatch in {what}: expected {expected}, got {got}")]
    ShapeMismatch {
        /// Which quantity disagreed.
        what: &'static str,
        /// The value the operation needed.
        expected: usize,
        /// The value it was given.
        got: usize,
    },
    /// An option outside its domain (NaN is never in one).
    #[error("invalid config: {field} = {value}: expected {reason}")]
    InvalidConfig {
        /// Which option.
        field: &'static str,
        /// The value given, as written by `{:?}`.
        value: String,
        /// Its domain, in words.
        reason: &'static str,
    },
    /// CUDA was requested but cannot be used here; `reason` says why.
    #[error("CUDA unavailable: {reason}")]
    CudaUnavailable {
        /// Why CUDA cannot be used (feature off, library missing, no device, ...).
        reason: String,
    },
    /// A device specification string could not be parsed.
    #[error("invalid device {spec:?}: expected `cpu` or `cuda:N`")]
    InvalidDevice {
        /// The string that was given.
        spec: String,
    },
    /// NVRTC rejected a kernel source; `log` is the compiler's own log.
    #[error("NVRTC failed to compile kernel `{kernel}` for {arch}:\n{log}")]
    KernelCompile {
        /// Name of the kernel source (file stem).
        kernel: String,
        /// Target architecture, e.g. `sm_90`.
        arch: String,
        /// The NVRTC program log.
        log: String,
    },
    /// A CUDA driver, NVRTC or library call failed.
    #[error("CUDA call `{op}` failed: {message}")]
    Cuda {
        /// The operation that failed.
        op: &'static str,
        /// The error as reported by the library.
        message: String,
    },
    /// A rank of a communicator group died or dropped its endpoint while another waited on it.
    #[error("peer rank {rank} was lost (panicked or dropped its communicator)")]
    PeerLost {
        /// The rank that is gone.
        rank: usize,
    },
    /// A peer stayed silent past the group's timeout.
    #[error("rank {rank} timed out after {waited:?} waiting for rank {peer}")]
    Timeout {
        /// The waiting rank.
        rank: usize,
        /// The silent peer.
        peer: usize,
        /// How long it waited.
        waited: Duration,
    },
    /// Two ranks called different collectives (or sizes) in the same slot of their programs.
    #[error("rank {rank} expected `{expected}` from rank {peer} but received `{found}`")]
    CollectiveMismatch {
        /// The receiving rank.
        rank: usize,
        /// The sending rank.
        peer: usize,
        /// The operation the receiver was in.
        expected: &'static str,
        /// The operation the sender was in.
        found: &'static str,
    },
    /// A rank index outside `0..world_size`.
    #[error("rank {rank} out of range for a group of {world_size}")]
    RankOutOfRange {
        /// The offending rank.
        rank: usize,
        /// The group size.
        world_size: usize,
    },
    /// A rank's closure panicked inside a `LocalGroup` run.
    #[error("rank {rank} panicked: {message}")]
    RankPanicked {
        /// The rank that panicked.
        rank: usize,
        /// The panic payload, when it was a string.
        message: String,
    },
    /// An emulated kernel did something a GPU would not allow (feature `cuda-emu`).
    #[error("emulated kernel `{kernel}` faulted: {message}")]
    EmuFault {
        /// The kernel entry point.
        kernel: String,
        /// What the emulator saw, with the block, thread and source location.
        message: String,
    },
    /// An emulated kernel gave different outputs under two thread schedules: it races.
    #[error(
        "emulated kernel `{kernel}` races: forward and reverse thread schedules differ first at output byte {first_difference}"
    )]
    EmuRace {
        /// The kernel entry point.
        kernel: String,
        /// First differing byte of the outputs.
        first_difference: usize,
    },
    /// `PeakMeter` was used in a binary that did not install `CountingAllocator`.
    #[error(
        "PeakMeter needs `#[global_allocator] static A: CountingAllocator = CountingAllocator;` in this binary"
    )]
    MeterNotInstalled,
}

impl Error {
    /// [`Error::InvalidConfig`] for `field = value`, outside the domain `reason`.
    pub fn invalid_config(field: &'static str, value: impl std::fmt::Debug, reason: &'static str) -> Self {
        Self::InvalidConfig { field, value: format!("{value:?}"), reason }
    }
}

/// Declares a crate's own `Error` enum in the workspace's one error vocabulary: the crate's
/// variants, then the four every crate shares, named and worded alike everywhere —
/// `InvalidConfig { field, value, reason }` (an option or dimension outside its domain),
/// `ShapeMismatch { what, expected, got }`, `BudgetTooSmall { budget, needed, what }` and
/// `Common(flatpeak_common::Error)` — with `Error::invalid_config(field, value, reason)`, which
/// writes the offending value with `{:?}`. The enum derives `Debug`, `Clone`, `PartialEq` and
/// `thiserror::Error` (the crate depends on `thiserror`) and is `#[non_exhaustive]`.
///
/// ```
/// flatpeak_common::error_vocabulary! {
///     /// What can go wrong in this crate.
///     pub enum Error {
///         /// A layer index past the end.
///         #[error("layer {layer} out of range")]
///         LayerOutOfRange {
///             /// The layer given.
///             layer: usize,
///         },
///     }
/// }
/// let e = Error::invalid_config("slots", 0usize, "at least 1");
/// assert_eq!(e.to_string(), "invalid config: slots = 0: expected at least 1");
/// assert!(matches!(Error::from(flatpeak_common::Error::MeterNotInstalled), Error::Common(_)));
/// ```
#[macro_export]
macro_rules! error_vocabulary {
    ($(#[$attr:meta])* $vis:vis enum $name:ident { $($variants:tt)* }) => {
        $(#[$attr])*
        #[derive(Debug, Clone, PartialEq, ::thiserror::Error)]
        #[non_exhaustive]
        $vis enum $name {
            $($variants)*
            /// An option or dimension outside its domain (NaN is never in one).
            #[error("invalid config: {field} = {value}: expected {reason}")]
            InvalidConfig {
                /// Which option or dimension.
                field: &'static str,
                /// The value given, as `{:?}` writes it.
                value: ::std::string::String,
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
            /// The budget cannot hold the working set the config and shape imply.
            #[error("budget of {budget} B is below the {needed} B of {what}")]
            BudgetTooSmall {
                /// The budget given.
                budget: usize,
                /// What the plan needs.
                needed: usize,
                /// Which buffers those are.
                what: &'static str,
            },
            /// An error from the shared foundation (workspace, communicator, CUDA).
            #[error(transparent)]
            Common(#[from] $crate::Error),
        }

        impl $name {
            /// [`Self::InvalidConfig`] for `field = value` outside the domain `reason`.
            pub fn invalid_config(field: &'static str, value: impl ::std::fmt::Debug, reason: &'static str) -> Self {
                Self::InvalidConfig { field, value: format!("{value:?}"), reason }
            }
        }
    };
}
