//! This crate's CUDA sources, for the run-time kernel cache, the NVRTC compile check and the
//! SIMT emulator.

use flatpeak_common::kernel_source;
use flatpeak_common::kernels::{BLOCK_REDUCE, KernelSource};

/// `kernels/stream_adamw.cu`: the gradient statistics pass (Σ g² per block, f64).
pub const STREAM_ADAMW: KernelSource = kernel_source!(
    "stream_adamw",
    [BLOCK_REDUCE],
    ["grad_sq_partial_f32", "grad_sq_partial_bf16", "grad_sq_partial_f16"]
);

/// Threads per block of the statistics kernel.
pub const STATS_THREADS: u32 = 256;

/// The statistics kernel's entry point for a gradient dtype.
pub fn grad_sq_entry(dtype: flatpeak_common::DType) -> &'static str {
    match dtype {
        flatpeak_common::DType::F32 => "grad_sq_partial_f32",
        flatpeak_common::DType::Bf16 => "grad_sq_partial_bf16",
        flatpeak_common::DType::F16 => "grad_sq_partial_f16",
    }
}
