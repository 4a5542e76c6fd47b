//! The one error type of `flatpeak-common`. Every variant carries the offending values.
//!
//! Three of its variants are also declared by every crate's error ([`error_vocabulary!`](crate::error_vocabulary)):
//! `InvalidConfig`, `ShapeMismatch` and `Internal`. They are worded alike in both places, and a
//! crate's `From<flatpeak_common::Error>` lifts them into the crate's own variant, so one mistake
//! arrives as one variant whichever layer found it. [`ErrorKind`] sorts every variant into the
//! four kinds a binding raises (Python's `TypeError`, `ValueError`, `MemoryError`,
//! `RuntimeError`).

use std::time::Duration;

/// What kind of failure an error is, for a binding to raise the matching exception: the kind
/// is decided here, by the crate that knows the variant, never by the binding.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// A tensor of the wrong dtype or on the wrong device (Python's `TypeError`).
    Type,
    /// An option, shape or value outside its domain (`ValueError`).
    Value,
    /// An allocation the system refused (`MemoryError`).
    Memory,
    /// Something that failed while running: a lost peer, a timeout, a CUDA call, a bug in
    /// flatpeak (`RuntimeError`).
    Runtime,
}

/// Result alias used throughout `flatpeak-common`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Why a rank has no inputs to bring to a multi-rank call: its caller's own check of its
/// arguments failed (a binding's tensor of the wrong dtype, a name it does not know). The rank
/// still enters the call with it, so the whole group refuses together; on this rank it is
/// [`Error::Refused`] with the same kind and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The kind of the failure (the exception a binding raises on every rank).
    pub kind: ErrorKind,
    /// What was refused, naming the offending values.
    pub message: String,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl From<Refusal> for Error {
    fn from(r: Refusal) -> Self {
        Error::Refused { kind: r.kind, message: r.message }
    }
}

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
    /// The device refused an allocation (CUDA's out-of-memory): nothing of it was allocated.
    #[error("could not allocate {bytes} B of device memory for {what}")]
    DeviceAlloc {
        /// What the allocation was for.
        what: &'static str,
        /// Bytes asked for.
        bytes: usize,
    },
    /// The OS refused page-locked (pinned) host memory.
    #[error(
        "could not pin {bytes} B of host memory for {what} ({reason}); check the memlock limit (`ulimit -l`)"
    )]
    PinnedAlloc {
        /// What the staging was for.
        what: &'static str,
        /// Bytes of the failed allocation.
        bytes: usize,
        /// The driver's error.
        reason: String,
    },
    /// An internal invariant of flatpeak broke: a bug in flatpeak, never the caller's mistake.
    #[error("internal error (a bug in flatpeak; please report it): {invariant}")]
    Internal {
        /// The invariant that failed, in words.
        invariant: &'static str,
    },
    /// A size computation overflowed `usize`.
    #[error("size overflow while computing {what}")]
    SizeOverflow {
        /// Which size was being computed.
        what: &'static str,
    },
    /// Two shapes or lengths that must agree do not.
    #[error("shape mismatch for {what}: expected {expected}, got {got}")]
    ShapeMismatch {
        /// Which buffer or dimension.
        what: &'static str,
        /// What the plan or the other inputs call for.
        expected: usize,
        /// What was given.
        got: usize,
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
    /// Another rank of the group refused its own input. Every rank checks its input and the group
    /// agrees on the verdicts before any data moves ([`agree_on_inputs`](crate::comm::agree_on_inputs)),
    /// so a bad input on one rank is an error on every rank, never a wait: this is what the
    /// other ranks return, with the refusing rank's error as it reported it.
    #[error("rank {rank} of the group refused its input: {message}")]
    PeerInput {
        /// The lowest rank that refused.
        rank: usize,
        /// The kind of its error (a binding raises the same exception on every rank).
        kind: ErrorKind,
        /// Its error's message.
        message: String,
    },
    /// This rank's input was refused before any of the call's data moved: by its caller's own
    /// checks (a binding's [`Refusal`]: a tensor of the wrong dtype, say),
    /// or because it differs from what the other ranks brought
    /// ([`agree_records`](crate::comm::agree_records)). Every other rank of the group returns
    /// [`Error::PeerInput`] with the same kind and message.
    #[error("{message}")]
    Refused {
        /// The kind of the refusal (a binding raises the same exception on every rank).
        kind: ErrorKind,
        /// What was refused, naming the offending values.
        message: String,
    },
    /// A collective of the caller's own communication library failed (for example a
    /// `torch.distributed` group's timeout after a peer died): the library's message.
    #[error("{op} failed: {message}")]
    Collective {
        /// The collective.
        op: &'static str,
        /// The library's message.
        message: String,
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

    /// The kind of failure, for a binding's exception.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::ShapeMismatch { .. }
            | Self::InvalidConfig { .. }
            | Self::SizeOverflow { .. }
            | Self::InvalidDevice { .. }
            | Self::RankOutOfRange { .. } => ErrorKind::Value,
            Self::WorkspaceExhausted { .. }
            | Self::HostAlloc { .. }
            | Self::DeviceAlloc { .. }
            | Self::PinnedAlloc { .. } => ErrorKind::Memory,
            Self::CudaUnavailable { .. }
            | Self::KernelCompile { .. }
            | Self::Cuda { .. }
            | Self::PeerLost { .. }
            | Self::Timeout { .. }
            | Self::CollectiveMismatch { .. }
            | Self::RankPanicked { .. }
            | Self::EmuFault { .. }
            | Self::EmuRace { .. }
            | Self::MeterNotInstalled
            | Self::Collective { .. }
            | Self::Internal { .. } => ErrorKind::Runtime,
            Self::PeerInput { kind, .. } | Self::Refused { kind, .. } => *kind,
        }
    }
}

