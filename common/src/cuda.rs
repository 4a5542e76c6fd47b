//! CUDA side of the foundation (feature `cuda`): contexts behind the panic-free probe, the
//! per-context [`KernelCache`], one-allocation [`DeviceWorkspace`]s, and the launches of
//! `kernels/common.cu`. This is the only file of the crate that launches kernels.

/// The cudarc version the workspace pins, re-exported so crates and tests name one version.
pub use cudarc;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytemuck::Pod;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr,
    LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use crate::arena::{Arena, Region};
use crate::device::Device;
use crate::error::{Error, Result};
use crate::kernels::{COMMON, KernelSource, grid_stride_blocks};
use crate::nvrtc::{Arch, Target, compile};

/// Maps a cudarc error (driver, cuBLAS, NCCL) to [`Error::Cuda`] naming the call:
/// `stream.synchronize().map_err(cuda_error("cuStreamSynchronize"))?` (a crate's `?` then converts it
/// to its own `Error::Common`).
pub fn cuda_error<E: std::fmt::Debug>(op: &'static str) -> impl Fn(E) -> Error {
    move |e| Error::Cuda { op, message: format!("{e:?}") }
}

/// Maps a failed device allocation of `bytes` for `what`: CUDA's out-of-memory is
/// [`Error::DeviceAlloc`] (the typed error a caller sizing its batch can act on), anything else
/// [`Error::Cuda`] naming `cuMemAlloc`:
/// `stream.alloc_zeros::<f32>(n).map_err(alloc_error("the logit block", n * 4))?`.
pub fn alloc_error(what: &'static str, bytes: usize) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| {
        if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
            Error::DeviceAlloc { what, bytes }
        } else {
            Error::Cuda { op: "cuMemAlloc", message: format!("{e:?}") }
        }
    }
}

/// Maps a refused page-locked host allocation of `bytes` for `what` to [`Error::PinnedAlloc`].
pub fn pinned_error(what: &'static str, bytes: usize) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::PinnedAlloc { what, bytes, reason: format!("{e:?}") }
}

/// A 1-D grid-stride launch over `n` elements: `threads` per block, at most `max_blocks` blocks
/// (the kernel's loop covers the rest).
pub fn linear_launch(n: usize, threads: u32, max_blocks: u32) -> LaunchConfig {
    let blocks = grid_stride_blocks(n, threads, max_blocks);
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

/// One block of `threads` per row, or [`Error::ShapeMismatch`] when `rows` exceeds a grid's
/// `u32` x dimension.
pub fn per_row_launch(rows: usize, threads: u32) -> Result<LaunchConfig> {
    let blocks = u32::try_from(rows).map_err(|_| Error::ShapeMismatch {
        what: "rows of a per-row launch (u32 grid)",
        expected: u32::MAX as usize,
        got: rows,
    })?;
    Ok(LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 })
}

fn gemm_dim(what: &'static str, value: usize) -> Result<i32> {
    i32::try_from(value).map_err(|_| Error::ShapeMismatch { what, expected: i32::MAX as usize, got: value })
}

/// One cuBLAS SGEMM on `blas`'s stream, in column-major terms: `C (m×n) = op_a(A)·op_b(B) +
/// beta·C` with α = 1, leading dimensions `lda`, `ldb`, `ldc`; a no-op when `m` or `n` is 0.
/// [`Error::ShapeMismatch`] when a dimension does not fit cuBLAS's `i32`.
///
/// # Safety
///
/// `a`, `b` and `c` must hold the column-major extents the operations and leading dimensions
/// imply (`A`: `lda·k` elements for `op_a = N`, `lda·m` for `T`; likewise `B`; `C`: `ldc·n`),
/// belong to `blas`'s context, and be ordered on its stream after every earlier write to them;
/// `c` must not alias `a` or `b`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn sgemm<A, B, C>(
    blas: &cudarc::cublas::CudaBlas,
    (op_a, op_b): (cudarc::cublas::sys::cublasOperation_t, cudarc::cublas::sys::cublasOperation_t),
    (m, n, k): (usize, usize, usize),
    (a, lda): (&A, usize),
    (b, ldb): (&B, usize),
    (c, ldc): (&mut C, usize),
    beta: f32,
) -> Result<()>
where
    A: cudarc::driver::DevicePtr<f32>,
    B: cudarc::driver::DevicePtr<f32>,
    C: cudarc::driver::DevicePtrMut<f32>,
{
    use cudarc::cublas::{Gemm, GemmConfig};
    if m == 0 || n == 0 {
        return Ok(());
    }
    let cfg = GemmConfig {
        transa: op_a,
        transb: op_b,
        m: gemm_dim("sgemm m (i32)", m)?,
        n: gemm_dim("sgemm n (i32)", n)?,
        k: gemm_dim("sgemm k (i32)", k)?,
        alpha: 1.0f32,
        lda: gemm_dim("sgemm lda (i32)", lda.max(1))?,
        ldb: gemm_dim("sgemm ldb (i32)", ldb.max(1))?,
        beta,
        ldc: gemm_dim("sgemm ldc (i32)", ldc.max(1))?,
    };
    // SAFETY: the caller guarantees the extents, context, stream order and non-aliasing this
    // GEMM needs (this function's `# Safety`); every dimension was checked to fit i32.
    unsafe { blas.gemm(cfg, a, b, c) }.map_err(cuda_error("cublasSgemm"))
}

