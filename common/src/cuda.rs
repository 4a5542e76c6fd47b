//! CUDA side of the foundation (feature `cuda`): contexts behind the panic-free probe, the
//! per-device [`KernelCache`] and cuBLAS handle ([`KernelCache::shared`], [`SharedBlas`]),
//! one-allocation [`DeviceWorkspace`]s, and the launches of `kernels/common.cu`. This is the only file of the crate that launches kernels.

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
use crate::kernels::{COMMON, KernelSource, LINEAR_THREADS, grid_stride_blocks};
use crate::nvrtc::{Arch, Target, compile};

mod cublas;
mod shared;

pub use cublas::{
    Bf16GemmOutput, GemmCall, GemmShape, Operand, Output, SquareOperands, gemm_bf16, gemm_bf16_square, sgemm,
    sgemm_square,
};
pub use shared::{BlasMath, BoundBlas, SharedBlas};

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

/// A 1-D grid-stride launch over `n` elements: [`LINEAR_THREADS`] per block, at most
/// `max_blocks` blocks (the kernel's loop covers the rest).
pub fn linear_launch(n: usize, max_blocks: u32) -> LaunchConfig {
    let blocks = grid_stride_blocks(n, LINEAR_THREADS, max_blocks);
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (LINEAR_THREADS, 1, 1), shared_mem_bytes: 0 }
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
    unsafe { launch.launch(linear_launch(n as usize, 4096)) }
        .map_err(cuda_error("cuLaunchKernel(fill_f32)"))?;
    Ok(())
}

/// Σ x over the device buffer, reduced per block in f64 on the device and across blocks in a
/// fixed order on the host: bitwise reproducible for a given length.
pub fn checksum_f32(cache: &KernelCache, stream: &Arc<CudaStream>, x: &CudaView<'_, f32>) -> Result<f64> {
    let f = cache.function(&COMMON, "checksum_f32")?;
    let n = x.len() as u64;
    let cfg = linear_launch(x.len(), 1024);
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
    unsafe { launch.launch(linear_launch(n as usize, 4096)) }
        .map_err(cuda_error("cuLaunchKernel(cast_f32_to_bf16)"))?;
    Ok(())
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
