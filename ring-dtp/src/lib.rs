//! # ring-dtp — exact vocabulary projection + cross-entropy with a fixed working set
//!
//! The loss head of a long-context model materializes `tokens × vocabulary` logits: with fp32
//! logits and their gradient, 8 bytes per logit (2 GiB at N = 8,192, V = 32,768). This crate
//! never does: logits exist one block at a time (a token block against a vocabulary block, in a
//! buffer reserved at launch), folded into an online log-sum-exp, and in backward turned into
//! the logit gradient in place and projected straight into dX and dW. Nothing in the working
//! set grows with N but 24 bytes of per-token statistics. The loss and gradients are exact (no
//! gradient filtering): every logit is formed and used.
//!
//! Features: ignore_index, reduction mean/sum/none (with a per-token backward), label
//! smoothing, z-loss and a differentiable lse, logit softcap, bias, per-token weights, shift
//! without a copy, f32 or bf16 inputs with f32 accumulation. See `config.rs` for the math.
//!
//! ```
//! use ring_dtp::{cpu, GradOutput, Inputs, LinearCrossEntropy, Loss, Matrix, Plan};
//! use flatpeak_common::{DType, SplitMix64};
//!
//! let (n, d, v) = (64, 32, 1000);
//! let mut rng = SplitMix64::new(1);
//! let x = rng.normal_f32(n * d, 0.0, 1.0);
//! let w = rng.normal_f32(v * d, 0.0, 0.2);
//! let targets: Vec<i64> = (0..n as i64).map(|i| if i % 5 == 0 { -100 } else { i * 7 % v as i64 }).collect();
//! let config = LinearCrossEntropy::default();
//! // Blocks chosen from a 256 KiB budget: the 1000 × 64 logits never exist at once.
//! let plan = Plan::new(&config, n, d, v, DType::F32, 256 << 10)?;
//! let inputs = Inputs::new(Matrix::F32(&x), Matrix::F32(&w), &targets, n, d, v);
//! let (fwd, grads) = cpu::forward_backward(&config, &plan, &inputs, GradOutput::Scalar(1.0))?;
//! let Loss::Scalar(loss) = fwd.loss else { unreachable!() };
//! assert!(loss > 0.0 && grads.dw.len() == v * d);
//! # Ok::<(), ring_dtp::Error>(())
//! ```

pub mod config;
pub mod cpu;
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod cuda;
#[cfg(feature = "cuda-emu")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda-emu")))]
pub mod emu;
pub mod error;
pub mod inputs;
pub mod kernels;
pub mod plan;
pub mod ring;

pub use config::{LinearCrossEntropy, Reduction, Softcap};
pub use error::{Error, Result};
pub use inputs::{Forward, GradOutput, Gradients, Inputs, Loss, Matrix};
pub use plan::{PaperPeaks, Plan, RingChoice, RingKind, RingOptions, RingPlan, Schedule};
pub use ring::RankInputs;
