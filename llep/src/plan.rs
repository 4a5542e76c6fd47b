//! Pure planning: from the assignment and the all-gathered P×P row counts, the rounds K, the
//! pair cap q and every buffer's size, before anything runs. No device, no communication.
//!
//! A *row* is one token sent to one destination rank with the list of its routes there (a
//! token is sent once per destination and expanded to its local experts on arrival). Source s
//! sends `R[s][d]` rows to d. PipelinedLLEP deals the rows of every (s, d) list to K rounds,
//! at most q per round, with `K = max_{s,d} ⌈R[s][d]/q⌉`: every receive buffer is exactly P·q
//! rows whatever the routing; imbalance costs rounds, never memory. The baselines run one
//! round with buffers sized to what arrives (LLEP: ≈ α·k·N routes; standard EP: up to P·k·N).

use flatpeak_common::arena::Arena;

use crate::assign::{Assignment, RouteCounts};
use crate::config::{Chunking, LlepConfig, Mode, PairCap, Scheme, Shape};
use crate::error::{Error, Result};

/// One routed entry of a dispatched row: the destination's local expert slot (native experts
/// first, then foreign slots) and the routing weight. `slot == u32::MAX` pads unused entries.
#[derive(Debug, Clone, Copy, PartialEq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct RouteMeta {
    /// Local expert slot at the destination.
    pub slot: u32,
    /// Routing weight w_ij.
    pub weight: f32,
}

impl RouteMeta {
    /// The padding entry.
    pub const EMPTY: Self = Self { slot: u32::MAX, weight: 0.0 };
}

/// One route of a received round grouped by local expert: its row in the receive buffer and
/// its entry in the row's metadata.
#[derive(Debug, Clone, Copy, PartialEq, Eq, bytemuck::Pod, bytemuck::Zeroable)]
#[repr(C)]
pub struct GroupEntry {
    /// Row of the receive buffer.
    pub row: u32,
    /// Index into the receive metadata (`row·k + entry`).
    pub meta: u32,
}

/// Which pass a set of buffers serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// Forward: x rows out, weighted expert outputs back.
    Forward,
    /// Backward (checkpointed): x and dY rows out, recompute, dX rows and d(weights) back.
    Backward,
}

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
    let (p, k) = (shape.ranks, shape.top_k);
    if ids.len() != shape.tokens * k {
        return Err(Error::ShapeMismatch {
            what: "top-k ids (N·k)",
            expected: shape.tokens * k,
            got: ids.len(),
        });
    }
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

/// The largest q whose dispatch buffers for `config.mode` fit `budget` bytes, or the given q;
/// never more than N (a pair never has more than N rows).
pub fn pair_cap(config: &LlepConfig, shape: &Shape) -> Result<usize> {
    let q = match config.pair_cap {
        PairCap::Rows(q) => q,
        PairCap::DispatchBudget { bytes } => {
            let per_row =
                Buffers::dispatch_bytes_per_row(shape, Pass::Backward) * config.pipeline_depth * shape.ranks;
            if bytes < per_row {
                return Err(Error::BudgetTooSmall { budget: bytes, needed: per_row });
            }
            bytes / per_row
        }
    };
    Ok(q.min(shape.tokens).max(1))
}

/// The schedule of one layer call: assignment, rounds and buffer sizes. Identical on every rank.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    config: LlepConfig,
    shape: Shape,
    assignment: Assignment,
    /// Row-major P×P: `R[s][d]`.
    rows: Vec<usize>,
    pair_cap: usize,
    rounds: usize,
}

impl Plan {
    /// The plan for this assignment and the all-gathered row counts (row-major P×P).
    pub fn new(config: &LlepConfig, shape: &Shape, assignment: Assignment, rows: Vec<usize>) -> Result<Self> {
        config.validate()?;
        shape.validate()?;
        let p = shape.ranks;
        if rows.len() != p * p {
            return Err(Error::ShapeMismatch { what: "pair rows (P·P)", expected: p * p, got: rows.len() });
        }
        if let Some(&bad) = rows.iter().find(|&&r| r > shape.tokens) {
            return Err(Error::PlanMismatch {
                what: "rows of one pair (≤ N)",
                planned: shape.tokens,
                found: bad,
            });
        }
        let widest = rows.iter().copied().max().unwrap_or(0);
        let (pair_cap, rounds) = match config.scheme {
            Scheme::PipelinedLlep => {
                let q = pair_cap(config, shape)?;
                (q, widest.div_ceil(q).max(1))
            }
            Scheme::Llep | Scheme::StandardEp => (widest.max(1), 1),
        };
        Ok(Self { config: *config, shape: *shape, assignment, rows, pair_cap, rounds })
    }

