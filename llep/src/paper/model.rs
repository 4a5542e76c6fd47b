//! The per-rank peak model of `docs/design.md` (llep) and the paper's plan-only row (P = 8,
//! N = 65,536, k = 8, E = 128, H = 7168, I = 2048, bf16).
//!
//! `Peak_d = M0 + b·H·(a_s·S_d + a_r·T_d) + a_i·b·I·n_d + F_d·w`, w = 3·H·I·b: S_d rows on the
//! send side, T_d rows received in one dispatch, n_d the largest expert group, F_d foreign
//! experts; a_s, a_r, a_i live-copy multipliers; M0 weights, input and output. The multipliers
//! of [`PeakModel::paper_fit`] are *fitted* to the paper's measured balanced pair, so the LLEP
//! and paper-style pipelined rows reproduce its 52.66 → 21.43 GiB by construction (they are
//! fitted figures, not predictions); the crate's own row is M0 plus the exact bytes of its
//! buffers.

use flatpeak_common::Budget;

use super::workload::Profile;
use crate::assign::Assignment;
use crate::config::{Chunking, Config, PairCap, Scheme, Shape, SpillSplit};
use crate::error::Result;
use crate::plan::{Buffers, Pass, Plan};
use crate::schedule::Schedule;

const GIB: f64 = (1u64 << 30) as f64;

/// The paper's headline shape, per rank.
pub const PAPER_SHAPE: Shape = Shape {
    ranks: 8,
    tokens: 65_536,
    hidden: 7168,
    intermediate: 2048,
    experts: 128,
    top_k: 8,
    dtype: flatpeak_common::DType::Bf16,
};

/// Live-copy multipliers and the constant term of the peak model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PeakModel {
    /// M0 in bytes.
    pub m0_bytes: f64,
    /// a_s: live copies of the send side.
    pub send_copies: f64,
    /// a_r: live copies of the receive side.
    pub recv_copies: f64,
    /// a_i: live copies of the expert intermediate (I wide).
    pub intermediate_copies: f64,
}

/// The scheme-dependent terms of one rank's peak.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PeakTerms {
    /// S_d: rows held on the send side.
    pub send_rows: f64,
    /// T_d: rows received in one dispatch.
    pub recv_rows: f64,
    /// n_d: rows of the largest expert group.
    pub expert_rows: f64,
    /// F_d: foreign experts held.
    pub foreign_experts: f64,
}

impl PeakModel {
    /// The fit to the paper's balanced LLEP / PipelinedLLEP pair: a_s = 2, a_r = 4.96, a_i = 0,
    /// M0 = 3.96 GiB (the whole expert intermediate is folded into a_r).
    pub fn paper_fit() -> Self {
        Self { m0_bytes: 3.96 * GIB, send_copies: 2.0, recv_copies: 4.96, intermediate_copies: 0.0 }
    }

    /// Peak_d in bytes.
    pub fn peak(&self, shape: &Shape, t: PeakTerms) -> f64 {
        let (b, h, i) = (shape.elem_bytes() as f64, shape.hidden as f64, shape.intermediate as f64);
        let w = shape.expert_elems() as f64 * b;
        self.m0_bytes
            + b * h * (self.send_copies * t.send_rows + self.recv_copies * t.recv_rows)
            + self.intermediate_copies * b * i * t.expert_rows
            + t.foreign_experts * w
    }
}

/// Send balance of token chunks under a one-round plan's assignment (LLEP's dispatch cut into
/// K chunks of token positions, as the paper does).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChunkStats {
    /// Worst over senders and chunks of (largest send to one destination ÷ the mean over P).
    pub worst_send_ratio: f64,
    /// The most routes any destination receives in one chunk.
    pub max_chunk_recv: usize,
}

/// Chunk statistics of `assignment` when each rank's tokens are cut into `chunks` chunks
/// (strided: token i in chunk i mod K; contiguous: runs of ⌈N/K⌉).
pub fn chunk_stats(
    assignment: &Assignment,
    shape: &Shape,
    ids: &[&[i64]],
    chunks: usize,
    chunking: Chunking,
) -> Result<ChunkStats> {
    let (p, k, n) = (shape.ranks, shape.top_k, shape.tokens);
    let chunks = chunks.max(1);
    let mut recv = vec![0usize; chunks * p];
    let mut worst = 0f64;
    for (s, rank_ids) in ids.iter().enumerate() {
        let mut mapper = assignment.mapper(s);
        let mut sends = vec![0usize; chunks * p];
        let run = n.div_ceil(chunks).max(1);
        for (r, &id) in rank_ids.iter().enumerate() {
            let d = mapper.next(crate::assign::expert_index(shape, id, r / k, r % k)?)?;
            let i = r / k;
            let c = match chunking {
                Chunking::Strided => i % chunks,
                Chunking::Contiguous => i / run,
            };
            sends[c * p + d] += 1;
        }
        for c in 0..chunks {
            let row = &sends[c * p..(c + 1) * p];
            let total: usize = row.iter().sum();
            if total > 0 {
                let ratio = *row.iter().max().unwrap_or(&0) as f64 * p as f64 / total as f64;
                worst = worst.max(ratio);
            }
            for d in 0..p {
                recv[c * p + d] += row[d];
            }
        }
    }
    Ok(ChunkStats { worst_send_ratio: worst, max_chunk_recv: recv.into_iter().max().unwrap_or(0) })
}

