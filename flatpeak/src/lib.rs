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
//! | [`memory_model`] | — | the per-GPU memory of a training step, baseline against flattened, and the longest context that fits (`flatpeak plan`) |
//! | [`run`] | — | one primitive on tensors from any framework, through safetensors files (`flatpeak run`) |
//!
//! Every primitive has the same shape: a `Config` with a setter per field,
//! `Plan::new(&Config, Shape, Budget)` sizing the working set before any data exists, and an
//! executor that runs within it. One error vocabulary runs through them
//! (`InvalidConfig`, `ShapeMismatch`, `BudgetTooSmall`, `Common`).
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

pub mod memory_model;
pub mod run;

/// The README's Rust quick starts, compiled and run by `cargo test --doc -p flatpeak`.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
pub struct ReadmeDoctests;

/// CONTRIBUTING.md's worked example, compiled and run the same way.
#[cfg(doctest)]
#[doc = include_str!("../../CONTRIBUTING.md")]
pub struct ContributingDoctests;
