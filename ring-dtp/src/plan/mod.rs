//! Pure sizing: token and vocabulary block sizes from a byte budget, the schedule (keep a token
//! block's full-vocabulary logits, 3 GEMMs fused; or vocabulary blocks, 4 GEMMs), and the
//! working set, fixed before anything runs. Also the per-rank peak formulas of the paper's
//! comparison (naive, Megatron vocab-parallel, Cut Cross-Entropy, Ring-DTP).
//!
//! Working set (f32): logits block `Vb·C`, an X block `C·D`, a W sub-block
//! `min(Vb, WIDEN_ROWS)·D` when W is bf16 (widened per sub-block), a second `C·D` partial sum
//! of dX where its GEMMs are long enough to split their reduction ([`splits_dx`]), and `ROW_SCRATCH_BYTES` per
//! token of a block (gradient constants and the fold's partials); nothing grows with N but the
//! per-token statistics (`PER_TOKEN_BYTES`·N, besides the lse output), plus the CPU GEMM's own
//! packing buffers.

/// The accessors [`Plan`] and [`RingPlan`] share, over their fields of the same names (`config`,
/// `n`, `d`, `v`, `dtype`, `token_block`, `vocab_block`), with the docs that differ between them.
macro_rules! plan_accessors {
    (config: $config:literal, n_tokens: $n_tokens:literal, vocab_block: $vocab_block:literal $(,)?) => {
        #[doc = $config]
        pub fn config(&self) -> &Config {
            &self.config
        }
        #[doc = $n_tokens]
        pub fn n_tokens(&self) -> usize {
            self.n
        }
        /// Hidden size D.
        pub fn hidden(&self) -> usize {
            self.d
        }
        /// Vocabulary V.
        pub fn vocab(&self) -> usize {
            self.v
        }
        /// Input dtype.
        pub fn dtype(&self) -> DType {
            self.dtype
        }
        /// Tokens per block, C.
        pub fn token_block(&self) -> usize {
            self.token_block
        }
        #[doc = $vocab_block]
        pub fn vocab_block(&self) -> usize {
            self.vocab_block
        }
    };
}

mod layout;
mod ring;
mod ring_buffers;

pub use layout::{BlockRegions, DEVICE_REGION_ALIGN, SPLIT_K_MIN_ROWS, WIDEN_ROWS, pack_regions, splits_dx};
pub use ring::{RingChoice, RingKind, RingOptions, RingPlan};
pub(crate) use ring_buffers::{ActivationScratch, Packet, RegionKind, RegionSource, Slot, WeightScratch};

use flatpeak_common::{Budget, DType, Device, Precision};

use crate::budget::LossBudget;
use crate::config::Config;
use crate::error::{Error, Result};

/// Bytes of per-token state besides the outputs: the fold's running max (f32), sum-exp (f64),
/// target logit (f32) and Σz (f64, for label smoothing), and the gradient scale c_i (f32).
pub const PER_TOKEN_BYTES: usize = 28;

/// Bound on the CPU GEMM's packing buffers per thread (measured: 1.0 MiB per thread, a little
/// more when the left operand is a transposed view).
pub const CPU_GEMM_SCRATCH_PER_THREAD: usize = 5 << 18;

/// The CPU GEMM's depth block (the `gemm` crate's kc: at least 512 rows of k, 512 on the CI
/// machine kind). Where dX's GEMM is split in two ([`splits_dx`]), the second GEMM in
/// flight packs its own `kc × C` panel of Gᵀ: measured 0.5, 1.0 and 2.0 MiB at C = 256, 512
/// and 1024, for D from 256 to 2048, i.e. `4·512·C` bytes.
pub const CPU_GEMM_DEPTH_BLOCK: usize = 512;

/// Row ranges the CPU fold splits a block into (its partial maxima and sums are combined in
/// order).
pub(crate) const FOLD_TASKS: usize = 16;

/// Scratch bytes per token of a block besides the workspace: the gradient constants (6 f32),
/// the target entries of the gradient pass (16 B), and the fold's partials (a max in f32 and a
/// sum in f64 per task, and the new max).
pub const ROW_SCRATCH_BYTES: usize = 6 * 4 + 16 + FOLD_TASKS * 12 + 4;

/// Token block sizes tried, largest first: wider blocks mean fewer passes over W and dW.
const TOKEN_BLOCKS: [usize; 7] = [1024, 512, 256, 128, 64, 32, 16];
/// Fewest tokens per block for which the full-vocabulary schedule is preferred outright.
const MIN_FULL_VOCAB_TOKENS: usize = 256;
/// Smallest vocabulary block of the blocked schedule.
const MIN_VOCAB_BLOCK: usize = 64;

