//! The loss's device work counted without a device ([`count_call`]): the block schedule every
//! backend runs (the driver's passes over its blocks) over a counting
//! backend that issues, for each block operation, what the CUDA backend's `CudaBlocks` and its
//! `Engine` issue — one cuBLAS GEMM per product, one launch per row kernel, the widening kernels
//! where bf16 inputs meet f32 GEMMs, and the per-call work around the blocks (target
//! resolution with its host wait, the statistics' buffers, uploads of the per-token scales,
//! downloads of the statistics). Nothing is computed: the counts depend on the plan alone.

use flatpeak_common::device_counts::{DeviceCounts, GemmCall};
use flatpeak_common::{DType, Precision};

use crate::blocks::{BlockAt, BlockOps, GradientInputs, Pass, run_blocks};
use crate::config::Config;
use crate::error::Result;
use crate::kernels::GradientStore;
use crate::loss::Stats;
use crate::plan::{BlockSchedule, Plan};

/// What a counted call computes beside the loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CountedCall {
    /// W has a bias (its gradient kernel runs per block).
    pub bias: bool,
    /// The call has per-token weights (downloaded for the loss).
    pub token_weights: bool,
}

/// The block operations as the CUDA backend issues them, counted.
struct CountBlocks<'p> {
    config: &'p Config,
    plan: &'p Plan,
    call: CountedCall,
    counts: DeviceCounts,
}

impl CountBlocks<'_> {
    /// bf16 inputs multiplied in place by bf16 GEMMs (no widening).
    fn native_bf16(&self) -> bool {
        self.plan.dtype() == DType::Bf16 && self.config.precision != Precision::F32
    }
    /// How the gradient kernel stores G (as `CudaBlocks` chooses it).
    fn store(&self) -> GradientStore {
        GradientStore::for_block(self.native_bf16(), self.call.bias)
    }
    fn gemm_dtype(&self) -> DType {
        if self.native_bf16() { DType::Bf16 } else { DType::F32 }
    }
    fn gemm(&mut self, (m, n, k): (usize, usize, usize), accumulate: bool) {
        let dtype = self.gemm_dtype();
        self.counts.gemm(GemmCall { m, n, k, dtype, out: DType::F32, accumulate });
    }
    fn zeros(&mut self, bytes: usize) {
        self.counts.allocations += 1;
        self.counts.launch("memset", bytes);
    }
}

