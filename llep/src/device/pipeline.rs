//! The round pipeline of the device schedule: which round's dispatch, experts, combine and
//! scatter are issued when, over the plan's D copies of the dispatch buffers.
//!
//! Issue order for round j, where j+1 and j−1 are the next and previous rounds of the pass
//! (backward runs the rounds in reverse, so there they are rounds j−1 and j+1):
//!
//! | copies | issued before round j's experts | after them |
//! |---|---|---|
//! | 1 | round j's dispatch | round j's combine and scatter |
//! | 2 | round j+1's dispatch | round j's combine and scatter |
//! | ≥ 3 | round j+1's dispatch | round j's combine, round j−1's scatter |
//!
//! On a device with concurrent queues (CUDA: NCCL's stream beside the compute stream), round j's
//! GEMMs run while round j+1's rows arrive (two or more copies). With three or more, the compute
//! queue also does not wait for round j−1's combine before round j's experts: that combine runs
//! beside them, and its scatter follows them. This is the DESIGN's double-buffered round — "round
//! j's expert GEMMs overlap round j+1's dispatch and j−1's combine" — which needs three copies:
//! with two, round j+1's dispatch and round j−1's combine share one.
//!
//! The first round's dispatch is issued on its own; with three or more copies the last round's
//! scatter follows the loop. Every copy a dispatch writes was last used by a round whose scatter
//! is already issued, and the scatters into the output keep the pass's round order, so every
//! depth gives the same result.

use super::host::{HostTables, SendLists, decode_meta};
use super::{DeviceInputs, DeviceOps};
use crate::config::Shape;
use crate::cpu::{round_counts, scale};
use crate::error::Result;
use crate::plan::RouteMeta;
use crate::schedule::Schedule;

/// One pipeline copy of the dispatch buffers (backward-only ones hold one element in forward).
/// The token list is per copy too: round j's combine scatters by it after round j+1's dispatch
/// has gathered by its own.
#[derive(Debug)]
pub(super) struct RoundSet<B, I> {
    pub(super) send_tokens: I,
    pub(super) send_x: B,
    pub(super) recv_x: B,
    pub(super) out: B,
    pub(super) send_meta: I,
    pub(super) recv_meta: I,
    pub(super) send_dy: B,
    pub(super) recv_dy: B,
    pub(super) dw_out: B,
    pub(super) dw_back: B,
}

/// A round whose dispatch has been issued: its host lists and counts, and the copy of the
/// dispatch buffers it uses.
pub(super) struct Issued {
    pub(super) set: usize,
    pub(super) lists: SendLists,
    pub(super) send_counts: Vec<usize>,
    pub(super) recv_counts: Vec<usize>,
}

impl Issued {
    /// Rows this rank sent.
    pub(super) fn sent(&self) -> usize {
        self.lists.tokens.len()
    }
    /// Rows this rank received.
    pub(super) fn got(&self) -> usize {
        self.recv_counts.iter().sum()
    }
}

/// Issues round j's dispatch into buffer copy `j mod depth`: the token list, the gathered x
/// (and, in backward, dY) rows and their route metadata, then the all-to-alls.
pub(super) fn dispatch<O: DeviceOps>(
    ops: &O,
    plan: &Schedule,
    (s, t): (&Shape, &HostTables),
    (inputs, dy): (&DeviceInputs<'_, O::Buf>, Option<&O::Buf>),
    sets: &mut [RoundSet<O::Buf, O::Index>],
    j: usize,
) -> Result<Issued> {
    let (me, h, k) = (ops.rank(), s.hidden, s.top_k);
    let at = j % sets.len();
    let set = &mut sets[at];
    let (send_counts, recv_counts) = round_counts(plan, me, j);
    let lists = SendLists::new(plan, me, t, &inputs.routing, j)?;
    let sent = lists.tokens.len();
    ops.write_index(&lists.tokens, &mut set.send_tokens)?;
    ops.gather_rows(inputs.x, &set.send_tokens, sent, None, h, &mut set.send_x)?;
    if let Some(dy) = dy {
        ops.gather_rows(dy, &set.send_tokens, sent, None, h, &mut set.send_dy)?;
    }
    ops.write_index(&lists.meta, &mut set.send_meta)?;
    let (sh, rh) = (scale(&send_counts, h), scale(&recv_counts, h));
    ops.all_to_all_v((&set.send_x, 0), &sh, (&mut set.recv_x, 0), &rh)?;
    if dy.is_some() {
        ops.all_to_all_v((&set.send_dy, 0), &sh, (&mut set.recv_dy, 0), &rh)?;
    }
    let (sm, rm) = (scale(&send_counts, 2 * k), scale(&recv_counts, 2 * k));
    ops.all_to_all_v_index(&set.send_meta, &sm, &mut set.recv_meta, &rm)?;
    Ok(Issued { set: at, lists, send_counts, recv_counts })
}

/// The received routes' metadata of an issued round (a download: waits for its all-to-all).
fn received_meta<O: DeviceOps>(
    ops: &O,
    sets: &[RoundSet<O::Buf, O::Index>],
    round: &Issued,
    k: usize,
) -> Result<Vec<RouteMeta>> {
    Ok(decode_meta(&ops.download_index(&sets[round.set].recv_meta, round.got() * k * 2)?))
}

/// Runs the rounds in `order` in the issue order of the module's table: `issue` dispatches a
/// round, `run` issues its experts and combine once its metadata is on the host, `finish`
/// scatters its combined rows back. `state` is handed to both (what either writes besides
/// the buffer copies: the output, the gradients).
pub(super) fn pipelined<O: DeviceOps, S>(
    ops: &O,
    order: &[usize],
    sets: &mut [RoundSet<O::Buf, O::Index>],
    (k, state): (usize, &mut S),
    mut issue: impl FnMut(&mut [RoundSet<O::Buf, O::Index>], usize) -> Result<Issued>,
    mut run: impl FnMut(&mut S, &mut [RoundSet<O::Buf, O::Index>], &Issued, &[RouteMeta]) -> Result<()>,
    mut finish: impl FnMut(&mut S, &mut [RoundSet<O::Buf, O::Index>], &Issued) -> Result<()>,
) -> Result<()> {
    let (ahead, lag) = (sets.len() >= 2, sets.len() >= 3);
    let mut ready: Option<(Issued, Vec<RouteMeta>)> = None;
    let mut unfinished: Option<Issued> = None;
    for (at, &j) in order.iter().enumerate() {
        let (round, meta) = match ready.take() {
            Some(r) => r,
            None => {
                let round = issue(sets, j)?;
                let meta = received_meta(ops, sets, &round, k)?;
                (round, meta)
            }
        };
        let next = match order.get(at + 1) {
            Some(&jn) if ahead => Some(issue(sets, jn)?),
            _ => None,
        };
        run(state, sets, &round, &meta)?;
        if let Some(previous) = unfinished.take() {
            finish(state, sets, &previous)?;
        }
        if lag {
            unfinished = Some(round);
        } else {
            finish(state, sets, &round)?;
        }
        if let Some(next) = next {
            let meta = received_meta(ops, sets, &next, k)?;
            ready = Some((next, meta));
        }
    }
    if let Some(last) = unfinished {
        finish(state, sets, &last)?;
    }
    Ok(())
}
