//! [`DeviceOps`] on a CUDA device (feature `cuda`): buffers are cudarc [`CudaSlice`](flatpeak_common::cuda::cudarc::driver::CudaSlice)s of f32 or
//! bf16 ([`CudaBuf`]), the kernels are `kernels/llep.cu` compiled by NVRTC through
//! [`KernelCache`] (the instantiation of the buffers' type), the GEMM is cuBLAS — SGEMM on f32
//! operands (default math mode: f32 with f32 accumulation, no TF32), `GemmEx` on bf16 operands
//! in place (tensor cores, `CUBLAS_COMPUTE_32F`; C f32 or bf16, rounded once) — and all-to-all is
//! [`DeviceCommunicator::all_to_all_v`] (NCCL, of the buffers' type). The round schedule ([`crate::device`]) runs on
//! it unchanged, chosen by [`Executor::new`](crate::Executor::new) with `Device::Cuda(n)`
//! ([`Executor::forward`](crate::Executor::forward),
//! [`Executor::backward`](crate::Executor::backward) with these ops as the [`Rank`](crate::Rank)).
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
//! This module (`launch.rs`: the kernels; here: cuBLAS) is the only place in the crate that
//! launches kernels or calls cuBLAS. Every safe method
//! checks its operands' lengths before launching; gathers and scatters also check every row
//! index against the rows of the buffer it indexes, from the host mirror [`CudaIndex`] keeps of
//! what the host wrote (an index buffer filled on the device cannot be used as row indices).
//! No device, driver, NVRTC or NCCL is a typed error ([`flatpeak_common::Error`]), never a
//! fallback.

use std::sync::Arc;

use flatpeak_common::DType;
use flatpeak_common::cuda::cudarc::cublas::sys::cublasOperation_t;
use flatpeak_common::cuda::cudarc::driver::{CudaStream, CudaView, CudaViewMut, DeviceRepr, ValidAsZeroBits};
use flatpeak_common::cuda::{
    self as blas, Bf16GemmOutput, BlasMath, GemmShape, KernelCache, SharedBlas, alloc_error, cuda_error,
    gemm_bf16, sgemm,
};
use flatpeak_common::gemm::Accumulate;
use flatpeak_common::nccl::DeviceCommunicator;
use half::bf16;

use crate::device::{
    DeviceOps, GemmDims, IndexedRows, Operand, Orientation, PreAt, ScatterLayout, need, same_type,
};
use crate::error::{Error, Result};

mod arena;
mod buf;
mod launch;

use crate::kernels::entry;
pub use arena::{DevSlice, DeviceArena};
pub use buf::{CudaBuf, CudaIndex};
use buf::{rows_at, view, view_mut};

