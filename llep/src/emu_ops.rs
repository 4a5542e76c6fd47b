//! [`DeviceOps`] on the host (feature `cuda-emu`): buffers are zeroed `Vec`s of f32 or bf16
//! ([`EmuBuf`]), the kernels run under the SIMT emulator ([`crate::emu`]: the same `.cu` source
//! and instantiations, both thread schedules, a race is an error), the GEMM is the CPU one
//! ([`flatpeak_common::gemm::matmul`], bitwise identical for any thread count; for bf16 operands
//! the CPU's bf16 GEMM with f32 accumulation, as [`crate::cpu::HostOps`] runs it) and all-to-all
//! goes through a host [`Communicator`] (e.g. a [`flatpeak_common::LocalGroup`] rank). It runs
//! the device schedule exactly as a GPU would, so the schedule is tested without one.

use flatpeak_common::gemm::{Accumulate, Threads};
use flatpeak_common::gemm_bf16::Bf16Kernel;
use flatpeak_common::{Communicator, CommunicatorExt, DType};
use half::bf16;

use crate::cpu::elem::{IndexScale, ViewMut, gemm_bf16, mismatch};
use crate::cpu::{host_gemm, span, span_mut};
use crate::device::{DeviceOps, GemmDims, IndexedRows, Operand, PreAt, need, same_type, typed_buf};
use crate::emu;
use crate::error::{Error, Result};

/// The emulated device of one rank of a host communicator group.
#[derive(Debug)]
pub struct EmuOps<'c, C: ?Sized> {
    comm: &'c C,
}

impl<'c, C: Communicator + ?Sized> EmuOps<'c, C> {
    /// The emulated device of `comm`'s rank.
    pub fn new(comm: &'c C) -> Self {
        Self { comm }
    }

    /// A new bf16 buffer holding `host` (a bf16 layer's tokens, expert weights and dY).
    pub fn upload_bf16(&self, host: &[bf16]) -> Result<EmuBuf> {
        Ok(EmuBuf::Bf16(if host.is_empty() { vec![bf16::ZERO] } else { host.to_vec() }))
    }
}

typed_buf! {
    /// A buffer of the emulated device: f32 or bf16 elements.
    #[derive(Debug, Clone, PartialEq)]
    EmuBuf(Vec)
}

/// The rows of a gather or scatter under the emulator.
type EmuRows<'a> = IndexedRows<'a, EmuBuf, Vec<u32>>;

/// The index entries and the routing-weight scale (f32) of a gather or scatter (the emulated
/// launch checks them against the buffers); `None` when it moves nothing.
fn emu_rows<'a>(sel: &EmuRows<'a>) -> Result<Option<IndexScale<'a>>> {
    if sel.is_empty() {
        return Ok(None);
    }
    let index = &sel.index[sel.index_range(sel.index.len())?];
    let scale = match sel.scale {
        Some(s) => {
            let s = s.as_f32("gather/scatter scale (f32)")?;
            Some(&s[sel.scale_range(s.len())?])
        }
        None => None,
    };
    Ok(Some((index, scale)))
}

