//! [`Precision`]: which arithmetic a primitive's GEMMs run in, chosen once on its config.
//!
//! The inputs' storage dtype decides what "exact" means: an f32 GEMM (SGEMM) on f32 inputs, a
//! GEMM on bf16 operands with f32 accumulation on bf16 inputs (each product of two bf16 values
//! is exact in f32, so only the order of the f32 sums differs from a widened f32 GEMM). The
//! option chooses between that and all-f32 GEMMs.

/// How GEMMs multiply. Default: [`Precision::Native`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Precision {
    /// GEMMs in the inputs' storage dtype with f32 accumulation and f32 outputs where the
    /// schedule folds (logits blocks, the online lse): SGEMM for f32 inputs; for bf16 inputs
    /// the CPU's bf16 dot products (AVX512-BF16 `vdpbf16ps`) where it has them, else the
    /// operands widened block by block (the same products); on CUDA, cuBLAS `GemmEx` on the
    /// bf16 operands in place with f32 accumulation (ring-dtp's single-device path).
    /// Where backward multiplies by a gradient it computed in f32 (ring-dtp's logit gradient),
    /// that gradient is rounded to bf16 first, as autograd of a bf16 matmul does.
    #[default]
    Native,
    /// Every GEMM in f32: bf16 operands are widened to f32 (exactly) block by block and the
    /// gradients stay f32 — the slowest and most exact choice for bf16 inputs; for f32 inputs
    /// the same as `Native`.
    F32,
    /// f32 inputs multiplied on tensor cores as TF32 (operands rounded to a 10-bit significand,
    /// products summed in f32: cuBLAS's `CUBLAS_TF32_TENSOR_OP_MATH`). **Not exact**: each
    /// product carries a relative error up to ~2⁻¹¹, so losses and gradients differ from f32's
    /// at about 1e-3 relative. Opt-in, for speed on a GPU; a CUDA backend with f32 inputs only
    /// — a CPU, the emulator or bf16 inputs answer it with a typed error, never silently
    /// running something else.
    Tf32,
}

impl Precision {
    /// A short name for reports and row labels: `native`, `f32` or `tf32`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::F32 => "f32",
            Self::Tf32 => "tf32",
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
