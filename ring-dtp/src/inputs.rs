//! The tensors one call reads and the results it returns.

use std::marker::PhantomData;

use flatpeak_common::DType;
use half::bf16;
use rayon::prelude::*;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::plan::{Plan, Shape};
pub use crate::selection::{GradientSelection, Want};

/// Elements one task widens from bf16.
const WIDEN_CHUNK: usize = 1 << 16;

/// A row-major matrix in f32 or bf16 (accumulation is f32 either way).
#[derive(Debug, Clone, Copy)]
pub enum Matrix<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// bf16 elements, upcast exactly per block.
    Bf16(&'a [bf16]),
}

impl Matrix<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Matrix::F32(m) => m.len(),
            Matrix::Bf16(m) => m.len(),
        }
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        match self {
            Matrix::F32(_) => DType::F32,
            Matrix::Bf16(_) => DType::Bf16,
        }
    }
    /// Rows `rows` (of width `cols`) as f32 into `out`.
    pub fn rows_f32(&self, rows: std::ops::Range<usize>, cols: usize, out: &mut [f32]) {
        let (a, b) = (rows.start * cols, rows.end * cols);
        match self {
            Matrix::F32(m) => out[..b - a].copy_from_slice(&m[a..b]),
            // bf16 is the top half of an f32: widening is a shift, exact for every value (NaN
            // included), and vectorizes; rows are widened in parallel chunks.
            Matrix::Bf16(m) => out[..b - a]
                .par_chunks_mut(WIDEN_CHUNK)
                .zip(m[a..b].par_chunks(WIDEN_CHUNK))
                .for_each(|(o, x)| {
                    o.iter_mut().zip(x).for_each(|(o, x)| *o = f32::from_bits((x.to_bits() as u32) << 16))
                }),
        }
    }
}

/// One tensor of a call, wherever it lives (host slices; with feature `cuda`, device buffers):
/// how many elements it holds. Sealed.
pub trait Tensor: sealed::Sealed + Copy + std::fmt::Debug {
    /// Elements.
    fn elements(&self) -> usize;
}

/// X or W, wherever they live: a [`Tensor`] of f32 or bf16. Sealed.
pub trait MatrixTensor: Tensor {
    /// The element type.
    fn dtype(&self) -> DType;
}

pub(crate) mod sealed {
    /// This crate's tensors only.
    pub trait Sealed {}
}

impl sealed::Sealed for Matrix<'_> {}
impl sealed::Sealed for &[f32] {}
impl sealed::Sealed for &[i64] {}

impl Tensor for Matrix<'_> {
    fn elements(&self) -> usize {
        self.len()
    }
}

impl MatrixTensor for Matrix<'_> {
    fn dtype(&self) -> DType {
        Matrix::dtype(self)
    }
}

impl Tensor for &[f32] {
    fn elements(&self) -> usize {
        self.len()
    }
}

impl Tensor for &[i64] {
    fn elements(&self) -> usize {
        self.len()
    }
}

/// One call's inputs, wherever they live: X (N×D), W (V×D), optional bias (V), targets (N),
/// optional per-token weights (N). By default host slices (`Inputs<'a>`); with feature `cuda`
/// the same struct holds a device's buffers (`cuda::DeviceInputs`). Over a ring
/// ([`RingLinearCrossEntropy`](crate::RingLinearCrossEntropy)) they are one rank's share: its
/// N = n_r tokens and its vocabulary shard, V = v_r rows of W and the bias (targets stay ids of
/// the whole vocabulary).
#[derive(Debug, Clone, Copy)]
pub struct Inputs<'a, X = Matrix<'a>, F = &'a [f32], T = &'a [i64]> {
    /// Hidden states, N×D row-major.
    pub x: X,
    /// Projection, V×D row-major.
    pub w: X,
    /// Bias, V.
    pub bias: Option<F>,
    /// Target ids, N (see `Config::shift`).
    pub targets: T,
    /// Per-token weights ω, N.
    pub weights: Option<F>,
    /// Tokens N.
    pub n: usize,
    /// Hidden size D.
    pub d: usize,
    /// Vocabulary V.
    pub v: usize,
    /// The lifetime of the memory the tensors borrow (a marker, `PhantomData`: struct-update
    /// syntax, `Inputs { targets, ..inputs }`, keeps it).
    pub borrows: PhantomData<&'a ()>,
}

