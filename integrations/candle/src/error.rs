//! This crate's errors, and their conversion into candle's.

use candle_core::DType;

/// Why a flatpeak call on candle tensors failed. Every variant names the offending values; it
/// reaches candle callers as a [`candle_core::Error`] whose message is this one's.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A tensor has a dtype this call does not take.
    #[error("{what}: expected {expected}, got {got:?}")]
    DType {
        /// Which tensor.
        what: &'static str,
        /// The dtypes accepted.
        expected: &'static str,
        /// The tensor's dtype.
        got: DType,
    },
    /// A tensor has the wrong shape.
    #[error("{what}: expected shape {expected}, got {got:?}")]
    Shape {
        /// Which tensor.
        what: &'static str,
        /// The shape expected, in words (`[N, D]` with the sizes filled in).
        expected: String,
        /// The tensor's dims.
        got: Vec<usize>,
    },
    /// A tensor is on another device than the inputs, or on a device this build cannot run.
    #[error("{what}: on {got}, expected {expected}")]
    Device {
        /// Which tensor.
        what: &'static str,
        /// The device expected.
        expected: String,
        /// The tensor's device.
        got: String,
    },
    /// A CUDA tensor reached a build without the `cuda` feature.
    #[error(
        "{what}: a CUDA tensor, but flatpeak-candle was built without its `cuda` feature \
         (build with `--features cuda`)"
    )]
    CudaNotBuilt {
        /// Which tensor.
        what: &'static str,
    },
    /// The op's backward ran without the log-sum-exp its forward saves (the forward failed, or
    /// the op was constructed by hand).
    #[error("backward of {op} without its forward's saved log-sum-exp")]
    MissingForward {
        /// The op's name.
        op: &'static str,
    },
    /// A Var handed to the optimizer has a dtype or device it does not update.
    #[error("var {index}: {reason}")]
    Var {
        /// The Var's position in the optimizer.
        index: usize,
        /// What is wrong with it.
        reason: String,
    },
    /// A CUDA call failed (allocation, copy).
    #[error("CUDA {op}: {message}")]
    Cuda {
        /// What was being done.
        op: &'static str,
        /// The driver's error.
        message: String,
    },
    /// ring-dtp refused the call (its message names the values).
    #[error(transparent)]
    RingDtp(#[from] ring_dtp::Error),
    /// stream-adamw refused the call (its message names the values).
    #[error(transparent)]
    StreamAdamW(#[from] stream_adamw::Error),
    /// candle failed underneath (reading a tensor, building an output).
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// A result with this crate's [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

impl From<Error> for candle_core::Error {
    /// candle's own errors pass through unchanged; flatpeak's are wrapped, their message kept.
    fn from(e: Error) -> Self {
        match e {
            Error::Candle(inner) => inner,
            other => candle_core::Error::wrap(other),
        }
    }
}
