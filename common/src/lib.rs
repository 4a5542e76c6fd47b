//! # flatpeak-common
//!
//! The small foundation the four flatpeak primitives (`llep`, `ring-dtp`, `sco`, `stream-adamw`)
//! plug into. Each primitive plans a working set, reserves it once, and runs a schedule whose
//! device memory never grows; this crate provides the pieces those schedules share:
//!
//! | item | what it is |
//! |---|---|
//! | [`Budget`] | the bytes a plan's working set may take: `Plan::new(&Config, Shape, Budget)` in every crate |
//! | [`Workspace`], [`Arena`] | one reservation at launch, carved into typed aligned buffers; past capacity is [`Error::WorkspaceExhausted`] |
//! | [`PeakMeter`], [`CountingAllocator`] | exact transient-heap measurement (high-water − before − outputs) |
//! | [`Device`], [`cuda_available`] | `cpu` / `cuda:N`, probed without cudarc's missing-library panic |
//! | [`Communicator`], [`LocalGroup`] | send/recv, all-to-all-v, all-reduce, barrier; P ranks as threads, failures as errors |
//! | [`comm::agree_records`], [`comm::OverCollectives`] | the typed record every multi-rank call agrees on before data moves; point to point over a framework's collectives |
//! | [`Digest`] | a stable digest of typed fields (options and plans ranks compare) |
//! | [`ExecutorCache`] | executors kept between calls, their reservations bounded and visible |
//! | [`gemm`] | the CPU GEMM (AVX-512 via the `gemm` crate) behind checked strided views |
//! | [`Link`] | the CPU fallback's copy engine: memcpy, optionally paced to a link bandwidth |
//! | [`kernels`], `cuda` (feature) | embedded `.cu` sources, NVRTC compile, per-context kernel cache, device workspace |
//! | `testing` (feature) | tolerance table, `PROPTEST_CASES`-aware config, seeded inputs |
//!
//! ```
//! use flatpeak_common::{CommunicatorExt, LocalGroup, LocalGroupOptions, ReduceOp, Communicator, Workspace};
//!
//! // Four ranks pass a block around a ring and all-reduce a sum; scratch comes from a workspace
//! // reserved once per rank.
//! let sums = LocalGroup::run(4, LocalGroupOptions::default(), |comm| {
//!     let ws = Workspace::new(1 << 12)?;
//!     let (block, incoming) = (ws.take::<f32>(8)?, ws.take::<f32>(8)?);
//!     block.fill(comm.rank() as f32);
//!     comm.ring_shift(block, incoming)?;
//!     assert_eq!(incoming[0], comm.prev_rank() as f32);
//!     let mut total = [incoming[0]];
//!     comm.all_reduce_f32(&mut total, ReduceOp::Sum)?;
//!     Ok(total[0])
//! });
//! assert!(sums.iter().all(|s| *s == Ok(6.0)));
//! ```
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod arena;
pub mod budget;
pub mod cache;
pub mod comm;
pub mod device;
pub mod device_counts;
pub mod digest;
pub mod dtype;
pub mod error;
pub mod gemm;
pub mod gemm_bf16;
mod host_pages;
pub mod kernels;
pub mod link;
pub mod numerics;
pub mod peak;
pub mod precision;
pub mod rng;
mod setters;
pub mod team;
pub mod workspace;

#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod cuda;
#[cfg(feature = "cuda-emu")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda-emu")))]
pub mod emu;
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod nccl;
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod nvrtc;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;

pub use arena::{Arena, Region};
pub use budget::Budget;
pub use cache::{ExecutorCache, Held};
pub use comm::{Communicator, CommunicatorExt, LocalComm, LocalGroup, LocalGroupOptions, ReduceOp};
pub use device::{Device, DeviceElement, cuda_available, cuda_device_count, nvrtc_available};
pub use digest::Digest;
pub use dtype::{DType, DTypeNames};
pub use error::{Error, ErrorKind, HasErrorKind, Refusal, Result};
pub use host_pages::{advise_huge_pages, page_bytes, release_pages, zeroed_vec};
pub use link::Link;
pub use numerics::relative_error;
pub use peak::{CountingAllocator, HeapSize, Measured, PeakMeter};
pub use precision::Precision;
pub use rng::SplitMix64;
pub use workspace::Workspace;
