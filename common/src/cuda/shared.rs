//! What every executor on one device shares, made once per device and process: its compiled
//! kernels ([`KernelCache::shared`]) and its cuBLAS handle ([`SharedBlas`]). An executor made
//! per call (a framework op's) then costs no NVRTC compile and no `cublasCreate` after the
//! device's first.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaStream};

use super::{KernelCache, cuda_error};
use crate::error::{Error, Result};

/// The math mode of a GEMM on a [`SharedBlas`] handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum BlasMath {
    /// cuBLAS's default: f32 GEMMs in f32 (no TF32), bf16 ones on the tensor cores.
    #[default]
    Default,
    /// `CUBLAS_TF32_TENSOR_OP_MATH`: f32 GEMMs round their operands to TF32 (not exact).
    Tf32,
}

/// One value per device ordinal, made at first use.
fn per_device<T>(
    cell: &'static OnceLock<Mutex<HashMap<usize, Arc<T>>>>,
    ordinal: usize,
    make: impl FnOnce() -> Result<T>,
) -> Result<Arc<T>> {
    let mut map = cell.get_or_init(|| Mutex::new(HashMap::new())).lock().unwrap_or_else(|p| p.into_inner());
    if let Some(value) = map.get(&ordinal) {
        return Ok(Arc::clone(value));
    }
    let value = Arc::new(make()?);
    map.insert(ordinal, Arc::clone(&value));
    Ok(value)
}

impl KernelCache {
    /// The kernel cache of `ctx`'s device (its primary context), shared by every executor on it:
    /// each kernel source compiles once per device and process.
    pub fn shared(ctx: &Arc<CudaContext>) -> Result<Arc<KernelCache>> {
        static CACHES: OnceLock<Mutex<HashMap<usize, Arc<KernelCache>>>> = OnceLock::new();
        per_device(&CACHES, ctx.ordinal(), || KernelCache::new(ctx.clone()))
    }
}

/// The cuBLAS handle of one device, shared by every executor on it (one `cublasCreate` per
/// device and process). A GEMM takes it with [`SharedBlas::bind`], which points it at the
/// caller's stream and math mode for as long as the guard lives; the lock keeps two threads
/// from re-binding it under each other (a GEMM only enqueues, so the lock is held briefly).
#[derive(Debug)]
pub struct SharedBlas {
    handle: Mutex<Bound>,
}

#[derive(Debug)]
struct Bound {
    blas: CudaBlas,
    /// The stream the handle is bound to (its `CUstream`, as an address).
    stream: usize,
    math: BlasMath,
}

/// A [`SharedBlas`] handle bound to one stream and math mode, until it drops.
#[derive(Debug)]
pub struct BoundBlas<'a>(MutexGuard<'a, Bound>);

impl std::ops::Deref for BoundBlas<'_> {
    type Target = CudaBlas;
    fn deref(&self) -> &CudaBlas {
        &self.0.blas
    }
}

impl SharedBlas {
    /// The handle of `ctx`'s device, made at its first use.
    pub fn of(ctx: &Arc<CudaContext>) -> Result<Arc<SharedBlas>> {
        static HANDLES: OnceLock<Mutex<HashMap<usize, Arc<SharedBlas>>>> = OnceLock::new();
        per_device(&HANDLES, ctx.ordinal(), || {
            let stream = ctx.default_stream();
            let blas = CudaBlas::new(stream.clone()).map_err(cuda_error("cublasCreate"))?;
            let bound = Bound { blas, stream: stream.cu_stream() as usize, math: BlasMath::Default };
            Ok(SharedBlas { handle: Mutex::new(bound) })
        })
    }

    /// The handle, bound to `stream` (of its device) in `math`, for the GEMMs the caller issues
    /// while it holds the guard.
    pub fn bind(&self, stream: &Arc<CudaStream>, math: BlasMath) -> Result<BoundBlas<'_>> {
        let mut bound = self.handle.lock().unwrap_or_else(|p| p.into_inner());
        if bound.stream != stream.cu_stream() as usize {
            // SAFETY: cudarc marks re-binding unsafe because work on two streams may then race;
            // here the handle is used only under this lock, by a caller that orders its operands
            // on `stream` (the GEMM functions' own `# Safety`), so every GEMM issued through the
            // guard runs on the stream its operands are ordered on.
            unsafe { bound.blas.set_stream(stream.clone()) }.map_err(cuda_error("cublasSetStream"))?;
            bound.stream = stream.cu_stream() as usize;
        }
        if bound.math != math {
            set_math(&bound.blas, math)?;
            bound.math = math;
        }
        Ok(BoundBlas(bound))
    }
}

/// `blas`'s math mode.
fn set_math(blas: &CudaBlas, math: BlasMath) -> Result<()> {
    use cudarc::cublas::sys::{cublasMath_t, cublasSetMathMode, cublasStatus_t};
    let mode = match math {
        BlasMath::Default => cublasMath_t::CUBLAS_DEFAULT_MATH,
        BlasMath::Tf32 => cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH,
    };
    // SAFETY: `blas.handle()` is a live cuBLAS handle (CudaBlas owns it until it drops, after
    // this call); setting its math mode touches no memory of ours.
    let status = unsafe { cublasSetMathMode(*blas.handle(), mode) };
    if status == cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda { op: "cublasSetMathMode", message: format!("{status:?}") })
    }
}
