//! The host side of the device schedule: the route tables (the CPU executor's, built by the
//! same code) and, per round, the index lists the kernels read — tokens in send order, each
//! sent row's route metadata, the d(weights) return map, and per expert group its received
//! rows, weights and metadata entries. O(N·k) on the host, nothing N×H.

use crate::config::Shape;
use crate::cpu::{Tables, build_tables, check_call_shape, check_planned_counts, row_routes};
use crate::error::Result;
use crate::layer::Routing;
use crate::plan::{GroupEntry, RouteMeta};
use crate::schedule::Schedule;

/// Rank `me`'s route tables: compute rank per route, per-destination token lists.
#[derive(Debug)]
pub(super) struct HostTables {
    dest: Vec<u32>,
    row_tokens: Vec<u32>,
    row_start: Vec<u32>,
}

/// Checks the call (shape, group size, routing, planned counts) and builds the tables.
pub(super) fn tables(
    plan: &Schedule,
    me: usize,
    world: usize,
    routing: &Routing<'_>,
) -> Result<(Shape, HostTables)> {
    let s = check_call_shape(plan, world)?;
    routing.validate(&s)?;
    check_planned_counts(plan, me, routing.ids)?;
    let (n, k) = (s.tokens, s.top_k);
    let mut t =
        HostTables { dest: vec![0; n * k], row_tokens: vec![0; n * k], row_start: vec![0; s.ranks + 1] };
    let mut view = Tables { dest: &mut t.dest, row_tokens: &mut t.row_tokens, row_start: &mut t.row_start };
    build_tables(plan, me, routing.ids, &mut view)?;
    Ok((s, t))
}

/// Round j's send-side lists of rank `me`, in send order (destination-major, then the plan's
/// row order — the CPU executor's `pack` order).
#[derive(Debug, Default)]
pub(super) struct SendLists {
    /// Token of each sent row.
    pub tokens: Vec<u32>,
    /// Each sent row's k route entries, `[slot, weight bits]` per entry (padding: `u32::MAX`, 0).
    pub meta: Vec<u32>,
    /// Per route sent: its entry in the returned d(weights) rows (`row·k + m`)…
    pub dw_src: Vec<u32>,
    /// …and its place in the N×k d(weights) (`i·k + j`).
    pub dw_dst: Vec<u32>,
}

impl SendLists {
    /// Builds round j's lists.
    pub fn new(plan: &Schedule, me: usize, t: &HostTables, routing: &Routing<'_>, j: usize) -> Result<Self> {
        let s = plan.shape();
        let k = s.top_k;
        let a = plan.assignment();
        let mut out = Self::default();
        for d in 0..s.ranks {
            let start = t.row_start[d] as usize;
            for r in plan.round_row_indices(me, d, j) {
                let i = t.row_tokens[start + r] as usize;
                let o = out.tokens.len();
                out.tokens.push(i as u32);
                let mut row = vec![RouteMeta::EMPTY; k];
                row_routes(a, routing, &t.dest, (i, d, k), |m, jj, route| {
                    row[m] = route;
                    out.dw_src.push((o * k + m) as u32);
                    out.dw_dst.push((i * k + jj) as u32);
                })?;
                out.meta.extend(row.iter().flat_map(|m| [m.slot, m.weight.to_bits()]));
            }
        }
        Ok(out)
    }
}

/// Route metadata from its `[slot, weight bits]` encoding.
pub(super) fn decode_meta(raw: &[u32]) -> Vec<RouteMeta> {
    raw.chunks_exact(2).map(|e| RouteMeta { slot: e[0], weight: f32::from_bits(e[1]) }).collect()
}

/// One expert group's lists: received row, routing weight and metadata entry per route.
#[derive(Debug, Default)]
pub(super) struct GroupLists {
    /// Receive-buffer row of each route.
    pub rows: Vec<u32>,
    /// Routing weight of each route.
    pub weights: Vec<f32>,
    /// Metadata entry (`row·k + m`) of each route.
    pub meta: Vec<u32>,
}

impl GroupLists {
    /// The lists of `entries`.
    pub fn new(entries: &[GroupEntry], meta: &[RouteMeta]) -> Self {
        Self {
            rows: entries.iter().map(|e| e.row).collect(),
            weights: entries.iter().map(|e| meta[e.meta as usize].weight).collect(),
            meta: entries.iter().map(|e| e.meta).collect(),
        }
    }
}
