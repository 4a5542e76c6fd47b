//! This crate's CUDA sources, for the run-time kernel cache, the NVRTC compile check and the
//! SIMT emulator.

use flatpeak_common::kernel_source;
use flatpeak_common::kernels::{BLOCK_REDUCE, KernelSource};

/// `kernels/ring_dtp.cu`: target resolution, the fold, the gradient formation, the bias
/// gradient, the bf16 upcast and the logit gradient's rounding to bf16 (everything between one step's GEMMs).
pub const RING_DTP: KernelSource = kernel_source!(
    "ring_dtp",
    [BLOCK_REDUCE],
    [
        "lce_resolve_targets",
        "lce_fold",
        "lce_row_lse",
        "lce_gradient",
        "lce_bias_grad",
        "lce_widen_bf16",
        "lce_round_bf16",
        "lce_narrow_rows_bf16"
    ]
);

/// Threads per block of the per-row kernels (one block per token row).
pub const ROW_THREADS: u32 = 256;

/// A resolved target meaning "this row predicts nothing" (`LCE_NO_TARGET` in the source).
pub const NO_TARGET: u32 = u32::MAX;

/// The softcap argument of the kernels: the cap, or 0 for off.
pub fn softcap_arg(softcap: crate::Softcap) -> f32 {
    match softcap {
        crate::Softcap::Off => 0.0,
        crate::Softcap::Tanh { cap } => cap,
    }
}
