//! # flatpeak-candle — flatpeak for candle
//!
//! Two adapters that let a candle model use flatpeak's primitives as its own ops:
//! - [`linear_cross_entropy`]: ring-dtp's fused vocabulary projection + cross-entropy as a
//!   candle custom op with its backward. `cross_entropy(x.matmul(&w.t()))` materializes
//!   `N × V` logits and their gradient (8 bytes per logit in f32); this op's transient memory
//!   is ring-dtp's plan working set (≤ the budget: by default ring-dtp's for the device, `LossBudget::Default`) plus per-token state, and
//!   its loss and gradients are exact (every logit is formed, one block at a time).
//! - [`StreamAdamW`]: a `candle_nn::Optimizer` running stream-adamw's AdamW (torch's update
//!   order) on CPU f32 Vars, skipping the step on a non-finite gradient.
//!
//! flatpeak's errors reach candle as `candle_core::Error` with their message kept.
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! use candle_nn::Optimizer;
//! use flatpeak_candle::{Hyperparameters, LossOptions, StreamAdamW, linear_cross_entropy};
//!
//! let (vocab, hidden, dev) = (1000, 64, Device::Cpu);
//! let embedding = Var::randn(0f32, 1.0, (vocab, hidden), &dev)?;
//! let head = Var::randn(0f32, 0.1, (vocab, hidden), &dev)?; // the vocabulary projection [V, D]
//! let mut opt = StreamAdamW::new(vec![embedding.clone(), head.clone()], Hyperparameters::default().lr(3e-2))?;
//! let tokens = Tensor::arange(0u32, 129, &dev)?;
//! # let mut losses = Vec::new();
//! for _ in 0..20 {
//!     let hidden_states = embedding.as_tensor().embedding(&tokens.narrow(0, 0, 128)?)?; // [128, D]: no [128, V] logits below
//!     let loss = linear_cross_entropy(&hidden_states, head.as_tensor(), &tokens.narrow(0, 1, 128)?, &LossOptions::default())?;
//!     opt.backward_step(&loss)?;
//! #   losses.push(loss.to_scalar::<f32>()?);
//! }
//! # assert!(losses[19] < 0.5 * losses[0], "{losses:?}");
//! # Ok::<(), candle_core::Error>(())
//! ```
//!
//! The README's candle example is this one (its visible lines; a unit test keeps them equal).
#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
mod cuda;
pub mod error;
mod grads;
mod host;
pub mod loss;
mod op;
pub mod optim;

pub use error::{Error, Result};
pub use loss::{Extras, LossOptions, linear_cross_entropy, linear_cross_entropy_with};
pub use optim::{StepReport, StreamAdamW};
pub use ring_dtp::{LossBudget, Reduction, Softcap};
pub use stream_adamw::{GradClip, Hyperparameters, Objective, StepOutcome, Variant};

#[cfg(test)]
mod readme {
    /// The visible lines of the first example in `source`'s `//!` docs.
    fn doc_example(source: &str) -> Vec<&str> {
        let docs: Vec<&str> = source
            .lines()
            .filter_map(|l| l.strip_prefix("//!"))
            .map(|l| l.strip_prefix(' ').unwrap_or(l))
            .collect();
        let start = docs.iter().position(|l| *l == "```").expect("lib.rs has a doc example") + 1;
        let len = docs[start..].iter().position(|l| *l == "```").expect("the example ends");
        docs[start..start + len].iter().copied().filter(|l| !(l.starts_with("# ") || *l == "#")).collect()
    }

    /// The rust block after the README's marker for this example.
    fn readme_example(readme: &str) -> Vec<&str> {
        let marker = "<!-- the doc example of integrations/candle/src/lib.rs, compiled and run by cargo test --doc -->";
        let after = readme.split(marker).nth(1).expect("the README has the candle example's marker");
        // `ignore` in the README (whose rust blocks are the facade's doctests, without candle):
        // compiled and run here, as this crate's doc example.
        let block = after.split("```rust,ignore\n").nth(1).expect("a rust block follows the marker");
        block.split("\n```").next().unwrap_or_default().lines().collect()
    }

    #[test]
    fn the_readme_shows_the_doc_example() {
        let doc = doc_example(include_str!("lib.rs"));
        let readme = readme_example(include_str!("../../../README.md"));
        assert_eq!(readme, doc, "the README's candle example differs from lib.rs's doc example");
    }
}