/// How logits are formed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockSchedule {
    /// A token block's logits over the whole vocabulary fit: forward + backward fused in one
    /// pass costs 3 GEMMs (logits, dX, dW).
    FullVocab,
    /// Vocabulary blocks: a forward fold pass, then a backward pass recomputing logits (4 GEMMs).
    VocabBlocked,
}

/// Whose block buffers a plan's budget bounds: a backend's working set differs
/// ([`BlockRegions`]: the CPU widens bf16 rows and splits dX's GEMM in host regions; a device
/// reads bf16 in place and carves its buffers from one allocation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Target {
    /// The CPU executor and the free functions of [`crate::cpu`]: its host regions, aligned.
    #[default]
    Host,
    /// A CUDA device (and the SIMT emulator running the same launches):
    /// [`BlockRegions::device_bytes`]. Its plans choose wider token blocks within a budget
    /// (a GPU's GEMMs want them: the dW GEMM stays memory-bound below several hundred tokens
    /// per block) and are refused by the CPU executor.
    Device,
}

impl Target {
    /// The target of `device`'s executor.
    pub fn of(device: Device) -> Self {
        match device {
            Device::Cpu => Target::Host,
            Device::Cuda(_) => Target::Device,
        }
    }
}

/// Block sizes and working set of one call shape, with the [`Config`] they were planned for:
/// an executor made from the plan runs that config, so the two cannot disagree.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Plan {
    n: usize,
    d: usize,
    v: usize,
    dtype: DType,
    token_block: usize,
    vocab_block: usize,
    schedule: BlockSchedule,
    config: Config,
    target: Target,
}

/// The sizes of one call: N tokens of hidden size D against a vocabulary of V rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// N: tokens (rows of X).
    pub tokens: usize,
    /// D: hidden size.
    pub hidden: usize,
    /// V: vocabulary rows of W.
    pub vocab: usize,
    /// Element type of X and W (f32 or bf16; accumulation is f32 either way).
    pub dtype: DType,
}

/// The largest power of two below `x` (0 for x ≤ 1): where halving from a size that is not a
/// power of two starts. `x.next_power_of_two() / 2`, without its overflow above 2⁶³.
pub(crate) fn power_of_two_below(x: usize) -> usize {
    if x <= 1 { 0 } else { 1 << (usize::BITS - 1 - (x - 1).leading_zeros()) }
}

/// Checks that the inputs' sizes and the per-token statistics of `shape` are representable, so
/// that no size derived from them overflows.
fn check_input_sizes(Shape { tokens: n, hidden: d, vocab: v, .. }: Shape) -> Result<()> {
    let fits = |a: usize, b: usize| a.checked_mul(b).and_then(|x| x.checked_mul(4)).is_some();
    if fits(n, d) && fits(v, d) && n.checked_mul(PER_TOKEN_BYTES).is_some() {
        Ok(())
    } else {
        Err(Error::Common(flatpeak_common::Error::SizeOverflow { what: "ring-dtp input sizes" }))
    }
}

/// Working-set bytes of blocks (C, Vb) on the CPU ([`BlockRegions`]), `None` when the
/// arithmetic overflows (never fits).
fn block_bytes(c: usize, vb: usize, d: usize, dtype: DType) -> Option<usize> {
    BlockRegions::host(c, vb, d, dtype)?.host_bytes()
}

/// Working-set bytes of blocks (C, Vb) on `target` under `precision`, `None` on overflow.
fn target_bytes(
    target: Target,
    (c, vb): (usize, usize),
    d: usize,
    dtype: DType,
    precision: Precision,
) -> Option<usize> {
    match target {
        Target::Host => block_bytes(c, vb, d, dtype),
        Target::Device => {
            // The device's buffers, and never less than the host's checks: the sizes of a
            // host plan of the same blocks must not overflow either.
            block_bytes(c, vb, d, dtype)?;
            BlockRegions::device(c, vb, d, dtype, precision)?.device_bytes()
        }
    }
}

impl Plan {
    /// Chooses blocks for `shape` within `budget` of the CPU's working set ([`Target::Host`]:
    /// [`Plan::sized_for`]).
    pub fn new(config: &Config, shape: Shape, budget: Budget) -> Result<Self> {
        Self::sized_for(config, shape, budget, Target::Host)
    }