impl BlockOps for CountBlocks<'_> {
    fn begin(&mut self, pass: Pass, _gradient: Option<&GradientInputs<'_>>) -> Result<()> {
        let n = self.plan.n_tokens();
        if pass != Pass::Backward {
            // The statistics: max (filled with −∞), sum, target logit and Σz.
            for bytes in [4, 8, 4, 8] {
                self.zeros(bytes * n);
            }
            self.counts.launch("fill_f32", 4 * n);
        }
        if pass == Pass::Fused {
            self.zeros(4 * n);
        }
        if pass != Pass::Forward {
            // The gradients zeroed, then the per-token scales (and the saved lse) uploaded.
            let (d, v) = (self.plan.hidden(), self.plan.vocab());
            self.counts.launch("memset", 4 * (n * d + v * d + if self.call.bias { v } else { 0 }));
            self.counts.upload(4 * n);
            if pass == Pass::Backward {
                self.counts.upload(4 * n);
            }
        }
        Ok(())
    }
    fn load_tokens(&mut self, _t0: usize, c: usize) -> Result<()> {
        if self.plan.dtype() == DType::Bf16 && !self.native_bf16() {
            self.counts.launch("lce_widen_bf16", 6 * c * self.plan.hidden());
        }
        Ok(())
    }
    fn load_vocab(&mut self, _v0: usize, vb: usize) -> Result<()> {
        if self.plan.dtype() == DType::Bf16 && !self.native_bf16() {
            self.counts.launch("lce_widen_bf16", 6 * vb * self.plan.hidden());
        }
        Ok(())
    }
    fn logits(&mut self, at: BlockAt) -> Result<()> {
        self.gemm((at.c, at.vb, self.plan.hidden()), false);
        Ok(())
    }
    fn fold(&mut self, at: BlockAt) -> Result<()> {
        // The logits read; each row's statistics read and written; the bias slice and targets.
        let bias = if self.call.bias { 4 * at.vb } else { 0 };
        self.counts.launch("lce_fold", 4 * at.c * at.vb + 2 * 24 * at.c + 4 * at.c + bias);
        Ok(())
    }
    fn row_lse(&mut self, at: BlockAt) -> Result<()> {
        self.counts.launch("lce_row_lse", 16 * at.c);
        Ok(())
    }
    fn gradient(&mut self, at: BlockAt, _pass: Pass, _gradient: &GradientInputs<'_>) -> Result<()> {
        // In place over the block (f32 written back, or bf16 rows: 2 bytes a logit); the row
        // scales and targets read.
        let bias = if self.call.bias { 4 * at.vb } else { 0 };
        let written = match self.store() {
            GradientStore::F32 => 4,
            GradientStore::Bf16Rows => 2,
        };
        self.counts.launch("lce_gradient", (4 + written) * at.c * at.vb + 16 * at.c + bias);
        Ok(())
    }
    fn project(&mut self, at: BlockAt) -> Result<()> {
        let (c, vb, d) = (at.c, at.vb, self.plan.hidden());
        if self.call.bias {
            self.counts.launch("lce_bias_grad", 4 * c * vb + 8 * vb);
        }
        if self.store() == GradientStore::F32 && self.native_bf16() {
            self.counts.launch("lce_narrow_rows_bf16", 6 * c * vb);
        }
        self.gemm((c, d, vb), true);
        self.gemm((vb, d, c), true);
        Ok(())
    }
    fn token_rows_done(&mut self, _t0: usize, _c: usize) -> Result<()> {
        Ok(())
    }
    fn take_stats(&mut self) -> Result<Stats> {
        self.counts.host_syncs += 4;
        Ok(Stats::new(0))
    }
}

/// The device work of one forward + backward of the loss under `plan` (its schedule: the fused
/// pass on [`BlockSchedule::FullVocab`], a forward then a backward otherwise), as the CUDA
/// backend issues it, dX and dW both computed.
pub fn count_call(plan: &Plan, call: CountedCall) -> Result<DeviceCounts> {
    let config = plan.config();
    let mut ops = CountBlocks { config, plan, call, counts: DeviceCounts::default() };
    let n = plan.n_tokens();
    // Around the blocks: the targets resolved on the device (a launch, its verdict and the
    // targets read back), the per-token weights read back, the gradients' buffers.
    ops.zeros(4 * n);
    ops.counts.upload(8);
    ops.counts.launch("lce_resolve_targets", 12 * n);
    ops.counts.host_syncs += 2 + usize::from(call.token_weights);
    ops.counts.allocations += 2 + usize::from(call.bias);
    let (coef, lse) = (vec![0f32; n], vec![0f32; n]);
    let gradient = GradientInputs { coef: &coef, saved_lse: &lse, dlse: None };
    match plan.schedule() {
        BlockSchedule::FullVocab => {
            run_blocks(&mut ops, plan, Pass::Fused, Some(&gradient))?;
            ops.take_stats()?;
        }
        BlockSchedule::VocabBlocked => {
            run_blocks(&mut ops, plan, Pass::Forward, None)?;
            ops.take_stats()?;
            run_blocks(&mut ops, plan, Pass::Backward, Some(&gradient))?;
        }
    }
    Ok(ops.counts)
}

#[cfg(test)]
mod tests {
    use flatpeak_common::{Budget, Device};

    use super::*;
    use crate::budget::LossBudget;
    use crate::plan::Shape;