    /// Counts, assignment, rows and plan from every rank's top-k ids at once (what each rank
    /// computes from the all-gathered counts and rows).
    pub fn from_top_k(config: &LlepConfig, shape: &Shape, ids: &[&[i64]]) -> Result<Self> {
        let counts = RouteCounts::from_top_k(shape, ids)?;
        let assignment = Assignment::new(config, shape, counts)?;
        let mut rows = Vec::with_capacity(shape.ranks * shape.ranks);
        for (s, rank_ids) in ids.iter().enumerate() {
            rows.extend(pair_rows(&assignment, shape, s, rank_ids)?);
        }
        Self::new(config, shape, assignment, rows)
    }

    /// The config.
    pub fn config(&self) -> &LlepConfig {
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

    /// Rank d's buffers for one pass. PipelinedLLEP's are [`Buffers::at_launch`], whatever the
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
        vec![rows * h * b, rows * k * meta, routes * i * b, routes * i * b, 4 * (self.rounds + 1)]
    }

    /// Bytes rank d keeps from forward to backward in [`Mode::SaveActivations`] (0 when
    /// checkpointed): the exact size of [`Plan::saved_regions`], alignment included. At most
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

/// The buffers one rank carves from its workspace, in elements of rows (all sizes fixed before
/// the call). Per pipeline copy: a send buffer of `send_rows` rows (also the combine's receive
/// buffer), a receive buffer and an output buffer of `recv_rows` rows, each H wide, with k
/// metadata entries per row; backward adds dY send/receive buffers and d(weights) buffers.
/// Once: expert inputs and outputs (G×H), SwiGLU intermediates (G×I, two in forward, three in
/// backward), F foreign weight slots (3·H·I each; backward adds their gradients and one H·I
/// return buffer), and N·k-entry route tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buffers {
    shape: Shape,
    pass: Pass,
    depth: usize,
    send_rows: usize,
    recv_rows: usize,
    expert_rows: usize,
    foreign_slots: usize,
}

impl Buffers {
    /// PipelinedLLEP's buffers for pair cap q: `send_rows = recv_rows = G = P·q`, D copies,
    /// F_max slots. Depends on the config and shape only.
    pub fn pipelined(config: &LlepConfig, shape: &Shape, q: usize, pass: Pass) -> Self {
        let rows = shape.ranks * q;
        Self {
            shape: *shape,
            pass,
            depth: config.pipeline_depth,
            send_rows: rows,
            recv_rows: rows,
            expert_rows: rows,
            foreign_slots: config.foreign_slots,
        }
    }

    /// PipelinedLLEP's buffers, from the config and shape alone: what a rank reserves at launch.
    pub fn at_launch(config: &LlepConfig, shape: &Shape, pass: Pass) -> Result<Self> {
        config.validate()?;
        shape.validate()?;
        Ok(Self::pipelined(config, shape, pair_cap(config, shape)?, pass))
    }

    /// Dispatch bytes per row of one pipeline copy: send, receive and output rows with their
    /// metadata (backward: also dY rows and d(weights)).
    pub fn dispatch_bytes_per_row(shape: &Shape, pass: Pass) -> usize {
        let (h, k, b) = (shape.hidden, shape.top_k, shape.elem_bytes());
        let meta = std::mem::size_of::<RouteMeta>() * k;
        match pass {
            Pass::Forward => 3 * h * b + 2 * meta,
            Pass::Backward => 5 * h * b + 2 * meta + 2 * 4 * k,
        }
    }

    /// The shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }
    /// Rows of the send buffer per copy.
    pub fn send_rows(&self) -> usize {
        self.send_rows
    }
    /// Rows of the receive buffer per copy.
    pub fn recv_rows(&self) -> usize {
        self.recv_rows
    }
    /// G: rows of one expert GEMM.
    pub fn expert_rows(&self) -> usize {
        self.expert_rows
    }
    /// Foreign weight slots.
    pub fn foreign_slots(&self) -> usize {
        self.foreign_slots
    }
    /// Pipeline copies D.
    pub fn depth(&self) -> usize {
        self.depth
    }
    /// The pass.
    pub fn pass(&self) -> Pass {
        self.pass
    }
    /// Local expert slots, M + F.
    pub fn local_slots(&self) -> usize {
        self.shape.local_experts() + self.foreign_slots
    }

