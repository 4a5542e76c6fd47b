//! The CUDA backend's buffers: [`CudaBuf`] (f32 or bf16 elements) and [`CudaIndex`] (u32 with
//! a host mirror for the row-index checks), and the checked views every operation takes.

use flatpeak_common::cuda::cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use half::bf16;

use super::arena::DevSlice;
use crate::device::{IndexedRows, need, typed_buf};
use crate::error::{Error, Result};

pub(super) fn view<'a, T>(
    what: &'static str,
    s: &'a CudaSlice<T>,
    at: usize,
    len: usize,
) -> Result<CudaView<'a, T>> {
    need(what, at + len, s.len())?;
    s.try_slice(at..at + len).ok_or(Error::ShapeMismatch { what, expected: at + len, got: s.len() })
}

pub(super) fn view_mut<'a, T>(
    what: &'static str,
    s: &'a mut CudaSlice<T>,
    at: usize,
    len: usize,
) -> Result<CudaViewMut<'a, T>> {
    let found = s.len();
    need(what, at + len, found)?;
    s.try_slice_mut(at..at + len).ok_or(Error::ShapeMismatch { what, expected: at + len, got: found })
}

typed_buf! {
    /// A buffer on the CUDA device: f32 or bf16 elements (a bf16 layer's tokens, expert weights,
    /// dY, dispatch rows and expert scratch; everything else f32), allocated by llep or over
    /// lent memory ([`DevSlice`]).
    #[derive(Debug)]
    CudaBuf(DevSlice)
}

impl From<CudaSlice<f32>> for CudaBuf {
    /// A buffer llep allocated (freed when dropped).
    fn from(s: CudaSlice<f32>) -> Self {
        CudaBuf::F32(DevSlice::owned(s))
    }
}

impl From<CudaSlice<bf16>> for CudaBuf {
    /// A buffer llep allocated (freed when dropped).
    fn from(s: CudaSlice<bf16>) -> Self {
        CudaBuf::Bf16(DevSlice::owned(s))
    }
}

/// The entries a gather or scatter uses: the index range on the device and its host mirror, and
/// the routing-weight scale's range (f32), or none.
pub(super) struct RowsAt<'a> {
    pub(super) dev: CudaView<'a, u32>,
    pub(super) host: &'a [u32],
    pub(super) scale: Option<CudaView<'a, f32>>,
}

/// `sel`'s index entries (`index_at..index_at + rows`, known on the host) and scale factors
/// (`scale_at..scale_at + rows`), checked to lie in their buffers.
pub(super) fn rows_at<'a>(sel: &IndexedRows<'a, CudaBuf, CudaIndex>) -> Result<RowsAt<'a>> {
    let index: &'a CudaIndex = sel.index;
    let range = sel.index_range(index.dev.len())?;
    let host = index.entries(range.clone())?;
    let dev = view("gather/scatter index", &index.dev, range.start, sel.rows)?;
    let scale = match sel.scale {
        Some(s) => {
            let s = s.as_f32("gather/scatter scale (f32 rows)")?;
            let r = sel.scale_range(s.len())?;
            Some(view("gather/scatter scale", s, r.start, sel.rows)?)
        }
        None => None,
    };
    Ok(RowsAt { dev, host, scale })
}

/// Checks that every entry of `host` is below `bound` (rows of the buffer it indexes).
pub(super) fn check_entries(host: &[u32], bound: usize) -> Result<()> {
    match host.iter().find(|&&i| i as usize >= bound) {
        Some(&i) => Err(Error::ShapeMismatch {
            what: "row index (rows of src)",
            expected: bound,
            got: i as usize + 1,
        }),
        None => Ok(()),
    }
}

/// A device buffer of u32 with a host mirror of its entries while they are known on the host
/// (written by [`DeviceOps::write_index`](crate::device::DeviceOps::write_index)); `None` after a device-side write (all-to-all).
#[derive(Debug)]
pub struct CudaIndex {
    pub(super) dev: DevSlice<u32>,
    pub(super) host: Option<Vec<u32>>,
}

impl CudaIndex {
    /// Entries `range` from the host mirror (known when the index was written from the host),
    /// else [`Error::ScheduleMismatch`]: indices written on the device cannot be checked before
    /// a launch.
    pub(super) fn entries(&self, range: std::ops::Range<usize>) -> Result<&[u32]> {
        let len = range.len();
        self.host.as_ref().and_then(|h| h.get(range)).ok_or(Error::ScheduleMismatch {
            what: "row indices written on the device (not checkable before a launch)",
            planned: len,
            found: 0,
        })
    }
}
