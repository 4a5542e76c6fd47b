//! The single-device working set's layout, written once: which block buffers a backend carves
//! and how long each is. The plan's byte count, the CPU's carve of its workspace and the CUDA
//! block buffers (its own, or carved from a framework's tensor) all read these regions.

use flatpeak_common::arena::REGION_ALIGN;
use flatpeak_common::{DType, Precision};

/// The alignment, in bytes, of each block buffer a device carves from one allocation (a
/// framework's workspace tensor): [`BlockRegions::device_bytes`].
pub const DEVICE_REGION_ALIGN: usize = 256;

/// Rows of a bf16 W widened to f32 at a time by the CPU path (its `form_logits_widening`).
pub const WIDEN_ROWS: usize = 2048;

/// Fewest vocabulary rows (the k of `dX += Gᵀ·W_blk`) for which the CPU path splits dX's GEMM
/// in two halves of k, run side by side (its `DxPartial`).
pub const SPLIT_K_MIN_ROWS: usize = 2048;

/// Whether the single-device path splits dX's GEMMs for vocabulary blocks of `vb` rows with
/// inputs of `dtype` (a bf16 W is widened, and multiplied, [`WIDEN_ROWS`] rows at a time), so
/// its plan reserves the `C·D` partial.
pub fn splits_dx(vb: usize, dtype: DType) -> bool {
    let k = if dtype == DType::F32 { vb } else { vb.min(WIDEN_ROWS) };
    k >= SPLIT_K_MIN_ROWS
}

/// The block buffers of one device's schedule for blocks of C tokens × Vb vocabulary rows of
/// width D, in f32 elements, 0 where that device does not use one. Laid out in this order.
///
/// | region | host (CPU) | CUDA device |
/// |---|---|---|
/// | `logits` | `C·Vb` | `C·Vb` |
/// | `x_block` | `C·D` (X's rows as f32, read by the fold's targets and the GEMMs) | `C·D` for bf16 X under [`Precision::F32`] (widened), else 0 (read in place) |
/// | `w_block` | `min(Vb, WIDEN_ROWS)·D` for a bf16 W (widened a sub-block at a time), else 0 | `Vb·D` for a bf16 W under [`Precision::F32`], else 0 |
/// | `dx_partial` | `C·D` where dX's GEMM splits ([`splits_dx`]), else 0 | 0 |
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRegions {
    /// The logits block (then the logit gradient G, in place).
    pub logits: usize,
    /// The X block as f32.
    pub x_block: usize,
    /// W's rows as f32.
    pub w_block: usize,
    /// dX's second partial sum.
    pub dx_partial: usize,
}

impl BlockRegions {
    /// The CPU's regions, `None` when a length overflows.
    pub(crate) fn host(c: usize, vb: usize, d: usize, dtype: DType) -> Option<Self> {
        let cd = c.checked_mul(d)?;
        Some(Self {
            logits: vb.checked_mul(c)?,
            x_block: cd,
            w_block: if dtype == DType::F32 { 0 } else { vb.min(WIDEN_ROWS).checked_mul(d)? },
            dx_partial: if splits_dx(vb, dtype) { cd } else { 0 },
        })
    }

    /// A CUDA device's regions: bf16 inputs are widened only for f32 GEMMs
    /// ([`Precision::F32`]); otherwise X and W are read in place.
    pub(crate) fn device(c: usize, vb: usize, d: usize, dtype: DType, precision: Precision) -> Option<Self> {
        let wide = dtype != DType::F32 && precision == Precision::F32;
        Some(Self {
            logits: c.checked_mul(vb)?,
            x_block: if wide { c.checked_mul(d)? } else { 0 },
            w_block: if wide { vb.checked_mul(d)? } else { 0 },
            dx_partial: 0,
        })
    }

    /// The lengths in layout order: logits, X block, W block, dX partial.
    pub fn lens(&self) -> [usize; 4] {
        [self.logits, self.x_block, self.w_block, self.dx_partial]
    }

    /// Bytes a device's block buffers take carved from one allocation: logits, X and W blocks
    /// packed at [`DEVICE_REGION_ALIGN`], each at least one element ([`pack_regions`]); `None` on
    /// overflow.
    pub fn device_bytes(&self) -> Option<usize> {
        let [logits, x, w, _] = self.lens();
        pack_regions([logits, x, w], DEVICE_REGION_ALIGN).map(|(_, bytes)| bytes)
    }

    /// Bytes the CPU reserves for them: 4 per element, and a [`REGION_ALIGN`] line for each
    /// region it carves (logits, X and W always, the dX partial where used); `None` on overflow.
    pub(crate) fn host_bytes(&self) -> Option<usize> {
        let regions = 3 + usize::from(self.dx_partial > 0);
        let elems = self.lens().into_iter().try_fold(0usize, |sum, len| sum.checked_add(len))?;
        elems.checked_mul(4)?.checked_add(regions * REGION_ALIGN)
    }
}

/// Regions of `lens` f32 elements packed one after another, each at a multiple of `align` bytes
/// and at least one element long (so each has an address of its own, as a device slice needs):
/// each region's byte offset, and the bytes the packing spans. `None` on overflow, or for an
/// `align` of 0. A framework's workspace tensor is carved this way.
pub fn pack_regions<const K: usize>(lens: [usize; K], align: usize) -> Option<([usize; K], usize)> {
    let mut offsets = [0usize; K];
    let mut end = 0usize;
    for (offset, len) in offsets.iter_mut().zip(lens) {
        *offset = end.checked_next_multiple_of(align)?;
        end = offset.checked_add(len.max(1).checked_mul(4)?)?;
    }
    Some((offsets, end))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_and_device_regions_follow_the_table() {
        let host = BlockRegions::host(256, 4096, 64, DType::Bf16).unwrap();
        assert_eq!(host.lens(), [256 * 4096, 256 * 64, 2048 * 64, 256 * 64]);
        assert_eq!(host.host_bytes(), Some(4 * (256 * 4096 + 256 * 64 * 2 + 2048 * 64) + 4 * REGION_ALIGN));
        let f32_short = BlockRegions::host(64, 1000, 32, DType::F32).unwrap();
        assert_eq!(f32_short.lens(), [64 * 1000, 64 * 32, 0, 0]);
        assert_eq!(f32_short.host_bytes(), Some(4 * (64 * 1000 + 64 * 32) + 3 * REGION_ALIGN));
        let native = BlockRegions::device(256, 4096, 64, DType::Bf16, Precision::Native).unwrap();
        assert_eq!(native.lens(), [256 * 4096, 0, 0, 0]);
        let widened = BlockRegions::device(256, 4096, 64, DType::Bf16, Precision::F32).unwrap();
        assert_eq!(widened.lens(), [256 * 4096, 256 * 64, 4096 * 64, 0]);
        assert_eq!(BlockRegions::host(usize::MAX, 2, 1, DType::F32), None);
        // Carved at 256 B: logits, then the (empty, one-element) X and W regions.
        assert_eq!(native.device_bytes(), Some(256 * 4096 * 4 + 256 + 4));
        assert_eq!(widened.device_bytes(), Some(4 * (256 * 4096 + 256 * 64 + 4096 * 64)));
    }

    #[test]
    fn packed_regions_are_aligned_disjoint_and_nonempty() {
        let (offsets, end) = pack_regions([10, 0, 70], 256).unwrap();
        assert_eq!(offsets, [0, 256, 512]);
        assert_eq!(end, 512 + 280);
        assert_eq!(pack_regions([1], 0), None);
        assert_eq!(pack_regions([usize::MAX / 2], 64), None);
    }
}
