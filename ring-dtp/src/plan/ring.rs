//! Sizing of the ring schedules over P ranks (pure): which ring, the token block C and the
//! vocabulary block Vb, and every buffer a rank reserves at launch.
//!
//! Layout: rank r owns tokens `r·⌈N/P⌉ .. min((r+1)·⌈N/P⌉, N)` and vocabulary rows
//! `r·⌈V/P⌉ .. min((r+1)·⌈V/P⌉, V)` (the last ranks' ranges are shorter or empty: padding is
//! masked by construction, never computed).
//!
//! - **Weight ring**: W shards circulate in sub-blocks of Vb rows; each rank folds every
//!   sub-block into its own tokens' statistics (token blocks of C rows). Backward circulates them
//!   again with an fp32 dW accumulator travelling beside each sub-block, one extra hop home. Per
//!   rank: logits `4·C·Vb`, an X block `4·C·D`, two sub-block buffers (current + incoming) of
//!   `e·Vb·D` (W, element size e) `+ 4·Vb·D` (dW) `+ 8·Vb` (bias, dbias), a `4·Vb·D` upcast for
//!   bf16, and one step's messages in flight.
//! - **Activation ring**: token blocks of C rows circulate (X, targets, weights, the running
//!   statistics in forward; lse, scale, dlse and an fp32 dX accumulator in backward); W and dW stay
//!   home; one extra hop returns the statistics or dX. Per rank: logits `4·C·Vb`, two packets of
//!   `e·C·D + 4·C·D + 44·C`, X and W upcasts for bf16, and one step's messages in flight.
//!
//! Neither has an N·V term, nor an N term besides the per-token statistics of the rank's own
//! tokens. The ring is chosen by bytes moved: tokens circulate when a rank has fewer tokens than
//! vocabulary rows (n < v), shards otherwise.

use std::ops::Range;

use flatpeak_common::gemm::Threads;
use flatpeak_common::{Budget, DType};

use super::ring_buffers::{
    ActivationScratch, Bytes, Packet, RegionBytes, RegionKind, RegionSource, Slot, WeightScratch,
};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::plan::{PER_TOKEN_BYTES, Shape};

/// Which operand circulates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RingKind {
    /// W shards circulate (with a travelling dW accumulator in backward); dX stays home.
    Weight,
    /// Token blocks circulate (with a travelling dX accumulator in backward); W and dW stay home.
    Activation,
}

/// The ring to run: chosen from the shapes, or forced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RingChoice {
    /// Activation ring when a rank has fewer tokens than vocabulary rows, else weight ring.
    #[default]
    Auto,
    /// This ring.
    Force(RingKind),
}

/// The ring of [`RingPlan::new`]: its ranks, which operand circulates, and how each rank runs
/// its GEMMs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RingOptions {
    /// P: ranks of the ring (≥ 1).
    pub ranks: usize,
    /// The ring.
    pub ring: RingChoice,
    /// Threads of each block GEMM on the CPU. [`Threads::Single`] suits ranks that are threads
    /// of one process ([`LocalGroup`](flatpeak_common::LocalGroup)): the P ranks already fill
    /// the cores, and P GEMMs each splitting its tiles over every core only contend for them.
    /// Results are bitwise identical for every choice.
    pub gemm_threads: Threads,
}

impl Default for RingOptions {
    /// One rank, auto ring, GEMMs on the whole rayon pool.
    fn default() -> Self {
        Self { ranks: 1, ring: RingChoice::Auto, gemm_threads: Threads::All }
    }
}

impl RingOptions {
    /// These options over `ranks` ranks.
    pub fn ranks(self, ranks: usize) -> Self {
        Self { ranks, ..self }
    }
    /// These options with the ring forced.
    pub fn ring(self, kind: RingKind) -> Self {
        Self { ring: RingChoice::Force(kind), ..self }
    }
    /// These options with each block GEMM on `threads`.
    pub fn gemm_threads(self, threads: Threads) -> Self {
        Self { gemm_threads: threads, ..self }
    }
}

