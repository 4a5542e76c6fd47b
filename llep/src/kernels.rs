//! This crate's CUDA sources, for the run-time kernel cache, the NVRTC compile check and the
//! SIMT emulator.

use flatpeak_common::kernels::{BLOCK_REDUCE, KernelSource};
use flatpeak_common::{DType, kernel_source};

use crate::device::ScatterLayout;

/// `kernels/llep.cu`: row gather (pack, expand, δ = w·dY), scatter-add (combine, return) direct
/// or, where destinations repeat, ordered over rows grouped by destination
/// ([`ScatterLayout`]),
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
        "llep_scatter_add_rows_bf16_bf16",
        "llep_scatter_add_rows_direct",
        "llep_scatter_add_rows_direct_bf16",
        "llep_scatter_add_rows_direct_bf16_bf16"
    ]
);

/// Threads per block of `llep_row_dot` (one block per row).
pub const ROW_THREADS: u32 = 128;

/// The entry point of kernel `f32_name` for buffers of `dtype`: its `_bf16` instantiation
/// (`bf16_name`) for bf16. Every backend that launches by name (CUDA) or counts launches
/// ([`crate::device::CountOps`]) names them here.
pub fn entry(f32_name: &'static str, bf16_name: &'static str, dtype: DType) -> &'static str {
    if dtype == DType::Bf16 { bf16_name } else { f32_name }
}

/// The `llep_scatter_add_rows` instantiation for rows of `src` into accumulators of `acc`
/// (f32 → f32, bf16 → f32, bf16 → bf16) in `layout` (the `_direct` form for
/// [`ScatterLayout::Direct`]); f32 rows into bf16 accumulators is
/// [`Error::DtypeMismatch`](crate::Error::DtypeMismatch).
pub fn scatter_entry(src: DType, acc: DType, layout: &ScatterLayout) -> crate::Result<&'static str> {
    let direct = matches!(layout, ScatterLayout::Direct);
    match (src, acc, direct) {
        (DType::F32, DType::F32, false) => Ok("llep_scatter_add_rows"),
        (DType::Bf16, DType::F32, false) => Ok("llep_scatter_add_rows_bf16"),
        (DType::Bf16, DType::Bf16, false) => Ok("llep_scatter_add_rows_bf16_bf16"),
        (DType::F32, DType::F32, true) => Ok("llep_scatter_add_rows_direct"),
        (DType::Bf16, DType::F32, true) => Ok("llep_scatter_add_rows_direct_bf16"),
        (DType::Bf16, DType::Bf16, true) => Ok("llep_scatter_add_rows_direct_bf16_bf16"),
        _ => Err(crate::Error::DtypeMismatch {
            what: "scatter_add_rows acc (at least as wide as src)",
            expected: DType::F32,
            found: acc,
        }),
    }
}
