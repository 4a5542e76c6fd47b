//! [`DeviceOps`] on a CUDA device (feature `cuda`): buffers are cudarc [`CudaSlice`]s, the
//! kernels are `kernels/llep.cu` compiled by NVRTC through [`KernelCache`], the GEMM is cuBLAS
//! SGEMM (default math mode: f32 with f32 accumulation, no TF32) and all-to-all is
//! [`DeviceCommunicator::all_to_all_v`] (NCCL). The round schedule ([`crate::device`]) runs on
//! it unchanged, chosen by [`Executor::new`](crate::Executor::new) with `Device::Cuda(n)`
//! ([`Executor::forward_cuda`](crate::Executor::forward_cuda),
//! [`Executor::backward_cuda`](crate::Executor::backward_cuda)).
//!
//! # Streams
//!
//! The all-to-alls run on the communicator's stream; kernels, GEMMs and every other copy run on
//! a compute stream of the same context, and the downloads of received route metadata on a
//! third, both created by [`CudaOps::new`]. So round j+1's dispatch, which the schedule issues
//! before round j's experts, moves while they compute (with three buffer copies, so does round
//! j−1's combine), and the host fetches round j+1's metadata as soon as it has arrived — not
//! behind round j's combine, which waits for round j's experts — and queues round j+1 while
//! round j still computes. Order between the streams comes from cudarc's per-buffer read/write
//! events: every buffer the schedule touches is a `CudaSlice` of this
//! context, which `new` puts in multi-stream mode, so an all-to-all waits for the kernels that
//! wrote what it sends and for the last reader of what it overwrites, and a kernel waits for the
//! all-to-all that filled its operand. [`DeviceOps::fence`], at the start and end of every pass,
//! makes each stream wait for the other: the caller's work on the communicator's stream comes
//! first, and a pass's sends are complete before the caller may overwrite its inputs.
//!
//! This is the only file of the crate that launches kernels or calls cuBLAS. Every safe method
//! checks its operands' lengths before launching; gathers and scatters also check every row
//! index against the rows of the buffer it indexes, from the host mirror [`CudaIndex`] keeps of
//! what the host wrote (an index buffer filled on the device cannot be used as row indices).
//! No device, driver, NVRTC or NCCL is a typed error ([`flatpeak_common::Error`]), never a
//! fallback.

use std::sync::Arc;

use flatpeak_common::DType;
use flatpeak_common::cuda::cudarc::cublas::CudaBlas;
use flatpeak_common::cuda::cudarc::cublas::sys::cublasOperation_t;
use flatpeak_common::cuda::cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, LaunchConfig, PushKernelArg,
};
use flatpeak_common::cuda::{KernelCache, cuda_error, linear_launch, sgemm};
use flatpeak_common::gemm::Accumulate;
use flatpeak_common::nccl::DeviceCommunicator;

use crate::device::{DeviceOps, GemmDims, Operand, Orientation, need};
use crate::error::{Error, Result};
use crate::kernels::{LINEAR_THREADS, LLEP, ROW_THREADS};

fn linear(n: usize) -> LaunchConfig {
    linear_launch(n, LINEAR_THREADS, 4096)
}

fn view<'a>(what: &'static str, s: &'a CudaSlice<f32>, at: usize, len: usize) -> Result<CudaView<'a, f32>> {
    need(what, at + len, s.len())?;
    s.try_slice(at..at + len).ok_or(Error::ShapeMismatch { what, expected: at + len, got: s.len() })
}

fn view_mut<'a>(
    what: &'static str,
    s: &'a mut CudaSlice<f32>,
    at: usize,
    len: usize,
) -> Result<CudaViewMut<'a, f32>> {
    let found = s.len();
    need(what, at + len, found)?;
    s.try_slice_mut(at..at + len).ok_or(Error::ShapeMismatch { what, expected: at + len, got: found })
}