/// Token blocks tried, largest first (wider blocks: fewer passes, better GEMM shapes).
const TOKEN_BLOCKS: [usize; 6] = [512, 256, 128, 64, 32, 16];
/// Smallest vocabulary block.
const MIN_VOCAB_BLOCK: usize = 64;

/// The ring schedule of one call shape on P ranks; identical on every rank. It carries the
/// [`Config`] it was planned for, which the ring runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RingPlan {
    config: Config,
    world: usize,
    n: usize,
    d: usize,
    v: usize,
    dtype: DType,
    kind: RingKind,
    token_block: usize,
    vocab_block: usize,
    gemm_threads: Threads,
}

/// The product of `factors`; `None` on overflow.
fn product(factors: &[usize]) -> Option<usize> {
    factors.iter().try_fold(1usize, |p, &f| p.checked_mul(f))
}

impl RingPlan {
    /// Plans `shape` (N tokens over all ranks) on the ring of `options`, within `budget` bytes
    /// per rank (blocks, ring buffers, messages in flight); [`Error::BudgetTooSmall`] when not
    /// even 16 tokens × 64 vocabulary rows fit.
    pub fn new(config: &Config, shape: Shape, budget: Budget, options: RingOptions) -> Result<Self> {
        config.validate()?;
        let Shape { tokens: n, hidden: d, vocab: v, dtype } = shape;
        let world = options.ranks;
        if world == 0 {
            return Err(Error::invalid_config("world", world, "at least one rank"));
        }
        if dtype == DType::F16 {
            return Err(Error::invalid_config("dtype", dtype, "f32 or bf16 inputs"));
        }
        let (rows, shard) = (n.div_ceil(world).max(1), v.div_ceil(world).max(1));
        // The inputs' and per-token sizes, so that no size a rank derives overflows.
        if product(&[n, d, 4]).is_none()
            || product(&[v, d, 4]).is_none()
            || product(&[rows, PER_TOKEN_BYTES]).is_none()
        {
            return Err(Error::Common(flatpeak_common::Error::SizeOverflow { what: "ring-dtp input sizes" }));
        }
        let kind = match options.ring {
            RingChoice::Force(kind) => kind,
            RingChoice::Auto if rows < shard => RingKind::Activation,
            RingChoice::Auto => RingKind::Weight,
        };
        let gemm_threads = options.gemm_threads;
        let plan = |token_block, vocab_block| Self {
            config: *config,
            world,
            n,
            d,
            v,
            dtype,
            kind,
            token_block,
            vocab_block,
            gemm_threads,
        };
        let vocab_blocks = || {
            std::iter::successors(Some(shard), |&vb| {
                let next = if vb == shard { crate::plan::power_of_two_below(shard) } else { vb / 2 };
                (next >= MIN_VOCAB_BLOCK.min(shard) && next > 0 && next < vb).then_some(next)
            })
        };
        // First blocks wide enough for efficient GEMMs, then anything that fits.
        let (min_c, min_vb) = (128.min(rows), 512.min(shard));
        for (c_floor, vb_floor) in [(min_c, min_vb), (0, 0)] {
            let candidates: Vec<(usize, usize)> = match kind {
                // The travelling sub-block dominates the weight ring: its size first.
                RingKind::Weight => vocab_blocks()
                    .flat_map(|vb| TOKEN_BLOCKS.map(|c| c.min(rows)).into_iter().map(move |c| (c, vb)))
                    .collect(),
                // The travelling packet dominates the activation ring: the token block first.
                RingKind::Activation => TOKEN_BLOCKS
                    .map(|c| c.min(rows))
                    .into_iter()
                    .flat_map(|c| vocab_blocks().map(move |vb| (c, vb)))
                    .collect(),
            };
            for (c, vb) in candidates {
                let p = plan(c, vb);
                if c >= c_floor && vb >= vb_floor && p.checked_bound().is_some_and(|b| budget.admits(b)) {
                    return Ok(p);
                }
            }
        }
        let needed = plan(16.min(rows), MIN_VOCAB_BLOCK.min(shard))
            .checked_bound()
            .ok_or(Error::Common(flatpeak_common::Error::SizeOverflow { what: "ring-dtp ring bound" }))?;
        Err(Error::BudgetTooSmall {
            budget: budget.bytes(),
            needed,
            what: "a ring step of 16 tokens x 64 vocabulary rows",
        })
    }

