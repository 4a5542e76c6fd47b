//! # ring-dtp — exact vocabulary projection + cross-entropy with a fixed working set
//!
//! The loss head of a long-context model materializes `tokens × vocabulary` logits: with fp32
//! logits and their gradient, 8 bytes per logit (2 GiB at N = 8,192, V = 32,768). This crate
//! never does: logits exist one block at a time (a token block against a vocabulary block, in a
//! buffer reserved at launch), folded into an online log-sum-exp, and in backward turned into
//! the logit gradient in place and projected straight into dX and dW. Nothing in the working
//! set grows with N but 28 bytes of per-token statistics (`PER_TOKEN_BYTES`). The loss and gradients are exact (no
//! gradient filtering): every logit is formed and used.
//!
//! Features: ignore_index, reduction mean/sum/none (with a per-token backward), label
//! smoothing, z-loss and a differentiable lse, logit softcap, bias, per-token weights, shift
//! without a copy, f32 or bf16 inputs with f32 accumulation, fp32 or bf16 gradient outputs
//! ([`Bf16GradientsMut`]: rounded once, without an fp32 copy of both beside them). See
//! `config.rs` for the math.
//!
//! [`LinearCrossEntropy`] runs one device's schedule (CPU, or CUDA with the `cuda` feature);
//! [`ring`] runs it over P ranks; [`cpu`] also exposes the CPU path as free functions and its
//! f64 reference.
//!
//! ```
//! use ring_dtp::{Budget, Config, DType, Device, GradOutput, Inputs, LinearCrossEntropy, Loss, Matrix, Plan, Shape};
//!
//! let shape = Shape { tokens: 64, hidden: 32, vocab: 1000, dtype: DType::F32 };
//! let config = Config::default().label_smoothing(0.1);
//! // Sized before any data exists: blocks chosen within 256 KiB, so the 64 × 1000 logits
//! // never exist at once.
//! let plan = Plan::new(&config, shape, Budget::Bytes(256 << 10))?;
//! assert!(plan.workspace_bytes() <= 256 << 10);
//!
//! let (n, d, v) = (shape.tokens, shape.hidden, shape.vocab);
//! let x: Vec<f32> = (0..n * d).map(|i| (i as f32 * 0.37).sin()).collect();
//! let w: Vec<f32> = (0..v * d).map(|i| (i as f32 * 0.11).cos() * 0.2).collect();
//! let targets: Vec<i64> = (0..n as i64).map(|i| if i % 5 == 0 { -100 } else { i * 7 % v as i64 }).collect();
//! let inputs = Inputs::new(Matrix::F32(&x), Matrix::F32(&w), &targets, d);
//! // The executor reserves the plan's working set once, on the device it is given.
//! let mut lce = LinearCrossEntropy::new(plan, Device::Cpu)?;
//! let (fwd, grads) = lce.forward_backward(&inputs, GradOutput::Scalar(1.0))?;
//! let Loss::Scalar(loss) = fwd.loss else { unreachable!() };
//! assert!(loss > 0.0 && grads.dw.len() == v * d);
//! # Ok::<(), ring_dtp::Error>(())
//! ```

mod blocks;
pub mod budget;
pub mod config;
pub mod count;
pub mod cpu;
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod cuda;
mod driver;
#[cfg(feature = "cuda-emu")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda-emu")))]
pub mod emu;
pub mod error;
mod executor;
pub mod gradients;
pub mod inputs;
pub mod kernels;
mod loss;
pub mod narrowing;
pub mod paper;
pub mod plan;
pub mod ring;
mod selection;

pub use budget::{DEFAULT_CPU_BUDGET_BYTES, DEFAULT_CUDA_BUDGET_BYTES, LossBudget};
pub use config::{Config, Reduction, Softcap};
pub use error::{Error, Result};
pub use executor::{LinearCrossEntropy, LossInputs};
pub use flatpeak_common::gemm_bf16::Bf16Kernel;
pub use flatpeak_common::{Budget, DType, Device, Precision, Workspace};
pub use gradients::{Bf16GradientsMut, GradientBuffers, Gradients, GradientsMut};
pub use half::bf16;
pub use inputs::{
    Forward, GradOutput, GradientSelection, Inputs, Loss, Matrix, MatrixTensor, Tensor, Upstream, Want,
    check_targets, check_weights,
};
pub use plan::{
    BlockRegions, BlockSchedule, Plan, RingChoice, RingKind, RingOptions, RingPlan, Shape, Target,
};
pub use ring::{RingLinearCrossEntropy, RingRank};