/// An error that knows its [`ErrorKind`]: common's and every crate's ([`error_vocabulary!`](crate::error_vocabulary)).
pub trait HasErrorKind {
    /// The kind of failure, for a binding's exception.
    fn error_kind(&self) -> ErrorKind;
}

impl HasErrorKind for Error {
    fn error_kind(&self) -> ErrorKind {
        self.kind()
    }
}

/// Declares a crate's own `Error` enum in the workspace's one error vocabulary: the crate's
/// variants, then the five every crate shares, named and worded alike everywhere —
/// `InvalidConfig { field, value, reason }` (an option or dimension outside its domain),
/// `ShapeMismatch { what, expected, got }`, `BudgetTooSmall { budget, needed, what }`,
/// `WrongDevice { executor, inputs }` (buffers on one device handed to an executor on another),
/// `Internal { invariant }` (a bug in flatpeak, never the caller's mistake) and
/// `Common(flatpeak_common::Error)` — with `Error::invalid_config(field, value, reason)`, which
/// writes the offending value with `{:?}`, `Error::internal(invariant)`, and `Error::kind()`,
/// which sorts every variant into an [`ErrorKind`]: the shared ones here, the crate's own as its
/// `kinds { Kind: Variant, …; }` list after the enum says (the match is exhaustive: a variant
/// left out of the list does not compile).
/// `From<flatpeak_common::Error>` lifts common's `InvalidConfig`, `ShapeMismatch` and `Internal`
/// into the crate's own variants, so one mistake is one variant. The enum derives `Debug`,
/// `Clone`, `PartialEq` and `thiserror::Error` (the crate depends on `thiserror`) and is
/// `#[non_exhaustive]`.
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
///     kinds {
///         Value: LayerOutOfRange;
///     }
/// }
/// let e = Error::invalid_config("slots", 0usize, "at least 1");
/// assert_eq!(e.to_string(), "invalid config: slots = 0: expected at least 1");
/// assert!(matches!(Error::from(flatpeak_common::Error::MeterNotInstalled), Error::Common(_)));
/// // Common's shape mismatch is the crate's own variant, worded the same.
/// let common = flatpeak_common::Error::ShapeMismatch { what: "x", expected: 2, got: 3 };
/// let lifted = Error::from(common.clone());
/// assert!(matches!(lifted, Error::ShapeMismatch { what: "x", expected: 2, got: 3 }));
/// assert_eq!(lifted.to_string(), common.to_string());
/// assert_eq!(Error::LayerOutOfRange { layer: 9 }.kind(), flatpeak_common::ErrorKind::Value);
/// assert_eq!(Error::internal("a pass ran twice").kind(), flatpeak_common::ErrorKind::Runtime);
/// ```
#[macro_export]
macro_rules! error_vocabulary {
    (
        $(#[$attr:meta])* $vis:vis enum $name:ident { $($variants:tt)* }
        kinds { $($kind:ident: $($variant:ident),+;)+ }
    ) => {
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
            /// Tensors on one device handed to an executor on another (nothing is copied silently).
            #[error("executor on {executor} was handed tensors on {inputs}")]
            WrongDevice {
                /// The executor's device.
                executor: $crate::Device,
                /// Where the tensors are.
                inputs: $crate::Device,
            },
            /// An internal invariant broke: a bug in flatpeak, never the caller's mistake.
            #[error("internal error (a bug in flatpeak; please report it): {invariant}")]
            Internal {
                /// The invariant that failed, in words.
                invariant: &'static str,
            },
            /// An error from the shared foundation (workspace, communicator, CUDA).
            #[error(transparent)]
            Common($crate::Error),
        }

        impl $name {
            /// [`Self::InvalidConfig`] for `field = value` outside the domain `reason`.
            pub fn invalid_config(field: &'static str, value: impl ::std::fmt::Debug, reason: &'static str) -> Self {
                Self::InvalidConfig { field, value: format!("{value:?}"), reason }
            }

            /// [`Self::Internal`]: `invariant` broke (a bug in flatpeak).
            pub fn internal(invariant: &'static str) -> Self {
                Self::Internal { invariant }
            }

            /// The kind of failure, for a binding's exception.
            pub fn kind(&self) -> $crate::ErrorKind {
                match self {
                    Self::InvalidConfig { .. } | Self::ShapeMismatch { .. } | Self::BudgetTooSmall { .. } => {
                        $crate::ErrorKind::Value
                    }
                    Self::WrongDevice { .. } => $crate::ErrorKind::Type,
                    Self::Internal { .. } => $crate::ErrorKind::Runtime,
                    Self::Common(e) => e.kind(),
                    $($(Self::$variant { .. })|+ => $crate::ErrorKind::$kind,)+
                }
            }
        }

        impl $crate::HasErrorKind for $name {
            fn error_kind(&self) -> $crate::ErrorKind {
                self.kind()
            }
        }

        /// A binding's refusal of this rank's input ([`Refused`](flatpeak_common::Error::Refused)
        /// on this rank).
        impl ::std::convert::From<$crate::error::Refusal> for $name {
            fn from(r: $crate::error::Refusal) -> Self {
                Self::Common(r.into())
            }
        }

        impl ::std::convert::From<$crate::Error> for $name {
            fn from(e: $crate::Error) -> Self {
                match e {
                    $crate::Error::InvalidConfig { field, value, reason } => Self::InvalidConfig { field, value, reason },
                    $crate::Error::ShapeMismatch { what, expected, got } => Self::ShapeMismatch { what, expected, got },
                    $crate::Error::Internal { invariant } => Self::Internal { invariant },
                    other => Self::Common(other),
                }
            }
        }
    };
}