    /// A digest of the plan every rank of the ring must share, field by field (the config's
    /// [`Config::digest`], P, N, D, V, the dtype, the ring and its blocks; not the GEMM threads,
    /// which are each rank's own): ranks compare it before their first message.
    pub fn digest(&self) -> u64 {
        let dtype = match self.dtype {
            DType::F32 => 0,
            DType::Bf16 => 1,
            DType::F16 => 2,
        };
        let kind = match self.kind {
            RingKind::Weight => 0,
            RingKind::Activation => 1,
        };
        flatpeak_common::Digest::new()
            .str("ring_dtp::RingPlan")
            .u64(self.config.digest())
            .usize(self.world)
            .usize(self.n)
            .usize(self.d)
            .usize(self.v)
            .u64(dtype)
            .u64(kind)
            .usize(self.token_block)
            .usize(self.vocab_block)
            .finish()
    }

    plan_accessors! {
        config: "The config it was planned for (and the ring runs).",
        n_tokens: "Tokens N over all ranks.",
        vocab_block: "Vocabulary rows per block, Vb (the travelling sub-block of the weight ring).",
    }
    /// Ranks P.
    pub fn world(&self) -> usize {
        self.world
    }
    /// The ring.
    pub fn kind(&self) -> RingKind {
        self.kind
    }
    /// Threads of each block GEMM on the CPU (see [`RingOptions::gemm_threads`]).
    pub fn gemm_threads(&self) -> Threads {
        self.gemm_threads
    }
    /// Tokens per rank before clipping, ⌈N/P⌉.
    pub fn rows_per_rank(&self) -> usize {
        self.n.div_ceil(self.world)
    }
    /// Vocabulary rows per shard before clipping, ⌈V/P⌉.
    pub fn shard_rows(&self) -> usize {
        self.v.div_ceil(self.world)
    }
    /// The tokens rank `rank` owns (empty past the end).
    pub fn tokens(&self, rank: usize) -> Range<usize> {
        let r = self.rows_per_rank();
        rank.saturating_mul(r).min(self.n)..rank.saturating_add(1).saturating_mul(r).min(self.n)
    }
    /// The vocabulary rows rank `rank` owns (empty past the end).
    pub fn shard(&self, rank: usize) -> Range<usize> {
        let s = self.shard_rows();
        rank.saturating_mul(s).min(self.v)..rank.saturating_add(1).saturating_mul(s).min(self.v)
    }
    /// Global vocabulary rows of sub-block `j` of rank `s`'s shard (the weight ring's travelling
    /// unit; empty past the shard's end).
    pub fn vocab_sub_block(&self, s: usize, j: usize) -> Range<usize> {
        let shard = self.shard(s);
        let start = shard.start.saturating_add(j.saturating_mul(self.vocab_block)).min(shard.end);
        start..start.saturating_add(self.vocab_block).min(shard.end)
    }

    /// Rows of token block `b` of rank `o`, relative to that rank's first token (the activation
    /// ring's travelling unit; empty past the rank's last token).
    pub fn token_sub_block(&self, o: usize, b: usize) -> Range<usize> {
        let n = self.tokens(o).len();
        let start = b.saturating_mul(self.token_block).min(n);
        start..start.saturating_add(self.token_block).min(n)
    }