impl<X: MatrixTensor, F: Tensor, T: Tensor> Inputs<'_, X, F, T> {
    /// Inputs without bias or weights, with hidden size D: N is `targets`' length and V is W's
    /// elements / D. Each memory's constructor ([`Inputs::new`] on the host) is this.
    pub(crate) fn of(x: X, w: X, targets: T, hidden: usize) -> Self {
        let vocab = w.elements().checked_div(hidden).unwrap_or(0);
        let n = targets.elements();
        Self { x, w, bias: None, targets, weights: None, n, d: hidden, v: vocab, borrows: PhantomData }
    }

    /// These inputs with a bias.
    pub fn with_bias(self, bias: F) -> Self {
        Self { bias: Some(bias), ..self }
    }

    /// These inputs with per-token weights.
    pub fn with_weights(self, weights: F) -> Self {
        Self { weights: Some(weights), ..self }
    }

    /// The dtype of X.
    pub fn dtype(&self) -> DType {
        self.x.dtype()
    }

    /// N, D and V with the dtype of X.
    pub fn shape(&self) -> Shape {
        Shape { tokens: self.n, hidden: self.d, vocab: self.v, dtype: self.x.dtype() }
    }

    /// The sizes and dtypes every backend checks.
    pub(crate) fn sizes(&self) -> CallSizes {
        CallSizes {
            dims: (self.n, self.d, self.v),
            x: (self.x.elements(), self.x.dtype()),
            w: (self.w.elements(), self.w.dtype()),
            targets: self.targets.elements(),
            bias: self.bias.as_ref().map(Tensor::elements),
            weights: self.weights.as_ref().map(Tensor::elements),
        }
    }
}

impl<'a> Inputs<'a> {
    /// Host inputs without bias or weights, with hidden size D: N is `targets.len()` and V is
    /// `w.len() / D` (shapes and dtypes are checked against the plan's when a call runs).
    pub fn new(x: Matrix<'a>, w: Matrix<'a>, targets: &'a [i64], hidden: usize) -> Self {
        Self::of(x, w, targets, hidden)
    }

    /// Checks shapes, dtypes and targets against `config`.
    pub fn validate(&self, config: &Config) -> Result<()> {
        config.validate()?;
        config.check_host_precision(self.x.dtype(), "the CPU")?;
        self.sizes().check()?;
        if let Some(w) = self.weights {
            check_weights(w)?;
        }
        self.check_targets(config)
    }

    /// Every target is `ignore_index` or in `0..V`: [`Error::TargetOutOfRange`] names the
    /// first that is not.
    pub(crate) fn check_targets(&self, config: &Config) -> Result<()> {
        check_targets(self.targets, self.v, config.ignore_index)
    }

    /// The target row `i` predicts, or `None` when it is ignored (ignore_index, or past the end
    /// after the shift).
    pub(crate) fn target(&self, config: &Config, i: usize) -> Option<usize> {
        // A shift past the tokens ignores every row: the index is checked, never wrapped.
        let t = *self.targets.get(i.checked_add(config.shift)?)?;
        (t != config.ignore_index).then_some(t as usize)
    }

    /// ω_i (1 without weights; [`validate`](Self::validate) checked their length).
    pub(crate) fn weight(&self, i: usize) -> f32 {
        self.weights.and_then(|w| w.get(i).copied()).unwrap_or(1.0)
    }

    /// Σ of the valid rows' weights: the mean's denominator.
    pub(crate) fn valid_weight(&self, config: &Config) -> f64 {
        (0..self.n).filter(|&i| self.target(config, i).is_some()).map(|i| self.weight(i) as f64).sum()
    }
}

/// Checks targets against a vocabulary of `vocab` rows: each is `ignore_index` or in `0..vocab`;
/// [`Error::TargetOutOfRange`] names the first that is not.
pub fn check_targets(targets: &[i64], vocab: usize, ignore_index: i64) -> Result<()> {
    match targets.iter().position(|&t| t != ignore_index && !(0..vocab as i64).contains(&t)) {
        Some(token) => Err(Error::TargetOutOfRange { token, target: targets[token], vocab }),
        None => Ok(()),
    }
}

/// Checks per-token weights: each finite and ≥ 0, so the mean's denominator Σω is finite and
/// ≥ 0 and the loss and its gradient see the same one.
pub fn check_weights(weights: &[f32]) -> Result<()> {
    match weights.iter().position(|w| !(w.is_finite() && *w >= 0.0)) {
        Some(token) => Err(Error::InvalidWeight { token, weight: weights[token] }),
        None => Ok(()),
    }
}