    /// The plan of `shape` on `device` within `budget` (its default for the device:
    /// [`LossBudget::of`]), sized by that device's block buffers ([`Target::of`]): what a
    /// binding asks for a call.
    pub fn for_device(config: &Config, shape: Shape, budget: LossBudget, device: Device) -> Result<Self> {
        Self::sized_for(config, shape, budget.of(device), Target::of(device))
    }

    /// Chooses blocks for `shape` within `budget` of `target`'s working set (the largest token
    /// blocks, then the largest vocabulary blocks, that fit); [`Error::BudgetTooSmall`] when not
    /// even 16 tokens × 64 vocabulary rows fit. [`Budget::Unlimited`] gives the materialized
    /// `(N, V)` blocks.
    pub fn sized_for(config: &Config, shape: Shape, budget: Budget, target: Target) -> Result<Self> {
        config.validate()?;
        check_input_sizes(shape)?;
        let Shape { tokens: n, hidden: d, vocab: v, dtype } = shape;
        let precision = config.precision;
        let fits = |c: usize, vb: usize| {
            target_bytes(target, (c, vb), d, dtype, precision).is_some_and(|b| budget.admits(b))
        };
        let plan = |token_block: usize, vocab_block: usize, schedule| Self {
            n,
            d,
            v,
            dtype,
            token_block,
            vocab_block,
            schedule,
            config: *config,
            target,
        };
        let cap = |c: usize| c.min(n.max(1));
        // First the full-vocabulary schedule with wide token blocks (one GEMM fewer, and a bf16
        // W upcast once per call); then the widest token blocks over the largest vocabulary
        // blocks that fit (each token block reads all of W once, so few blocks matter most).
        let v1 = v.max(1);
        let wide = MIN_FULL_VOCAB_TOKENS.min(n.max(1));
        for c in TOKEN_BLOCKS.map(cap).into_iter().filter(|&c| c >= wide) {
            if fits(c, v1) {
                return Ok(plan(c, v1, BlockSchedule::FullVocab));
            }
        }
        for c in TOKEN_BLOCKS.map(cap) {
            let mut vb = v1;
            loop {
                if fits(c, vb) {
                    let schedule =
                        if vb == v1 { BlockSchedule::FullVocab } else { BlockSchedule::VocabBlocked };
                    return Ok(plan(c, vb, schedule));
                }
                let next = if vb == v1 { power_of_two_below(v1) } else { vb / 2 };
                if next < MIN_VOCAB_BLOCK.min(v1) || next == 0 || next >= vb {
                    break;
                }
                vb = next;
            }
        }
        let needed = target_bytes(target, (cap(16), MIN_VOCAB_BLOCK.min(v1)), d, dtype, precision)
            .ok_or(Error::Common(flatpeak_common::Error::SizeOverflow { what: "ring-dtp block bytes" }))?;
        Err(Error::BudgetTooSmall { budget: budget.bytes(), needed, what: "16 tokens x 64 vocabulary rows" })
    }

    /// Explicit blocks instead of a budget: `(token_block, vocab_block)` = (C, Vb), each capped
    /// at N and V; the full-vocabulary schedule when Vb ≥ V. For callers that know their
    /// device better than the CPU-oriented choice of [`Plan::new`] — on a GPU, wider blocks
    /// keep every GEMM large enough to fill the SMs (`docs/gpu.md`); `(N, V)` is the
    /// materialized-logits shape. [`Error::InvalidConfig`] for a zero block.
    pub fn with_blocks(
        config: &Config,
        shape: Shape,
        (token_block, vocab_block): (usize, usize),
    ) -> Result<Self> {
        config.validate()?;
        check_input_sizes(shape)?;
        let Shape { tokens: n, hidden: d, vocab: v, dtype } = shape;
        for (field, value) in [("token_block", token_block), ("vocab_block", vocab_block)] {
            if value == 0 {
                return Err(Error::invalid_config(field, value, "at least 1"));
            }
        }
        let (c, vb) = (token_block.min(n.max(1)), vocab_block.min(v.max(1)));
        if block_bytes(c, vb, d, dtype).is_none() {
            return Err(Error::Common(flatpeak_common::Error::SizeOverflow { what: "ring-dtp block bytes" }));
        }
        let schedule = if vb >= v { BlockSchedule::FullVocab } else { BlockSchedule::VocabBlocked };
        Ok(Self {
            n,
            d,
            v,
            dtype,
            token_block: c,
            vocab_block: vb,
            schedule,
            config: *config,
            target: Target::Host,
        })
    }

