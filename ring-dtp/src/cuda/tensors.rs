//! The device tensors of a call: the inputs ([`DeviceInputs`], [`DeviceMatrix`]), the gradient
//! buffers a backward writes ([`DeviceGradientsMut`], [`DeviceGradients`]) and the plan's block
//! buffers ([`BlockBuffers`]), with the checks and fills the executor makes of them.

#[cfg(doc)]
use flatpeak_common::Precision;
use flatpeak_common::cuda::cuda_error;
use flatpeak_common::cuda::cudarc::driver::{CudaSlice, CudaView};
use half::bf16;

use super::engine::Engine;
use crate::error::{Error, Result};
use crate::gradients::GradientLens;
use crate::inputs::{GradientSelection, Inputs, MatrixTensor, Tensor, sealed};
use crate::plan::Plan;

/// A device matrix, row-major, f32 or bf16.
#[derive(Debug, Clone, Copy)]
pub enum DeviceMatrix<'a> {
    /// f32 elements.
    F32(&'a CudaSlice<f32>),
    /// bf16 elements, read in place by the tensor-core GEMMs (widened per block under
    /// [`Precision::F32`]).
    Bf16(&'a CudaSlice<bf16>),
}

impl DeviceMatrix<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            DeviceMatrix::F32(m) => m.len(),
            DeviceMatrix::Bf16(m) => m.len(),
        }
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Element type.
    pub fn dtype(&self) -> flatpeak_common::DType {
        match self {
            DeviceMatrix::F32(_) => flatpeak_common::DType::F32,
            DeviceMatrix::Bf16(_) => flatpeak_common::DType::Bf16,
        }
    }
    /// Widens `rows` (of width `d`) of a bf16 matrix into `wide`, for GEMMs that read f32; an
    /// f32 matrix is read in place (nothing to do).
    pub(crate) fn widen_rows(
        &self,
        e: &Engine,
        rows: std::ops::Range<usize>,
        d: usize,
        wide: &mut CudaSlice<f32>,
    ) -> Result<()> {
        match self {
            DeviceMatrix::Bf16(s) => e.widen(&s.slice(rows.start * d..rows.end * d), wide),
            DeviceMatrix::F32(_) => Ok(()),
        }
    }
}

/// Rows `rows` (width `d`) of `m` as f32: a view of an f32 matrix, or widened into `buf`.
pub(crate) fn rows_f32<'r, 'm: 'r, 'b: 'r>(
    e: &Engine,
    m: &DeviceMatrix<'m>,
    rows: std::ops::Range<usize>,
    d: usize,
    buf: &'b mut CudaSlice<f32>,
) -> Result<CudaView<'r, f32>> {
    let (a, b) = (rows.start * d, rows.end * d);
    match *m {
        DeviceMatrix::F32(s) => Ok(s.slice(a..b)),
        DeviceMatrix::Bf16(s) => {
            e.widen(&s.slice(a..b), buf)?;
            Ok(buf.slice(0..b - a))
        }
    }
}

impl sealed::Sealed for DeviceMatrix<'_> {}
impl sealed::Sealed for &CudaSlice<f32> {}
impl sealed::Sealed for &CudaSlice<i64> {}

impl Tensor for DeviceMatrix<'_> {
    fn elements(&self) -> usize {
        self.len()
    }
}

impl MatrixTensor for DeviceMatrix<'_> {
    fn dtype(&self) -> flatpeak_common::DType {
        DeviceMatrix::dtype(self)
    }
}

impl Tensor for &CudaSlice<f32> {
    fn elements(&self) -> usize {
        self.len()
    }
}

impl Tensor for &CudaSlice<i64> {
    fn elements(&self) -> usize {
        self.len()
    }
}

/// One call's device inputs: [`Inputs`] holding a CUDA device's buffers.
pub type DeviceInputs<'a> = Inputs<'a, DeviceMatrix<'a>, &'a CudaSlice<f32>, &'a CudaSlice<i64>>;

impl<'a> DeviceInputs<'a> {
    /// Device inputs without bias or weights, with hidden size D: N is `targets.len()` and V is
    /// `w.len() / D`, as [`Inputs::new`] on the host (bias and weights by the same `with_*`
    /// methods).
    pub fn on_device(
        x: DeviceMatrix<'a>,
        w: DeviceMatrix<'a>,
        targets: &'a CudaSlice<i64>,
        hidden: usize,
    ) -> Self {
        Self::of(x, w, targets, hidden)
    }
}

/// Caller-owned device gradient buffers a backward writes into (overwriting them): a binding's
/// own tensors, so no gradient is copied out of the crate. As on the host
/// ([`GradientsMut`](crate::GradientsMut)), `wanted` says which are computed; a skipped one's
/// buffer is empty (dX, dW) or `None` (dbias), and its GEMM is not launched.
#[derive(Debug)]
pub struct DeviceGradientsMut<'a> {
    /// dX, N×D (empty when skipped).
    pub dx: &'a mut CudaSlice<f32>,
    /// dW, V×D (empty when skipped).
    pub dw: &'a mut CudaSlice<f32>,
    /// dbias, V: present exactly when the inputs have a bias and dbias is computed.
    pub dbias: Option<&'a mut CudaSlice<f32>>,
    /// Which gradients are computed ([`GradientSelection::ALL`] from [`DeviceGradientsMut::new`]).
    pub wanted: GradientSelection,
}

impl<'a> DeviceGradientsMut<'a> {
    /// Buffers for every gradient (dbias present exactly with a bias).
    pub fn new(
        dx: &'a mut CudaSlice<f32>,
        dw: &'a mut CudaSlice<f32>,
        dbias: Option<&'a mut CudaSlice<f32>>,
    ) -> Self {
        Self { dx, dw, dbias, wanted: GradientSelection::ALL }
    }