impl<C: Communicator + ?Sized> DeviceOps for EmuOps<'_, C> {
    type Buf = EmuBuf;
    type Index = Vec<u32>;

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn alloc(&self, len: usize, dtype: DType) -> Result<EmuBuf> {
        match dtype {
            DType::F32 => Ok(EmuBuf::F32(vec![0.0; len.max(1)])),
            DType::Bf16 => Ok(EmuBuf::Bf16(vec![bf16::ZERO; len.max(1)])),
            other => Err(Error::UnsupportedDtype {
                dtype: other,
                backend: "the emulated device",
                supported: "f32, bf16",
            }),
        }
    }

    fn alloc_index(&self, len: usize) -> Result<Vec<u32>> {
        Ok(vec![0; len.max(1)])
    }

    fn buf_len(&self, buf: &EmuBuf) -> usize {
        buf.len()
    }

    fn buf_dtype(&self, buf: &EmuBuf) -> DType {
        buf.dtype()
    }

    fn upload(&self, host: &[f32]) -> Result<EmuBuf> {
        Ok(EmuBuf::F32(if host.is_empty() { vec![0.0] } else { host.to_vec() }))
    }

    fn write_index(&self, host: &[u32], dst: &mut Vec<u32>) -> Result<()> {
        span_mut("index buffer", dst, 0, host.len())?.copy_from_slice(host);
        Ok(())
    }

    fn write(&self, host: &[f32], dst: &mut EmuBuf) -> Result<()> {
        span_mut("buffer", dst.as_f32_mut("write (an f32 buffer)")?, 0, host.len())?.copy_from_slice(host);
        Ok(())
    }

    fn download(&self, src: &EmuBuf, len: usize) -> Result<Vec<f32>> {
        Ok(span("download", src.as_f32("download (an f32 buffer)")?, 0, len)?.to_vec())
    }

    fn download_index(&self, src: &Vec<u32>, len: usize) -> Result<Vec<u32>> {
        Ok(span("index download", src, 0, len)?.to_vec())
    }

    fn zero(&self, dst: &mut EmuBuf, len: usize) -> Result<()> {
        match dst {
            EmuBuf::F32(v) => span_mut("zero fill", v, 0, len)?.fill(0.0),
            EmuBuf::Bf16(v) => span_mut("zero fill", v, 0, len)?.fill(bf16::ZERO),
        }
        Ok(())
    }

    fn copy(
        &self,
        (src, src_at): (&EmuBuf, usize),
        (dst, dst_at): (&mut EmuBuf, usize),
        len: usize,
    ) -> Result<()> {
        same_type!(EmuBuf, "copy (source and destination)"; src, dst => {
            let from = span("copy source", src, src_at, len)?;
            span_mut("copy destination", dst, dst_at, len)?.copy_from_slice(from);
        });
        Ok(())
    }

    fn gather_rows(&self, sel: EmuRows<'_>, dst: &mut EmuBuf) -> Result<()> {
        let Some((index, scale)) = emu_rows(&sel)? else { return Ok(()) };
        let (src, width) = (sel.src, sel.width);
        same_type!(EmuBuf, "gather_rows (src and dst)"; src, dst => emu::gather_rows(src, index, scale, width, dst))
    }

    fn scatter_add_rows(&self, sel: EmuRows<'_>, acc: &mut EmuBuf) -> Result<()> {
        let Some((index, scale)) = emu_rows(&sel)? else { return Ok(()) };
        let width = sel.width;
        match (sel.src, acc) {
            (EmuBuf::F32(s), EmuBuf::F32(a)) => emu::scatter_add_rows(s, index, scale, width, a),
            (EmuBuf::Bf16(s), EmuBuf::F32(a)) => emu::scatter_add_rows(s, index, scale, width, a),
            (EmuBuf::Bf16(s), EmuBuf::Bf16(a)) => emu::scatter_add_rows(s, index, scale, width, a),
            (EmuBuf::F32(_), EmuBuf::Bf16(_)) => {
                Err(mismatch("scatter_add_rows acc (at least as wide as src)", DType::F32, DType::Bf16))
            }
        }
    }

    fn swiglu(&self, gu: &EmuBuf, at: PreAt, n: usize, h: &mut EmuBuf) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        same_type!(EmuBuf, "swiglu (pre-activations and h)"; gu, h =>
            emu::swiglu(gu, at, span_mut("swiglu h", h, 0, n)?))
    }

    fn swiglu_backward(&self, gu: &mut EmuBuf, at: PreAt, dh: &EmuBuf, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        same_type!(EmuBuf, "swiglu_backward (pre-activations and dh)"; gu, dh =>
            emu::swiglu_backward(gu, at, span("swiglu_backward dh", dh, 0, n)?))
    }

    fn row_dot(&self, a: &EmuBuf, b: &EmuBuf, rows: usize, width: usize, out: &mut EmuBuf) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let out = span_mut("row_dot out (rows)", out.as_f32_mut("row_dot out (f32)")?, 0, rows)?;
        same_type!(EmuBuf, "row_dot (a and b)"; a, b => emu::row_dot(a, b, width, out))
    }

    fn gemm(
        &self,
        dims: GemmDims,
        a: Operand<'_, EmuBuf>,
        b: Operand<'_, EmuBuf>,
        c: &mut EmuBuf,
        c_offset: usize,
        accumulate: Accumulate,
    ) -> Result<()> {
        match (a.buf, b.buf) {
            (EmuBuf::F32(x), EmuBuf::F32(y)) => {
                let (x, y) =
                    ((x.as_slice(), a.offset, a.orientation), (y.as_slice(), b.offset, b.orientation));
                host_gemm(
                    dims,
                    (x, y),
                    (c.as_f32_mut("gemm C of f32 operands")?, c_offset),
                    accumulate,
                    Threads::All,
                )
            }
            (EmuBuf::Bf16(x), EmuBuf::Bf16(y)) => {
                let (x, y) =
                    ((x.as_slice(), a.offset, a.orientation), (y.as_slice(), b.offset, b.orientation));
                let c = match c {
                    EmuBuf::F32(v) => ViewMut::F32(v),
                    EmuBuf::Bf16(v) => ViewMut::Bf16(v),
                };
                gemm_bf16(dims, (x, y), (c, c_offset), accumulate, (Threads::All, Bf16Kernel::Detect))
            }
            (x, y) => Err(mismatch("gemm operands A and B", x.dtype(), y.dtype())),
        }
    }

    fn all_to_all_v(
        &self,
        (send, send_at): (&EmuBuf, usize),
        send_counts: &[usize],
        (recv, recv_at): (&mut EmuBuf, usize),
        recv_counts: &[usize],
    ) -> Result<()> {
        let (ns, nr) = (send_counts.iter().sum(), recv_counts.iter().sum());
        same_type!(EmuBuf, "all_to_all_v (send and recv)"; send, recv => {
            let send = span("all_to_all_v send elements", send, send_at, ns)?;
            let recv = span_mut("all_to_all_v recv elements", recv, recv_at, nr)?;
            self.comm.all_to_all_v(send, send_counts, recv, recv_counts)?
        });
        Ok(())
    }

    fn all_to_all_v_index(
        &self,
        send: &Vec<u32>,
        send_counts: &[usize],
        recv: &mut Vec<u32>,
        recv_counts: &[usize],
    ) -> Result<()> {
        let (ns, nr) = (send_counts.iter().sum(), recv_counts.iter().sum::<usize>());
        need("all_to_all_v send elements", ns, send.len())?;
        need("all_to_all_v recv elements", nr, recv.len())?;
        Ok(self.comm.all_to_all_v(&send[..ns], send_counts, &mut recv[..nr], recv_counts)?)
    }
}