    plan_accessors! {
        config: "The config it was planned for (and an executor made from it runs).",
        n_tokens: "Tokens N.",
        vocab_block: "Vocabulary rows per block, Vb (= V for the full-vocabulary schedule).",
    }
    /// The shape planned for.
    pub fn shape(&self) -> Shape {
        Shape { tokens: self.n, hidden: self.d, vocab: self.v, dtype: self.dtype }
    }
    /// The GEMMs' arithmetic (the config's), which decides whether the CUDA path widens bf16
    /// blocks ([`Precision::F32`]) or reads them in place.
    pub fn precision(&self) -> Precision {
        self.config.precision
    }
    /// The schedule.
    pub fn schedule(&self) -> BlockSchedule {
        self.schedule
    }
    /// The block buffers the CPU carves from its workspace ([`BlockRegions`]).
    pub fn host_regions(&self) -> BlockRegions {
        let (c, vb) = (self.token_block, self.vocab_block);
        // Both constructors refuse blocks whose sizes overflow, so this is always `Some`.
        BlockRegions::host(c, vb, self.d, self.dtype).unwrap_or(BlockRegions {
            logits: usize::MAX,
            x_block: 0,
            w_block: 0,
            dx_partial: 0,
        })
    }
    /// The block buffers a CUDA device reserves ([`BlockRegions`]).
    pub fn device_regions(&self) -> BlockRegions {
        let (c, vb) = (self.token_block, self.vocab_block);
        BlockRegions::device(c, vb, self.d, self.dtype, self.config.precision).unwrap_or(BlockRegions {
            logits: usize::MAX,
            x_block: 0,
            w_block: 0,
            dx_partial: 0,
        })
    }
    /// Bytes reserved at launch for blocks on the plan's [`Target`] (the CPU's
    /// [`host_regions`](Self::host_regions) aligned, or a device's
    /// [`device_regions`](Self::device_regions) carved from one allocation); independent of N.
    pub fn workspace_bytes(&self) -> usize {
        // Both constructors refuse blocks whose bytes overflow, so this is always `Some`.
        let blocks = (self.token_block, self.vocab_block);
        target_bytes(self.target, blocks, self.d, self.dtype, self.config.precision).unwrap_or(usize::MAX)
    }
    /// Whose block buffers the plan was sized by.
    pub fn target(&self) -> Target {
        self.target
    }
    /// Refuses a plan sized by a device's block buffers on the CPU, whose own may be larger
    /// (it widens bf16 rows and splits dX's GEMM): [`Error::InvalidConfig`] (`target`).
    pub fn check_host(&self) -> Result<()> {
        match self.target {
            Target::Host => Ok(()),
            Target::Device => Err(Error::invalid_config(
                "target",
                self.target,
                "a plan sized for the CPU (Plan::new, or Plan::for_device with Device::Cpu) on the CPU",
            )),
        }
    }
    /// The CPU GEMM's own buffers, independent of N: its packed operand panels, bounded by
    /// `CPU_GEMM_SCRATCH_PER_THREAD` per thread, plus `4·CPU_GEMM_DEPTH_BLOCK·C` for the second
    /// GEMM in flight where dX's GEMM is split. (The vocabulary-major logits block keeps every
    /// GEMM off the path where the CPU GEMM copies a whole transposed operand.)
    pub fn cpu_gemm_scratch_bytes(&self) -> usize {
        let split = if splits_dx(self.vocab_block, self.dtype) {
            4 * CPU_GEMM_DEPTH_BLOCK * self.token_block
        } else {
            0
        };
        // bf16 inputs: the bf16 GEMM's packed operands (a fixed size per thread), besides the
        // f32 GEMM's buffers.
        let bf16_panel = match self.dtype {
            DType::Bf16 => flatpeak_common::gemm_bf16::SCRATCH_BYTES_PER_THREAD,
            _ => 0,
        };
        // Saturating: a plan's sizes are checked, but a fuzzed plan may hold any usize.
        CPU_GEMM_SCRATCH_PER_THREAD
            .saturating_add(bf16_panel)
            .saturating_mul(rayon::current_num_threads())
            .saturating_add(split)
    }
    /// Scratch besides the workspace that scales with the token block (not with N):
    /// `ROW_SCRATCH_BYTES·C`.
    pub fn row_scratch_bytes(&self) -> usize {
        ROW_SCRATCH_BYTES * self.token_block
    }
    /// Host bytes a backward into bf16 outputs ([`Bf16GradientsMut`]) holds beyond the workspace
    /// and the outputs themselves: dW's f32 accumulator `4·V·D`, dX's f32 rows of the token block
    /// in flight `4·C·D` (twice: the partial page a block ends on stays until the next one), and
    /// one chunk of dW's narrowing, whose bf16 half is written before its f32 pages go.
    /// Saturating (a fuzzed plan may hold any size).
    ///
    /// [`Bf16GradientsMut`]: crate::Bf16GradientsMut
    pub fn bf16_outputs_bytes(&self) -> usize {
        let dw_accumulator = self.v.saturating_mul(self.d).saturating_mul(4);
        let dx_rows = self.token_block.saturating_mul(self.d).saturating_mul(8);
        dw_accumulator.saturating_add(dx_rows).saturating_add(crate::narrowing::DW_NARROW_CHUNK * 2)
    }
    /// The per-token statistics besides the workspace: `PER_TOKEN_BYTES·N`.
    pub fn per_token_bytes(&self) -> usize {
        PER_TOKEN_BYTES * self.n
    }
    /// GEMMs per forward + backward: 3 fused on the full-vocabulary schedule, else 4.
    pub fn gemms_fused(&self) -> usize {
        match self.schedule {
            BlockSchedule::FullVocab => 3,
            BlockSchedule::VocabBlocked => 4,
        }
    }
}

