//! What a layer is ([`Shape`]) and how it is scheduled ([`Config`]).
//!
//! The MoE layer: per rank, N tokens `x` (N×H), top-k expert ids and routing weights (N×k);
//! E SwiGLU experts `FFN_e(x) = (silu(x·W_gate,e) ⊙ (x·W_up,e))·W_down,e` with W_gate, W_up
//! H×I and W_down I×H; expert e lives on rank `e / (E/P)`. The output of token i is
//! `y_i = Σ_j w_ij·FFN_{e_ij}(x_i)`; a duplicate id in one token's top-k is two routes (the
//! same as one route with the summed weight).

use flatpeak_common::gemm::Threads;
use flatpeak_common::gemm_bf16::Bf16Kernel;
use flatpeak_common::{DType, Digest};

use crate::error::{Error, Result};

/// The sizes of one MoE layer over P ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// P: ranks of the expert-parallel group.
    pub ranks: usize,
    /// N: tokens per rank, the most any rank brings to a call (each rank may bring its own
    /// batch of n ≤ N tokens: [`Shape::for_call`]); every buffer is sized for N.
    pub tokens: usize,
    /// H: hidden size.
    pub hidden: usize,
    /// I: expert intermediate size.
    pub intermediate: usize,
    /// E: experts, E/P native to each rank.
    pub experts: usize,
    /// k: routes per token.
    pub top_k: usize,
    /// Storage type of tokens, weights, dY, the dispatch rows and the expert scratch: f32 or bf16
    /// (bf16 runs on the CPU backend; the output and the gradients are f32 either way).
    pub dtype: DType,
}

impl Shape {
    /// Checks the domains: P ≥ 1, E ≥ 1 divisible by P, k ≥ 1, H ≥ 1, I ≥ 1.
    pub fn validate(&self) -> Result<()> {
        let positive = |name, value: usize| {
            if value >= 1 { Ok(()) } else { Err(Error::invalid_config(name, value, "at least 1")) }
        };
        positive("ranks", self.ranks)?;
        positive("experts", self.experts)?;
        positive("top_k", self.top_k)?;
        positive("hidden", self.hidden)?;
        positive("intermediate", self.intermediate)?;
        if !self.experts.is_multiple_of(self.ranks) {
            return Err(Error::ExpertsNotDivisible { experts: self.experts, ranks: self.ranks });
        }
        Ok(())
    }

    /// M = E/P, the experts native to each rank.
    pub fn local_experts(&self) -> usize {
        self.experts / self.ranks.max(1)
    }

    /// The rank expert `e` is native to.
    pub fn native_rank(&self, expert: usize) -> usize {
        expert / self.local_experts().max(1)
    }

    /// Bytes per element of the storage type.
    pub fn elem_bytes(&self) -> usize {
        self.dtype.size_in_bytes()
    }

    /// This shape for one call on a rank that brings `ids_len` top-k ids: N is the plan's
    /// capacity, and each rank may bring fewer tokens (its own batch), `n = ids_len / k ≤ N`.
    /// The call's shape has `tokens = n`; every buffer the plan sized for N holds it.
    pub fn for_call(&self, ids_len: usize) -> Result<Shape> {
        let k = self.top_k.max(1);
        if !ids_len.is_multiple_of(k) || ids_len / k > self.tokens {
            return Err(Error::ShapeMismatch {
                what: "top-k ids (n·k, for n ≤ N tokens)",
                expected: self.tokens.saturating_mul(k),
                got: ids_len,
            });
        }
        Ok(Shape { tokens: ids_len / k, ..*self })
    }

    /// Elements of one expert's weights, `3·H·I` (gate, up, down), saturating at `usize::MAX`.
    pub fn expert_elems(&self) -> usize {
        saturating_product(&[3, self.hidden, self.intermediate])
    }
}

/// `Π factors`, `None` on overflow.
pub(crate) fn checked_product(factors: &[usize]) -> Option<usize> {
    factors.iter().try_fold(1usize, |p, &f| p.checked_mul(f))
}

/// `Π factors`, saturating at `usize::MAX`: the byte accessors' arithmetic. A region past
/// `usize` is an overflow whatever its exact size, and a sum of saturated terms stays saturated.
pub(crate) fn saturating_product(factors: &[usize]) -> usize {
    checked_product(factors).unwrap_or(usize::MAX)
}

/// Which schedule a plan describes; the two baselines are plans too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Scheme {
    /// Every route goes to its expert's native rank, in one all-to-all sized to what arrives
    /// (a hot rank receives up to P·k·N rows).
    StandardEp,
    /// Least-loaded assignment (LLEP), one all-to-all sized to what arrives (≈ α·k·N rows).
    Llep,
    /// Least-loaded assignment, then K rounds in which any source sends at most q rows to any
    /// destination: every buffer is sized at launch, whatever the routing.
    #[default]
    PipelinedLlep,
}