/// The loss: one number, or one per token.
#[derive(Debug, Clone, PartialEq)]
pub enum Loss {
    /// Mean or sum.
    Scalar(f64),
    /// Per-token losses (0 for ignored tokens).
    PerToken(Vec<f32>),
}

impl flatpeak_common::HeapSize for Loss {
    fn heap_bytes(&self) -> usize {
        match self {
            Loss::Scalar(_) => 0,
            Loss::PerToken(v) => v.heap_bytes(),
        }
    }
}

/// What forward returns.
#[derive(Debug, Clone, PartialEq)]
pub struct Forward {
    /// The loss.
    pub loss: Loss,
    /// Per-row log-sum-exp, every row (ignored rows too): saved for backward, and differentiable
    /// through `backward`'s `dlse`.
    pub lse: Vec<f32>,
}

impl flatpeak_common::HeapSize for Forward {
    fn heap_bytes(&self) -> usize {
        self.loss.heap_bytes() + self.lse.heap_bytes()
    }
}

/// The upstream gradient of the loss.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GradOutput<'a> {
    /// d(loss) for mean and sum.
    Scalar(f32),
    /// d(ℓ_i) per token, for reduction none.
    PerToken(&'a [f32]),
}

/// The sizes and dtypes of one call's tensors, wherever they live (host [`Inputs`] or a device's
/// inputs): the one shape check every backend runs, before any block.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CallSizes {
    /// N, D, V as the call states them.
    pub dims: (usize, usize, usize),
    /// Elements and dtype of X.
    pub x: (usize, DType),
    /// Elements and dtype of W.
    pub w: (usize, DType),
    /// Elements of the targets.
    pub targets: usize,
    /// Elements of the bias, if any.
    pub bias: Option<usize>,
    /// Elements of the per-token weights, if any.
    pub weights: Option<usize>,
}

impl CallSizes {
    /// Every length against the call's N, D and V (X N·D, W V·D, targets and weights N, bias
    /// V), and X and W of one dtype.
    pub(crate) fn check(&self) -> Result<()> {
        let (n, d, v) = self.dims;
        let check = |what, expected: usize, found: usize| {
            if expected == found { Ok(()) } else { Err(Error::ShapeMismatch { what, expected, got: found }) }
        };
        check("x (n·d)", n * d, self.x.0)?;
        check("w (v·d)", v * d, self.w.0)?;
        check("targets (n)", n, self.targets)?;
        if let Some(b) = self.bias {
            check("bias (v)", v, b)?;
        }
        if let Some(w) = self.weights {
            check("weights (n)", n, w)?;
        }
        if self.x.1 != self.w.1 {
            return Err(Error::DtypeMismatch { x: self.x.1, w: self.w.1 });
        }
        Ok(())
    }

    /// [`check`](Self::check), then N, D, V and the dtype against `plan`'s.
    pub(crate) fn check_plan(&self, plan: &Plan) -> Result<()> {
        self.check()?;
        let (n, d, v) = self.dims;
        for (what, expected, found) in
            [("n", plan.n_tokens(), n), ("d", plan.hidden(), d), ("v", plan.vocab(), v)]
        {
            if expected != found {
                return Err(Error::ShapeMismatch { what, expected, got: found });
            }
        }
        if plan.dtype() != self.x.1 {
            return Err(Error::DtypeMismatch { x: self.x.1, w: plan.dtype() });
        }
        Ok(())
    }
}

/// The upstream gradients of the loss's two outputs: of the loss itself and, optionally, of the
/// per-row lse (an `[n]` gradient, when the lse was an output something else used).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Upstream<'a> {
    /// d(loss).
    pub grad: GradOutput<'a>,
    /// d(lse), `[n]`, or none.
    pub dlse: Option<&'a [f32]>,
}

impl<'a> Upstream<'a> {
    /// The loss's gradient only.
    pub fn loss(grad: GradOutput<'a>) -> Self {
        Self { grad, dlse: None }
    }
    /// With an upstream gradient of the lse too.
    pub fn with_dlse(self, dlse: Option<&'a [f32]>) -> Self {
        Self { dlse, ..self }
    }
}

impl<'a> From<GradOutput<'a>> for Upstream<'a> {
    /// The loss's gradient only ([`Upstream::loss`]).
    fn from(grad: GradOutput<'a>) -> Self {
        Self::loss(grad)
    }
}
