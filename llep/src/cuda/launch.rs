//! The kernel launches of the CUDA backend: one generic launcher per kernel of
//! `kernels/llep.cu`, given the entry point of the buffers' element type. Each checks the
//! extents its kernel touches before the launch.

use flatpeak_common::cuda::cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg};
use flatpeak_common::cuda::{cuda_error, linear_launch};
use flatpeak_common::nccl::DeviceCommunicator;

use super::CudaOps;
use super::buf::{RowsAt, check_entries};
use crate::device::{PreAt, ScatterLayout, need};
use crate::error::Result;
use crate::kernels::{LLEP, ROW_THREADS};

fn linear(n: usize) -> LaunchConfig {
    linear_launch(n, 4096)
}

impl<C: DeviceCommunicator> CudaOps<'_, C> {
    /// `llep_gather_rows` of rows of T (entry point `name`): `out[r] = scale_r·src[index[r]]`
    /// over `at`'s entries.
    pub(super) fn launch_gather<T: DeviceRepr>(
        &self,
        name: &'static str,
        (src, at): (&CudaSlice<T>, &RowsAt<'_>),
        (rows, width): (usize, usize),
        out: &mut CudaSlice<T>,
    ) -> Result<()> {
        need("gather dst (rows·width)", rows * width, out.len())?;
        need("gather index (rows)", rows, at.host.len())?;
        check_entries(at.host, src.len() / width)?;
        let f = self.cache.function(&LLEP, name)?;
        let (rows32, width32, null) = (rows as u32, width as u32, 0u64);
        let mut l = self.stream.launch_builder(&f);
        l.arg(src).arg(&at.dev);
        match &at.scale {
            Some(s) => l.arg(s),
            None => l.arg(&null),
        };
        l.arg(&rows32).arg(&width32).arg(&mut *out);
        // SAFETY: `name` is the gather instantiation of T (`(const T*, const u32*, const float*,
        // u32, u32, T*)`: f32, or bf16 `_bf16`), matching the arguments in order (no scale: a null
        // pointer); it reads the `rows` entries of `at.dev` (a view of exactly them, mirrored on
        // the host and each checked a row of `src` above) and `rows` factors of `at.scale` (a view
        // of exactly them), and writes `out[0..rows·width)` (checked above), grid-stride over
        // rows·width, each element by one thread.
        unsafe { l.launch(linear(rows * width)) }.map_err(cuda_error(name))?;
        Ok(())
    }

    /// `llep_scatter_add_rows` of rows of S into rows of A (entry point `name`, the instantiation
    /// of `layout`): `out[index[r]] += scale_r·src[r]`, r in order, over `at`'s entries.
    /// [`ScatterLayout::Direct`] launches one thread per (row, column) on the index as it is;
    /// [`ScatterLayout::Grouped`] uploads the groups on the stream (4·(2·groups + 1 + rows)
    /// bytes, freed in stream order after the launch) and runs one thread per (destination,
    /// column).
    pub(super) fn launch_scatter<S: DeviceRepr, A: DeviceRepr>(
        &self,
        (name, layout): (&'static str, &ScatterLayout),
        (src, at): (&CudaSlice<S>, &RowsAt<'_>),
        (rows, width): (usize, usize),
        out: &mut CudaSlice<A>,
    ) -> Result<()> {
        need("scatter src (rows·width)", rows * width, src.len())?;
        need("scatter index (rows)", rows, at.host.len())?;
        check_entries(at.host, out.len() / width)?;
        // Grouped: the groups uploaded on the stream (freed in stream order after the launch).
        let packed = match layout {
            ScatterLayout::Direct => None,
            ScatterLayout::Grouped(g) => {
                Some(self.stream.clone_htod(g.packed()).map_err(cuda_error("cuMemcpyHtoD"))?)
            }
        };
        let count = match layout {
            ScatterLayout::Direct => rows,
            ScatterLayout::Grouped(g) => g.groups(),
        };
        let f = self.cache.function(&LLEP, name)?;
        let (count32, width32, null) = (count as u32, width as u32, 0u64);
        let mut l = self.stream.launch_builder(&f);
        l.arg(src);
        match &packed {
            Some(p) => l.arg(p),
            None => l.arg(&at.dev),
        };
        match &at.scale {
            Some(s) => l.arg(s),
            None => l.arg(&null),
        };
        l.arg(&count32).arg(&width32).arg(&mut *out);
        // SAFETY: `name` is `layout`'s scatter instantiation of (S, A) (`(const S*, const u32*,
        // const float*, u32, u32, A*)`: f32→f32, bf16→f32 `_bf16`, bf16→bf16 `_bf16_bf16`, direct
        // or grouped), matching the arguments in order (no scale: a null pointer); `src` holds
        // rows·width and `at.scale` views exactly `rows` factors (checked above). Direct: `at.dev`
        // views exactly the `rows` entries, mirrored on the host, each a row of `out` (checked
        // above) and all distinct (`ScatterLayout::of`), one thread per (row, column).
        // Grouped: `packed` is `ScatterGroups`' layout for `count` groups over the `rows` rows,
        // every destination a row of `out` (checked above) and distinct, one thread per
        // (destination, column). Either way each thread updates its own element of `out`.
        unsafe { l.launch(linear(count * width)) }.map_err(cuda_error(name))?;
        Ok(())
    }

    /// `llep_swiglu` of element type T over `n` elements: gate and up the pre-activations of
    /// `gu` at `at` (split blocks or fused rows).
    pub(super) fn launch_swiglu<T: DeviceRepr>(
        &self,
        name: &'static str,
        (gu, at): (&CudaSlice<T>, PreAt),
        n: usize,
        h: &mut CudaSlice<T>,
    ) -> Result<()> {
        at.check(n, gu.len())?;
        need("swiglu h", n, h.len())?;
        let f = self.cache.function(&LLEP, name)?;
        let (gate_at, up_at, width, pitch) = at.layout(n);
        let (gate_at, up_at, n64, width, pitch) =
            (gate_at as u64, up_at as u64, n as u64, width as u32, pitch as u64);
        let mut l = self.stream.launch_builder(&f);
        l.arg(gu).arg(&gate_at).arg(&up_at).arg(&n64).arg(&width).arg(&pitch).arg(&mut *h);
        // SAFETY: `name` is `llep_swiglu` of T (`(const T*, u64, u64, u64, u32, u64, T*)`),
        // matching; it reads the n gate and n up elements of `at`'s layout, inside `gu` (checked
        // above), and writes `h[0..n)` (checked); `h` is a distinct allocation (a `&mut` borrow).
        unsafe { l.launch(linear(n)) }.map_err(cuda_error(name))?;
        Ok(())
    }

    /// `llep_swiglu_backward` of element type T over `n` elements: the pre-activations of `gu`
    /// at `at` rewritten in place from `dh`.
    pub(super) fn launch_swiglu_backward<T: DeviceRepr>(
        &self,
        name: &'static str,
        (gu, at): (&mut CudaSlice<T>, PreAt),
        dh: &CudaSlice<T>,
        n: usize,
    ) -> Result<()> {
        at.check(n, gu.len())?;
        need("swiglu_backward dh", n, dh.len())?;
        let f = self.cache.function(&LLEP, name)?;
        let (gate_at, up_at, width, pitch) = at.layout(n);
        let (gate_at, up_at, n64, width, pitch) =
            (gate_at as u64, up_at as u64, n as u64, width as u32, pitch as u64);
        let mut l = self.stream.launch_builder(&f);
        l.arg(&mut *gu).arg(&gate_at).arg(&up_at).arg(dh).arg(&n64).arg(&width).arg(&pitch);
        // SAFETY: `name` is `llep_swiglu_backward` of T (`(T*, u64, u64, const T*, u64, u32,
        // u64)`), matching; element e's thread rewrites its gate and up element of `at`'s layout
        // (inside `gu` and disjoint, checked above) and reads `dh[e]`, e < n (checked); `dh` is
        // a distinct allocation (a `&` borrow beside `gu`'s `&mut`).
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