    /// Ring passes per call direction: token blocks (activation ring) or vocabulary sub-blocks
    /// (weight ring) of the largest range, the same on every rank.
    pub fn blocks(&self) -> usize {
        match self.kind {
            RingKind::Weight => self.shard_rows().div_ceil(self.vocab_block.max(1)),
            RingKind::Activation => self.rows_per_rank().div_ceil(self.token_block.max(1)),
        }
    }

    /// One weight-ring buffer of this plan ([`Slot`]: a sub-block of Vb rows), laid out by
    /// `source`.
    pub(crate) fn slot<K: RegionKind>(&self, source: &mut impl RegionSource<K>) -> Result<Slot<K>> {
        Slot::new(source, self.dtype, (self.vocab_block, self.d))
    }

    /// One activation-ring buffer of this plan ([`Packet`]: a token block of C rows), laid out
    /// by `source`.
    pub(crate) fn packet<K: RegionKind>(&self, source: &mut impl RegionSource<K>) -> Result<Packet<K>> {
        Packet::new(source, self.dtype, (self.token_block, self.d))
    }

    /// Bytes of one ring buffer ([`Slot`] or [`Packet`]), each region aligned; `None` on
    /// overflow.
    fn buffer_bytes(&self) -> Option<usize> {
        RegionBytes::of(|bytes| match self.kind {
            RingKind::Weight => self.slot::<Bytes>(bytes).map(drop),
            RingKind::Activation => self.packet::<Bytes>(bytes).map(drop),
        })
    }

    /// The CPU weight ring's block scratch ([`WeightScratch`]), laid out by `source`.
    pub(crate) fn weight_scratch<K: RegionKind>(
        &self,
        source: &mut impl RegionSource<K>,
    ) -> Result<WeightScratch<K>> {
        WeightScratch::new(source, self.dtype, (self.token_block, self.vocab_block, self.d))
    }

    /// The CPU activation ring's block scratch ([`ActivationScratch`]), laid out by `source`.
    pub(crate) fn activation_scratch<K: RegionKind>(
        &self,
        source: &mut impl RegionSource<K>,
    ) -> Result<ActivationScratch<K>> {
        ActivationScratch::new(source, self.dtype, (self.token_block, self.vocab_block, self.d))
    }

    /// Bytes of the CPU ring's block scratch, each region aligned; `None` on overflow.
    fn scratch_bytes(&self) -> Option<usize> {
        RegionBytes::of(|bytes| match self.kind {
            RingKind::Weight => self.weight_scratch::<Bytes>(bytes).map(drop),
            RingKind::Activation => self.activation_scratch::<Bytes>(bytes).map(drop),
        })
    }

    /// [`workspace_bytes`](Self::workspace_bytes), `None` on overflow.
    fn checked_workspace(&self) -> Option<usize> {
        self.scratch_bytes()?.checked_add(self.buffer_bytes()?.checked_mul(2)?)
    }

    /// [`message_bytes`](Self::message_bytes), `None` on overflow.
    fn checked_message(&self) -> Option<usize> {
        let (c, vb, d, e) = (self.token_block, self.vocab_block, self.d, self.dtype.size_in_bytes());
        let sum = |terms: &[Option<usize>]| terms.iter().try_fold(0usize, |s, &t| s.checked_add(t?));
        match self.kind {
            RingKind::Weight => sum(&[product(&[e, vb, d]), product(&[4, vb, d]), product(&[8, vb])]),
            RingKind::Activation => {
                let backward = sum(&[product(&[4, c, d]), product(&[12, c])])?;
                sum(&[product(&[e, c, d]), product(&[4, c]), Some(backward.max(product(&[24, c])?))])
            }
        }
    }