    /// Every region in carve order, in bytes (the CPU executor carves exactly these).
    pub fn regions(&self) -> Vec<usize> {
        let s = &self.shape;
        let (n, h, i, k, b) = (s.tokens, s.hidden, s.intermediate, s.top_k, s.elem_bytes());
        let meta = std::mem::size_of::<RouteMeta>();
        let group = std::mem::size_of::<GroupEntry>();
        let bwd = self.pass == Pass::Backward;
        let g = self.expert_rows;
        let mut out =
            vec![4 * n * k, 4 * n * k, 4 * (s.ranks + 1), self.foreign_slots * s.expert_elems() * b];
        if bwd {
            out.extend([self.foreign_slots * s.expert_elems() * 4, h * i * 4]);
        }
        for _ in 0..self.depth {
            out.extend([
                self.send_rows * h * b,
                self.recv_rows * h * b,
                self.recv_rows * h * b,
                self.send_rows * k * meta,
                self.recv_rows * k * meta,
            ]);
            if bwd {
                out.extend([
                    self.send_rows * h * b,
                    self.recv_rows * h * b,
                    self.recv_rows * k * 4,
                    self.send_rows * k * 4,
                ]);
            }
        }
        out.extend([
            self.recv_rows * k * group,
            4 * (self.local_slots() + 1),
            g * h * b,
            g * h * b,
            g * i * b,
            g * i * b,
        ]);
        if bwd {
            out.extend([g * h * b, g * i * b]);
        }
        out
    }

    /// Bytes of the whole reservation, alignment included.
    pub fn workspace_bytes(&self) -> usize {
        Arena::bytes_for(&self.regions()).unwrap_or(usize::MAX)
    }
    /// Send-side dispatch bytes (all copies): x rows (and dY rows) with their metadata.
    pub fn send_bytes(&self) -> usize {
        let (h, k, b) = (self.shape.hidden, self.shape.top_k, self.shape.elem_bytes());
        let per_row = match self.pass {
            Pass::Forward => h * b + 8 * k,
            Pass::Backward => 2 * h * b + 12 * k,
        };
        self.depth * self.send_rows * per_row
    }
    /// Receive-side dispatch bytes (all copies): received rows, output rows and metadata.
    pub fn recv_bytes(&self) -> usize {
        let (h, k, b) = (self.shape.hidden, self.shape.top_k, self.shape.elem_bytes());
        let per_row = match self.pass {
            Pass::Forward => 2 * h * b + 8 * k,
            Pass::Backward => 3 * h * b + 12 * k,
        };
        self.depth * self.recv_rows * per_row
    }
    /// Expert GEMM inputs, outputs and SwiGLU intermediates (G rows).
    pub fn expert_intermediate_bytes(&self) -> usize {
        let (h, i, b) = (self.shape.hidden, self.shape.intermediate, self.shape.elem_bytes());
        let g = self.expert_rows;
        match self.pass {
            Pass::Forward => g * (2 * h + 2 * i) * b,
            Pass::Backward => g * (3 * h + 3 * i) * b,
        }
    }
    /// Foreign expert weights (and, in backward, their fp32 gradients and one return buffer).
    pub fn foreign_weight_bytes(&self) -> usize {
        let s = &self.shape;
        let w = self.foreign_slots * s.expert_elems() * s.elem_bytes();
        match self.pass {
            Pass::Forward => w,
            Pass::Backward => w + self.foreign_slots * s.expert_elems() * 4 + s.hidden * s.intermediate * 4,
        }
    }
    /// The fp32 N×H accumulator the combine scatter-adds into (forward: y; backward: dX). The
    /// CPU executor accumulates straight into the returned output, so it is not in the workspace.
    pub fn accumulator_bytes(&self) -> usize {
        self.shape.tokens * self.shape.hidden * 4
    }
    /// The route tables, `8·N·k` bytes: the documented O(N) per-token state.
    pub fn route_table_bytes(&self) -> usize {
        8 * self.shape.tokens * self.shape.top_k
    }
    /// The bound of what [`Mode::SaveActivations`] keeps from forward to backward for K
    /// rounds: every round's receive buffer of rows with their metadata and per-route SwiGLU
    /// pre-activations, `K·recv_rows·(H·b + 8·k + 2·k·I·b)` plus K + 1 route offsets and
    /// alignment; [`Plan::saved_bytes`] is the exact figure of one routing. 0 when checkpointed.
    pub fn saved_activation_bytes(&self, mode: Mode, rounds: usize) -> usize {
        match mode {
            Mode::Checkpointed => 0,
            Mode::SaveActivations => {
                let s = &self.shape;
                let (h, i, k, b) = (s.hidden, s.intermediate, s.top_k, s.elem_bytes());
                let rows = rounds * self.recv_rows;
                let meta = std::mem::size_of::<RouteMeta>();
                let regions =
                    [rows * h * b, rows * k * meta, rows * k * i * b, rows * k * i * b, 4 * (rounds + 1)];
                Arena::bytes_for(&regions).unwrap_or(usize::MAX)
            }
        }
    }
}
