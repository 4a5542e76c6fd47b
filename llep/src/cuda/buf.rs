//! The CUDA backend's buffers: [`CudaBuf`] (f32 or bf16 elements) and [`CudaIndex`] (u32 with
//! a host mirror for the row-index checks), and the checked views every operation takes.

use flatpeak_common::cuda::cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use half::bf16;

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
    /// dY, dispatch rows and expert scratch; everything else f32).
    #[derive(Debug)]
    CudaBuf(CudaSlice)
}

impl From<CudaSlice<f32>> for CudaBuf {
    fn from(s: CudaSlice<f32>) -> Self {
        CudaBuf::F32(s)
    }
}

impl From<CudaSlice<bf16>> for CudaBuf {
    fn from(s: CudaSlice<bf16>) -> Self {
        CudaBuf::Bf16(s)
    }
}

/// The routing-weight scale of a gather or scatter (f32, at least `rows`), or none.
pub(super) fn scale_of<'a>(sel: &IndexedRows<'a, CudaBuf, CudaIndex>) -> Result<Option<&'a CudaSlice<f32>>> {
    let Some(s) = sel.scale else { return Ok(None) };
    let s = s.as_f32("gather/scatter scale (f32 rows)")?;
    need("gather/scatter scale (f32 rows)", sel.rows, s.len())?;
    Ok(Some(s))
}

/// A device buffer of u32 with a host mirror of its entries while they are known on the host
/// (written by [`DeviceOps::write_index`](crate::device::DeviceOps::write_index)); `None` after a device-side write (all-to-all).
#[derive(Debug)]
pub struct CudaIndex {
    pub(super) dev: CudaSlice<u32>,
    pub(super) host: Option<Vec<u32>>,
}

impl CudaIndex {
    /// The first `rows` entries, from the host mirror (known when the index was written from the
    /// host; see [`check_rows`](Self::check_rows)).
    pub(super) fn rows(&self, rows: usize) -> Result<&[u32]> {
        self.host.as_ref().and_then(|h| h.get(..rows)).ok_or(Error::ScheduleMismatch {
            what: "row indices written on the device (not checkable before a launch)",
            planned: rows,
            found: 0,
        })
    }

    /// Checks that the first `rows` entries are known and each is below `bound`.
    pub(super) fn check_rows(&self, rows: usize, bound: usize) -> Result<()> {
        need("index buffer (rows)", rows, self.dev.len())?;
        let host = self.host.as_ref().ok_or(Error::ScheduleMismatch {
            what: "row indices written on the device (not checkable before a launch)",
            planned: rows,
            found: 0,
        })?;
        match host.get(..rows).and_then(|h| h.iter().find(|&&i| i as usize >= bound)) {
            Some(&i) => Err(Error::ShapeMismatch {
                what: "row index (rows of src)",
                expected: bound,
                got: i as usize + 1,
            }),
            None => need("index mirror (rows)", rows, host.len()),
        }
    }
}