    /// [`bound_bytes`](Self::bound_bytes), `None` on overflow; [`RingPlan::new`] returns only
    /// plans for which it is `Some`, so the accessors below never overflow.
    fn checked_bound(&self) -> Option<usize> {
        let in_flight =
            if self.world == 1 { 0 } else { self.checked_message()?.checked_add(TRANSPORT_OVERHEAD)? };
        let rows = product(&[crate::plan::ROW_SCRATCH_BYTES, self.token_block])?;
        self.checked_workspace()?.checked_add(in_flight)?.checked_add(rows)
    }

    /// Bytes a rank reserves at launch: the block regions and two ring buffers (current +
    /// incoming), each region aligned.
    pub fn workspace_bytes(&self) -> usize {
        self.checked_workspace().unwrap_or(usize::MAX)
    }

    /// Bytes a rank sends per ring step, at most: a W sub-block with its bias and, in backward,
    /// the dW accumulator; or a packet's X rows and targets with the statistics (forward) or
    /// the row data and dX accumulator (backward).
    pub fn message_bytes(&self) -> usize {
        self.checked_message().unwrap_or(usize::MAX)
    }

    /// Bytes of messages in flight per rank: the CPU fallback's transport buffers each send
    /// until the receiver takes it, and a rank posts a step's messages only after its neighbour
    /// has acknowledged taking the previous step's, so at most one step's messages, plus `TRANSPORT_OVERHEAD` for the channel's own nodes (a
    /// rendezvous transport such as NCCL holds none).
    pub fn in_flight_bytes(&self) -> usize {
        if self.world == 1 { 0 } else { self.message_bytes() + TRANSPORT_OVERHEAD }
    }

    /// Per-row scratch besides the workspace: the gradient pass's per-token constants and the
    /// fold's partials (`ROW_SCRATCH_BYTES` per token of a block).
    pub fn row_scratch_bytes(&self) -> usize {
        crate::plan::ROW_SCRATCH_BYTES * self.token_block
    }

    /// The plan's per-rank bound on the working set besides per-token statistics and the CPU
    /// GEMM's own packing buffers: `workspace_bytes + in_flight_bytes + row_scratch_bytes`.
    /// Independent of N.
    pub fn bound_bytes(&self) -> usize {
        self.checked_bound().unwrap_or(usize::MAX)
    }

    /// Per-token statistics of a rank's own tokens besides the outputs: `PER_TOKEN_BYTES·⌈N/P⌉`.
    pub fn per_token_bytes(&self) -> usize {
        PER_TOKEN_BYTES * self.rows_per_rank()
    }

    /// The CPU GEMM's own buffers per rank, independent of N: the rank thread's packing buffers
    /// (see [`Plan::cpu_gemm_scratch_bytes`]; the rayon pool's own buffers, shared by the ranks,
    /// come on top once per process).
    ///
    /// [`Plan::cpu_gemm_scratch_bytes`]: crate::Plan::cpu_gemm_scratch_bytes
    pub fn cpu_gemm_scratch_bytes(&self) -> usize {
        crate::plan::CPU_GEMM_SCRATCH_PER_THREAD
    }

    /// GEMMs per forward + backward over the whole vocabulary: 4 — logits in forward, then in
    /// backward the logits again (the loss over the whole vocabulary is known only after a
    /// full turn of the ring), dX and dW.
    pub fn gemms(&self) -> usize {
        4
    }

    /// GEMM FLOPs of forward + backward on one rank holding ⌈N/P⌉ tokens against ⌈V/P⌉ rows per
    /// shard: [`gemms`](Self::gemms) GEMMs of `2·n·V·D`.
    pub fn gemm_flops_per_rank(&self) -> f64 {
        self.gemms() as f64 * 2.0 * self.rows_per_rank() as f64 * self.v as f64 * self.d as f64
    }
}