/// Puts `blas` in TF32 tensor-op math (`CUBLAS_TF32_TENSOR_OP_MATH`): its f32 GEMMs ([`sgemm`])
/// then round their operands to TF32 and run on tensor cores, summing in f32 — faster and not
/// exact ([`Precision::Tf32`](crate::Precision::Tf32)). For a handle of its own: the mode stays
/// for every later GEMM on it.
pub fn tf32_math(blas: &cudarc::cublas::CudaBlas) -> Result<()> {
    use cudarc::cublas::sys::{cublasMath_t, cublasSetMathMode, cublasStatus_t};
    // SAFETY: `blas.handle()` is a live cuBLAS handle (CudaBlas owns it until it drops, after
    // this call); setting its math mode touches no memory of ours.
    let status = unsafe { cublasSetMathMode(*blas.handle(), cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH) };
    if status == cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda { op: "cublasSetMathMode(TF32)", message: format!("{status:?}") })
    }
}

/// The element type of a [`gemm_bf16`]'s C: f32, or bf16 (the f32 result rounded once, to
/// nearest even; with β = 1 the stored C is widened and added before that rounding). Sealed.
pub trait Bf16GemmOutput: cudarc::driver::DeviceRepr + sealed::Sealed {
    /// cuBLAS's name for it.
    const CUDA_TYPE: cudarc::cublas::sys::cudaDataType_t;
}

impl Bf16GemmOutput for f32 {
    const CUDA_TYPE: cudarc::cublas::sys::cudaDataType_t = cudarc::cublas::sys::cudaDataType_t::CUDA_R_32F;
}

impl Bf16GemmOutput for half::bf16 {
    const CUDA_TYPE: cudarc::cublas::sys::cudaDataType_t = cudarc::cublas::sys::cudaDataType_t::CUDA_R_16BF;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
}

/// bf16 operands of a [`gemm_bf16`]: cuBLAS `GemmEx` with `CUDA_R_16BF` A and B, a C of f32 or
/// bf16 ([`Bf16GemmOutput`]) and `CUBLAS_COMPUTE_32F` (tensor cores; each bf16 product exact,
/// sums in f32).
///
/// Column-major, as [`sgemm`]: `C (m×n) = op_a(A)·op_b(B) + beta·C`, α = 1; a no-op when `m`
/// or `n` is 0; [`Error::ShapeMismatch`] when a dimension does not fit cuBLAS's `i32`.
///
/// # Safety
///
/// As [`sgemm`] (extents, context, non-aliasing), with `A` and `B` bf16; besides, `blas` must
/// be bound to `stream` (every operand is ordered on it).
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_bf16<A, B, C, T>(
    blas: &cudarc::cublas::CudaBlas,
    stream: &CudaStream,
    (op_a, op_b): (cudarc::cublas::sys::cublasOperation_t, cudarc::cublas::sys::cublasOperation_t),
    (m, n, k): (usize, usize, usize),
    (a, lda): (&A, usize),
    (b, ldb): (&B, usize),
    (c, ldc): (&mut C, usize),
    beta: f32,
) -> Result<()>
where
    A: cudarc::driver::DevicePtr<half::bf16>,
    B: cudarc::driver::DevicePtr<half::bf16>,
    C: cudarc::driver::DevicePtrMut<T>,
    T: Bf16GemmOutput,
{
    use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType_t};
    if m == 0 || n == 0 {
        return Ok(());
    }
    let (m, n, k) =
        (gemm_dim("gemm m (i32)", m)?, gemm_dim("gemm n (i32)", n)?, gemm_dim("gemm k (i32)", k)?);
    let (lda, ldb, ldc) = (
        gemm_dim("gemm lda (i32)", lda.max(1))?,
        gemm_dim("gemm ldb (i32)", ldb.max(1))?,
        gemm_dim("gemm ldc (i32)", ldc.max(1))?,
    );
    let (alpha, beta) = (1.0f32, beta);
    // The guards order each operand on `stream` (cudarc's per-buffer events) until they drop,
    // after the call.
    let (a, _a) = a.device_ptr(stream);
    let (b, _b) = b.device_ptr(stream);
    let (c, _c) = c.device_ptr_mut(stream);
    // SAFETY: the caller guarantees the extents, context, stream binding, order and
    // non-aliasing this GEMM needs (this function's `# Safety`); every dimension fits i32, the
    // pointers are live device addresses held by the guards above, and α, β are f32 as
    // `CUBLAS_COMPUTE_32F` reads them.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            op_a,
            op_b,
            m,
            n,
            k,
            (&alpha as *const f32).cast(),
            a as *const std::ffi::c_void,
            cudaDataType_t::CUDA_R_16BF,
            lda,
            b as *const std::ffi::c_void,
            cudaDataType_t::CUDA_R_16BF,
            ldb,
            (&beta as *const f32).cast(),
            c as *mut std::ffi::c_void,
            T::CUDA_TYPE,
            ldc,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(cuda_error("cublasGemmEx(bf16)"))
}

