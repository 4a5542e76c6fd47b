//! Reproducing the paper's vocabulary-projection comparison: the per-rank peak formulas of the
//! naive data-parallel head, Megatron's vocab-parallel cross-entropy, Cut Cross-Entropy and
//! Ring-DTP ([`PaperPeaks`]). The crate's own bound is its plan's
//! ([`Plan::workspace_bytes`](crate::Plan::workspace_bytes),
//! [`RingPlan::bound_bytes`](crate::RingPlan::bound_bytes)); nothing in the schedule needs this.

/// Per-rank peak bytes of the vocabulary projection + loss, forward and backward, by formula,
/// for N tokens over P ranks (n = N/P tokens and
/// v = ⌈V/P⌉ vocabulary rows per rank) and hidden size D with bf16 inputs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PaperPeaks {
    /// A data-parallel rank materializing its n tokens' fp32 logits and their gradient: 8·n·V.
    pub naive: f64,
    /// Megatron vocab-parallel CE (TP + SP): 6·N·V/P + 2·N·D.
    pub megatron: f64,
    /// Cut Cross-Entropy on a rank's n tokens with bf16 dC and dE: 4n + 4V + 2·V·D + 2·n·D.
    pub cut_cross_entropy: f64,
    /// Ring-DTP, weight ring, one buffer each: 2·v·D (bf16 W) + 4·v·D (fp32 dW) + 4·n·D + 12·n.
    pub ring_dtp: f64,
}

impl PaperPeaks {
    /// The formulas at N tokens, D, V, P ranks.
    pub fn at(n_total: usize, d: usize, v: usize, p: usize) -> Self {
        let (nt, d, v, p) = (n_total as f64, d as f64, v as f64, p.max(1) as f64);
        let n = nt / p;
        let vs = (v / p).ceil();
        Self {
            naive: 8.0 * n * v,
            megatron: 6.0 * nt * v / p + 2.0 * nt * d,
            cut_cross_entropy: 4.0 * n + 4.0 * v + 2.0 * v * d + 2.0 * n * d,
            ring_dtp: 2.0 * vs * d + 4.0 * vs * d + 4.0 * n * d + 12.0 * n,
        }
    }

    /// `1 − ring_dtp / naive`.
    pub fn ring_reduction(&self) -> f64 {
        1.0 - self.ring_dtp / self.naive
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_papers_86_6_percent() {
        // N = 32,768, V = 152,064 (Qwen2.5), D = 5,120: 1 − 0.75·D/N − D/(2V) = 86.6%, any P.
        for p in [1, 8] {
            let peaks = PaperPeaks::at(32_768, 5_120, 152_064, p);
            let want = 1.0 - 0.75 * 5120.0 / 32768.0 - 5120.0 / (2.0 * 152_064.0);
            assert!((peaks.ring_reduction() - want).abs() < 2e-4, "P={p}: {}", peaks.ring_reduction());
        }
        assert!((PaperPeaks::at(32_768, 5_120, 152_064, 8).ring_reduction() - 0.866).abs() < 5e-4);
    }
}
