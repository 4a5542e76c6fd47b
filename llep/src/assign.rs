//! Pure least-loaded assignment (LLA, LLEP's Alg. 2) from the all-gathered P×E route counts,
//! the per-source split of every spilled expert, and the route → compute-rank mapping.
//!
//! Loads `l_e = Σ_s c[s][e]`; capacity `cap = ⌊α·⌊Σl/P⌋⌋` (= α·k·N). Experts are walked by
//! decreasing load (ties by id). For expert e on native rank g with load n, `pending[g]` drops
//! by n and `avail = cap − assigned[g] − pending[g]` (room, reserving g's own experts still to
//! come): g keeps min(n, avail⁺); the excess spills to the other ranks in increasing order of
//! effective load `assigned + pending`, each chunk `min(remaining, spare)` placed only if it is
//! at least m routes or finishes the expert; what no helper takes is forced onto the least
//! loaded helper (over capacity). With F_max foreign slots per rank, a helper whose slots are
//! full is skipped, and a remainder no helper can host stays on the native rank. When the
//! per-rank imbalance `max_g L_g / mean` is below λ, every route stays native (plain EP).

use crate::config::{Config, Scheme, Shape, SpillSplit};
use crate::error::{Error, Result};

/// The all-gathered route counts: `c[s][e]` routes (token, slot) of source rank s to expert e.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteCounts {
    ranks: usize,
    experts: usize,
    counts: Vec<usize>,
}

impl RouteCounts {
    /// Wraps a row-major P×E matrix.
    pub fn new(ranks: usize, experts: usize, counts: Vec<usize>) -> Result<Self> {
        if counts.len() != ranks * experts {
            return Err(Error::ShapeMismatch {
                what: "route counts (P·E)",
                expected: ranks * experts,
                got: counts.len(),
            });
        }
        Ok(Self { ranks, experts, counts })
    }

    /// The counts of every rank's top-k ids (`ids[s]` is rank s's N×k ids), validated.
    pub fn from_top_k(shape: &Shape, ids: &[&[i64]]) -> Result<Self> {
        shape.validate()?;
        if ids.len() != shape.ranks {
            return Err(Error::ShapeMismatch { what: "ranks of ids", expected: shape.ranks, got: ids.len() });
        }
        let mut counts = Vec::with_capacity(shape.ranks * shape.experts);
        for rank_ids in ids {
            counts.extend(local_counts(shape, rank_ids)?);
        }
        Self::new(shape.ranks, shape.experts, counts)
    }

    /// P.
    pub fn ranks(&self) -> usize {
        self.ranks
    }
    /// E.
    pub fn experts(&self) -> usize {
        self.experts
    }
    /// `c[s][e]`.
    pub fn get(&self, source: usize, expert: usize) -> usize {
        self.counts[source * self.experts + expert]
    }
    /// Row s: source s's counts per expert.
    pub fn row(&self, source: usize) -> &[usize] {
        &self.counts[source * self.experts..(source + 1) * self.experts]
    }
    /// `l_e = Σ_s c[s][e]`.
    pub fn load(&self, expert: usize) -> usize {
        (0..self.ranks).map(|s| self.get(s, expert)).sum()
    }
    /// Σ_e l_e.
    pub fn total(&self) -> usize {
        self.counts.iter().sum()
    }
}

/// Checks one rank's top-k ids (length n·k for its n ≤ N tokens, each in 0..E) and returns its
/// E route counts.
pub fn local_counts(shape: &Shape, ids: &[i64]) -> Result<Vec<usize>> {
    let k = shape.for_call(ids.len())?.top_k;
    let mut counts = vec![0usize; shape.experts];
    for (r, &id) in ids.iter().enumerate() {
        let e = expert_index(shape, id, r / k, r % k)?;
        counts[e] += 1;
    }
    Ok(counts)
}

/// Validates one id and returns it as an index.
pub(crate) fn expert_index(shape: &Shape, id: i64, token: usize, slot: usize) -> Result<usize> {
    if id < 0 {
        return Err(Error::NegativeExpert { token, slot, expert: id });
    }
    match usize::try_from(id) {
        Ok(e) if e < shape.experts => Ok(e),
        _ => Err(Error::ExpertOutOfRange { token, slot, expert: id, experts: shape.experts }),
    }
}

