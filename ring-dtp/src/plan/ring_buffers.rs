//! The ring buffers' layout, written once: what a weight-ring slot and an activation-ring packet
//! hold, and how long each region is. A [`RegionSource`] lays them out: the CPU ring carves them
//! from its workspace, the CUDA ring allocates them on its device, and the plan counts their
//! bytes ([`RegionBytes`]) for its bound.

use flatpeak_common::DType;
use flatpeak_common::arena::REGION_ALIGN;

use crate::error::Result;

/// The types of one place's regions: host slices, device buffers, or byte counts.
pub(crate) trait RegionKind {
    /// Rows of X or W in the inputs' dtype.
    type Raw;
    /// f32 elements.
    type F32;
    /// f64 elements.
    type F64;
    /// u32 elements.
    type U32;
}

/// Where a layout's regions come from, one typed region at a time, in layout order.
pub(crate) trait RegionSource<K: RegionKind> {
    /// `elems` elements of `dtype`.
    fn raw(&mut self, dtype: DType, elems: usize) -> Result<K::Raw>;
    /// `len` f32.
    fn f32(&mut self, len: usize) -> Result<K::F32>;
    /// `len` f64.
    fn f64(&mut self, len: usize) -> Result<K::F64>;
    /// `len` u32.
    fn u32(&mut self, len: usize) -> Result<K::U32>;
}

/// `a·b` elements of a region, or [`flatpeak_common::Error::SizeOverflow`] naming `what`.
fn elems(a: usize, b: usize, what: &'static str) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| flatpeak_common::Error::SizeOverflow { what }.into())
}

/// One weight-ring buffer: a W sub-block of Vb rows in the inputs' dtype, the dW accumulator
/// that travels with it, its bias and the dbias accumulator.
pub(crate) struct Slot<K: RegionKind> {
    pub w: K::Raw,
    pub dw: K::F32,
    pub bias: K::F32,
    pub dbias: K::F32,
}

impl<K: RegionKind> Slot<K> {
    /// A slot for sub-blocks of `vb` rows of width `d` in `dtype`, from `source`.
    pub fn new(source: &mut impl RegionSource<K>, dtype: DType, (vb, d): (usize, usize)) -> Result<Self> {
        let block = elems(vb, d, "ring slot (Vb·D)")?;
        Ok(Self {
            w: source.raw(dtype, block)?,
            dw: source.f32(block)?,
            bias: source.f32(vb)?,
            dbias: source.f32(vb)?,
        })
    }
}

/// One activation-ring packet of C token rows: X in the inputs' dtype, the dX accumulator, the
/// resolved targets, the fold's statistics (max, sum-exp, target logit, Σz) and the backward's
/// row data (lse, scale, dlse).
pub(crate) struct Packet<K: RegionKind> {
    pub x: K::Raw,
    pub dx: K::F32,
    pub targets: K::U32,
    pub max: K::F32,
    pub sum: K::F64,
    pub target_logit: K::F32,
    pub logit_sum: K::F64,
    pub lse: K::F32,
    pub coef: K::F32,
    pub dlse: K::F32,
}

impl<K: RegionKind> Packet<K> {
    /// A packet for token blocks of `c` rows of width `d` in `dtype`, from `source`.
    pub fn new(source: &mut impl RegionSource<K>, dtype: DType, (c, d): (usize, usize)) -> Result<Self> {
        let rows = elems(c, d, "ring packet (C·D)")?;
        Ok(Self {
            x: source.raw(dtype, rows)?,
            dx: source.f32(rows)?,
            targets: source.u32(c)?,
            max: source.f32(c)?,
            sum: source.f64(c)?,
            target_logit: source.f32(c)?,
            logit_sum: source.f64(c)?,
            lse: source.f32(c)?,
            coef: source.f32(c)?,
            dlse: source.f32(c)?,
        })
    }
}

/// The CPU weight ring's block scratch: one token block's logits against a sub-block, its
/// resolved targets and X rows as f32, and a bf16 sub-block widened (empty for f32 inputs).
pub(crate) struct WeightScratch<K: RegionKind> {
    pub logits: K::F32,
    pub targets: K::U32,
    pub xblk: K::F32,
    pub w_up: K::F32,
}

impl<K: RegionKind> WeightScratch<K> {
    /// The scratch of blocks `(c, vb)` of width `d` in `dtype`, from `source`.
    pub fn new(
        source: &mut impl RegionSource<K>,
        dtype: DType,
        (c, vb, d): (usize, usize, usize),
    ) -> Result<Self> {
        let widened = if dtype == DType::F32 { 0 } else { elems(vb, d, "widened W block (Vb·D)")? };
        Ok(Self {
            logits: source.f32(elems(c, vb, "logits block (C·Vb)")?)?,
            targets: source.u32(c)?,
            xblk: source.f32(elems(c, d, "X block (C·D)")?)?,
            w_up: source.f32(widened)?,
        })
    }
}

/// The CPU activation ring's block scratch: a packet's logits against one vocabulary block, and
/// the bf16 X rows and W block widened (empty for f32 inputs).
pub(crate) struct ActivationScratch<K: RegionKind> {
    pub logits: K::F32,
    pub x_up: K::F32,
    pub w_up: K::F32,
}

impl<K: RegionKind> ActivationScratch<K> {
    /// The scratch of blocks `(c, vb)` of width `d` in `dtype`, from `source`.
    pub fn new(
        source: &mut impl RegionSource<K>,
        dtype: DType,
        (c, vb, d): (usize, usize, usize),
    ) -> Result<Self> {
        let bf16 = dtype != DType::F32;
        Ok(Self {
            logits: source.f32(elems(c, vb, "logits block (C·Vb)")?)?,
            x_up: source.f32(if bf16 { elems(c, d, "widened X block (C·D)")? } else { 0 })?,
            w_up: source.f32(if bf16 { elems(vb, d, "widened W block (Vb·D)")? } else { 0 })?,
        })
    }
}

/// Byte counts: the plan's side of a layout.
pub(crate) struct Bytes;

impl RegionKind for Bytes {
    type Raw = ();
    type F32 = ();
    type F64 = ();
    type U32 = ();
}

/// Sums the bytes of the regions laid out from it, each rounded up to whole [`REGION_ALIGN`]
/// lines as a workspace carves them; `None` once a size overflows.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RegionBytes(pub Option<usize>);

impl RegionBytes {
    /// The bytes of everything `layout` lays out from a fresh count; `None` when a size
    /// overflows or the layout fails.
    pub(crate) fn of(layout: impl FnOnce(&mut Self) -> Result<()>) -> Option<usize> {
        let mut bytes = Self(Some(0));
        layout(&mut bytes).ok().and(bytes.0)
    }

    fn add(&mut self, elems: usize, elem_bytes: usize) -> Result<()> {
        let aligned = elems.checked_mul(elem_bytes).and_then(|b| b.checked_next_multiple_of(REGION_ALIGN));
        self.0 = self.0.zip(aligned).and_then(|(sum, b)| sum.checked_add(b));
        Ok(())
    }
}

impl RegionSource<Bytes> for RegionBytes {
    fn raw(&mut self, dtype: DType, elems: usize) -> Result<()> {
        self.add(elems, dtype.size_in_bytes())
    }
    fn f32(&mut self, len: usize) -> Result<()> {
        self.add(len, 4)
    }
    fn f64(&mut self, len: usize) -> Result<()> {
        self.add(len, 8)
    }
    fn u32(&mut self, len: usize) -> Result<()> {
        self.add(len, 4)
    }
}