/// One profile's row at a shape: modelled per-rank peaks (max over ranks) and chunk balance.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelRow {
    /// The routing profile.
    pub profile: Profile,
    /// Standard EP, GiB (model).
    pub ep_gib: f64,
    /// LLEP (one dispatch), GiB (model).
    pub llep_gib: f64,
    /// The paper's PipelinedLLEP: LLEP's plan, the receive side cut into K strided chunks, GiB.
    pub paper_pipelined_gib: f64,
    /// This crate: the model's formula with T_d = S_d = D·P·q and F_d = F_max, GiB.
    pub crate_formula_gib: f64,
    /// This crate: M0 plus the exact bytes of its training-pass buffers, GiB.
    pub crate_buffers_gib: f64,
    /// LLEP's largest number of foreign experts on one rank.
    pub llep_foreign_experts: usize,
    /// Strided chunks of LLEP's plan.
    pub strided: ChunkStats,
    /// Contiguous chunks of LLEP's plan.
    pub contiguous: ChunkStats,
    /// The crate's rounds K for this profile.
    pub crate_rounds: usize,
    /// The crate's pair cap q.
    pub pair_cap: usize,
}

impl ModelRow {
    /// `1 − paper_pipelined / llep`.
    pub fn paper_reduction(&self) -> f64 {
        1.0 - self.paper_pipelined_gib / self.llep_gib
    }
    /// `1 − crate_buffers / llep`.
    pub fn crate_reduction(&self) -> f64 {
        1.0 - self.crate_buffers_gib / self.llep_gib
    }
}

/// The plan-only row of `profile` at `shape` with K paper chunks, the paper's LLEP settings
/// (α = 1, m = 1024, λ = 1.3, position split) and, for this crate, the pair cap `q` (a fixed
/// launch-time choice; see [`crate_pair_cap`]) with the config's D and F_max.
pub fn model_row(
    shape: &Shape,
    profile: Profile,
    chunks: usize,
    q: usize,
    crate_config: &Config,
    model: &PeakModel,
) -> Result<ModelRow> {
    let ids = profile.ids(&Shape { ranks: 1, ..*shape })?;
    let views: Vec<&[i64]> = (0..shape.ranks).map(|_| ids.as_slice()).collect();
    let (p, m, kn) = (shape.ranks, shape.local_experts(), (shape.tokens * shape.top_k) as f64);
    let llep_cfg = Config::with_scheme(Scheme::Llep).spill_split(SpillSplit::Position);
    let schedule =
        |config: &Config| Schedule::from_top_k(&Plan::new(config, *shape, Budget::Unlimited)?, &views);
    let llep = schedule(&llep_cfg)?;
    let ep = schedule(&Config::with_scheme(Scheme::StandardEp))?;
    let max_over = |plan: &Schedule, recv: &dyn Fn(&Assignment, usize) -> f64, slice_div: f64| {
        let a = plan.assignment();
        (0..p)
            .map(|d| {
                let slice =
                    |e: usize| a.pieces(e).iter().filter(|x| x.rank == d).map(|x| x.routes).sum::<usize>();
                let n_d =
                    (d * m..(d + 1) * m).chain(a.foreign(d).iter().copied()).map(slice).max().unwrap_or(0);
                let terms = PeakTerms {
                    send_rows: kn,
                    recv_rows: recv(a, d),
                    expert_rows: n_d as f64 / slice_div,
                    foreign_experts: a.foreign(d).len() as f64,
                };
                model.peak(shape, terms)
            })
            .fold(0.0, f64::max)
    };
    let whole = |a: &Assignment, d: usize| a.rank_load(d) as f64;
    let strided = chunk_stats(llep.assignment(), shape, &views, chunks, Chunking::Strided)?;
    let contiguous = chunk_stats(llep.assignment(), shape, &views, chunks, Chunking::Contiguous)?;
    let chunk_recv = strided.max_chunk_recv as f64;
    let config = crate_config.scheme(Scheme::PipelinedLlep).pair_cap(PairCap::Rows(q));
    let ours = schedule(&config)?;
    let rows = (config.pipeline_depth * p * ours.pair_cap()) as f64;
    let formula = PeakTerms {
        send_rows: rows,
        recv_rows: rows,
        expert_rows: (p * ours.pair_cap()) as f64,
        foreign_experts: config.foreign_slots as f64,
    };
    let buffers =
        Buffers::pipelined(&config, shape, ours.pair_cap(), Pass::Backward).workspace_bytes() as f64;
    Ok(ModelRow {
        profile,
        ep_gib: max_over(&ep, &whole, 1.0) / GIB,
        llep_gib: max_over(&llep, &whole, 1.0) / GIB,
        paper_pipelined_gib: max_over(&llep, &|_, _| chunk_recv, chunks as f64) / GIB,
        crate_formula_gib: model.peak(shape, formula) / GIB,
        crate_buffers_gib: (model.m0_bytes + buffers) / GIB,
        llep_foreign_experts: llep.assignment().max_foreign(),
        strided,
        contiguous,
        crate_rounds: ours.rounds(),
        pair_cap: ours.pair_cap(),
    })
}

/// The pair cap that gives this crate `rounds` rounds on `profile` (balanced, for the paper's
/// K = 10): `⌈max_{s,d} R[s][d] / rounds⌉`.
pub fn crate_pair_cap(shape: &Shape, profile: Profile, rounds: usize, config: &Config) -> Result<usize> {
    let ids = profile.ids(&Shape { ranks: 1, ..*shape })?;
    let views: Vec<&[i64]> = (0..shape.ranks).map(|_| ids.as_slice()).collect();
    let plan =
        Schedule::from_top_k(&Plan::new(&config.scheme(Scheme::Llep), *shape, Budget::Unlimited)?, &views)?;
    let p = shape.ranks;
    let widest = (0..p * p).map(|i| plan.pair_rows(i / p, i % p)).max().unwrap_or(0);
    Ok(widest.div_ceil(rounds.max(1)).max(1))
}