/// How a rank's native expert weights (and their gradients) are laid out. Both are read in
/// place: the expert GEMMs take the weights as stored, transposed or not, never copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightLayout {
    /// llep's own, `x·W`: W_gate and W_up `[M][H][I]` in [`ExpertWeights::gate`] and
    /// [`ExpertWeights::up`], W_down `[M][I][H]`.
    ///
    /// [`ExpertWeights::gate`]: crate::ExpertWeights::gate
    /// [`ExpertWeights::up`]: crate::ExpertWeights::up
    #[default]
    Split,
    /// torch's `nn.Linear` (`x·Wᵀ`), as Hugging Face transformers' fused experts store them
    /// (`gate_up_proj`, `down_proj`): [`ExpertWeights::gate`] holds gate_up `[M][2I][H]` (each
    /// expert's I gate rows, then its I up rows), [`ExpertWeights::up`] is empty, and
    /// [`ExpertWeights::down`] holds W_down `[M][H][I]`. The gradients come back in the same
    /// layout (`d_gate` is dL/d gate_up, `d_up` empty).
    ///
    /// [`ExpertWeights::gate`]: crate::ExpertWeights::gate
    /// [`ExpertWeights::up`]: crate::ExpertWeights::up
    /// [`ExpertWeights::down`]: crate::ExpertWeights::down
    Linear,
}

impl WeightLayout {
    /// Elements of the three native weight tensors (gate, up, down) of M experts.
    pub fn native_lens(self, shape: &Shape) -> [usize; 3] {
        let native = saturating_product(&[shape.local_experts(), shape.hidden, shape.intermediate]);
        match self {
            Self::Split => [native; 3],
            Self::Linear => [native.saturating_mul(2), 0, native],
        }
    }

    /// Where local expert `slot`'s part (0 gate, 1 up, 2 down, each H·I elements) begins: which
    /// of the three tensors holds it, and at which element.
    pub(crate) fn part_at(self, shape: &Shape, slot: usize, part: usize) -> (usize, usize) {
        let hi = shape.hidden * shape.intermediate;
        match (self, part) {
            (Self::Split, _) | (Self::Linear, 2) => (part, slot * hi),
            (Self::Linear, _) => (0, (2 * slot + part) * hi),
        }
    }

    /// Whether the stored matrix of a part is the transpose of llep's `x·W` operand (W_gate,
    /// W_up `H×I`, W_down `I×H`).
    pub(crate) fn transposed(self) -> bool {
        self == Self::Linear
    }
}

/// What the forward pass keeps for backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// The layer runs under activation checkpointing: forward keeps nothing but its input, and
    /// backward recomputes each round (re-dispatch, expert forward) and runs that round's
    /// backward at once, so nothing outlives its round.
    #[default]
    Checkpointed,
    /// Forward keeps every round's received rows, their routes and each route's SwiGLU
    /// pre-activations (x·W_gate, x·W_up) for backward, which then dispatches only dY and runs
    /// no recompute. What is kept grows with the routing: rank d holds `Σ_s R[s][d]` rows and
    /// `L_d` routes' pre-activations ([`Schedule::saved_bytes`](crate::Schedule::saved_bytes)), at most
    /// `K·P·q` rows ([`Buffers::saved_activation_bytes`](crate::Buffers::saved_activation_bytes)).
    /// Run it with [`Executor::forward_saving`](crate::Executor::forward_saving) and
    /// [`Executor::backward_saved`](crate::Executor::backward_saved).
    SaveActivations,
}

/// How the pair cap q is chosen when the launch [`Plan`](crate::Plan) is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PairCap {
    /// q rows per (source, destination) per round (at most N).
    Rows(usize),
    /// The largest q ≤ N whose buffers fit the plan's [`Budget`](flatpeak_common::Budget).
    #[default]
    FitBudget,
}

/// How a spilled expert's routes are divided among the sources that hold them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SpillSplit {
    /// Every source contributes to every piece of the expert in proportion to its count
    /// (a Sainte-Laguë interleave of the sources), so `S[s][d] ≈ L_d/P`.
    #[default]
    Proportional,
    /// LLEP's own split: pieces are ranges of the source-major route list, so a helper
    /// receives a contiguous block, usually from one or two sources.
    Position,
}

/// Which rows of a (source, destination) list go to which round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Chunking {
    /// Row r goes to round r mod K.
    #[default]
    Strided,
    /// Rows are cut into K consecutive runs of ⌈R/K⌉.
    Contiguous,
}