/// Opens the primary context of CUDA device `ordinal`, after checking (without panicking) that
/// the driver and the device exist.
pub fn context(ordinal: usize) -> Result<Arc<CudaContext>> {
    Device::Cuda(ordinal).ensure_available()?;
    CudaContext::new(ordinal).map_err(cuda_error("cuCtxCreate"))
}

/// Compiled modules of one context, compiled at first use: a cubin for the device's exact
/// architecture when NVRTC can emit it, else PTX for the driver to JIT.
#[derive(Debug)]
pub struct KernelCache {
    ctx: Arc<CudaContext>,
    arch: Arch,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
}

impl KernelCache {
    /// A cache for `ctx`, targeting its compute capability.
    pub fn new(ctx: Arc<CudaContext>) -> Result<Self> {
        let (major, minor) = ctx.compute_capability().map_err(cuda_error("cuDeviceGetAttribute"))?;
        let arch = Arch { major: major as u32, minor: minor as u32 };
        Ok(Self { ctx, arch, modules: Mutex::new(HashMap::new()) })
    }

    /// The architecture kernels are compiled for.
    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// The context this cache loads into.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Entry point `entry` of `kernel`, compiling and loading the module on first use.
    pub fn function(&self, kernel: &KernelSource, entry: &str) -> Result<CudaFunction> {
        let module = {
            let mut modules = self.modules.lock().unwrap_or_else(|p| p.into_inner());
            match modules.get(kernel.name) {
                Some(m) => Arc::clone(m),
                None => {
                    let m = self.load(kernel)?;
                    modules.insert(kernel.name, Arc::clone(&m));
                    m
                }
            }
        };
        module.load_function(entry).map_err(cuda_error("cuModuleGetFunction"))
    }

    fn load(&self, kernel: &KernelSource) -> Result<Arc<CudaModule>> {
        let cubin = compile(kernel, self.arch, Target::Cubin).and_then(|c| {
            self.ctx.load_module(Ptx::from_binary(c.image)).map_err(cuda_error("cuModuleLoadData(cubin)"))
        });
        match cubin {
            Ok(module) => Ok(module),
            Err(e @ Error::KernelCompile { .. }) => Err(e),
            Err(_) => {
                let ptx = compile(kernel, self.arch, Target::Ptx)?;
                let text = String::from_utf8_lossy(&ptx.image).into_owned();
                self.ctx.load_module(Ptx::from_src(text)).map_err(cuda_error("cuModuleLoadData(ptx)"))
            }
        }
    }
}

/// One device allocation made at launch, carved into typed regions; never grows.
#[derive(Debug)]
pub struct DeviceWorkspace {
    buffer: CudaSlice<u8>,
    arena: Arena,
}

