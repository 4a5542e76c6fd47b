//! # sco — selective checkpoint offload
//!
//! With activation checkpointing each layer's input (its boundary, `s = S·H·b` bytes) lives from
//! forward to backward, so a stack of L layers holds `L·s` on the device and the peak grows with
//! depth × sequence. SCO keeps exactly those tensors in a host arena of `L·s` bytes (allocated
//! once) and a fixed device ring of `k_keep + max(m, d + 1)` slots (3 by default): the newest
//! boundary stays resident, forward copies run on their own D2H engine, and backward prefetches
//! boundary i−d on an H2D engine while layer i recomputes. Device memory for boundaries:
//! `3·s` whatever L. The schedule changes only where tensors live, so gradients are bitwise
//! those of plain checkpointing (and of no checkpointing, for layers whose recompute is
//! deterministic).
//!
//! ```
//! use sco::layers::ResidualMlp;
//! use sco::{Budget, CheckpointStore, CheckpointedStack, Config, Device, OnHost, Offloader, Plan, Shape};
//!
//! let (tokens, hidden, layers) = (16, 8, 12);
//! let config = Config::default(); // k_keep = 1, m = 2, d = 1: 3 slots
//! // Sized before any data exists: the device ring is 3 boundaries whatever the depth.
//! let plan = Plan::new(&config, Shape::of::<f32>(layers, tokens * hidden), Budget::Bytes(4 << 10))?;
//! assert_eq!(plan.workspace_bytes(), 3 * tokens * hidden * 4);
//!
//! // The executor, chosen by one `Device`: host buffers and copy threads on `Device::Cpu`; a
//! // device ring, a pinned arena and copy streams on `Device::Cuda(n)` (feature `cuda`; without
//! // it, an error that says so). One type either way: it lends its device's tensors.
//! let offloader = Offloader::<f32>::new(plan, Device::Cpu)?;
//! // The stack drives any `CheckpointStore`, with layers that compute on its tensors (host
//! // layers through `OnHost`).
//! let stack_layers: Vec<_> =
//!     (0..layers).map(|l| OnHost(ResidualMlp::new(tokens, hidden, 16, l as u64))).collect();
//! let mut stack = CheckpointedStack::with_store(stack_layers, offloader)?;
//! let input: Vec<f32> = (0..tokens * hidden).map(|i| (i as f32 * 0.1).sin()).collect();
//! // dL/dy = 2·y, computed where y is (here, host memory).
//! let out = stack.step(input.as_slice().into(), |y| Ok(y.host()?.iter().map(|v| 2.0 * v).collect::<Vec<_>>().into()))?;
//! // 12 boundaries of 512 B, never more than the plan's 3 on the "device".
//! assert!(out.boundary_high_water_bytes <= plan.workspace_bytes());
//! assert_eq!(stack.store().map(|s| s.high_water_bytes()), Some(out.boundary_high_water_bytes));
//! assert_eq!(out.param_grads.len(), 12);
//! # Ok::<(), sco::Error>(())
//! ```

#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod cuda;
pub mod device_tensors;
pub mod error;
pub mod executor;
#[cfg(feature = "layers")]
#[cfg_attr(docsrs, doc(cfg(feature = "layers")))]
pub mod layers;
pub mod offloader;
pub mod plan;
pub mod ring;
pub mod stack;
pub mod store;

#[cfg(feature = "cuda")]
pub use device_tensors::OnCuda;
pub use device_tensors::{BoundaryElement, DeviceMut, DeviceRef, DeviceTensor, DeviceTensors, OnHost};
pub use error::{Error, Result};
pub use executor::Offloader;
pub use flatpeak_common::Link;
pub use flatpeak_common::{Budget, DType, Device, Workspace};
pub use offloader::{CheckpointOffloader, SlotReader, SlotWriter};
pub use plan::{Config, MAX_RING_OPTION, Plan, Shape, hide_ratio};
pub use ring::SlotRing;
pub use stack::{CheckpointedStack, Checkpointing, Layer, StepOutput};
pub use store::{CheckpointStore, Host, Tensors};
