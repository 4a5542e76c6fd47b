//! [`DeviceOps`] on the host (feature `cuda-emu`): buffers are zeroed `Vec`s, the kernels run under
//! the SIMT emulator ([`crate::emu`]: the same `.cu` source, both thread schedules, a race is an
//! error), the GEMM is the CPU one ([`flatpeak_common::gemm::matmul`], bitwise identical for any
//! thread count) and all-to-all goes through a host [`Communicator`] (e.g. a
//! [`flatpeak_common::LocalGroup`] rank). It runs the device schedule exactly as a GPU would,
//! so the schedule is tested without one.

use flatpeak_common::gemm::{Accumulate, Threads};
use flatpeak_common::{Communicator, CommunicatorExt, DType};

use super::{DeviceOps, GemmDims, Operand, need};
use crate::cpu::{host_gemm, span, span_mut};
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
}

impl<C: Communicator + ?Sized> DeviceOps for EmuOps<'_, C> {
    type Buf = Vec<f32>;
    type Index = Vec<u32>;

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn alloc(&self, len: usize, dtype: DType) -> Result<Vec<f32>> {
        if dtype != DType::F32 {
            return Err(Error::UnsupportedDtype { dtype, backend: "the emulated device", supported: "f32" });
        }
        Ok(vec![0.0; len.max(1)])
    }

    fn alloc_index(&self, len: usize) -> Result<Vec<u32>> {
        Ok(vec![0; len.max(1)])
    }

    fn buf_len(&self, buf: &Vec<f32>) -> usize {
        buf.len()
    }

    fn buf_dtype(&self, _: &Vec<f32>) -> DType {
        DType::F32
    }

    fn upload(&self, host: &[f32]) -> Result<Vec<f32>> {
        Ok(if host.is_empty() { vec![0.0] } else { host.to_vec() })
    }

    fn write_index(&self, host: &[u32], dst: &mut Vec<u32>) -> Result<()> {
        span_mut("index buffer", dst, 0, host.len())?.copy_from_slice(host);
        Ok(())
    }

    fn write(&self, host: &[f32], dst: &mut Vec<f32>) -> Result<()> {
        span_mut("buffer", dst, 0, host.len())?.copy_from_slice(host);
        Ok(())
    }

    fn download(&self, src: &Vec<f32>, len: usize) -> Result<Vec<f32>> {
        Ok(span("download", src, 0, len)?.to_vec())
    }

    fn download_index(&self, src: &Vec<u32>, len: usize) -> Result<Vec<u32>> {
        Ok(span("index download", src, 0, len)?.to_vec())
    }

    fn zero(&self, dst: &mut Vec<f32>, len: usize) -> Result<()> {
        span_mut("zero fill", dst, 0, len)?.fill(0.0);
        Ok(())
    }

    fn copy(
        &self,
        (src, src_at): (&Vec<f32>, usize),
        (dst, dst_at): (&mut Vec<f32>, usize),
        len: usize,
    ) -> Result<()> {
        let from = span("copy source", src, src_at, len)?;
        span_mut("copy destination", dst, dst_at, len)?.copy_from_slice(from);
        Ok(())
    }

    fn gather_rows(
        &self,
        src: &Vec<f32>,
        index: &Vec<u32>,
        rows: usize,
        scale: Option<&Vec<f32>>,
        width: usize,
        dst: &mut Vec<f32>,
    ) -> Result<()> {
        if rows == 0 || width == 0 {
            return Ok(());
        }
        let index = span("gather index (rows)", index, 0, rows)?;
        emu::gather_rows(src, index, scale.map(Vec::as_slice), width, dst)
    }

    fn scatter_add_rows(
        &self,
        src: &Vec<f32>,
        index: &Vec<u32>,
        rows: usize,
        scale: Option<&Vec<f32>>,
        width: usize,
        acc: &mut Vec<f32>,
    ) -> Result<()> {
        if rows == 0 || width == 0 {
            return Ok(());
        }
        let index = span("scatter index (rows)", index, 0, rows)?;
        emu::scatter_add_rows(src, index, scale.map(Vec::as_slice), width, acc)
    }

    fn swiglu(&self, gate: &Vec<f32>, up: &Vec<f32>, n: usize, h: &mut Vec<f32>) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        emu::swiglu(gate, up, span_mut("swiglu h", h, 0, n)?)
    }

    fn swiglu_backward(&self, gate: &mut Vec<f32>, up: &mut Vec<f32>, dh: &Vec<f32>, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        emu::swiglu_backward(gate, up, span("swiglu_backward dh", dh, 0, n)?)
    }

    fn row_dot(
        &self,
        a: &Vec<f32>,
        b: &Vec<f32>,
        rows: usize,
        width: usize,
        out: &mut Vec<f32>,
    ) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        emu::row_dot(a, b, width, span_mut("row_dot out (rows)", out, 0, rows)?)
    }

    fn gemm(
        &self,
        dims: GemmDims,
        a: Operand<'_, Vec<f32>>,
        b: Operand<'_, Vec<f32>>,
        c: &mut Vec<f32>,
        c_offset: usize,
        accumulate: Accumulate,
    ) -> Result<()> {
        let (a, b) =
            ((a.buf.as_slice(), a.offset, a.orientation), (b.buf.as_slice(), b.offset, b.orientation));
        host_gemm(dims, (a, b), (c, c_offset), accumulate, Threads::All)
    }

    fn all_to_all_v(
        &self,
        (send, send_at): (&Vec<f32>, usize),
        send_counts: &[usize],
        (recv, recv_at): (&mut Vec<f32>, usize),
        recv_counts: &[usize],
    ) -> Result<()> {
        let (ns, nr) = (send_counts.iter().sum(), recv_counts.iter().sum());
        let send = span("all_to_all_v send elements", send, send_at, ns)?;
        let recv = span_mut("all_to_all_v recv elements", recv, recv_at, nr)?;
        Ok(self.comm.all_to_all_v(send, send_counts, recv, recv_counts)?)
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