/// The most copies of the dispatch buffers a config may ask for (3 already overlaps dispatch,
/// experts and combine).
pub const MAX_PIPELINE_DEPTH: usize = 16;

/// The schedule's options. Defaults: the paper's α = 1.0, m = 1024, λ = 1.3; PipelinedLLEP
/// with the largest pair cap the plan's budget holds, 4 foreign-expert slots per rank, proportional spill split,
/// strided rounds, checkpointed training, double buffering, GEMMs on the whole rayon pool (bf16
/// ones on the CPU's bf16 instructions where it has them).
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct Config {
    /// Which schedule.
    pub scheme: Scheme,
    /// α: a rank's capacity is `⌊α·⌊Σl/P⌋⌋` routes (= α·k·N).
    pub alpha: f64,
    /// m: a spill chunk is at least this many routes unless it finishes its expert.
    pub min_chunk: usize,
    /// λ: below this per-rank imbalance (max / mean native load) plain EP runs.
    pub imbalance_threshold: f64,
    /// The pair cap q (PipelinedLLEP only).
    pub pair_cap: PairCap,
    /// F_max: foreign-expert weight slots per rank, reserved at launch (PipelinedLLEP only;
    /// LLEP takes as many as its assignment needs).
    pub foreign_slots: usize,
    /// How spilled routes are divided among sources.
    pub spill_split: SpillSplit,
    /// How rows are dealt to rounds.
    pub chunking: Chunking,
    /// What forward keeps for backward.
    pub mode: Mode,
    /// D: copies of the dispatch buffers, so round j+1's dispatch can overlap round j's GEMMs
    /// (D ≥ 2), and round j−1's combine too (D ≥ 3; the device executor's issue order, see
    /// `device`). The CPU executor's rounds run in order whatever D is.
    pub pipeline_depth: usize,
    /// Threads of each expert GEMM and of the CPU's row operations around it (gathers,
    /// scatter-adds, SwiGLU, row dot products). [`Threads::Single`] keeps a rank's compute on
    /// its own thread (P ranks as threads already fill the cores, and the rank's thread CPU
    /// time is then its compute); results are bitwise identical for every choice.
    pub gemm_threads: Threads,
    /// The CPU kernel of bf16 expert GEMMs ([`Bf16Kernel`]): by default AMX tiles or
    /// AVX512-BF16, where the CPU has them; [`Bf16Kernel::Widened`] runs the widening fallback on any CPU. The device
    /// backends ignore it.
    pub bf16_kernel: Bf16Kernel,
    /// How the native expert weights are laid out ([`WeightLayout::Split`] by default).
    pub weight_layout: WeightLayout,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            scheme: Scheme::PipelinedLlep,
            alpha: 1.0,
            min_chunk: 1024,
            imbalance_threshold: 1.3,
            pair_cap: PairCap::default(),
            foreign_slots: 4,
            spill_split: SpillSplit::Proportional,
            chunking: Chunking::Strided,
            mode: Mode::Checkpointed,
            pipeline_depth: 2,
            gemm_threads: Threads::All,
            bf16_kernel: Bf16Kernel::Detect,
            weight_layout: WeightLayout::Split,
        }
    }
}

impl Config {
    /// Defaults with this scheme.
    pub fn with_scheme(scheme: Scheme) -> Self {
        Self { scheme, ..Self::default() }
    }
    flatpeak_common::setters! {
        /// This config with another scheme.
        scheme: Scheme,
        /// This config with capacity factor α.
        alpha: f64,
        /// This config with minimum spill chunk m.
        min_chunk: usize,
        /// This config with imbalance threshold λ.
        imbalance_threshold: f64,
        /// This config with another pair cap.
        pair_cap: PairCap,
        /// This config with F_max foreign-expert slots.
        foreign_slots: usize,
        /// This config with another spill split.
        spill_split: SpillSplit,
        /// This config with another chunking.
        chunking: Chunking,
        /// This config in another mode.
        mode: Mode,
        /// This config with D copies of the dispatch buffers.
        pipeline_depth: usize,
        /// This config with expert GEMMs on these threads.
        gemm_threads: Threads,
        /// This config with this CPU kernel for bf16 GEMMs ([`Bf16Kernel`]).
        bf16_kernel: Bf16Kernel,
        /// This config reading the expert weights in another layout.
        weight_layout: WeightLayout,
    }

