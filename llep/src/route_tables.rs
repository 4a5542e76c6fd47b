//! Rank `me`'s route tables, built once per call on the host: which rank computes each route
//! (the plan's assignment), the per-destination row lists (a token is sent once per destination
//! with its routes there), and per round the rows sent and received. Shared by the CPU and the
//! device executors: a module of its own, so the shared schedule (`device`) does not import a
//! backend.

use flatpeak_common::DType;

use crate::assign::{Assignment, local_counts};
use crate::config::Shape;
use crate::error::{Error, Result};
use crate::layer::Routing;
use crate::plan::RouteMeta;
use crate::schedule::Schedule;

/// The group size against the shape's ranks.
pub(crate) fn check_world_size(world: usize, shape: &Shape) -> Result<()> {
    if world != shape.ranks {
        return Err(Error::ScheduleMismatch { what: "ranks", planned: shape.ranks, found: world });
    }
    Ok(())
}

/// Rank `me`'s route tables, in workspace memory.
pub(crate) struct Tables<'w> {
    /// Compute rank of route (i, j) at `i·k + j`.
    pub(crate) dest: &'w mut [u32],
    /// Per destination d, its row list's tokens at `row_start[d]..row_start[d+1]`.
    pub(crate) row_tokens: &'w mut [u32],
    pub(crate) row_start: &'w mut [u32],
}

/// Checks the plan's shape for a call on a group of `world` ranks (f32 or bf16, the group
/// size, N·k < 2³²) and returns it.
pub(crate) fn check_call_shape(plan: &Schedule, world: usize) -> Result<Shape> {
    let s = *plan.shape();
    if !matches!(s.dtype, DType::F32 | DType::Bf16) {
        return Err(Error::UnsupportedDtype { dtype: s.dtype, backend: "llep", supported: "f32 and bf16" });
    }
    check_world_size(world, &s)?;
    if s.tokens.checked_mul(s.top_k).is_none_or(|v| v > u32::MAX as usize) {
        return Err(Error::invalid_config("tokens·top_k", (s.tokens * s.top_k) as f64, "< 2^32"));
    }
    Ok(s)
}

/// Checks that rank `me`'s routes per expert are the ones the plan was made from.
pub(crate) fn check_planned_counts(plan: &Schedule, me: usize, ids: &[i64]) -> Result<()> {
    let s = plan.shape();
    let planned = plan.assignment().counts().row(me);
    let found = local_counts(s, ids)?;
    if let Some(e) = (0..s.experts).find(|&e| planned[e] != found[e]) {
        return Err(Error::ScheduleMismatch {
            what: "routes of this rank to an expert",
            planned: planned[e],
            found: found[e],
        });
    }
    Ok(())
}

/// Route → compute rank, and the per-destination row lists (tokens ascending), of rank `me`.
pub(crate) fn build_tables(plan: &Schedule, me: usize, ids: &[i64], t: &mut Tables<'_>) -> Result<()> {
    let s = plan.shape();
    let (k, p) = (s.top_k, s.ranks);
    let mut mapper = plan.assignment().mapper(me);
    for (r, &id) in ids.iter().enumerate() {
        t.dest[r] = mapper.next(id as usize)? as u32;
    }
    // Row counts per destination: a token counts once per distinct destination.
    t.row_start.fill(0);
    for token in t.dest.chunks_exact(k) {
        for (j, &d) in token.iter().enumerate() {
            if !token[..j].contains(&d) {
                t.row_start[d as usize + 1] += 1;
            }
        }
    }
    for d in 0..p {
        let planned = plan.pair_rows(me, d);
        let found = t.row_start[d + 1] as usize;
        if planned != found {
            return Err(Error::ScheduleMismatch {
                what: "rows of this rank to a destination",
                planned,
                found,
            });
        }
        t.row_start[d + 1] += t.row_start[d];
    }
    let mut fill: Vec<u32> = t.row_start[..p].to_vec();
    for (i, token) in t.dest.chunks_exact(k).enumerate() {
        for (j, &d) in token.iter().enumerate() {
            if !token[..j].contains(&d) {
                t.row_tokens[fill[d as usize] as usize] = i as u32;
                fill[d as usize] += 1;
            }
        }
    }
    Ok(())
}

/// Token i's routes computed on rank d, in slot order: calls `f(m, jj, meta)` for the m-th
/// such route, which is the token's top-k slot jj, with its local expert slot on d and its
/// routing weight. The send side of every executor builds its row metadata from this.
pub(crate) fn row_routes(
    a: &Assignment,
    routing: &Routing<'_>,
    dest: &[u32],
    (i, d, k): (usize, usize, usize),
    mut f: impl FnMut(usize, usize, RouteMeta),
) -> Result<()> {
    for (m, jj) in (0..k).filter(|&jj| dest[i * k + jj] as usize == d).enumerate() {
        let e = routing.ids[i * k + jj] as usize;
        let slot = a.local_slot(d, e).ok_or(Error::ScheduleMismatch {
            what: "expert without a slot on its compute rank",
            planned: d,
            found: e,
        })?;
        f(m, jj, RouteMeta { slot: slot as u32, weight: routing.weights[i * k + jj] });
    }
    Ok(())
}

/// Rows rank `me` sends each destination, and receives from each source, in round j.
pub(crate) fn round_counts(plan: &Schedule, me: usize, j: usize) -> (Vec<usize>, Vec<usize>) {
    let p = plan.shape().ranks;
    let send = (0..p).map(|d| plan.round_pair_rows(me, d, j)).collect();
    let recv = (0..p).map(|s| plan.round_pair_rows(s, me, j)).collect();
    (send, recv)
}
