//! What the op's backward hands candle, from either device.

use candle_core::Tensor;

/// dX, dW and dbias in the arguments' dtypes, on their device.
pub(crate) struct Grads {
    /// `[N, D]`.
    pub(crate) dx: Tensor,
    /// `[V, D]`.
    pub(crate) dw: Tensor,
    /// `[V]`, when the op has a bias.
    pub(crate) dbias: Option<Tensor>,
}
