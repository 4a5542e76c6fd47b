//! The schedule of one layer call, from the routing: the least-loaded assignment, the
//! all-gathered P×P row counts, the rounds K and, for the baselines, buffers sized to what
//! arrives. Pure: no device, no communication (the executors all-gather the counts it needs).
//!
//! A *row* is one token sent to one destination rank with the list of its routes there (a
//! token is sent once per destination and expanded to its local experts on arrival). Source s
//! sends `R[s][d]` rows to d. PipelinedLLEP deals the rows of every (s, d) list to K rounds,
//! at most q per round (q from the launch [`Plan`]), with `K = max_{s,d} ⌈R[s][d]/q⌉`: every
//! receive buffer is exactly P·q rows whatever the routing; imbalance costs rounds, never
//! memory. The baselines run one round with buffers sized to what arrives (LLEP: ≈ α·k·N
//! routes; standard EP: up to P·k·N).

use flatpeak_common::arena::Arena;

use crate::assign::{Assignment, RouteCounts};
use crate::config::{Chunking, Config, Mode, Scheme, Shape};
use crate::error::{Error, Result};
use crate::plan::{Buffers, Pass, Plan, RouteMeta};

/// Rows of source s's list for d in round j: indices `r` with `r mod K = j` (strided) or the
/// j-th run of ⌈R/K⌉ (contiguous).
pub fn round_rows(chunking: Chunking, total: usize, rounds: usize, round: usize) -> RoundRows {
    let rounds = rounds.max(1);
    match chunking {
        Chunking::Strided => RoundRows { next: round, end: total, step: rounds },
        Chunking::Contiguous => {
            let run = total.div_ceil(rounds);
            let start = (round * run).min(total);
            RoundRows { next: start, end: (start + run).min(total), step: 1 }
        }
    }
}

/// Iterator over the row indices of one round (see [`round_rows`]).
#[derive(Debug, Clone)]
pub struct RoundRows {
    next: usize,
    end: usize,
    step: usize,
}

impl Iterator for RoundRows {
    type Item = usize;
    fn next(&mut self) -> Option<usize> {
        (self.next < self.end).then(|| {
            let r = self.next;
            self.next += self.step;
            r
        })
    }
    fn size_hint(&self) -> (usize, Option<usize>) {
        let n = if self.next < self.end { (self.end - self.next).div_ceil(self.step) } else { 0 };
        (n, Some(n))
    }
}

impl ExactSizeIterator for RoundRows {}

/// Source s's row counts `R[s][d]`: tokens with at least one route computed on d.
pub fn pair_rows(assignment: &Assignment, shape: &Shape, source: usize, ids: &[i64]) -> Result<Vec<usize>> {
    let (p, k) = (shape.ranks, shape.for_call(ids.len())?.top_k);
    let mut mapper = assignment.mapper(source);
    let mut rows = vec![0usize; p];
    let mut stamp = vec![usize::MAX; p];
    for (i, token) in ids.chunks_exact(k).enumerate() {
        for (j, &id) in token.iter().enumerate() {
            let d = mapper.next(crate::assign::expert_index(shape, id, i, j)?)?;
            if stamp[d] != i {
                stamp[d] = i;
                rows[d] += 1;
            }
        }
    }
    Ok(rows)
}

/// The schedule of one layer call within a launch [`Plan`]: assignment, rounds and (for the
/// baselines) buffer sizes. Identical on every rank.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    config: Config,
    shape: Shape,
    assignment: Assignment,
    /// Row-major P×P: `R[s][d]`.
    rows: Vec<usize>,
    pair_cap: usize,
    rounds: usize,
}

impl Schedule {
    /// The schedule within `plan` for this assignment and the all-gathered row counts
    /// (row-major P×P).
    pub fn new(plan: &Plan, assignment: Assignment, rows: Vec<usize>) -> Result<Self> {
        let (config, shape) = (plan.config(), plan.shape());
        let p = shape.ranks;
        if rows.len() != p * p {
            return Err(Error::ShapeMismatch { what: "pair rows (P·P)", expected: p * p, got: rows.len() });
        }
        if let Some(&bad) = rows.iter().find(|&&r| r > shape.tokens) {
            return Err(Error::ScheduleMismatch {
                what: "rows of one pair (≤ N)",
                planned: shape.tokens,
                found: bad,
            });
        }
        let widest = rows.iter().copied().max().unwrap_or(0);
        let (pair_cap, rounds) = match config.scheme {
            Scheme::PipelinedLlep => {
                let q = plan.pair_cap();
                (q, widest.div_ceil(q).max(1))
            }
            Scheme::Llep | Scheme::StandardEp => (widest.max(1), 1),
        };
        Ok(Self { config: *config, shape: *shape, assignment, rows, pair_cap, rounds })
    }

    /// Counts, assignment, rows and schedule from every rank's top-k ids at once (what each
    /// rank computes from the all-gathered counts and rows).
    pub fn from_top_k(plan: &Plan, ids: &[&[i64]]) -> Result<Self> {
        let (config, shape) = (plan.config(), plan.shape());
        let counts = RouteCounts::from_top_k(shape, ids)?;
        let assignment = Assignment::new(config, shape, counts)?;
        let mut rows = Vec::with_capacity(shape.ranks * shape.ranks);
        for (s, rank_ids) in ids.iter().enumerate() {
            rows.extend(pair_rows(&assignment, shape, s, rank_ids)?);
        }
        Self::new(plan, assignment, rows)
    }