    /// These buffers computing only the gradients `wanted` selects (the skipped ones' buffers
    /// empty or `None`, as the call checks).
    pub fn selecting(self, wanted: GradientSelection) -> Self {
        Self { wanted, ..self }
    }
}

/// The plan's block buffers on a device: the logits block (`C·Vb` f32) and, for bf16 inputs
/// under [`Precision::F32`], the widened X and W blocks (`C·D` and `Vb·D` f32). An executor made
/// by [`LinearCrossEntropy::new`](crate::LinearCrossEntropy::new) reserves its own; a caller with
/// its own allocator (a framework's caching allocator) passes them to
/// the `*_with` methods instead, sized by [`BlockBuffers::lens`].
#[derive(Debug)]
pub struct BlockBuffers {
    /// The logits block.
    pub logits: CudaSlice<f32>,
    /// The widened X block (bf16 inputs).
    pub x_wide: CudaSlice<f32>,
    /// The widened W block (bf16 inputs).
    pub w_wide: CudaSlice<f32>,
}

impl BlockBuffers {
    /// Elements each buffer needs for `plan`: `[logits, x_wide, w_wide]` (0 where unused), its
    /// [`device_regions`](Plan::device_regions).
    pub fn lens(plan: &Plan) -> [usize; 3] {
        let r = plan.device_regions();
        [r.logits, r.x_block, r.w_block]
    }

    /// The alignment, in bytes, of each buffer [`carved`](Self::carved) from one allocation.
    pub const CARVE_ALIGN: usize = crate::plan::DEVICE_REGION_ALIGN;

    /// The three buffers carved from one device allocation (a framework's workspace tensor, so
    /// its allocator sees the working set): each buffer's byte offset (a multiple of
    /// [`CARVE_ALIGN`](Self::CARVE_ALIGN)) and elements (at least one), and the allocation's
    /// bytes ([`pack_regions`](crate::plan::pack_regions)); a plan's sizes never overflow.
    pub fn carved(plan: &Plan) -> Result<CarvedLayout> {
        let lens = Self::lens(plan).map(|l| l.max(1));
        let (offsets, bytes) = crate::plan::pack_regions(lens, Self::CARVE_ALIGN)
            .ok_or_else(|| Error::internal("block buffers packed at a nonzero alignment, within usize"))?;
        Ok(CarvedLayout { offsets, lens, bytes })
    }

    pub(super) fn zeros(e: &Engine, plan: &Plan) -> Result<Self> {
        let [logits, x_wide, w_wide] = Self::lens(plan);
        Ok(Self { logits: e.zeros(logits)?, x_wide: e.zeros(x_wide)?, w_wide: e.zeros(w_wide)? })
    }

    /// Each buffer holds at least what `plan` needs.
    pub(super) fn check(&self, plan: &Plan) -> Result<()> {
        let [logits, x_wide, w_wide] = Self::lens(plan);
        for (what, expected, got) in [
            ("logits block buffer", logits, self.logits.len()),
            ("widened x block buffer", x_wide, self.x_wide.len()),
            ("widened w block buffer", w_wide, self.w_wide.len()),
        ] {
            if got < expected {
                return Err(Error::ShapeMismatch { what, expected, got });
            }
        }
        Ok(())
    }
}

/// Where [`BlockBuffers::carved`] puts the block buffers in one allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CarvedLayout {
    /// Byte offset of the logits, widened X and widened W buffers.
    pub offsets: [usize; 3],
    /// Their f32 elements (at least one each).
    pub lens: [usize; 3],
    /// Bytes of the allocation.
    pub bytes: usize,
}

/// Device gradients, f32.
#[derive(Debug)]
pub struct DeviceGradients {
    /// dX, N×D.
    pub dx: CudaSlice<f32>,
    /// dW, V×D.
    pub dw: CudaSlice<f32>,
    /// dbias, V.
    pub dbias: Option<CudaSlice<f32>>,
}

impl DeviceGradientsMut<'_> {
    /// The lengths of dX, dW and dbias, with the selection they are checked against.
    pub(super) fn lens(&self) -> GradientLens {
        GradientLens {
            dx: self.dx.len(),
            dw: self.dw.len(),
            dbias: self.dbias.as_ref().map(|b| b.len()),
            wanted: self.wanted,
        }
    }

    /// Zeroes every buffer (a skipped one is empty: no memset is issued for it).
    pub(super) fn fill_zero(&mut self, e: &Engine) -> Result<()> {
        let zero = |s: &mut CudaSlice<f32>| match s.len() {
            0 => Ok(()),
            _ => e.stream.memset_zeros(s).map_err(cuda_error("cuMemsetD8")),
        };
        zero(self.dx)?;
        zero(self.dw)?;
        if let Some(b) = self.dbias.as_deref_mut() {
            zero(b)?;
        }
        Ok(())
    }
}

impl DeviceGradients {
    /// Borrowed views of these gradients, to write into.
    pub fn as_mut(&mut self) -> DeviceGradientsMut<'_> {
        DeviceGradientsMut::new(&mut self.dx, &mut self.dw, self.dbias.as_mut())
    }

    /// Zeroed gradients of `inputs`, once N, D and V are checked against the plan (so N·D and
    /// V·D are sizes the plan accepted).
    pub(super) fn zeros(e: &Engine, plan: &Plan, inputs: &DeviceInputs<'_>) -> Result<Self> {
        inputs.sizes().check_plan(plan)?;
        Ok(Self {
            dx: e.zeros(inputs.n * inputs.d)?,
            dw: e.zeros(inputs.v * inputs.d)?,
            dbias: inputs.bias.map(|_| e.zeros(inputs.v)).transpose()?,
        })
    }
}