/// A run of an expert's routes computed on one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// The compute rank.
    pub rank: usize,
    /// Routes in the run.
    pub routes: usize,
}

/// One expert's weights travelling from its owner to a helper (and its gradient back).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transfer {
    /// The expert.
    pub expert: usize,
    /// Its native rank.
    pub owner: usize,
    /// The rank that computes part of it.
    pub helper: usize,
    /// The helper's foreign slot the weights land in.
    pub slot: usize,
}

/// The least-loaded assignment: pieces per expert, each source's share of each piece, the
/// foreign experts per rank and the weight transfers. Identical on every rank.
#[derive(Debug, Clone, PartialEq)]
pub struct Assignment {
    counts: RouteCounts,
    local_experts: usize,
    capacity: usize,
    imbalance: f64,
    spilled: bool,
    /// Per expert, in creation order (native first when it keeps any).
    pieces: Vec<Vec<Piece>>,
    /// Per expert, row-major P × pieces: source s's routes in each piece.
    shares: Vec<Vec<usize>>,
    /// Per rank, its foreign experts, ascending (index = slot).
    foreign: Vec<Vec<usize>>,
    transfers: Vec<Transfer>,
}

impl Assignment {
    /// Runs the assignment the config's scheme calls for on these counts.
    pub fn new(config: &Config, shape: &Shape, counts: RouteCounts) -> Result<Self> {
        config.validate()?;
        shape.validate()?;
        if counts.ranks() != shape.ranks || counts.experts() != shape.experts {
            return Err(Error::ShapeMismatch {
                what: "route counts (P·E)",
                expected: shape.ranks * shape.experts,
                got: counts.ranks() * counts.experts(),
            });
        }
        for s in 0..shape.ranks {
            let routes: usize = counts.row(s).iter().sum();
            let most = shape.tokens.saturating_mul(shape.top_k);
            if routes > most || !routes.is_multiple_of(shape.top_k) {
                return Err(Error::ShapeMismatch {
                    what: "routes of one source (n·k, n ≤ N)",
                    expected: most,
                    got: routes,
                });
            }
        }
        let (p, m) = (shape.ranks, shape.local_experts());
        let loads: Vec<usize> = (0..shape.experts).map(|e| counts.load(e)).collect();
        let total: usize = loads.iter().sum();
        let native_load: Vec<usize> = (0..p).map(|g| loads[g * m..(g + 1) * m].iter().sum()).collect();
        let imbalance = if total == 0 {
            1.0
        } else {
            native_load.iter().copied().max().unwrap_or(0) as f64 * p as f64 / total as f64
        };
        let capacity = (config.alpha * (total / p) as f64).floor() as usize;
        let lla = config.scheme != Scheme::StandardEp && imbalance >= config.imbalance_threshold;
        let f_cap = if config.scheme == Scheme::PipelinedLlep { config.foreign_slots } else { usize::MAX };
        let pieces = if lla {
            least_loaded(shape, &loads, &native_load, capacity, config.min_chunk, f_cap)
        } else {
            (0..shape.experts)
                .map(|e| if loads[e] == 0 { vec![] } else { vec![Piece { rank: e / m, routes: loads[e] }] })
                .collect()
        };
        let shares = (0..shape.experts)
            .map(|e| {
                let c: Vec<usize> = (0..p).map(|s| counts.get(s, e)).collect();
                split(&c, &pieces[e], config.spill_split)
            })
            .collect();
        let mut foreign = vec![Vec::new(); p];
        for (e, list) in pieces.iter().enumerate() {
            for piece in list {
                if piece.rank != e / m && !foreign[piece.rank].contains(&e) {
                    foreign[piece.rank].push(e);
                }
            }
        }
        foreign.iter_mut().for_each(|f| f.sort_unstable());
        let mut transfers: Vec<Transfer> = foreign
            .iter()
            .enumerate()
            .flat_map(|(helper, list)| {
                list.iter().enumerate().map(move |(slot, &expert)| Transfer {
                    expert,
                    owner: expert / m,
                    helper,
                    slot,
                })
            })
            .collect();
        transfers.sort_by_key(|t| (t.expert, t.helper));
        Ok(Self {
            counts,
            local_experts: m,
            capacity,
            imbalance,
            spilled: lla,
            pieces,
            shares,
            foreign,
            transfers,
        })
    }