impl DeviceWorkspace {
    /// Allocates `capacity` bytes on `stream`'s device, zeroed.
    pub fn new(stream: &Arc<CudaStream>, capacity: usize) -> Result<Self> {
        let buffer =
            stream.alloc_zeros::<u8>(capacity.max(1)).map_err(alloc_error("a device workspace", capacity))?;
        Ok(Self { buffer, arena: Arena::new(capacity) })
    }
    /// Carves `len` elements of `T` (see [`Arena::carve`]).
    pub fn carve<T: Pod + DeviceRepr>(&mut self, len: usize) -> Result<Region<T>> {
        self.arena.carve(len)
    }
    /// Returns every region; the high-water mark stays.
    pub fn reset(&mut self) {
        self.arena.reset();
    }
    /// A read view of `region`.
    pub fn view<T: Pod + DeviceRepr>(&self, region: Region<T>) -> Result<CudaView<'_, T>> {
        let bytes = self.buffer.slice(region.offset()..region.offset() + region.bytes());
        // SAFETY: the region was carved from this arena, so it lies inside `buffer`, starts
        // 64-aligned (≥ align_of::<T>()), and spans exactly `len` `T`s; `T: Pod` makes any byte
        // pattern a valid value.
        unsafe { bytes.transmute::<T>(region.len()) }.ok_or(Error::ShapeMismatch {
            what: "device region bytes",
            expected: region.bytes(),
            got: bytes.len(),
        })
    }
    /// A write view of `region`.
    pub fn view_mut<'s, T: Pod + DeviceRepr>(&'s mut self, region: Region<T>) -> Result<CudaViewMut<'s, T>> {
        let mut bytes = self.buffer.slice_mut(region.offset()..region.offset() + region.bytes());
        let found = bytes.len();
        // SAFETY: as in `view`; the `&'s mut self` borrow makes the view unique.
        let view = unsafe { bytes.transmute_mut::<T>(region.len()) }.ok_or(Error::ShapeMismatch {
            what: "device region bytes",
            expected: region.bytes(),
            got: found,
        })?;
        // SAFETY: a `CudaViewMut` holds a raw device pointer and references copied from the
        // `CudaSlice` itself (its events and stream), not into the temporary `bytes`; so the view
        // is valid for as long as `self.buffer` is mutably borrowed, which is `'s`.
        Ok(unsafe { std::mem::transmute::<CudaViewMut<'_, T>, CudaViewMut<'s, T>>(view) })
    }
    /// Bytes reserved at launch.
    pub fn capacity(&self) -> usize {
        self.arena.capacity()
    }
    /// The most bytes ever carved at once.
    pub fn high_water(&self) -> usize {
        self.arena.high_water()
    }
}

const THREADS: u32 = 256;

fn grid_for(n: usize, max_blocks: u32) -> LaunchConfig {
    linear_launch(n, THREADS, max_blocks)
}

/// `out[i] = value` on `stream`.
pub fn fill_f32(
    cache: &KernelCache,
    stream: &Arc<CudaStream>,
    out: &mut CudaViewMut<'_, f32>,
    value: f32,
) -> Result<()> {
    let f = cache.function(&COMMON, "fill_f32")?;
    let n = out.len() as u64;
    let mut launch = stream.launch_builder(&f);
    launch.arg(out).arg(&value).arg(&n);
    // SAFETY: `fill_f32(float*, float, u64)` matches the three arguments in order; the kernel
    // writes only `out[0..n)` (grid-stride loop bounded by `n = out.len()`).
    unsafe { launch.launch(grid_for(n as usize, 4096)) }.map_err(cuda_error("cuLaunchKernel(fill_f32)"))?;
    Ok(())
}

/// Σ x over the device buffer, reduced per block in f64 on the device and across blocks in a
/// fixed order on the host: bitwise reproducible for a given length.
pub fn checksum_f32(cache: &KernelCache, stream: &Arc<CudaStream>, x: &CudaView<'_, f32>) -> Result<f64> {
    let f = cache.function(&COMMON, "checksum_f32")?;
    let n = x.len() as u64;
    let cfg = grid_for(x.len(), 1024);
    let blocks = cfg.grid_dim.0 as usize;
    let mut partial =
        stream.alloc_zeros::<f64>(blocks).map_err(alloc_error("checksum partials", blocks * 8))?;
    let mut launch = stream.launch_builder(&f);
    launch.arg(x).arg(&n).arg(&mut partial);
    // SAFETY: `checksum_f32(const float*, u64, double*)` matches the arguments; it reads
    // `x[0..n)`, writes `partial[blockIdx.x]` for `gridDim.x = partial.len()` blocks, and its
    // block size (256) is a multiple of 32 as the kernel requires.
    unsafe { launch.launch(cfg) }.map_err(cuda_error("cuLaunchKernel(checksum_f32)"))?;
    let partial = stream.clone_dtoh(&partial).map_err(cuda_error("cuMemcpyDtoH"))?;
    Ok(partial.iter().sum())
}