/// The CUDA device of one rank of a [`DeviceCommunicator`]: a compute stream beside the
/// communicator's, the NVRTC kernels and a cuBLAS handle.
#[derive(Debug)]
pub struct CudaOps<'c, C: DeviceCommunicator> {
    comm: &'c C,
    stream: Arc<CudaStream>,
    fetch: Arc<CudaStream>,
    cache: Arc<KernelCache>,
    blas: Arc<SharedBlas>,
    /// Lent memory every buffer is carved from, or none (allocated through cudarc).
    arena: Option<DeviceArena>,
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
        let (cache, blas) = (KernelCache::shared(&ctx)?, SharedBlas::of(&ctx)?);
        Ok(Self { comm, stream, fetch, cache, blas, arena: None })
    }

    /// These ops carving every buffer they allocate (dispatch buffers, expert scratch, index
    /// lists, uploads, outputs) from `arena` instead of allocating through cudarc: a framework's
    /// allocator then holds the call's whole device working set. An arena too small for a
    /// buffer is [`Error::ShapeMismatch`] naming the bytes needed
    /// ([`Plan::device_arena_bytes`](crate::Plan::device_arena_bytes) is enough for a call of
    /// the plan).
    pub fn lending(mut self, arena: DeviceArena) -> Self {
        self.arena = Some(arena);
        self
    }

    /// A zeroed buffer of `len` elements (at least one): carved from the lent arena, or allocated.
    fn fresh<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize, what: &'static str) -> Result<DevSlice<T>> {
        let len = len.max(1);
        let bytes = len * std::mem::size_of::<T>();
        match &self.arena {
            None => Ok(DevSlice::owned(self.stream.alloc_zeros::<T>(len).map_err(alloc_error(what, bytes))?)),
            Some(arena) => {
                let address = arena.carve(bytes)?;
                // SAFETY: `address..address + bytes` lies inside the arena, aligned and disjoint
                // from every other carve (`carve`), zeroed device memory of this context that
                // nothing else uses for the call and that outlives it (`DeviceArena::new`'s
                // contract); `DevSlice::lent` never frees it.
                Ok(DevSlice::lent(unsafe { self.stream.upgrade_device_ptr::<T>(address, len) }))
            }
        }
    }

    /// A new buffer holding `host` (at least one element): [`fresh`](Self::fresh), then a copy.
    fn uploaded<T: DeviceRepr + ValidAsZeroBits>(&self, host: &[T]) -> Result<DevSlice<T>> {
        let mut out = self.fresh::<T>(host.len(), "an llep upload")?;
        if !host.is_empty() {
            let mut to =
                out.try_slice_mut(..host.len()).ok_or(Error::internal("an upload fits its buffer"))?;
            self.stream.memcpy_htod(host, &mut to).map_err(cuda_error("cuMemcpyHtoD"))?;
        }
        Ok(out)
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

    /// A new bf16 buffer holding `host` (a bf16 layer's tokens, expert weights and dY).
    pub fn upload_bf16(&self, host: &[bf16]) -> Result<CudaBuf> {
        Ok(CudaBuf::Bf16(self.uploaded(host)?))
    }

    /// `C = op(A)·op(B) + β·C` with bf16 A and B into a C of f32 or bf16 (cuBLAS rounds a bf16
    /// result once), on this handle and stream.
    ///
    /// # Safety
    /// As `gemm_bf16`'s: the views hold the column-major extents `call.shape` and their leading
    /// dimensions imply, and C is distinct from A and B.
    unsafe fn gemm_bf16_views<T: Bf16GemmOutput>(
        &self,
        call: blas::GemmCall<'_, CudaView<'_, bf16>, CudaView<'_, bf16>, CudaViewMut<'_, T>>,
    ) -> Result<()> {
        let bound = self.blas.bind(&self.stream, BlasMath::Default)?;
        // SAFETY: the extents and the non-aliasing are this function's contract; `bound` is
        // bound to `self.stream`, on which every operand is ordered, while it lives.
        Ok(unsafe { gemm_bf16(&bound, &self.stream, call) }?)
    }
}

/// Row-major `C = op(A)·op(B)` is column-major `Cᵀ = op(B)ᵀ·op(A)ᵀ`: op(B)ᵀ is B's storage read
/// column-major (n×k, ld n) or its transpose (stored n×k row-major: ld k); likewise A. Returns
/// cuBLAS's (op, ld) of B then of A.
fn column_major_ops(
    GemmDims { m, n, k }: GemmDims,
    (a, b): (Orientation, Orientation),
) -> ((cublasOperation_t, usize), (cublasOperation_t, usize)) {
    let op_b = if b == Orientation::Transposed {
        (cublasOperation_t::CUBLAS_OP_T, k)
    } else {
        (cublasOperation_t::CUBLAS_OP_N, n)
    };
    let op_a = if a == Orientation::Transposed {
        (cublasOperation_t::CUBLAS_OP_T, m)
    } else {
        (cublasOperation_t::CUBLAS_OP_N, k)
    };
    (op_b, op_a)
}