    /// The counts it was made from.
    pub fn counts(&self) -> &RouteCounts {
        &self.counts
    }
    /// `cap = ⌊α·⌊Σl/P⌋⌋`.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Per-rank imbalance of the native loads, `max_g L_g / mean`.
    pub fn imbalance(&self) -> f64 {
        self.imbalance
    }
    /// Whether the least-loaded assignment ran (false: plain EP, by scheme or below λ).
    pub fn least_loaded(&self) -> bool {
        self.spilled
    }
    /// Expert e's pieces in creation order.
    pub fn pieces(&self, expert: usize) -> &[Piece] {
        &self.pieces[expert]
    }
    /// Source s's routes in piece `piece` of expert e.
    pub fn share(&self, expert: usize, source: usize, piece: usize) -> usize {
        self.shares[expert][source * self.pieces[expert].len() + piece]
    }
    /// Rank d's foreign experts, ascending; an expert's index is its slot.
    pub fn foreign(&self, rank: usize) -> &[usize] {
        &self.foreign[rank]
    }
    /// The largest number of foreign experts on any rank.
    pub fn max_foreign(&self) -> usize {
        self.foreign.iter().map(Vec::len).max().unwrap_or(0)
    }
    /// Every weight transfer, ordered by (expert, helper).
    pub fn transfers(&self) -> &[Transfer] {
        &self.transfers
    }
    /// Routes computed on rank d, `L_d`.
    pub fn rank_load(&self, rank: usize) -> usize {
        self.pieces.iter().flatten().filter(|p| p.rank == rank).map(|p| p.routes).sum()
    }
    /// Rank d's local index of expert e (native `e − d·M`, foreign `M + slot`), if d computes it.
    pub fn local_slot(&self, rank: usize, expert: usize) -> Option<usize> {
        let m = self.local_experts;
        if expert / m == rank {
            return Some(expert - rank * m);
        }
        self.foreign[rank].binary_search(&expert).ok().map(|f| m + f)
    }
    /// Routes of source s sent to destination d, `S[s][d]` (before deduplication into rows).
    pub fn pair_routes(&self, source: usize, dest: usize) -> usize {
        (0..self.pieces.len())
            .map(|e| {
                let np = self.pieces[e].len();
                (0..np)
                    .filter(|&p| self.pieces[e][p].rank == dest)
                    .map(|p| self.shares[e][source * np + p])
                    .sum::<usize>()
            })
            .sum()
    }
    /// A mapper of source s's routes, taken in (token, slot) order, to compute ranks.
    pub fn mapper(&self, source: usize) -> RouteMapper<'_> {
        RouteMapper { assignment: self, source, cursor: vec![(0, 0); self.pieces.len()] }
    }
}

/// Maps one source's routes to compute ranks: the t-th route of expert e (in token, slot order)
/// goes to the piece whose cumulative share of this source covers t.
#[derive(Debug, Clone)]
pub struct RouteMapper<'a> {
    assignment: &'a Assignment,
    source: usize,
    /// Per expert: (piece, routes already taken from it).
    cursor: Vec<(usize, usize)>,
}

impl RouteMapper<'_> {
    /// The compute rank of this source's next route to `expert`. More routes than the counts
    /// the assignment was made from is [`Error::ScheduleMismatch`].
    pub fn next(&mut self, expert: usize) -> Result<usize> {
        let a = self.assignment;
        let pieces = &a.pieces[expert];
        let (piece, used) = &mut self.cursor[expert];
        while *piece < pieces.len() && *used == a.share(expert, self.source, *piece) {
            *piece += 1;
            *used = 0;
        }
        if *piece == pieces.len() {
            let planned = a.counts.get(self.source, expert);
            return Err(Error::ScheduleMismatch {
                what: "routes of this rank to one expert",
                planned,
                found: planned + 1,
            });
        }
        *used += 1;
        Ok(pieces[*piece].rank)
    }
}

