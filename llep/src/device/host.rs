//! The host side of the round schedule: the call's checks, the route tables (carved from the
//! host workspace) and the index lists each round writes into the device's index buffers —
//! tokens in send order, each sent row's route metadata, the d(weights) return map, and the
//! round's routes grouped by expert: received rows, weights and metadata entries. O(N·k) on the
//! host, nothing N×H; every list is written in place through [`DeviceOps::fill_index`] (on a host
//! backend, into the buffer itself).

use flatpeak_common::Workspace;

use super::DeviceOps;
use crate::config::Shape;
use crate::error::{Error, Result};
use crate::layer::Routing;
use crate::plan::{GroupEntry, RouteMeta};
use crate::route_tables::{Tables, build_tables, check_call_shape, check_planned_counts, row_routes};
use crate::schedule::Schedule;

/// Checks the call (shape, group size, routing, planned counts) and returns its shape.
pub(super) fn check_call(plan: &Schedule, me: usize, world: usize, routing: &Routing<'_>) -> Result<Shape> {
    let s = check_call_shape(plan, world)?.for_call(routing.ids.len())?;
    routing.validate(&s)?;
    check_planned_counts(plan, me, routing.ids)?;
    Ok(s)
}

/// Carves rank `me`'s route tables from `host` (the first three regions of
/// [`Buffers::regions`](crate::Buffers::regions)) and fills them.
pub(super) fn tables<'h>(
    plan: &Schedule,
    me: usize,
    routing: &Routing<'_>,
    host: &'h Workspace,
) -> Result<Tables<'h>> {
    let (routes, ranks) = (routing.ids.len(), plan.shape().ranks);
    let take = |len| host_take(host, len);
    let mut t = Tables { dest: take(routes)?, row_tokens: take(routes)?, row_start: take(ranks + 1)? };
    build_tables(plan, me, routing.ids, &mut t)?;
    Ok(t)
}

/// `len` elements from the host workspace; an empty buffer takes no region (as
/// [`Buffers::regions`] counts them).
pub(super) fn host_take<T: bytemuck::Pod>(host: &Workspace, len: usize) -> Result<&mut [T]> {
    if len == 0 { Ok(Default::default()) } else { Ok(host.take(len)?) }
}

/// Route metadata as the u32 pairs (`[slot, weight bits]`) the index buffers carry.
pub(super) fn meta_words(meta: &mut [RouteMeta]) -> &mut [u32] {
    bytemuck::cast_slice_mut(meta)
}

/// The u32 pairs of an index buffer as route metadata (an odd length is a
/// [`Error::ShapeMismatch`]).
fn as_meta(words: &mut [u32]) -> Result<&mut [RouteMeta]> {
    let len = words.len();
    bytemuck::try_cast_slice_mut(words).map_err(|_| Error::ShapeMismatch {
        what: "route metadata words (two per route)",
        expected: len + 1,
        got: len,
    })
}

/// Calls `f(o, d, i)` for the o-th row rank `me` sends in round j: destination d, token i (send
/// order: destination-major, then the plan's row order).
fn for_each_sent(
    plan: &Schedule,
    me: usize,
    t: &Tables<'_>,
    j: usize,
    mut f: impl FnMut(usize, usize, usize) -> Result<()>,
) -> Result<usize> {
    let mut o = 0usize;
    for d in 0..plan.shape().ranks {
        let start = t.row_start[d] as usize;
        for r in plan.round_row_indices(me, d, j) {
            f(o, d, t.row_tokens[start + r] as usize)?;
            o += 1;
        }
    }
    Ok(o)
}

/// Writes round j's sent tokens into `tokens` and, with `meta`, each sent row's k route entries
/// (local slot on the destination, weight; padded with [`RouteMeta::EMPTY`]). Returns the rows.
pub(super) fn send_lists<O: DeviceOps>(
    ops: &O,
    (plan, me, t, routing): (&Schedule, usize, &Tables<'_>, &Routing<'_>),
    j: usize,
    tokens: &mut O::Index,
    meta: Option<&mut O::Index>,
) -> Result<usize> {
    let k = plan.shape().top_k;
    let rows = (0..plan.shape().ranks).map(|d| plan.round_pair_rows(me, d, j)).sum::<usize>();
    let sent = ops.fill_index(tokens, rows, |out| {
        for_each_sent(plan, me, t, j, |o, _, i| {
            out[o] = i as u32;
            Ok(())
        })
    })?;
    if let Some(meta) = meta {
        let a = plan.assignment();
        ops.fill_index(meta, rows * k * 2, |words| {
            let out = as_meta(words)?;
            for_each_sent(plan, me, t, j, |o, d, i| {
                let row = &mut out[o * k..(o + 1) * k];
                row.fill(RouteMeta::EMPTY);
                row_routes(a, routing, t.dest, (i, d, k), |m, _, route| row[m] = route)
            })
            .map(|o| o * k * 2)
        })?;
    }
    Ok(sent)
}