    /// The config.
    pub fn config(&self) -> &Config {
        &self.config
    }
    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }
    /// The least-loaded assignment.
    pub fn assignment(&self) -> &Assignment {
        &self.assignment
    }
    /// q: rows any source sends any destination in one round (the exact widest pair for the
    /// one-round baselines).
    pub fn pair_cap(&self) -> usize {
        self.pair_cap
    }
    /// K.
    pub fn rounds(&self) -> usize {
        self.rounds
    }
    /// `R[s][d]`.
    pub fn pair_rows(&self, source: usize, dest: usize) -> usize {
        self.rows[source * self.shape.ranks + dest]
    }
    /// Rows source s sends d in round j.
    pub fn round_pair_rows(&self, source: usize, dest: usize, round: usize) -> usize {
        round_rows(self.config.chunking, self.pair_rows(source, dest), self.rounds, round).len()
    }
    /// The rows of source s's list for d that go in round j.
    pub fn round_row_indices(&self, source: usize, dest: usize, round: usize) -> RoundRows {
        round_rows(self.config.chunking, self.pair_rows(source, dest), self.rounds, round)
    }
    /// Round j's send matrix `S_j[s][d]` in rows (row-major P×P).
    pub fn round_matrix(&self, round: usize) -> Vec<usize> {
        let p = self.shape.ranks;
        (0..p * p).map(|i| self.round_pair_rows(i / p, i % p, round)).collect()
    }
    /// The most rows any rank receives in any round.
    pub fn max_rows_per_round(&self) -> usize {
        let p = self.shape.ranks;
        (0..self.rounds)
            .flat_map(|j| (0..p).map(move |d| (0..p).map(|s| self.round_pair_rows(s, d, j)).sum::<usize>()))
            .max()
            .unwrap_or(0)
    }

    /// Rank d's buffers for one pass. PipelinedLLEP's are the launch [`Plan::buffers`], whatever the
    /// routing; the baselines' are sized to this routing.
    pub fn buffers(&self, rank: usize, pass: Pass) -> Buffers {
        let (p, m) = (self.shape.ranks, self.shape.local_experts());
        match self.config.scheme {
            Scheme::PipelinedLlep => Buffers::pipelined(&self.config, &self.shape, self.pair_cap, pass),
            Scheme::Llep | Scheme::StandardEp => {
                let a = &self.assignment;
                let send_rows = (0..p).map(|d| a.pair_routes(rank, d)).sum();
                let recv_rows = (0..p).map(|s| a.pair_routes(s, rank)).sum();
                let slice =
                    |e: usize| a.pieces(e).iter().filter(|x| x.rank == rank).map(|x| x.routes).sum::<usize>();
                let native = (rank * m..(rank + 1) * m).map(slice);
                let expert_rows = native.chain(a.foreign(rank).iter().map(|&e| slice(e))).max().unwrap_or(0);
                Buffers {
                    shape: self.shape,
                    pass,
                    depth: 1,
                    send_rows,
                    recv_rows,
                    expert_rows,
                    foreign_slots: a.foreign(rank).len(),
                }
            }
        }
    }

    /// Rows rank d receives over all rounds, `Σ_s R[s][d]`.
    pub fn recv_rows_total(&self, rank: usize) -> usize {
        (0..self.shape.ranks).map(|s| self.pair_rows(s, rank)).sum()
    }

    /// Rank d's saved-activation store of [`Mode::SaveActivations`], in carve order (bytes):
    /// the received x rows of every round (`Σ_s R[s][d]` × H), their route metadata (× k
    /// entries), each computed route's gate and up pre-activations (`L_d` × I, twice), and K + 1
    /// route offsets. Empty when the config is checkpointed.
    pub fn saved_regions(&self, rank: usize) -> Vec<usize> {
        if self.config.mode == Mode::Checkpointed {
            return Vec::new();
        }
        let s = &self.shape;
        let (h, i, k, b) = (s.hidden, s.intermediate, s.top_k, s.elem_bytes());
        let rows = self.recv_rows_total(rank);
        let routes = self.assignment.rank_load(rank);
        let meta = std::mem::size_of::<RouteMeta>();
        vec![rows * h * b, rows * k * meta, routes * 2 * i * b, 4 * (self.rounds + 1)]
    }

    /// Bytes rank d keeps from forward to backward in [`Mode::SaveActivations`] (0 when
    /// checkpointed): the exact size of [`Schedule::saved_regions`], alignment included. At most
    /// [`Buffers::saved_activation_bytes`] of the rank's buffers for this plan's K: unlike the
    /// dispatch buffers, it grows with the routing.
    pub fn saved_bytes(&self, rank: usize) -> usize {
        let regions = self.saved_regions(rank);
        if regions.is_empty() { 0 } else { Arena::bytes_for(&regions).unwrap_or(usize::MAX) }
    }

    /// The largest workspace any rank needs for `pass`.
    pub fn max_workspace_bytes(&self, pass: Pass) -> usize {
        (0..self.shape.ranks).map(|d| self.buffers(d, pass).workspace_bytes()).max().unwrap_or(0)
    }
}