#[cfg(test)]
mod tests {
    use flatpeak_common::arena::REGION_ALIGN;

    use super::*;

    /// N tokens of width D against a vocabulary of V, in `dtype` (the ring plan's tests too).
    pub(super) fn shape(tokens: usize, hidden: usize, vocab: usize, dtype: DType) -> Shape {
        Shape { tokens, hidden, vocab, dtype }
    }

    #[test]
    fn explicit_blocks_are_capped_and_pick_the_schedule() {
        let cfg = Config::default();
        let all = Plan::with_blocks(&cfg, shape(8192, 1024, 32768, DType::F32), (1 << 20, 1 << 20)).unwrap();
        assert_eq!(
            (all.schedule(), all.token_block(), all.vocab_block()),
            (BlockSchedule::FullVocab, 8192, 32768)
        );
        // logits, X block and dX's second partial (k = V splits); no W sub-block for f32.
        assert_eq!(all.workspace_bytes(), 4 * (8192 * 32768 + 2 * 8192 * 1024) + 4 * REGION_ALIGN);
        let short = Plan::with_blocks(&cfg, shape(64, 32, 1000, DType::F32), (64, 1000)).unwrap();
        assert_eq!(short.workspace_bytes(), 4 * (64 * 1000 + 64 * 32) + 3 * REGION_ALIGN);
        let blocked = Plan::with_blocks(&cfg, shape(8192, 1024, 32768, DType::Bf16), (2048, 4096)).unwrap();
        assert_eq!(
            (blocked.schedule(), blocked.token_block(), blocked.vocab_block()),
            (BlockSchedule::VocabBlocked, 2048, 4096)
        );
        assert!(matches!(
            Plan::with_blocks(&cfg, shape(8, 4, 16, DType::F32), (0, 16)),
            Err(Error::InvalidConfig { field: "token_block", .. })
        ));
        assert!(matches!(
            Plan::with_blocks(&cfg, shape(8, 4, 16, DType::F32), (8, 0)),
            Err(Error::InvalidConfig { field: "vocab_block", .. })
        ));
    }