/// Bytes the CPU fallback's channel allocates per ring step besides the payloads (list nodes,
/// empty acknowledgements); measured well below this.
pub const TRANSPORT_OVERHEAD: usize = 16 << 10;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::tests::shape;

    #[test]
    fn sizes_that_overflow_are_an_error_not_a_panic() {
        let cfg = Config::default();
        // The last: blocks whose C·Vb logits overflow while C·D and Vb·D do not (found by the
        // `plans` fuzz target).
        let sizes = [
            (usize::MAX, 16, 1000),
            (1000, usize::MAX / 2, 1000),
            (1 << 40, 1 << 30, 1 << 20),
            (7_011_482_571_112_448, 0, usize::MAX),
        ];
        for (n, d, v) in sizes {
            for p in [1, 3, 25] {
                let shape = shape(n, d, v, DType::Bf16);
                let options = RingOptions::default().ranks(p);
                for budget in [Budget::Unlimited, Budget::mib(64)] {
                    match RingPlan::new(&cfg, shape, budget, options) {
                        Err(Error::Common(flatpeak_common::Error::SizeOverflow { .. }))
                        | Err(Error::BudgetTooSmall { .. }) => {}
                        // D = 0: nothing to multiply, a plan whose every size fits.
                        Ok(plan) if d == 0 => assert!(plan.bound_bytes() < usize::MAX),
                        other => panic!("N={n} D={d} V={v} P={p}: {other:?}"),
                    }
                }
            }
        }
    }

    #[test]
    fn layout_covers_everything_once() {
        let cfg = Config::default();
        for (n, v, p) in [(10, 7, 3), (8192, 32768, 4), (5, 3, 7), (1, 1, 1)] {
            let plan = RingPlan::new(
                &cfg,
                shape(n, 16, v, DType::F32),
                Budget::mib(64),
                RingOptions::default().ranks(p),
            )
            .unwrap();
            let tokens: usize = (0..p).map(|r| plan.tokens(r).len()).sum();
            let rows: usize = (0..p).map(|r| plan.shard(r).len()).sum();
            assert_eq!((tokens, rows), (n, v));
            for r in 1..p {
                assert_eq!(plan.tokens(r - 1).end, plan.tokens(r).start);
                assert_eq!(plan.shard(r - 1).end, plan.shard(r).start);
            }
        }
    }

    #[test]
    fn auto_ring_and_budget() {
        let cfg = Config::default();
        let (budget, opts) = (Budget::mib(48), RingOptions::default());
        let a = RingPlan::new(&cfg, shape(8192, 1024, 32768, DType::F32), budget, opts.ranks(4)).unwrap();
        assert_eq!(a.kind(), RingKind::Activation);
        assert!(a.bound_bytes() <= 48 << 20);
        let w = RingPlan::new(
            &cfg,
            shape(8192, 1024, 32768, DType::F32),
            budget,
            opts.ring(RingKind::Weight).ranks(4),
        )
        .unwrap();
        assert_eq!(w.kind(), RingKind::Weight);
        assert!(w.bound_bytes() <= 48 << 20 && w.vocab_block() >= 512);
        let b = RingPlan::new(&cfg, shape(1 << 20, 1024, 32768, DType::F32), budget, opts.ranks(4)).unwrap();
        assert_eq!(b.kind(), RingKind::Weight);
        let err = RingPlan::new(
            &cfg,
            shape(8192, 1024, 32768, DType::F32),
            Budget::Bytes(1 << 10),
            RingOptions::default().ranks(4),
        );
        assert!(matches!(err, Err(Error::BudgetTooSmall { budget: 1024, .. })));
    }

    #[test]
    fn bound_does_not_grow_with_tokens() {
        let cfg = Config::default();
        let (budget, opts) = (Budget::mib(32), RingOptions::default().ring(RingKind::Weight));
        let a = RingPlan::new(&cfg, shape(1 << 12, 512, 50_000, DType::Bf16), budget, opts.ranks(4)).unwrap();
        let b = RingPlan::new(&cfg, shape(1 << 20, 512, 50_000, DType::Bf16), budget, opts.ranks(4)).unwrap();
        assert_eq!(a.bound_bytes(), b.bound_bytes());
    }
}
