//! The gradient buffers a backward writes: the fp32 [`Gradients`] an entry point returns and
//! the caller-owned [`GradientsMut`] (fp32, or bf16 as [`Bf16GradientsMut`]: dX and dW
//! accumulated in f32 and rounded once), with the one check of their lengths every backend
//! makes.

use std::sync::atomic::{AtomicUsize, Ordering};

use half::bf16;

use crate::error::{Error, Result};
use crate::inputs::Inputs;
use crate::narrowing::{DxNarrowing, narrow_releasing};
use crate::selection::{GradientSelection, Want};

/// What backward returns: fp32 gradients.
#[derive(Debug, Clone, PartialEq)]
pub struct Gradients {
    /// dX, N×D.
    pub dx: Vec<f32>,
    /// dW, V×D.
    pub dw: Vec<f32>,
    /// d(bias), V (when there is a bias).
    pub dbias: Option<Vec<f32>>,
}

impl Gradients {
    /// Zeroed gradients for `inputs` (dX N×D, dW V×D, dbias V when there is a bias).
    pub fn zeros(inputs: &Inputs<'_>) -> Self {
        let (n, d, v) = (inputs.n, inputs.d, inputs.v);
        Self { dx: vec![0.0; n * d], dw: vec![0.0; v * d], dbias: inputs.bias.map(|_| vec![0.0; v]) }
    }

    /// Borrowed views of these gradients, to write into.
    pub fn as_mut(&mut self) -> GradientsMut<'_> {
        GradientsMut::new(&mut self.dx, &mut self.dw, self.dbias.as_deref_mut())
    }
}

/// Caller-owned gradient buffers a backward writes into (overwriting them): a binding's own
/// tensors, so no gradient is copied out of the crate. dX and dW are in `T`, f32 (the default)
/// or bf16 ([`Bf16GradientsMut`]); dbias is f32 either way. `wanted` says which are computed; a
/// skipped one's buffer is empty (dX, dW) or `None` (dbias) and is never touched.
#[derive(Debug)]
pub struct GradientsMut<'a, T = f32> {
    /// dX, N×D (empty when skipped).
    pub dx: &'a mut [T],
    /// dW, V×D (empty when skipped).
    pub dw: &'a mut [T],
    /// d(bias), V, f32: present exactly when the inputs have a bias and dbias is computed.
    pub dbias: Option<&'a mut [f32]>,
    /// Which gradients are computed ([`GradientSelection::ALL`] from [`GradientsMut::new`]).
    pub wanted: GradientSelection,
    /// Set only on the f32 accumulators of a backward into bf16 outputs: where dX's finished
    /// rows are narrowed to.
    dx_narrowing: Option<DxNarrowing<'a>>,
}

/// Caller-owned bf16 gradient buffers: dX (N×D) and dW (V×D) in bf16, dbias (V) in f32, what
/// a binding whose parameters are bf16 returns. A backward into them accumulates in f32
/// exactly as into fp32 [`GradientsMut`] and rounds each gradient once, to nearest even, so
/// they hold `bf16(g)` of the f32 gradients `g`, bit for bit.
///
/// Memory beyond the plan's working set and the outputs ([`Plan::bf16_outputs_bytes`]): dW's
/// f32 accumulator, `V·D·4` bytes (every token block adds into all of it), given back
/// [`DW_NARROW_CHUNK`] elements at a time as it is narrowed at the end; and dX's f32 rows,
/// narrowed and given back as each token block finishes, so about one block's `C·D·4` bytes at
/// a time. Against fp32 buffers narrowed afterwards (`(N + V)·D·4` in f32, then the bf16
/// copies beside them), that saves about `N·D·4` during the pass and the narrowed dW's `V·D·2`
/// after it.
///
/// [`DW_NARROW_CHUNK`]: crate::narrowing::DW_NARROW_CHUNK
/// [`Plan::bf16_outputs_bytes`]: crate::Plan::bf16_outputs_bytes
pub type Bf16GradientsMut<'a> = GradientsMut<'a, bf16>;

impl<'a, T> GradientsMut<'a, T> {
    /// Buffers for every gradient (dbias present exactly with a bias).
    pub fn new(dx: &'a mut [T], dw: &'a mut [T], dbias: Option<&'a mut [f32]>) -> Self {
        Self { dx, dw, dbias, wanted: GradientSelection::ALL, dx_narrowing: None }
    }

    /// These buffers computing only the gradients `wanted` selects (the skipped ones' buffers
    /// empty or `None`; [`check`](Self::check) says so otherwise).
    pub fn selecting(self, wanted: GradientSelection) -> Self {
        Self { wanted, ..self }
    }

    /// Checks each buffer's length (and dbias's presence) against `inputs` and the selection.
    pub fn check(&self, inputs: &Inputs<'_>) -> Result<()> {
        check_gradient_lens((inputs.n, inputs.d, inputs.v), inputs.bias.is_some(), self.lens())
    }

    /// The lengths of dX, dW and dbias, with the selection they are checked against.
    pub(crate) fn lens(&self) -> GradientLens {
        GradientLens {
            dx: self.dx.len(),
            dw: self.dw.len(),
            dbias: self.dbias.as_ref().map(|b| b.len()),
            wanted: self.wanted,
        }
    }
}

