//! # stream-adamw — OffloadStreamAdamW
//!
//! Optimizer offload keeps the fp32 master parameters and Adam moments (12 B/param) in host
//! memory. The usual schedule (ZeRO-Offload, FSDP2 `CPUOffloadPolicy`) is serial: every gradient
//! down, a CPU Adam over everything, every parameter up. This crate runs the same update as a
//! bucket pipeline, D2H of bucket k ‖ CPU AdamW of bucket k−1 ‖ H2D of bucket k−2, from R
//! staging slots per direction, so the step tends to `(a + c + h) / max(a, c, h)` times faster
//! (a, c, h: per-bucket D2H, Adam, H2D times) and the pinned staging is `R·N_b·(b_g + b_p)`
//! bytes instead of `N·(b_g + b_p)`.
//!
//! The update is `torch.optim.AdamW` exactly (decoupled decay, bias corrections in f64,
//! `denom = √v/√(1−β2^t) + ε`, AMSGrad on raw v, maximize), with `clip_grad_norm_` semantics for
//! global-norm clipping (the norm is computed first and applied on load) and a GradScaler-style
//! non-finite check that skips the whole step. Serial and pipelined steps are bitwise equal, and
//! so are runs on any thread count.
//!
//! ```
//! use stream_adamw::{bf16, Budget, Config, Device, HostDevice, Hyperparameters, Link, Plan, StepOptions, StreamAdamW};
//!
//! let n = 10_000;
//! let config = Config::default().bucket_elems(1024).hyperparameters(Hyperparameters::default().lr(1e-2));
//! // Sized before any data exists: 3 slots of 1024 f32 gradients and bf16 parameters.
//! let plan = Plan::new(&config, StreamAdamW::<f32, bf16>::shape(n), Budget::Bytes(32 << 10))?;
//! assert_eq!(plan.workspace_bytes(), 3 * 1024 * (4 + 2));
//!
//! let mut opt = StreamAdamW::<f32, bf16>::new(plan.clone(), Device::Cpu)?; // reserves the staging once
//! let master: Vec<f32> = (0..n).map(|i| (i as f32).sin()).collect();
//! opt.load_master(&master)?;
//! // The CPU fallback's device: gradients and bf16 parameters behind a simulated link.
//! let grads: Vec<f32> = (0..n).map(|i| (i as f32).cos() * 1e-2).collect();
//! let mut device = HostDevice::new(grads, vec![bf16::ZERO; n], Link::Memcpy);
//! let report = opt.step(&mut device, StepOptions::default())?; // the same call on a GPU's buffers
//! assert_eq!(report.step, 1);
//! assert_eq!(device.params[7], bf16::from_f32(opt.state().param()[7]));
//! assert_eq!(opt.plan(), &plan);
//! # Ok::<(), stream_adamw::Error>(())
//! ```
//!
//! Frameworks whose optimizer keeps the state in its own tensors (`torch.optim`, candle) step
//! them with [`step_in_place`]: the same checks, skip, clipping and step counts; one that also
//! offloads some parameters steps everything under one decision with [`step_parts`]. Ranks that
//! each hold part of a model (FSDP's shards, expert-parallel experts, DDP's replicas) take one
//! decision, the same on every rank, with [`step_parts_over`].

pub mod config;
pub mod cpu;
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod cuda;
pub mod element;
#[cfg(feature = "cuda-emu")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda-emu")))]
pub mod emu;
pub mod error;
pub mod group;
pub mod host;
mod host_engines;
pub mod hyperparameters;
pub mod in_place;
pub mod kernels;
pub mod optimizer;
pub mod parts;
mod pipeline;
pub mod plan;
pub mod state;
pub mod step;

pub use config::{BUCKET_ALIGN, Config, OnFailure, StepSchedule};
pub use element::{GradElement, ParamElement};
pub use error::{Error, Result};
pub use flatpeak_common::{Budget, DType, Device, Workspace};
pub use group::{Replicated, agree, step_parts_over};
pub use half::bf16;
pub use host::{HostDevice, Link};
pub use hyperparameters::{GradClip, Hyperparameters, Objective, StepScalars, Variant};
pub use in_place::{GradRef, InPlaceGroup, InPlaceParam, apply_in_place, global_clip, in_place_grad_sq};
pub use optimizer::{StepBuffers, StreamAdamW};
pub use parts::{
    InPlaceGroups, OffloadedStep, OnNonFinite, Statistics, StepPart, apply_parts, statistics, step_in_place,
    step_parts,
};
pub use pipeline::{Fault, Stage};
pub use plan::{Plan, Shape, ideal_speedup, pipelined_time};
pub use state::{OptimizerState, StateDict};
pub use step::{StageTimes, StepDecision, StepOptions, StepOutcome, StepReport};