/// A device buffer of u32 with a host mirror of its entries while they are known on the host
/// (written by [`DeviceOps::write_index`]); `None` after a device-side write (all-to-all).
#[derive(Debug)]
pub struct CudaIndex {
    dev: CudaSlice<u32>,
    host: Option<Vec<u32>>,
}

impl CudaIndex {
    /// Checks that the first `rows` entries are known and each is below `bound`.
    fn check_rows(&self, rows: usize, bound: usize) -> Result<()> {
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

/// The CUDA device of one rank of a [`DeviceCommunicator`]: a compute stream beside the
/// communicator's, the NVRTC kernels and a cuBLAS handle.
#[derive(Debug)]
pub struct CudaOps<'c, C: DeviceCommunicator> {
    comm: &'c C,
    stream: Arc<CudaStream>,
    fetch: Arc<CudaStream>,
    cache: KernelCache,
    blas: CudaBlas,
}

impl<'c, C: DeviceCommunicator> CudaOps<'c, C> {
    /// The device of `comm`'s stream, with a new compute stream that first waits for it and a
    /// stream for metadata downloads: compiles nothing yet (kernels compile at first use),
    /// creates the cuBLAS handle (default math mode) on the compute stream. Creating the streams
    /// puts the context in multi-stream mode (cudarc synchronizes the context once, when it
    /// does).
    ///
    /// Synchronize ([`CudaOps::synchronize`]) before dropping the communicator: cudarc aborts an
    /// NCCL communicator when it drops, which would cancel the last pass's transfers if they
    /// are still queued (a pass returns without waiting for them).
    pub fn new(comm: &'c C) -> Result<Self> {
        let ctx = comm.stream().context().clone();
        let stream = ctx.new_stream().map_err(cuda_error("cuStreamCreate"))?;
        stream.join(comm.stream()).map_err(cuda_error("cuStreamWaitEvent"))?;
        let fetch = ctx.new_stream().map_err(cuda_error("cuStreamCreate"))?;
        let cache = KernelCache::new(ctx)?;
        let blas = CudaBlas::new(stream.clone()).map_err(cuda_error("cublasCreate"))?;
        Ok(Self { comm, stream, fetch, cache, blas })
    }

    /// Waits for every operation issued so far, on both streams (the metadata downloads wait
    /// on the host as they run).
    pub fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(cuda_error("cuStreamSynchronize"))?;
        self.comm.stream().synchronize().map_err(cuda_error("cuStreamSynchronize")).map_err(Error::from)
    }

    /// The compute stream: kernels, GEMMs and copies other than the all-to-alls' run on it.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<C: DeviceCommunicator> DeviceOps for CudaOps<'_, C> {
    type Buf = CudaSlice<f32>;
    type Index = CudaIndex;

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn alloc(&self, len: usize, dtype: DType) -> Result<CudaSlice<f32>> {
        if dtype != DType::F32 {
            return Err(Error::UnsupportedDtype { dtype, backend: "the CUDA device", supported: "f32" });
        }
        self.stream.alloc_zeros::<f32>(len.max(1)).map_err(cuda_error("cuMemAlloc")).map_err(Error::from)
    }

    fn alloc_index(&self, len: usize) -> Result<CudaIndex> {
        let dev = self.stream.alloc_zeros::<u32>(len.max(1)).map_err(cuda_error("cuMemAlloc"))?;
        Ok(CudaIndex { dev, host: Some(vec![0; len.max(1)]) })
    }

    fn buf_len(&self, buf: &CudaSlice<f32>) -> usize {
        buf.len()
    }

    fn buf_dtype(&self, _: &CudaSlice<f32>) -> DType {
        DType::F32
    }

    fn upload(&self, host: &[f32]) -> Result<CudaSlice<f32>> {
        if host.is_empty() {
            return self.alloc(1, DType::F32);
        }
        self.stream.clone_htod(host).map_err(cuda_error("cuMemcpyHtoD")).map_err(Error::from)
    }