impl GradientsMut<'_> {
    /// Token rows `t0..t0 + c` of dX are final (a backward finished their token block, in
    /// order): with bf16 outputs they are narrowed into them and their f32 pages given back;
    /// into f32 buffers, nothing is left to do.
    pub(crate) fn token_rows_done(&mut self, t0: usize, c: usize) -> Result<()> {
        let Self { dx, dx_narrowing, .. } = self;
        match dx_narrowing {
            Some(rows) => rows.rows_done(dx, t0, c),
            None => Ok(()),
        }
    }

    /// Sets every element to 0 (a skipped buffer is empty: nothing to set).
    pub(crate) fn fill_zero(&mut self) {
        self.dx.fill(0.0);
        self.dw.fill(0.0);
        self.zero_dbias();
    }

    /// Zeroes dbias (when there is one).
    pub(crate) fn zero_dbias(&mut self) {
        if let Some(b) = self.dbias.as_deref_mut() {
            b.fill(0.0);
        }
    }
}

/// The lengths of a call's gradient buffers (host or device) and the selection they serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GradientLens {
    pub dx: usize,
    pub dw: usize,
    pub dbias: Option<usize>,
    pub wanted: GradientSelection,
}

/// Checks gradient buffers against N, D, V and their selection: a computed dX is N·D long and
/// a skipped one empty, likewise dW (V·D); dbias is V long and present exactly when there is a
/// bias and it is computed (host and device buffers alike).
pub(crate) fn check_gradient_lens(
    (n, d, v): (usize, usize, usize),
    has_bias: bool,
    lens: GradientLens,
) -> Result<()> {
    let GradientLens { dx, dw, dbias, wanted } = lens;
    let check = |what, expected: usize, got: usize| {
        if expected == got { Ok(()) } else { Err(Error::ShapeMismatch { what, expected, got }) }
    };
    match wanted.dx {
        Want::Compute => check("dx (n·d)", n * d, dx)?,
        Want::Skip => check("dx (skipped: empty)", 0, dx)?,
    }
    match wanted.dw {
        Want::Compute => check("dw (v·d)", v * d, dw)?,
        Want::Skip => check("dw (skipped: empty)", 0, dw)?,
    }
    match (dbias, has_bias && wanted.dbias.is_computed()) {
        (Some(b), true) => check("dbias (v)", v, b),
        (None, false) => Ok(()),
        (None, true) => check("dbias (v, present with a bias whose gradient is computed)", v, 0),
        // Even an empty one: a buffer where none belongs is a caller's mistake, never ignored.
        (Some(b), false) => Err(Error::ShapeMismatch {
            what: "dbias (absent: no bias, or its gradient skipped)",
            expected: 0,
            got: b,
        }),
    }
}

impl flatpeak_common::HeapSize for Gradients {
    fn heap_bytes(&self) -> usize {
        self.dx.heap_bytes() + self.dw.heap_bytes() + self.dbias.heap_bytes()
    }
}

/// The gradient buffers a single-device backward writes: fp32 ([`GradientsMut`]) or bf16
/// ([`Bf16GradientsMut`]). Sealed: the crate's backends accumulate in f32 either way.
pub trait GradientBuffers: sealed::Sealed {
    /// Runs `write` on fp32 buffers for a call of N, D, V (with or without a bias): these
    /// buffers, or f32 accumulators narrowed into them as their parts finish.
    #[doc(hidden)]
    fn write_f32<R>(
        self,
        dims: (usize, usize, usize),
        has_bias: bool,
        write: impl FnOnce(GradientsMut<'_>) -> Result<R>,
    ) -> Result<R>;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for super::GradientsMut<'_, f32> {}
    impl Sealed for super::GradientsMut<'_, half::bf16> {}
}

impl GradientBuffers for GradientsMut<'_> {
    fn write_f32<R>(
        self,
        _dims: (usize, usize, usize),
        _has_bias: bool,
        write: impl FnOnce(GradientsMut<'_>) -> Result<R>,
    ) -> Result<R> {
        // The backend checks these buffers' lengths where it checks the call.
        write(self)
    }
}

impl GradientBuffers for Bf16GradientsMut<'_> {
    /// Checks the outputs' lengths, then runs `write` on f32 accumulators allocated untouched
    /// (dX's rows narrowed into `dx` as each token block finishes), then narrows dW into `dw`.
    fn write_f32<R>(
        self,
        (n, d, v): (usize, usize, usize),
        has_bias: bool,
        write: impl FnOnce(GradientsMut<'_>) -> Result<R>,
    ) -> Result<R> {
        check_gradient_lens((n, d, v), has_bias, self.lens())?;
        let Self { dx, dw, dbias, wanted, .. } = self;
        let mut dx_acc: Vec<f32> = flatpeak_common::zeroed_vec(dx.len(), "dX's f32 rows (bf16 outputs)")?;
        let mut dw_acc: Vec<f32> =
            flatpeak_common::zeroed_vec(dw.len(), "dW's f32 accumulator (bf16 outputs)")?;
        let rows_done = AtomicUsize::new(0);
        let narrowing = wanted.dx.is_computed().then(|| DxNarrowing::new(dx, d, &rows_done));
        let f32_buffers =
            GradientsMut { dx: &mut dx_acc, dw: &mut dw_acc, dbias, wanted, dx_narrowing: narrowing };
        let written = write(f32_buffers)?;
        if wanted.dx.is_computed() && rows_done.load(Ordering::Relaxed) != n {
            return Err(Error::internal("a backward into bf16 outputs left dX rows unfinished"));
        }
        drop(dx_acc);
        if wanted.dw.is_computed() {
            narrow_releasing(&mut dw_acc, dw)?;
        }
        Ok(written)
    }
}