/// Writes round j's d(weights) return map: per route sent, its entry in the returned rows
/// (`row·k + m`) into `src` and its place in the N×k d(weights) (`i·k + jj`) into `dst`.
/// Returns the routes.
pub(super) fn dw_lists<O: DeviceOps>(
    ops: &O,
    (plan, me, t, routing): (&Schedule, usize, &Tables<'_>, &Routing<'_>),
    j: usize,
    (src, dst): (&mut O::Index, &mut O::Index),
) -> Result<usize> {
    let k = plan.shape().top_k;
    let rows = (0..plan.shape().ranks).map(|d| plan.round_pair_rows(me, d, j)).sum::<usize>();
    let a = plan.assignment();
    let mut routes = 0usize;
    ops.fill_index(src, rows * k, |src| {
        ops.fill_index(dst, rows * k, |dst| {
            for_each_sent(plan, me, t, j, |o, d, i| {
                row_routes(a, routing, t.dest, (i, d, k), |m, jj, _| {
                    src[routes] = (o * k + m) as u32;
                    dst[routes] = (i * k + jj) as u32;
                    routes += 1;
                })
            })?;
            Ok(routes)
        })
    })
}

/// The lists of a round's routes grouped by [`group`] (`entries`: every group, each a range):
/// received row and routing weight per route, and with `meta_entries` each route's metadata
/// entry. One upload per list per round.
pub(super) fn round_lists<O: DeviceOps>(
    ops: &O,
    entries: &[GroupEntry],
    meta: &[RouteMeta],
    (rows, weights, meta_entries): (&mut O::Index, &mut O::Buf, Option<&mut O::Index>),
) -> Result<()> {
    let n = entries.len();
    ops.fill_index(rows, n, |out| {
        out.iter_mut().zip(entries).for_each(|(o, e)| *o = e.row);
        Ok(n)
    })?;
    ops.fill(weights, n, |out| {
        for (o, e) in out.iter_mut().zip(entries) {
            *o = meta.get(e.meta as usize).map(|m| m.weight).ok_or(Error::ScheduleMismatch {
                what: "metadata entry of a grouped route",
                planned: meta.len(),
                found: e.meta as usize,
            })?;
        }
        Ok(n)
    })?;
    if let Some(m) = meta_entries {
        ops.fill_index(m, n, |out| {
            out.iter_mut().zip(entries).for_each(|(o, e)| *o = e.meta);
            Ok(n)
        })?;
    }
    Ok(())
}

/// `0, 1, …, n − 1` into `index` (a gather that scales rows in place order).
pub(super) fn iota<O: DeviceOps>(ops: &O, index: &mut O::Index, n: usize) -> Result<()> {
    ops.fill_index(index, n, |out| {
        out.iter_mut().enumerate().for_each(|(r, o)| *o = r as u32);
        Ok(n)
    })
    .map(|_| ())
}

/// Counting sort of a round's received routes (k metadata entries per row) by local expert
/// slot, stable; `offsets[s]..offsets[s + 1]` is slot s's group. Returns the route count.
pub(crate) fn group(
    meta: &[RouteMeta],
    k: usize,
    slots: usize,
    groups: &mut [GroupEntry],
    offsets: &mut [u32],
) -> Result<usize> {
    offsets.fill(0);
    for m in meta.iter().filter(|m| m.slot != u32::MAX) {
        let slot = m.slot as usize;
        if slot >= slots {
            return Err(Error::ScheduleMismatch {
                what: "local expert slot received",
                planned: slots,
                found: slot,
            });
        }
        offsets[slot + 1] += 1;
    }
    for s in 0..slots {
        offsets[s + 1] += offsets[s];
    }
    let total = offsets[slots] as usize;
    if total > groups.len() {
        return Err(Error::ScheduleMismatch {
            what: "routes received in one round",
            planned: groups.len(),
            found: total,
        });
    }
    // offsets[s] is now slot s's start; use it as the fill cursor (it ends at slot s + 1's
    // start), then shift back.
    for (idx, m) in meta.iter().enumerate().filter(|(_, m)| m.slot != u32::MAX) {
        let cursor = &mut offsets[m.slot as usize];
        groups[*cursor as usize] = GroupEntry { row: (idx / k.max(1)) as u32, meta: idx as u32 };
        *cursor += 1;
    }
    for s in (1..=slots).rev() {
        offsets[s] = offsets[s - 1];
    }
    offsets[0] = 0;
    Ok(total)
}

/// Per-rank counts in rows → counts in elements of rows `width` wide.
pub(crate) fn scale(counts: &[usize], width: usize) -> Vec<usize> {
    counts.iter().map(|&c| c * width).collect()
}