    fn write_index(&self, host: &[u32], dst: &mut CudaIndex) -> Result<()> {
        let found = dst.dev.len();
        need("index buffer", host.len(), found)?;
        if host.is_empty() {
            return Ok(());
        }
        let mut v = dst.dev.try_slice_mut(..host.len()).ok_or(Error::ShapeMismatch {
            what: "index buffer",
            expected: host.len(),
            got: found,
        })?;
        self.stream.memcpy_htod(host, &mut v).map_err(cuda_error("cuMemcpyHtoD"))?;
        let mirror = dst.host.get_or_insert_with(|| vec![u32::MAX; found]);
        mirror[..host.len()].copy_from_slice(host);
        Ok(())
    }

    fn write(&self, host: &[f32], dst: &mut CudaSlice<f32>) -> Result<()> {
        if host.is_empty() {
            return Ok(());
        }
        let mut v = view_mut("buffer", dst, 0, host.len())?;
        self.stream.memcpy_htod(host, &mut v).map_err(cuda_error("cuMemcpyHtoD")).map_err(Error::from)
    }

    fn download(&self, src: &CudaSlice<f32>, len: usize) -> Result<Vec<f32>> {
        if len == 0 {
            return Ok(Vec::new());
        }
        self.stream
            .clone_dtoh(&view("download", src, 0, len)?)
            .map_err(cuda_error("cuMemcpyDtoH"))
            .map_err(Error::from)
    }

    fn download_index(&self, src: &CudaIndex, len: usize) -> Result<Vec<u32>> {
        need("index download", len, src.dev.len())?;
        if len == 0 {
            return Ok(Vec::new());
        }
        let v = src.dev.try_slice(..len).ok_or(Error::ShapeMismatch {
            what: "index download",
            expected: len,
            got: src.dev.len(),
        })?;
        // On a stream of its own: cudarc's events make it wait for the all-to-all that wrote
        // `src` (or the upload that did), not for the combine and compute queued meanwhile on
        // the other two streams.
        self.fetch.clone_dtoh(&v).map_err(cuda_error("cuMemcpyDtoH")).map_err(Error::from)
    }

    fn fence(&self) -> Result<()> {
        self.stream.join(self.comm.stream()).map_err(cuda_error("cuStreamWaitEvent"))?;
        self.comm.stream().join(&self.stream).map_err(cuda_error("cuStreamWaitEvent")).map_err(Error::from)
    }

    fn zero(&self, dst: &mut CudaSlice<f32>, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.stream
            .memset_zeros(&mut view_mut("zero fill", dst, 0, len)?)
            .map_err(cuda_error("cuMemsetD8"))
            .map_err(Error::from)
    }

    fn copy(
        &self,
        (src, src_at): (&CudaSlice<f32>, usize),
        (dst, dst_at): (&mut CudaSlice<f32>, usize),
        len: usize,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let from = view("copy source", src, src_at, len)?;
        let mut to = view_mut("copy destination", dst, dst_at, len)?;
        self.stream.memcpy_dtod(&from, &mut to).map_err(cuda_error("cuMemcpyDtoD")).map_err(Error::from)
    }

    fn gather_rows(
        &self,
        src: &CudaSlice<f32>,
        index: &CudaIndex,
        rows: usize,
        scale: Option<&CudaSlice<f32>>,
        width: usize,
        dst: &mut CudaSlice<f32>,
    ) -> Result<()> {
        if rows == 0 || width == 0 {
            return Ok(());
        }
        need("gather dst (rows·width)", rows * width, dst.len())?;
        index.check_rows(rows, src.len() / width)?;
        if let Some(s) = scale {
            need("gather scale (rows)", rows, s.len())?;
        }
        let f = self.cache.function(&LLEP, "llep_gather_rows")?;
        let (rows32, width32, null) = (rows as u32, width as u32, 0u64);
        let mut l = self.stream.launch_builder(&f);
        l.arg(src).arg(&index.dev);
        match scale {
            Some(s) => l.arg(s),
            None => l.arg(&null),
        };
        l.arg(&rows32).arg(&width32).arg(&mut *dst);
        // SAFETY: `llep_gather_rows(const float*, const u32*, const float*, u32, u32, float*)`
        // matches the arguments in order (no scale: a null pointer); it reads `index[0..rows)`,
        // each entry < src rows (checked on the host mirror), `scale[0..rows)` and writes
        // `dst[0..rows·width)` — all lengths checked above; grid-stride over rows·width.
        unsafe { l.launch(linear(rows * width)) }.map_err(cuda_error("cuLaunchKernel(llep_gather_rows)"))?;
        Ok(())
    }

