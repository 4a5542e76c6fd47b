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

/// How `lce_gradient` stores a block's logit gradient G.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GradientStore {
    /// G in f32 over the logits (f32 GEMMs read it, or the bias gradient sums it first).
    #[default]
    F32,
    /// Each row of G rounded to bf16 (nearest even) into the first half of its bytes, in the
    /// same pass: the operand of the bf16 dX/dW GEMMs (`lce_narrow_rows_bf16` fused away).
    Bf16Rows,
}

impl GradientStore {
    /// How a block's G is stored: [`Bf16Rows`](GradientStore::Bf16Rows) when bf16 GEMMs read it
    /// (`bf16_gemms`) and no bias gradient must sum the f32 G first (`bias_grad` false), else f32
    /// (the bias case rounds after summing, by `lce_narrow_rows_bf16`).
    pub fn for_block(bf16_gemms: bool, bias_grad: bool) -> Self {
        if bf16_gemms && !bias_grad { Self::Bf16Rows } else { Self::F32 }
    }

    /// The kernel's `store_bf16` argument.
    pub fn arg(self) -> i32 {
        match self {
            Self::F32 => 0,
            Self::Bf16Rows => 1,
        }
    }
}

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
