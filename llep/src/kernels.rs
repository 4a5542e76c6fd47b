//! This crate's CUDA sources, for the run-time kernel cache, the NVRTC compile check and the
//! SIMT emulator.

use flatpeak_common::kernel_source;
use flatpeak_common::kernels::{BLOCK_REDUCE, KernelSource};

/// `kernels/llep.cu`: row gather (pack, expand, δ = w·dY), ordered scatter-add over rows grouped
/// by destination (combine, return: [`ScatterGroups`](crate::device::ScatterGroups)),
/// SwiGLU forward and backward, and per-row dot products (routing-weight gradients), each for
/// an f32 layer and (suffix `_bf16`) a bf16 one.
pub const LLEP: KernelSource = kernel_source!(
    "llep",
    [BLOCK_REDUCE],
    [
        "llep_gather_rows",
        "llep_swiglu",
        "llep_swiglu_backward",
        "llep_row_dot",
        "llep_scatter_add_rows",
        "llep_gather_rows_bf16",
        "llep_swiglu_bf16",
        "llep_swiglu_backward_bf16",
        "llep_row_dot_bf16",
        "llep_scatter_add_rows_bf16",
        "llep_scatter_add_rows_bf16_bf16"
    ]
);

/// Threads per block of `llep_row_dot` (one block per row).
pub const ROW_THREADS: u32 = 128;