    fn scatter_add_rows(
        &self,
        src: &CudaSlice<f32>,
        index: &CudaIndex,
        rows: usize,
        scale: Option<&CudaSlice<f32>>,
        width: usize,
        acc: &mut CudaSlice<f32>,
    ) -> Result<()> {
        if rows == 0 || width == 0 {
            return Ok(());
        }
        need("scatter src (rows·width)", rows * width, src.len())?;
        index.check_rows(rows, acc.len() / width)?;
        if let Some(s) = scale {
            need("scatter scale (rows)", rows, s.len())?;
        }
        let f = self.cache.function(&LLEP, "llep_scatter_add_rows")?;
        let (rows32, width32, null) = (rows as u32, width as u32, 0u64);
        let mut l = self.stream.launch_builder(&f);
        l.arg(src).arg(&index.dev);
        match scale {
            Some(s) => l.arg(s),
            None => l.arg(&null),
        };
        l.arg(&rows32).arg(&width32).arg(&mut *acc);
        // SAFETY: `llep_scatter_add_rows(const float*, const u32*, const float*, u32, u32,
        // float*)` matches the arguments in order (no scale: a null pointer); it reads
        // `src[0..rows·width)`, `index[0..rows)` (each < acc rows, checked on the host mirror),
        // `scale[0..rows)`, and thread c updates column c of `acc` only — lengths checked above.
        unsafe { l.launch(linear(width)) }.map_err(cuda_error("cuLaunchKernel(llep_scatter_add_rows)"))?;
        Ok(())
    }

    fn swiglu(
        &self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        n: usize,
        h: &mut CudaSlice<f32>,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        need("swiglu gate", n, gate.len())?;
        need("swiglu up", n, up.len())?;
        need("swiglu h", n, h.len())?;
        let f = self.cache.function(&LLEP, "llep_swiglu")?;
        let n64 = n as u64;
        let mut l = self.stream.launch_builder(&f);
        l.arg(gate).arg(up).arg(&n64).arg(&mut *h);
        // SAFETY: `llep_swiglu(const float*, const float*, u64, float*)` matches; it reads
        // `gate[0..n)`, `up[0..n)` and writes `h[0..n)`, all holding ≥ n (checked above); `h`
        // is a distinct allocation (a `&mut` borrow).
        unsafe { l.launch(linear(n)) }.map_err(cuda_error("cuLaunchKernel(llep_swiglu)"))?;
        Ok(())
    }

    fn swiglu_backward(
        &self,
        gate: &mut CudaSlice<f32>,
        up: &mut CudaSlice<f32>,
        dh: &CudaSlice<f32>,
        n: usize,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        need("swiglu_backward gate", n, gate.len())?;
        need("swiglu_backward up", n, up.len())?;
        need("swiglu_backward dh", n, dh.len())?;
        let f = self.cache.function(&LLEP, "llep_swiglu_backward")?;
        let n64 = n as u64;
        let mut l = self.stream.launch_builder(&f);
        l.arg(&mut *gate).arg(&mut *up).arg(dh).arg(&n64);
        // SAFETY: `llep_swiglu_backward(float*, float*, const float*, u64)` matches; element e
        // of `gate`, `up` (rewritten in place) and `dh` for e < n, all holding ≥ n (checked
        // above); the three are distinct allocations (two `&mut` borrows and a `&`).
        unsafe { l.launch(linear(n)) }.map_err(cuda_error("cuLaunchKernel(llep_swiglu_backward)"))?;
        Ok(())
    }

