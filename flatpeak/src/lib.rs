//! # flatpeak
//!
//! The four primitives that bound the memory peaks of long-context Mixture-of-Experts training,
//! under one dependency, and what composes them:
//!
//! | item | bounds | with |
//! |---|---|---|
//! | [`llep`] | expert dispatch (the routing matrix) | PipelinedLLEP: least-loaded assignment, a per-pair cap per round |
//! | [`ring_dtp`] | the vocabulary projection (tokens × vocabulary logits) | blocks folded into an online log-sum-exp, on one device or around a ring |
//! | [`sco`] | checkpoint boundaries (depth × sequence) | the boundaries in host memory, a fixed device ring |
//! | [`stream_adamw`] | the offloaded optimizer step | torch's AdamW as a D2H ‖ Adam ‖ H2D bucket pipeline |
//! | `memory_model` (feature `cli`) | — | the per-GPU memory of a training step, baseline against flattened, and the longest context that fits (`flatpeak plan`) |
//! | `run` (feature `cli`) | — | one primitive on tensors from any framework, through safetensors files (`flatpeak run`) |
//!
//! Every primitive has the same shape: a `Config` with a setter per field,
//! `Plan::new(&Config, Shape, Budget)` sizing the working set before any data exists (the plan
//! carries its config), and an executor made as `X::new(plan, device)` that reserves it once
//! and runs within it, one call per operation whatever the device. One error vocabulary runs
//! through them (`InvalidConfig`, `ShapeMismatch`, `BudgetTooSmall`, `WrongDevice`,
//! `Internal`, `Common`). The four, made and run the same way:
//!
//! ```
//! use flatpeak::{Budget, DType, Device, llep, ring_dtp, sco, stream_adamw};
//!
//! let device = Device::Cpu; // Device::Cuda(n) on a GPU (feature `cuda`): the same constructors
//! let wave = |len: usize, s: f32| -> Vec<f32> { (0..len).map(|i| (i as f32 * s).sin() * 0.3).collect() };
//!
//! // ring-dtp: linear + cross-entropy in vocabulary blocks.
//! let shape = ring_dtp::Shape { tokens: 32, hidden: 16, vocab: 200, dtype: DType::F32 };
//! let plan = ring_dtp::Plan::new(&ring_dtp::Config::default(), shape, Budget::Bytes(64 << 10))?;
//! let mut loss = ring_dtp::LinearCrossEntropy::new(plan, device)?;
//! let (x, w, targets) = (wave(32 * 16, 0.7), wave(200 * 16, 0.3), (0..32).collect::<Vec<i64>>());
//! let inputs = ring_dtp::Inputs::new(ring_dtp::Matrix::F32(&x), ring_dtp::Matrix::F32(&w), &targets, 16);
//! let (_, grads) = loss.forward_backward(&inputs, ring_dtp::GradOutput::Scalar(1.0))?;
//! assert_eq!(grads.dw.len(), 200 * 16);
//!
//! // llep: one MoE layer (here one rank of a group of one).
//! let shape = llep::Shape { ranks: 1, tokens: 16, hidden: 8, intermediate: 4, experts: 2, top_k: 1, dtype: DType::F32 };
//! let plan = llep::Plan::new(&llep::Config::default(), shape, Budget::mib(1))?;
//! let (x, gate, up, down) = (wave(16 * 8, 0.5), wave(2 * 8 * 4, 0.2), wave(2 * 8 * 4, 0.9), wave(2 * 4 * 8, 0.4));
//! let (ids, weights) = ((0..16).map(|t| t % 2).collect::<Vec<i64>>(), vec![1.0f32; 16]);
//! let ranks = llep::LocalGroup::run(1, llep::LocalGroupOptions::default(), |comm| {
//!     let inputs = llep::RankInputs {
//!         x: &x,
//!         routing: llep::Routing { ids: &ids, weights: &weights },
//!         experts: llep::ExpertWeights { gate: &gate, up: &up, down: &down },
//!     };
//!     let run = || -> llep::Result<Vec<f32>> {
//!         let mut layer = llep::Executor::new(plan, device)?;
//!         let schedule = layer.schedule(comm, &inputs.routing)?;
//!         layer.forward(comm, &schedule, &inputs) // on a GPU: `cuda::CudaOps` and device inputs
//!     };
//!     Ok(run())
//! });
//! for y in ranks {
//!     assert_eq!(y??.len(), 16 * 8);
//! }
//!
//! // sco: checkpoint boundaries through a fixed device ring.
//! let plan = sco::Plan::new(&sco::Config::default(), sco::Shape::of::<f32>(6, 64), Budget::Unlimited)?;
//! let store = sco::Offloader::<f32>::new(plan, device)?;
//! let layers = (0..6).map(|l| sco::OnHost(sco::layers::AddOne::new(64, l))).collect();
//! let mut stack = sco::CheckpointedStack::with_store(layers, store)?;
//! let input = wave(64, 0.1);
//! let out = stack.step(input.as_slice().into(), |y| Ok(y.host()?.to_vec().into()))?;
//! assert!(out.boundary_high_water_bytes <= plan.workspace_bytes());
//!
//! // stream-adamw: the offloaded optimizer step.
//! let shape = stream_adamw::StreamAdamW::<f32, f32>::shape(256);
//! let plan = stream_adamw::Plan::new(&stream_adamw::Config::default().bucket_elems(64), shape, Budget::Unlimited)?;
//! let mut opt = stream_adamw::StreamAdamW::<f32, f32>::new(plan, device)?;
//! opt.load_master(&wave(256, 0.05))?;
//! let mut buffers = stream_adamw::HostDevice::new(wave(256, 0.6), vec![0.0f32; 256], stream_adamw::Link::Memcpy);
//! assert_eq!(opt.step(&mut buffers, stream_adamw::StepOptions::default())?.step, 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ```
//! use flatpeak::{Budget, DType, ring_dtp, sco};
//!
//! // The vocabulary projection of 8,192 tokens against 32,768 rows within 64 MiB...
//! let shape = ring_dtp::Shape { tokens: 8192, hidden: 1024, vocab: 32768, dtype: DType::Bf16 };
//! let vocab = ring_dtp::Plan::new(&ring_dtp::Config::default(), shape, Budget::mib(64))?;
//! assert!(vocab.workspace_bytes() <= 64 << 20); // materialized: 2 GiB of logits and gradient
//! // ...and 48 checkpoint boundaries of 8,192 × 1,024 bf16 values in a 3-slot device ring.
//! let boundaries = sco::Plan::new(&sco::Config::default(), sco::Shape::of::<u16>(48, 8192 * 1024), Budget::Unlimited)?;
//! assert_eq!(boundaries.workspace_bytes(), 3 * 8192 * 1024 * 2);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The composed training step of a small MoE model, every schedule at once, is the example
//! `moe_train` (`cargo run --release -p flatpeak --example moe_train`).

pub use flatpeak_common as common;
pub use flatpeak_common::{Budget, DType, Device, Workspace};
pub use {llep, ring_dtp, sco, stream_adamw};

#[cfg(feature = "cli")]
#[cfg_attr(docsrs, doc(cfg(feature = "cli")))]
pub mod memory_model;
#[cfg(feature = "cli")]
#[cfg_attr(docsrs, doc(cfg(feature = "cli")))]
pub mod run;

/// The README's Rust quick starts, compiled and run by `cargo test --doc -p flatpeak`.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;

/// CONTRIBUTING.md's worked example, compiled and run the same way.
#[cfg(doctest)]
#[doc = include_str!("../../CONTRIBUTING.md")]
pub struct ContributingDoctests;