fn least_loaded(
    shape: &Shape,
    loads: &[usize],
    native_load: &[usize],
    cap: usize,
    min_chunk: usize,
    f_cap: usize,
) -> Vec<Vec<Piece>> {
    let (p, m) = (shape.ranks, shape.local_experts());
    let mut pending: Vec<usize> = native_load.to_vec();
    let mut assigned = vec![0usize; p];
    let mut foreign_count = vec![0usize; p];
    let mut pieces = vec![Vec::new(); loads.len()];
    let mut order: Vec<usize> = (0..loads.len()).collect();
    order.sort_by_key(|&e| (std::cmp::Reverse(loads[e]), e));
    for e in order {
        let n = loads[e];
        if n == 0 {
            continue;
        }
        let g = e / m;
        pending[g] -= n;
        let avail = cap.saturating_sub(assigned[g] + pending[g]);
        let mut remaining = n;
        let keep = avail.min(n);
        if keep > 0 {
            pieces[e].push(Piece { rank: g, routes: keep });
            assigned[g] += keep;
            remaining -= keep;
        }
        if remaining == 0 {
            continue;
        }
        // Case 2 (the native rank kept some) rescans the re-sorted helpers after every chunk;
        // case 3 makes one pass over the sorted helpers. A helper needs a free foreign slot.
        let rescan = keep > 0;
        let mut hosts = vec![false; p];
        let sorted = |assigned: &[usize], fc: &[usize], hosts: &[bool]| {
            let mut hs: Vec<usize> = (0..p).filter(|&h| h != g && (hosts[h] || fc[h] < f_cap)).collect();
            hs.sort_by_key(|&h| (assigned[h] + pending[h], h));
            hs
        };
        let mut helpers = sorted(&assigned, &foreign_count, &hosts);
        let mut i = 0;
        while remaining > 0 && i < helpers.len() {
            let h = helpers[i];
            let spare = cap.saturating_sub(assigned[h] + pending[h]);
            let chunk = spare.min(remaining);
            if chunk > 0 && (chunk >= min_chunk || chunk == remaining) {
                pieces[e].push(Piece { rank: h, routes: chunk });
                assigned[h] += chunk;
                if !hosts[h] {
                    hosts[h] = true;
                    foreign_count[h] += 1;
                }
                remaining -= chunk;
                if rescan {
                    helpers = sorted(&assigned, &foreign_count, &hosts);
                    i = 0;
                    continue;
                }
            }
            i += 1;
        }
        if remaining > 0 {
            // Forced: the least-loaded helper with a free slot, else the native rank.
            let forced = sorted(&assigned, &foreign_count, &hosts).first().copied().unwrap_or(g);
            if forced != g && !hosts[forced] {
                foreign_count[forced] += 1;
            }
            pieces[e].push(Piece { rank: forced, routes: remaining });
            assigned[forced] += remaining;
        }
    }
    pieces
}