/// `out[i] = bf16(x[i])`, round to nearest even.
pub fn cast_f32_to_bf16(
    cache: &KernelCache,
    stream: &Arc<CudaStream>,
    x: &CudaView<'_, f32>,
    out: &mut CudaViewMut<'_, half::bf16>,
) -> Result<()> {
    if x.len() != out.len() {
        return Err(Error::ShapeMismatch { what: "cast output length", expected: x.len(), got: out.len() });
    }
    let f = cache.function(&COMMON, "cast_f32_to_bf16")?;
    let n = x.len() as u64;
    let mut launch = stream.launch_builder(&f);
    launch.arg(x).arg(out).arg(&n);
    // SAFETY: `cast_f32_to_bf16(const float*, __nv_bfloat16*, u64)` matches; both buffers hold
    // `n` elements (checked above) and the kernel touches indices below `n` only.
    unsafe { launch.launch(grid_for(n as usize, 4096)) }
        .map_err(cuda_error("cuLaunchKernel(cast_f32_to_bf16)"))?;
    Ok(())
}

/// `c = a·b` for `n×n` bf16 matrices `a`, `b` into an f32 `c` with [`gemm_bf16`] (tensor
/// cores, f32 accumulation): the bf16 counterpart of [`sgemm_square`], the ceiling a bf16 path's
/// `gemm_efficiency` is measured against on a GPU (2n³ FLOPs per call).
///
/// # Safety
///
/// `blas` must be bound to `stream` (created on it), and the three buffers belong to its context.
pub unsafe fn gemm_bf16_square(
    blas: &cudarc::cublas::CudaBlas,
    stream: &CudaStream,
    n: usize,
    (a, b): (&CudaSlice<half::bf16>, &CudaSlice<half::bf16>),
    c: &mut CudaSlice<f32>,
) -> Result<()> {
    use cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N;
    for (what, len) in [("gemm a (n·n)", a.len()), ("gemm b (n·n)", b.len()), ("gemm c (n·n)", c.len())] {
        if len != n * n {
            return Err(Error::ShapeMismatch { what, expected: n * n, got: len });
        }
    }
    // SAFETY: a, b and c each hold exactly n·n elements (checked above), the column-major
    // extents of an n×n×n product with leading dimensions n; `c` is a `&mut` borrow distinct
    // from `a` and `b`; the binding of `blas` to `stream` and the context are the caller's.
    unsafe { gemm_bf16(blas, stream, (CUBLAS_OP_N, CUBLAS_OP_N), (n, n, n), (a, n), (b, n), (c, n), 0.0) }
}

/// `c = a·b` for `n×n` f32 matrices with cuBLAS SGEMM on `blas`'s stream, in cuBLAS's default
/// math mode (true f32, no TF32): the device's GEMM rate probe, the ceiling `gemm_efficiency`
/// is measured against on a GPU (2n³ FLOPs per call).
pub fn sgemm_square(
    blas: &cudarc::cublas::CudaBlas,
    n: usize,
    (a, b): (&CudaSlice<f32>, &CudaSlice<f32>),
    c: &mut CudaSlice<f32>,
) -> Result<()> {
    use cudarc::cublas::sys::cublasOperation_t::CUBLAS_OP_N;
    for (what, len) in [("sgemm a (n·n)", a.len()), ("sgemm b (n·n)", b.len()), ("sgemm c (n·n)", c.len())]
    {
        if len != n * n {
            return Err(Error::ShapeMismatch { what, expected: n * n, got: len });
        }
    }
    // SAFETY: a, b and c each hold exactly n·n floats (checked above), the column-major extents
    // of an n×n×n product with leading dimensions n; all three belong to `blas`'s context, and
    // `c` is a `&mut` borrow distinct from `a` and `b`.
    unsafe { sgemm(blas, (CUBLAS_OP_N, CUBLAS_OP_N), (n, n, n), (a, n), (b, n), (c, n), 0.0) }
}

#[cfg(test)]
mod tests {
    use cudarc::driver::DriverError;
    use cudarc::driver::sys::CUresult;

    use super::*;

    /// (Other driver errors are written with the driver's own message, which needs libcuda: the
    /// out-of-memory mapping is what runs without one.)
    #[test]
    fn out_of_memory_is_the_typed_allocation_error() {
        let oom = alloc_error("the logit block", 1 << 30)(DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
        assert_eq!(oom, Error::DeviceAlloc { what: "the logit block", bytes: 1 << 30 });
        assert_eq!(oom.kind(), crate::ErrorKind::Memory);
        assert_eq!(oom.to_string(), "could not allocate 1073741824 B of device memory for the logit block");
    }
}