    fn row_dot(
        &self,
        a: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
        rows: usize,
        width: usize,
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        need("row_dot a", rows * width, a.len())?;
        need("row_dot b", rows * width, b.len())?;
        need("row_dot out (rows)", rows, out.len())?;
        let f = self.cache.function(&LLEP, "llep_row_dot")?;
        let width32 = width as u32;
        let mut l = self.stream.launch_builder(&f);
        l.arg(a).arg(b).arg(&width32).arg(&mut *out);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (ROW_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: `llep_row_dot(const float*, const float*, u32, float*)` matches; block r reads
        // row r of `a` and `b` (rows·width, checked) and writes `out[r]` (rows, checked);
        // ROW_THREADS is a multiple of 32 and at most 1024, as the block reduction requires.
        unsafe { l.launch(cfg) }.map_err(cuda_error("cuLaunchKernel(llep_row_dot)"))?;
        Ok(())
    }

    fn gemm(
        &self,
        GemmDims { m, n, k }: GemmDims,
        a: Operand<'_, CudaSlice<f32>>,
        b: Operand<'_, CudaSlice<f32>>,
        c: &mut CudaSlice<f32>,
        c_offset: usize,
        accumulate: Accumulate,
    ) -> Result<()> {
        if m == 0 || n == 0 {
            return Ok(());
        }
        let av = view("gemm A (m·k)", a.buf, a.offset, m * k)?;
        let bv = view("gemm B (k·n)", b.buf, b.offset, k * n)?;
        let mut cv = view_mut("gemm C (m·n)", c, c_offset, m * n)?;
        // Row-major C = op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ: op(B)ᵀ is B's storage
        // read column-major (n×k, ld n) or its transpose (stored n×k row-major: ld k); same for A.
        let (op_b, ld_b) = if b.orientation == Orientation::Transposed {
            (cublasOperation_t::CUBLAS_OP_T, k)
        } else {
            (cublasOperation_t::CUBLAS_OP_N, n)
        };
        let (op_a, ld_a) = if a.orientation == Orientation::Transposed {
            (cublasOperation_t::CUBLAS_OP_T, m)
        } else {
            (cublasOperation_t::CUBLAS_OP_N, k)
        };
        let beta = if accumulate == Accumulate::Add { 1.0 } else { 0.0 };
        // SAFETY: the views hold exactly the extents this product reads and writes: op(B)ᵀ n×k
        // (k·n elements, ld n or k), op(A)ᵀ k×m (m·k, ld k or m) and C n×m (m·n, ld n), checked
        // when the views were made; all three are ordered on `self.stream`, the handle's
        // stream, and C is a `&mut` borrow distinct from A and B.
        Ok(unsafe {
            sgemm(&self.blas, (op_b, op_a), (n, m, k), (&bv, ld_b), (&av, ld_a), (&mut cv, n), beta)
        }?)
    }

    fn all_to_all_v(
        &self,
        (send, send_at): (&CudaSlice<f32>, usize),
        send_counts: &[usize],
        (recv, recv_at): (&mut CudaSlice<f32>, usize),
        recv_counts: &[usize],
    ) -> Result<()> {
        let (ns, nr) = (send_counts.iter().sum(), recv_counts.iter().sum());
        let sv = view("all_to_all_v send elements", send, send_at, ns)?;
        let mut rv = view_mut("all_to_all_v recv elements", recv, recv_at, nr)?;
        Ok(self.comm.all_to_all_v(&sv, send_counts, &mut rv, recv_counts)?)
    }

    fn all_to_all_v_index(
        &self,
        send: &CudaIndex,
        send_counts: &[usize],
        recv: &mut CudaIndex,
        recv_counts: &[usize],
    ) -> Result<()> {
        let found = recv.dev.len();
        need("all_to_all_v recv elements", recv_counts.iter().sum(), found)?;
        recv.host = None;
        let sv = send.dev.as_view();
        let mut rv = recv.dev.as_view_mut();
        Ok(self.comm.all_to_all_v(&sv, send_counts, &mut rv, recv_counts)?)
    }
}