impl<C: DeviceCommunicator> DeviceOps for CudaOps<'_, C> {
    type Buf = CudaBuf;
    type Index = CudaIndex;

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn alloc(&self, len: usize, dtype: DType) -> Result<CudaBuf> {
        Ok(match dtype {
            DType::F32 => CudaBuf::F32(self.fresh(len, "an llep buffer")?),
            DType::Bf16 => CudaBuf::Bf16(self.fresh(len, "an llep buffer")?),
            other => {
                return Err(Error::UnsupportedDtype {
                    dtype: other,
                    backend: "the CUDA device",
                    supported: "f32, bf16",
                });
            }
        })
    }

    fn alloc_index(&self, len: usize) -> Result<CudaIndex> {
        let dev = self.fresh::<u32>(len, "an llep index buffer")?;
        Ok(CudaIndex { dev, host: Some(vec![0; len.max(1)]) })
    }

    fn buf_len(&self, buf: &CudaBuf) -> usize {
        buf.len()
    }

    fn buf_dtype(&self, buf: &CudaBuf) -> DType {
        buf.dtype()
    }

    fn upload(&self, host: &[f32]) -> Result<CudaBuf> {
        Ok(CudaBuf::F32(self.uploaded(host)?))
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

    fn write(&self, host: &[f32], dst: &mut CudaBuf) -> Result<()> {
        if host.is_empty() {
            return Ok(());
        }
        let mut v = view_mut("buffer", dst.as_f32_mut("write (an f32 buffer)")?, 0, host.len())?;
        self.stream.memcpy_htod(host, &mut v).map_err(cuda_error("cuMemcpyHtoD")).map_err(Error::from)
    }

    fn download(&self, src: &CudaBuf, len: usize) -> Result<Vec<f32>> {
        if len == 0 {
            return Ok(Vec::new());
        }
        self.stream
            .clone_dtoh(&view("download", src.as_f32("download (an f32 buffer)")?, 0, len)?)
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

    fn zero(&self, dst: &mut CudaBuf, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        match dst {
            CudaBuf::F32(d) => self.stream.memset_zeros(&mut view_mut("zero fill", d, 0, len)?),
            CudaBuf::Bf16(d) => self.stream.memset_zeros(&mut view_mut("zero fill", d, 0, len)?),
        }
        .map_err(cuda_error("cuMemsetD8"))
        .map_err(Error::from)
    }

    fn copy(
        &self,
        (src, src_at): (&CudaBuf, usize),
        (dst, dst_at): (&mut CudaBuf, usize),
        len: usize,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        same_type!(CudaBuf, "copy (source and destination)"; src, dst => {
            let from = view("copy source", src, src_at, len)?;
            let mut to = view_mut("copy destination", dst, dst_at, len)?;
            self.stream.memcpy_dtod(&from, &mut to).map_err(cuda_error("cuMemcpyDtoD"))?
        });
        Ok(())
    }

    fn gather_rows(&self, sel: IndexedRows<'_, CudaBuf, CudaIndex>, dst: &mut CudaBuf) -> Result<()> {
        if sel.is_empty() {
            return Ok(());
        }
        let at = rows_at(&sel)?;
        let name = entry("llep_gather_rows", "llep_gather_rows_bf16", sel.src.dtype());
        let (src, shape) = (sel.src, (sel.rows, sel.width));
        same_type!(CudaBuf, "gather_rows (src and dst)"; src, dst =>
            self.launch_gather(name, (src, &at), shape, dst))
    }

    fn scatter_add_rows(&self, sel: IndexedRows<'_, CudaBuf, CudaIndex>, acc: &mut CudaBuf) -> Result<()> {
        if sel.is_empty() {
            return Ok(());
        }
        let at = rows_at(&sel)?;
        let shape = (sel.rows, sel.width);
        let layout = ScatterLayout::of(at.host, acc.len() / sel.width)?;
        let kernel = (crate::kernels::scatter_entry(sel.src.dtype(), acc.dtype(), &layout)?, &layout);
        match (sel.src, acc) {
            (CudaBuf::F32(s), CudaBuf::F32(a)) => self.launch_scatter(kernel, (s, &at), shape, a),
            (CudaBuf::Bf16(s), CudaBuf::F32(a)) => self.launch_scatter(kernel, (s, &at), shape, a),
            (CudaBuf::Bf16(s), CudaBuf::Bf16(a)) => self.launch_scatter(kernel, (s, &at), shape, a),
            (CudaBuf::F32(_), CudaBuf::Bf16(_)) => {
                Err(Error::internal("scatter_entry refuses f32 rows into bf16"))
            }
        }
    }

    fn swiglu(&self, gu: &CudaBuf, at: PreAt, n: usize, h: &mut CudaBuf) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let name = entry("llep_swiglu", "llep_swiglu_bf16", gu.dtype());
        same_type!(CudaBuf, "swiglu (pre-activations and h)"; gu, h => self.launch_swiglu(name, (gu, at), n, h))
    }

    fn swiglu_backward(&self, gu: &mut CudaBuf, at: PreAt, dh: &CudaBuf, n: usize) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let name = entry("llep_swiglu_backward", "llep_swiglu_backward_bf16", dh.dtype());
        same_type!(CudaBuf, "swiglu_backward (pre-activations and dh)"; gu, dh =>
            self.launch_swiglu_backward(name, (gu, at), dh, n))
    }

    fn row_dot(&self, a: &CudaBuf, b: &CudaBuf, rows: usize, width: usize, out: &mut CudaBuf) -> Result<()> {
        if rows == 0 {
            return Ok(());
        }
        let out = out.as_f32_mut("row_dot out (f32)")?;
        let name = entry("llep_row_dot", "llep_row_dot_bf16", a.dtype());
        same_type!(CudaBuf, "row_dot (a and b)"; a, b => self.launch_row_dot(name, (a, b), (rows, width), out))
    }

    fn gemm(
        &self,
        dims: GemmDims,
        a: Operand<'_, CudaBuf>,
        b: Operand<'_, CudaBuf>,
        c: &mut CudaBuf,
        c_offset: usize,
        accumulate: Accumulate,
    ) -> Result<()> {
        let GemmDims { m, n, k } = dims;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let ((op_b, ld_b), (op_a, ld_a)) = column_major_ops(dims, (a.orientation, b.orientation));
        let beta = if accumulate == Accumulate::Add { 1.0 } else { 0.0 };
        // Row-major C = A·B is column-major Cᵀ (n×m) = op(B)ᵀ·op(A)ᵀ.
        let shape = GemmShape { op_a: op_b, op_b: op_a, m: n, n: m, k };
        match (a.buf, b.buf, c) {
            (CudaBuf::F32(ab), CudaBuf::F32(bb), CudaBuf::F32(cb)) => {
                let av = view("gemm A (m·k)", ab, a.offset, m * k)?;
                let bv = view("gemm B (k·n)", bb, b.offset, k * n)?;
                let mut cv = view_mut("gemm C (m·n)", cb, c_offset, m * n)?;
                let (lhs, rhs) = (blas::Operand { buf: &bv, ld: ld_b }, blas::Operand { buf: &av, ld: ld_a });
                let out = blas::Output { buf: &mut cv, ld: n, beta };
                let bound = self.blas.bind(&self.stream, BlasMath::Default)?;
                // SAFETY: the views hold exactly the extents this product reads and writes:
                // op(B)ᵀ n×k (k·n elements, ld n or k), op(A)ᵀ k×m (m·k, ld k or m) and C n×m
                // (m·n, ld n), checked when the views were made; all three are ordered on
                // `self.stream`, the stream `bound` is bound to, and C is a `&mut` borrow
                // distinct from A and B.
                Ok(unsafe { sgemm(&bound, blas::GemmCall { shape, a: lhs, b: rhs, c: out }) }?)
            }
            (CudaBuf::Bf16(ab), CudaBuf::Bf16(bb), c) => {
                let av = view("gemm A (m·k)", ab, a.offset, m * k)?;
                let bv = view("gemm B (k·n)", bb, b.offset, k * n)?;
                let (lhs, rhs) = (blas::Operand { buf: &bv, ld: ld_b }, blas::Operand { buf: &av, ld: ld_a });
                match c {
                    CudaBuf::F32(cb) => {
                        let mut cv = view_mut("gemm C (m·n)", cb, c_offset, m * n)?;
                        let out = blas::Output { buf: &mut cv, ld: n, beta };
                        // SAFETY: as the f32 case: the views hold exactly the extents read and
                        // written (checked when made) and C is a distinct `&mut` borrow; C f32.
                        unsafe { self.gemm_bf16_views(blas::GemmCall { shape, a: lhs, b: rhs, c: out }) }
                    }
                    CudaBuf::Bf16(cb) => {
                        let mut cv = view_mut("gemm C (m·n)", cb, c_offset, m * n)?;
                        let out = blas::Output { buf: &mut cv, ld: n, beta };
                        // SAFETY: as above, with a bf16 C (cuBLAS rounds the f32 result once).
                        unsafe { self.gemm_bf16_views(blas::GemmCall { shape, a: lhs, b: rhs, c: out }) }
                    }
                }
            }
            (x, y, c) => {
                let (found, expected) =
                    if x.dtype() != y.dtype() { (y.dtype(), x.dtype()) } else { (c.dtype(), DType::F32) };
                Err(Error::DtypeMismatch {
                    what: "gemm operands (A and B of one type; C f32 or theirs)",
                    expected,
                    found,
                })
            }
        }
    }

    fn all_to_all_v(
        &self,
        (send, send_at): (&CudaBuf, usize),
        send_counts: &[usize],
        (recv, recv_at): (&mut CudaBuf, usize),
        recv_counts: &[usize],
    ) -> Result<()> {
        let (ns, nr) = (send_counts.iter().sum(), recv_counts.iter().sum());
        same_type!(CudaBuf, "all_to_all_v (send and recv)"; send, recv => {
            let sv = view("all_to_all_v send elements", send, send_at, ns)?;
            let mut rv = view_mut("all_to_all_v recv elements", recv, recv_at, nr)?;
            self.comm.all_to_all_v(&sv, send_counts, &mut rv, recv_counts)?
        });
        Ok(())
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
