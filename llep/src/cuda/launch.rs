//! The kernel launches of the CUDA backend: one generic launcher per kernel of
//! `kernels/llep.cu`, given the entry point of the buffers' element type. Each checks the
//! extents its kernel touches before the launch.

use flatpeak_common::cuda::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use flatpeak_common::cuda::{cuda_error, linear_launch};
use flatpeak_common::nccl::DeviceCommunicator;

use super::{CudaIndex, CudaOps};
use crate::device::need;
use crate::error::Result;
use crate::kernels::{LLEP, ROW_THREADS};

fn linear(n: usize) -> LaunchConfig {
    linear_launch(n, 4096)
}

/// Which of the two row kernels of `kernels/llep.cu` (one argument list) a launch runs.
#[derive(Debug, Clone, Copy)]
pub(super) enum RowKernel {
    /// `llep_gather_rows`: `out[r] = scale_r·src[index[r]]`.
    Gather,
    /// `llep_scatter_add_rows`: `out[index[r]] += scale_r·src[r]`, r in order.
    ScatterAdd,
}

impl<C: DeviceCommunicator> CudaOps<'_, C> {
    /// `llep_gather_rows` or `llep_scatter_add_rows` ([`RowKernel`]) of rows of S into rows of
    /// A (entry point `name`).
    pub(super) fn launch_rows<S: DeviceRepr, A: DeviceRepr>(
        &self,
        kernel: RowKernel,
        name: &'static str,
        (src, index, scale): (&CudaSlice<S>, &CudaIndex, Option<&CudaSlice<f32>>),
        (rows, width): (usize, usize),
        out: &mut CudaSlice<A>,
    ) -> Result<()> {
        let threads = match kernel {
            RowKernel::Gather => {
                need("gather dst (rows·width)", rows * width, out.len())?;
                index.check_rows(rows, src.len() / width)?;
                rows * width
            }
            RowKernel::ScatterAdd => {
                need("scatter src (rows·width)", rows * width, src.len())?;
                index.check_rows(rows, out.len() / width)?;
                width
            }
        };
        let f = self.cache.function(&LLEP, name)?;
        let (rows32, width32, null) = (rows as u32, width as u32, 0u64);
        let mut l = self.stream.launch_builder(&f);
        l.arg(src).arg(&index.dev);
        match scale {
            Some(s) => l.arg(s),
            None => l.arg(&null),
        };
        l.arg(&rows32).arg(&width32).arg(&mut *out);
        // SAFETY: `name` is the `kernel` instantiation of (S, A), both kernels `(const S*, const
        // u32*, const float*, u32, u32, A*)` (gather: f32, or bf16 `_bf16`, S = A; scatter:
        // f32→f32, bf16→f32 `_bf16`, bf16→bf16 `_bf16_bf16`), matching the arguments in order (no
        // scale: a null pointer); it reads `index[0..rows)`, each entry < rows of `src` (gather)
        // or of `out` (scatter), checked on the host mirror, and `scale[0..rows)` (checked by the
        // caller). Gather reads rows of `src` and writes `out[0..rows·width)` (checked above),
        // grid-stride over rows·width; scatter reads `src[0..rows·width)` (checked above) and
        // thread c updates column c of `out` only.
        unsafe { l.launch(linear(threads)) }.map_err(cuda_error(name))?;
        Ok(())
    }

    /// `llep_swiglu` of element type T.
    pub(super) fn launch_swiglu<T: DeviceRepr>(
        &self,
        name: &'static str,
        (gate, up): (&CudaSlice<T>, &CudaSlice<T>),
        n: usize,
        h: &mut CudaSlice<T>,
    ) -> Result<()> {
        need("swiglu gate", n, gate.len())?;
        need("swiglu up", n, up.len())?;
        need("swiglu h", n, h.len())?;
        let f = self.cache.function(&LLEP, name)?;
        let n64 = n as u64;
        let mut l = self.stream.launch_builder(&f);
        l.arg(gate).arg(up).arg(&n64).arg(&mut *h);
        // SAFETY: `name` is `llep_swiglu` of T (`(const T*, const T*, u64, T*)`), matching; it
        // reads `gate[0..n)`, `up[0..n)` and writes `h[0..n)`, all holding ≥ n (checked above);
        // `h` is a distinct allocation (a `&mut` borrow).
        unsafe { l.launch(linear(n)) }.map_err(cuda_error(name))?;
        Ok(())
    }

    /// `llep_swiglu_backward` of element type T.
    pub(super) fn launch_swiglu_backward<T: DeviceRepr>(
        &self,
        name: &'static str,
        (gate, up): (&mut CudaSlice<T>, &mut CudaSlice<T>),
        dh: &CudaSlice<T>,
        n: usize,
    ) -> Result<()> {
        need("swiglu_backward gate", n, gate.len())?;
        need("swiglu_backward up", n, up.len())?;
        need("swiglu_backward dh", n, dh.len())?;
        let f = self.cache.function(&LLEP, name)?;
        let n64 = n as u64;
        let mut l = self.stream.launch_builder(&f);
        l.arg(&mut *gate).arg(&mut *up).arg(dh).arg(&n64);
        // SAFETY: `name` is `llep_swiglu_backward` of T (`(T*, T*, const T*, u64)`), matching;
        // element e of `gate`, `up` (rewritten in place) and `dh` for e < n, all holding ≥ n
        // (checked above); the three are distinct allocations (two `&mut` borrows and a `&`).
        unsafe { l.launch(linear(n)) }.map_err(cuda_error(name))?;
        Ok(())
    }

    /// `llep_row_dot` of element type T (out f32).
    pub(super) fn launch_row_dot<T: DeviceRepr>(
        &self,
        name: &'static str,
        (a, b): (&CudaSlice<T>, &CudaSlice<T>),
        (rows, width): (usize, usize),
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        need("row_dot a", rows * width, a.len())?;
        need("row_dot b", rows * width, b.len())?;
        need("row_dot out (rows)", rows, out.len())?;
        let f = self.cache.function(&LLEP, name)?;
        let width32 = width as u32;
        let mut l = self.stream.launch_builder(&f);
        l.arg(a).arg(b).arg(&width32).arg(&mut *out);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `name` is `llep_row_dot` of T (`(const T*, const T*, u32, float*)`), matching;
        // block r reads row r of `a` and `b` (rows·width, checked) and writes `out[r]` (rows,
        // checked); ROW_THREADS is a multiple of 32 and at most 1024, as the block reduction
        // requires.
        unsafe { l.launch(cfg) }.map_err(cuda_error(name))?;
        Ok(())
    }
}
