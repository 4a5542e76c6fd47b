//! Which gradients a backward computes ([`GradientSelection`]): a leaf of the crate (the
//! buffers that carry a selection, [`GradientsMut`](crate::GradientsMut), and the error that
//! refuses one both name it).

/// Whether a backward computes one gradient.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Want {
    /// Computed into its buffer, which has the gradient's full length.
    #[default]
    Compute,
    /// Not computed: its buffer is empty (dX, dW) or absent (dbias), and the work that forms it
    /// (dX's GEMM `dX += G·W_blk`, dW's `dW_blk += Gᵀ·X_blk`, dbias's row sums) is not done.
    Skip,
}

impl Want {
    /// True for [`Want::Compute`].
    pub fn is_computed(self) -> bool {
        self == Want::Compute
    }
}

/// Which gradients a backward computes: by default all of them. A frozen weight (or input, or
/// bias) skips its gradient and the GEMM behind it: G is formed in full either way (both
/// gradients read it), then `dX = G·W` is skipped for a skipped dX and `dW = Gᵀ·X` for a
/// skipped dW, so a backward with one of the two costs 2 GEMMs per block instead of 3.
///
/// The selection travels with the buffers ([`GradientsMut::wanted`]) and is checked against
/// them: a computed gradient's buffer has its full length, a skipped one's is empty (dX, dW) or
/// `None` (dbias), so a buffer of the wrong length is a [`ShapeMismatch`] whatever N is.
///
/// [`GradientsMut::wanted`]: crate::GradientsMut::wanted
/// [`ShapeMismatch`]: crate::Error::ShapeMismatch
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct GradientSelection {
    /// dX, N×D.
    pub dx: Want,
    /// dW, V×D.
    pub dw: Want,
    /// dbias, V (without a bias there is none to compute, whatever this says).
    pub dbias: Want,
}

impl GradientSelection {
    /// Every gradient computed (the default).
    pub const ALL: Self = Self { dx: Want::Compute, dw: Want::Compute, dbias: Want::Compute };

    /// This selection with dX's choice.
    pub fn dx(self, dx: Want) -> Self {
        Self { dx, ..self }
    }
    /// This selection with dW's choice.
    pub fn dw(self, dw: Want) -> Self {
        Self { dw, ..self }
    }
    /// This selection with dbias's choice.
    pub fn dbias(self, dbias: Want) -> Self {
        Self { dbias, ..self }
    }
    /// Whether every gradient there is is computed (dbias counts only with a bias).
    pub fn is_all(self, has_bias: bool) -> bool {
        self.dx.is_computed() && self.dw.is_computed() && (!has_bias || self.dbias.is_computed())
    }
}