    #[test]
    fn the_fused_schedule_runs_three_gemms_and_three_row_kernels_per_block() {
        let config = Config::default();
        let shape = Shape { tokens: 16384, hidden: 4096, vocab: 131072, dtype: DType::Bf16 };
        let plan = Plan::for_device(&config, shape, LossBudget::Default, Device::Cuda(0)).unwrap();
        let blocks = shape.tokens.div_ceil(plan.token_block());
        let c = count_call(&plan, CountedCall { bias: false, token_weights: false }).unwrap();
        assert_eq!(blocks, 16);
        // The counts that must not grow: three GEMMs and three row kernels a block (the bf16
        // rounding of G fused into the gradient kernel without a bias), a handful of host
        // waits a call; each logit read once by the fold and read once, written as bf16, by the
        // gradient.
        assert_eq!(c.gemms.len(), 3 * blocks);
        for kernel in ["lce_fold", "lce_row_lse", "lce_gradient"] {
            assert_eq!(c.launches[kernel], blocks, "{kernel}");
        }
        assert!(!c.launches.contains_key("lce_narrow_rows_bf16"));
        let logits = (shape.tokens * shape.vocab) as u64;
        let zeroed = 4 * (shape.tokens + shape.vocab) as u64 * shape.hidden as u64;
        let per_token = 1 << 24;
        assert!(
            c.kernel_bytes <= 10 * logits + zeroed + per_token,
            "{} bytes for {logits} logits",
            c.kernel_bytes
        );
        // With a bias, dbias sums the f32 G before it is rounded: the rounding is its own pass.
        let b = count_call(&plan, CountedCall { bias: true, token_weights: false }).unwrap();
        assert_eq!(b.launches["lce_narrow_rows_bf16"], blocks);
        assert!(!c.launches.contains_key("lce_widen_bf16"));
        assert_eq!(c.host_syncs, 6);
        // The GEMMs are the three products over the whole logits matrix, exactly.
        let (n, d, v) = (16384.0, 4096.0, 131072.0);
        assert_eq!(c.gemm_flops(), 3.0 * 2.0 * n * d * v);
        // Under f32 GEMMs the bf16 inputs are widened, once per token block and vocabulary block.
        let wide = Plan::sized_for(
            &config.precision(Precision::F32),
            shape,
            Budget::Bytes(1 << 31),
            crate::Target::Device,
        )
        .unwrap();
        let w = count_call(&wide, CountedCall { bias: true, token_weights: false }).unwrap();
        // (Its widened W block does not fit the budget whole: vocabulary blocks, two passes,
        // each widening every token block once and every vocabulary block per token block.)
        assert_eq!(wide.schedule(), BlockSchedule::VocabBlocked);
        let (tb, vbk) = (shape.tokens.div_ceil(wide.token_block()), shape.vocab.div_ceil(wide.vocab_block()));
        assert_eq!(w.launches["lce_widen_bf16"], 2 * tb * (1 + vbk));
        assert_eq!(w.launches["lce_bias_grad"], tb * vbk);
        assert!(w.gemms.iter().all(|g| g.dtype == DType::F32));
    }

    #[test]
    fn the_blocked_schedule_recomputes_the_logits() {
        let config = Config::default();
        let shape = Shape { tokens: 4096, hidden: 1024, vocab: 32768, dtype: DType::F32 };
        let plan = Plan::sized_for(&config, shape, Budget::Bytes(4 << 20), crate::Target::Device).unwrap();
        assert_eq!(plan.schedule(), BlockSchedule::VocabBlocked);
        let c = count_call(&plan, CountedCall { bias: false, token_weights: true }).unwrap();
        let blocks = shape.tokens.div_ceil(plan.token_block()) * shape.vocab.div_ceil(plan.vocab_block());
        assert_eq!(c.gemms.len(), 4 * blocks);
        assert_eq!(c.gemm_flops(), 4.0 * 2.0 * 4096.0 * 1024.0 * 32768.0);
        assert_eq!(c.host_syncs, 7);
    }
}