    #[test]
    fn a_device_plan_is_sized_by_the_device_buffers_and_takes_wider_blocks() {
        let cfg = Config::default();
        let budget = Budget::Bytes(crate::DEFAULT_CUDA_BUDGET_BYTES);
        // The default GPU budget gives 1024-token blocks over a 128K and a 152K vocabulary, in
        // bf16 and f32: the device reads bf16 in place, so its blocks are the logits alone.
        for (v, dtype) in [(131072, DType::Bf16), (131072, DType::F32), (152064, DType::Bf16)] {
            let s = shape(16384, 4096, v, dtype);
            let device = Plan::for_device(&cfg, s, LossBudget::Default, Device::Cuda(0)).unwrap();
            assert_eq!(
                (device.token_block(), device.schedule(), device.target()),
                (1024, BlockSchedule::FullVocab, Target::Device)
            );
            assert_eq!(Some(device.workspace_bytes()), device.device_regions().device_bytes());
            assert!(budget.admits(device.workspace_bytes()));
            // The CPU's regions of the same blocks are larger (widened W rows, dX's partial).
            let host = Plan::sized_for(&cfg, s, budget, Target::Host).unwrap();
            assert!(host.workspace_bytes() <= budget.bytes());
            if dtype == DType::Bf16 && v == 152064 {
                assert!(host.token_block() < 1024, "{}", host.token_block());
            }
        }
        // Within the same budget, the device's sizing never picks narrower blocks.
        for (budget, d) in [(64usize << 20, 1024), (8 << 20, 256), (256 << 20, 4096)] {
            for dtype in [DType::F32, DType::Bf16] {
                let s = shape(8192, d, 32768, dtype);
                let host = Plan::sized_for(&cfg, s, Budget::Bytes(budget), Target::Host).unwrap();
                let device = Plan::sized_for(&cfg, s, Budget::Bytes(budget), Target::Device).unwrap();
                assert!(device.workspace_bytes() <= budget, "{budget} {dtype:?}");
                assert!(
                    device.token_block() * device.vocab_block() >= host.token_block() * host.vocab_block()
                );
            }
        }
        // On the CPU, for_device is the host plan; a device plan there is refused, by name.
        let s = shape(64, 32, 1000, DType::Bf16);
        let cpu = Plan::for_device(&cfg, s, LossBudget::Default, Device::Cpu).unwrap();
        assert_eq!(cpu, Plan::new(&cfg, s, LossBudget::Default.of(Device::Cpu)).unwrap());
        assert_eq!(cpu.check_host(), Ok(()));
        let device = Plan::for_device(&cfg, s, LossBudget::Default, Device::Cuda(0)).unwrap();
        assert!(matches!(device.check_host(), Err(Error::InvalidConfig { field: "target", .. })));
    }

    #[test]
    fn budget_picks_the_schedule() {
        let cfg = Config::default();
        let big = Plan::new(&cfg, shape(8192, 1024, 32768, DType::F32), Budget::Bytes(1 << 30)).unwrap();
        assert_eq!(
            (big.schedule(), big.token_block(), big.vocab_block()),
            (BlockSchedule::FullVocab, 1024, 32768)
        );
        let small = Plan::new(&cfg, shape(8192, 1024, 32768, DType::F32), Budget::Bytes(8 << 20)).unwrap();
        assert_eq!(small.schedule(), BlockSchedule::VocabBlocked);
        assert!(small.workspace_bytes() <= 8 << 20);
        let err = Plan::new(&cfg, shape(8192, 1024, 32768, DType::F32), Budget::Bytes(1000)).unwrap_err();
        assert!(matches!(err, Error::BudgetTooSmall { budget: 1000, .. }));
    }

    #[test]
    fn powers_of_two_below() {
        for x in [0usize, 1, 2, 3, 8, 9, 1000, usize::MAX / 2 + 2, usize::MAX] {
            let want = x.checked_next_power_of_two().map_or(1 << (usize::BITS - 1), |p| p / 2);
            assert_eq!(power_of_two_below(x), if x <= 1 { 0 } else { want }, "{x}");
        }
    }

    #[test]
    fn sizes_that_overflow_are_an_error_not_a_panic() {
        let cfg = Config::default();
        for (n, d, v) in [(usize::MAX, 16, 1000), (1000, usize::MAX / 2, 1000), (1 << 40, 1 << 30, 1 << 20)] {
            let shape = shape(n, d, v, DType::F32);
            for budget in [Budget::Unlimited, Budget::mib(64)] {
                match Plan::new(&cfg, shape, budget) {
                    Err(Error::Common(flatpeak_common::Error::SizeOverflow { .. }))
                    | Err(Error::BudgetTooSmall { .. }) => {}
                    other => panic!("N={n} D={d} V={v}: {other:?}"),
                }
            }
            assert!(Plan::with_blocks(&cfg, shape, (n, v)).is_err());
        }
    }

    #[test]
    fn workspace_does_not_grow_with_tokens() {
        let cfg = Config::default();
        let a = Plan::new(&cfg, shape(1 << 10, 512, 4096, DType::Bf16), Budget::Bytes(64 << 20)).unwrap();
        let b = Plan::new(&cfg, shape(1 << 20, 512, 4096, DType::Bf16), Budget::Bytes(64 << 20)).unwrap();
        assert_eq!(a.workspace_bytes(), b.workspace_bytes());
        assert_eq!(b.per_token_bytes() - a.per_token_bytes(), PER_TOKEN_BYTES * ((1 << 20) - (1 << 10)));
    }
}