/// Source s's routes in each piece (row-major P × pieces); row sums are `c[s]`, column sums
/// the pieces' routes.
fn split(c: &[usize], pieces: &[Piece], how: SpillSplit) -> Vec<usize> {
    let (p, np) = (c.len(), pieces.len());
    let mut out = vec![0usize; p * np];
    if np == 1 {
        for s in 0..p {
            out[s * np] = c[s];
        }
        return out;
    }
    let mut bounds = Vec::with_capacity(np);
    let mut acc = 0usize;
    for piece in pieces {
        acc += piece.routes;
        bounds.push(acc);
    }
    match how {
        SpillSplit::Position => {
            // Pieces are ranges of the source-major list: source s holds [cum_s, cum_s + c_s).
            let mut cum = 0usize;
            for s in 0..p {
                let (lo, hi) = (cum, cum + c[s]);
                let mut start = 0usize;
                for (q, &end) in bounds.iter().enumerate() {
                    out[s * np + q] = end.min(hi).saturating_sub(start.max(lo));
                    start = end;
                }
                cum = hi;
            }
        }
        SpillSplit::Proportional => {
            // Sainte-Laguë interleave: the b-th route of the merged list is the next one of the
            // source with the smallest (2·taken + 1)/(2·c_s) (ties: lower rank). House
            // monotone, so every piece gets a non-negative share of every source.
            let mut taken = vec![0usize; p];
            let mut prev = vec![0usize; p];
            let mut b = 0usize;
            for (q, &end) in bounds.iter().enumerate() {
                if q + 1 == np {
                    // The last piece takes what is left of every source.
                    for s in 0..p {
                        out[s * np + q] = c[s] - taken[s];
                    }
                    break;
                }
                while b < end {
                    let mut best = usize::MAX;
                    for s in 0..p {
                        if taken[s] < c[s]
                            && (best == usize::MAX
                                || (2 * taken[s] as u128 + 1) * (c[best] as u128)
                                    < (2 * taken[best] as u128 + 1) * (c[s] as u128))
                        {
                            best = s;
                        }
                    }
                    taken[best] += 1;
                    b += 1;
                }
                for s in 0..p {
                    out[s * np + q] = taken[s] - prev[s];
                }
                prev.copy_from_slice(&taken);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use flatpeak_common::DType;

    fn shape(p: usize, n: usize, e: usize, k: usize) -> Shape {
        Shape { ranks: p, tokens: n, hidden: 4, intermediate: 4, experts: e, top_k: k, dtype: DType::F32 }
    }

    #[test]
    fn split_marginals_are_exact() {
        let c = [7usize, 0, 13, 5];
        let pieces =
            [Piece { rank: 0, routes: 9 }, Piece { rank: 2, routes: 11 }, Piece { rank: 3, routes: 5 }];
        for how in [SpillSplit::Proportional, SpillSplit::Position] {
            let out = split(&c, &pieces, how);
            for s in 0..4 {
                assert_eq!(out[s * 3..s * 3 + 3].iter().sum::<usize>(), c[s], "{how:?}");
            }
            for q in 0..3 {
                assert_eq!((0..4).map(|s| out[s * 3 + q]).sum::<usize>(), pieces[q].routes, "{how:?}");
            }
        }
        // Position split: piece 0 is source 0's 7 routes and 2 of source 2's.
        assert_eq!(&split(&c, &pieces, SpillSplit::Position)[..3], &[7, 0, 0]);
    }

    #[test]
    fn one_hot_expert_spills_to_every_rank() {
        let s = shape(4, 64, 8, 2);
        // Every route of every rank to expert 0.
        let counts =
            RouteCounts::new(4, 8, (0..4).flat_map(|_| [128, 0, 0, 0, 0, 0, 0, 0]).collect()).unwrap();
        let config = Config::default().min_chunk(16);
        let a = Assignment::new(&config, &s, counts).unwrap();
        assert!(a.least_loaded());
        assert_eq!(a.capacity(), 128);
        assert_eq!(a.pieces(0).iter().map(|p| p.routes).sum::<usize>(), 512);
        for d in 0..4 {
            assert_eq!(a.rank_load(d), 128, "rank {d}");
        }
        assert_eq!(a.transfers().len(), 3);
        assert_eq!(a.local_slot(2, 0), Some(2));
        assert_eq!(a.local_slot(2, 1), None);
    }

    #[test]
    fn below_lambda_is_plain_ep() {
        let s = shape(2, 8, 4, 1);
        let counts = RouteCounts::new(2, 4, vec![2, 2, 2, 2, 2, 2, 2, 2]).unwrap();
        let a = Assignment::new(&Config::default(), &s, counts).unwrap();
        assert!(!a.least_loaded());
        assert_eq!(a.imbalance(), 1.0);
        assert!(a.transfers().is_empty());
    }

    #[test]
    fn bad_ids_are_typed() {
        let s = shape(1, 2, 4, 2);
        assert_eq!(
            local_counts(&s, &[0, 1, 4, 0]),
            Err(Error::ExpertOutOfRange { token: 1, slot: 0, expert: 4, experts: 4 })
        );
        assert_eq!(
            local_counts(&s, &[0, -1, 2, 0]),
            Err(Error::NegativeExpert { token: 0, slot: 1, expert: -1 })
        );
        assert!(matches!(local_counts(&s, &[0, 1, 2]), Err(Error::ShapeMismatch { .. })));
    }
}