    /// A digest of the options every rank of a group must share, field by field (stable across
    /// processes and builds, never over the `Debug` text): everything that decides the plan and
    /// the exchanges. [`Config::gemm_threads`] and [`Config::bf16_kernel`] are left out: they
    /// choose how a rank computes its own GEMMs, not what it sends, and may differ by rank.
    pub fn digest(&self) -> u64 {
        let code = |v: usize| v as u64;
        let pair_cap = match self.pair_cap {
            PairCap::FitBudget => Digest::new().u64(0),
            PairCap::Rows(q) => Digest::new().u64(1).usize(q),
        };
        Digest::new()
            .str("llep::Config")
            .u64(code(match self.scheme {
                Scheme::StandardEp => 0,
                Scheme::Llep => 1,
                Scheme::PipelinedLlep => 2,
            }))
            .f64(self.alpha)
            .usize(self.min_chunk)
            .f64(self.imbalance_threshold)
            .u64(pair_cap.finish())
            .usize(self.foreign_slots)
            .u64(code(match self.spill_split {
                SpillSplit::Proportional => 0,
                SpillSplit::Position => 1,
            }))
            .u64(code(match self.chunking {
                Chunking::Strided => 0,
                Chunking::Contiguous => 1,
            }))
            .u64(code(match self.mode {
                Mode::Checkpointed => 0,
                Mode::SaveActivations => 1,
            }))
            .usize(self.pipeline_depth)
            .u64(code(match self.weight_layout {
                WeightLayout::Split => 0,
                WeightLayout::Linear => 1,
            }))
            .finish()
    }

    /// Checks every option's domain (NaN is never valid).
    pub fn validate(&self) -> Result<()> {
        let bad = |name, value: f64, expected| Err(Error::invalid_config(name, value, expected));
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return bad("alpha", self.alpha, "a finite value > 0");
        }
        if self.imbalance_threshold.is_nan() || self.imbalance_threshold < 0.0 {
            return bad("imbalance_threshold", self.imbalance_threshold, "a value ≥ 0");
        }
        if self.min_chunk == 0 {
            return bad("min_chunk", 0.0, "at least 1");
        }
        if !(1..=MAX_PIPELINE_DEPTH).contains(&self.pipeline_depth) {
            return bad("pipeline_depth", self.pipeline_depth as f64, "1 to 16 copies");
        }
        if self.pair_cap == PairCap::Rows(0) {
            return bad("pair_cap", 0.0, "at least 1 row");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_papers() {
        let c = Config::default();
        assert_eq!((c.alpha, c.min_chunk, c.imbalance_threshold), (1.0, 1024, 1.3));
        assert_eq!((c.scheme, c.mode), (Scheme::PipelinedLlep, Mode::Checkpointed));
        assert!(c.validate().is_ok());
    }

    #[test]
    fn validation_names_the_option() {
        let bad = [
            Config::default().alpha(f64::NAN),
            Config::default().alpha(0.0),
            Config::default().min_chunk(0),
            Config::default().pipeline_depth(0),
            Config::default().pair_cap(PairCap::Rows(0)),
            Config::default().imbalance_threshold(f64::NAN),
        ];
        for c in bad {
            assert!(matches!(c.validate(), Err(Error::InvalidConfig { .. })), "{c:?}");
        }
        let shape = Shape {
            ranks: 3,
            tokens: 4,
            hidden: 2,
            intermediate: 2,
            experts: 8,
            top_k: 2,
            dtype: DType::F32,
        };
        assert_eq!(shape.validate(), Err(Error::ExpertsNotDivisible { experts: 8, ranks: 3 }));
        assert!(Shape { ranks: 4, ..shape }.validate().is_ok());
        assert!(matches!(Shape { top_k: 0, ..shape }.validate(), Err(Error::InvalidConfig { .. })));
    }

    /// The digest is the same in every process and build (a fixed value for the defaults), moves
    /// with every field the ranks share and stays put for the rank-local ones.
    #[test]
    fn the_digest_is_stable_and_follows_the_shared_fields_only() {
        let d = Config::default();
        assert_eq!(d.digest(), 0x1f3f_7ff9_6f5c_978a, "the default config's digest changed");
        let shared = [
            d.scheme(Scheme::Llep),
            d.alpha(1.5),
            d.min_chunk(7),
            d.imbalance_threshold(2.0),
            d.pair_cap(PairCap::Rows(8)),
            d.pair_cap(PairCap::Rows(9)),
            d.foreign_slots(2),
            d.spill_split(SpillSplit::Position),
            d.chunking(Chunking::Contiguous),
            d.mode(Mode::SaveActivations),
            d.pipeline_depth(3),
            d.weight_layout(WeightLayout::Linear),
        ];
        let mut seen = vec![d.digest()];
        for c in shared {
            assert!(!seen.contains(&c.digest()), "{c:?}");
            seen.push(c.digest());
        }
        let local = [d.gemm_threads(Threads::Single), d.bf16_kernel(Bf16Kernel::Widened)];
        assert!(local.iter().all(|c| c.digest() == d.digest()));
    }
}
