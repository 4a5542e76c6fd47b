//! The round pipeline of the schedule: which round's dispatch, experts, combine and scatter are
//! issued when, over the plan's D copies of the dispatch buffers.
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
//! beside them, and its scatter follows them. This is the double-buffered round of `docs/design.md` — "round
//! j's expert GEMMs overlap round j+1's dispatch and j−1's combine" — which needs three copies:
//! with two, round j+1's dispatch and round j−1's combine share one. On the host every operation
//! runs when it is issued, in this order.
//!
//! The first round's dispatch is issued on its own; with three or more copies the last round's
//! scatter follows the loop. Every copy a dispatch writes was last used by a round whose scatter
//! is already issued, and the scatters into the output keep the pass's round order, so every
//! depth gives the same result.

use super::host::{meta_words, scale, send_lists};
use super::{DeviceInputs, DeviceOps, IndexedRows};
use crate::error::{Error, Result};
use crate::layer::Routing;
use crate::plan::RouteMeta;
use crate::route_tables::{Tables, round_counts};
use crate::schedule::Schedule;

/// One pipeline copy of the dispatch buffers (backward-only ones are empty in forward).
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

/// What a pass dispatches each round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Sends {
    /// x rows and their routes (forward).
    X,
    /// x and dY rows and their routes (checkpointed backward).
    XAndDy,
    /// dY rows only (backward from saved activations: x rows and routes are in the store).
    Dy,
}

/// A round whose dispatch has been issued: its counts, the copy of the dispatch buffers it
/// uses, and where its received metadata is on the host.
pub(super) struct Issued {
    pub(super) round: usize,
    pub(super) set: usize,
    pub(super) sent: usize,
    pub(super) send_counts: Vec<usize>,
    pub(super) recv_counts: Vec<usize>,
    meta_at: usize,
}

impl Issued {
    /// Rows this rank received.
    pub(super) fn got(&self) -> usize {
        self.recv_counts.iter().sum()
    }
}

/// The call's fixed context for issuing dispatches.
pub(super) struct Dispatcher<'a, 't, O: DeviceOps> {
    pub(super) ops: &'a O,
    pub(super) plan: &'a Schedule,
    pub(super) tables: &'a Tables<'t>,
    pub(super) inputs: &'a DeviceInputs<'a, O::Buf>,
    pub(super) dy: Option<&'a O::Buf>,
    pub(super) sends: Sends,
}

impl<O: DeviceOps> Dispatcher<'_, '_, O> {
    fn routing(&self) -> &Routing<'_> {
        &self.inputs.routing
    }

    /// Issues round j's dispatch into buffer copy `j mod depth`: the token list, the gathered x
    /// and/or dY rows and their route metadata, then the all-to-alls.
    fn issue(&self, sets: &mut [RoundSet<O::Buf, O::Index>], j: usize) -> Result<Issued> {
        let (ops, s) = (self.ops, self.plan.shape());
        let (me, h, k) = (ops.rank(), s.hidden, s.top_k);
        let at = j % sets.len().max(1);
        let set = sets.get_mut(at).ok_or(Error::ScheduleMismatch {
            what: "dispatch buffer copies",
            planned: 1,
            found: 0,
        })?;
        let (send_counts, recv_counts) = round_counts(self.plan, me, j);
        let (x, dy) = match self.sends {
            Sends::X => (true, None),
            Sends::XAndDy => (true, self.dy),
            Sends::Dy => (false, self.dy),
        };
        let meta = x.then_some(&mut set.send_meta);
        let call = (self.plan, me, self.tables, self.routing());
        let sent = send_lists(ops, call, j, &mut set.send_tokens, meta)?;
        let (sh, rh) = (scale(&send_counts, h), scale(&recv_counts, h));
        if x {
            ops.gather_rows(IndexedRows::new(self.inputs.x, &set.send_tokens, sent, h), &mut set.send_x)?;
            ops.all_to_all_v((&set.send_x, 0), &sh, (&mut set.recv_x, 0), &rh)?;
        }
        if let Some(dy) = dy {
            ops.gather_rows(IndexedRows::new(dy, &set.send_tokens, sent, h), &mut set.send_dy)?;
            ops.all_to_all_v((&set.send_dy, 0), &sh, (&mut set.recv_dy, 0), &rh)?;
        }
        if x {
            let (sm, rm) = (scale(&send_counts, 2 * k), scale(&recv_counts, 2 * k));
            ops.all_to_all_v_index(&set.send_meta, &sm, &mut set.recv_meta, &rm)?;
        }
        Ok(Issued { round: j, set: at, sent, send_counts, recv_counts, meta_at: 0 })
    }
}

/// Where each round's received route metadata is on the host.
pub(super) enum MetaHost<'m> {
    /// Downloaded into one of the staging slots (`slots` of `len` routes each; two when round
    /// j+1's is fetched before round j's experts run).
    Staging { meta: &'m mut [RouteMeta], slots: usize, len: usize },
    /// The saved store's metadata of every round, round j's from row `row_start[j]`: downloaded
    /// into it (`download`: the saving forward) or read from it (backward from the store).
    Store { meta: &'m mut [RouteMeta], row_start: Vec<usize>, download: bool },
}

impl MetaHost<'_> {
    /// Places issued round `round` (the `at`-th of the pass) and fetches its metadata.
    fn receive<O: DeviceOps>(
        &mut self,
        ops: &O,
        sets: &[RoundSet<O::Buf, O::Index>],
        mut round: Issued,
        (at, k): (usize, usize),
    ) -> Result<Issued> {
        let len = round.got() * k;
        let (meta, start, download) = match self {
            MetaHost::Staging { meta, slots, len: slot } => (&mut **meta, (at % *slots) * *slot, true),
            MetaHost::Store { meta, row_start, download } => {
                let row = row_start.get(round.round).copied().unwrap_or(usize::MAX);
                (&mut **meta, row.saturating_mul(k), *download)
            }
        };
        let found = meta.len();
        let dst = meta.get_mut(start..start.saturating_add(len)).ok_or(Error::ScheduleMismatch {
            what: "received route entries (host metadata)",
            planned: found,
            found: start.saturating_add(len),
        })?;
        if download {
            ops.download_index_into(&sets[round.set].recv_meta, meta_words(dst))?;
        }
        round.meta_at = start;
        Ok(round)
    }

    fn of(&self, round: &Issued, k: usize) -> &[RouteMeta] {
        let meta = match self {
            MetaHost::Staging { meta, .. } | MetaHost::Store { meta, .. } => &**meta,
        };
        &meta[round.meta_at..round.meta_at + round.got() * k]
    }
}

/// Runs the rounds in `order` in the issue order of the module's table: `issue` dispatches a
/// round, `run` issues its experts and combine once its metadata is on the host, `finish`
/// scatters its combined rows back. `state` is handed to both (what either writes besides
/// the buffer copies: the output, the gradients, the saved store).
pub(super) fn pipelined<O: DeviceOps, S>(
    d: &Dispatcher<'_, '_, O>,
    order: &[usize],
    sets: &mut [RoundSet<O::Buf, O::Index>],
    mut host: MetaHost<'_>,
    state: &mut S,
    mut run: impl FnMut(&mut S, &mut [RoundSet<O::Buf, O::Index>], &Issued, &[RouteMeta]) -> Result<()>,
    mut finish: impl FnMut(&mut S, &mut [RoundSet<O::Buf, O::Index>], &Issued) -> Result<()>,
) -> Result<()> {
    let k = d.plan.shape().top_k;
    let (ahead, lag) = (sets.len() >= 2, sets.len() >= 3);
    let mut ready: Option<Issued> = None;
    let mut unfinished: Option<Issued> = None;
    for (at, &j) in order.iter().enumerate() {
        let round = match ready.take() {
            Some(r) => r,
            None => {
                let round = d.issue(sets, j)?;
                host.receive(d.ops, sets, round, (at, k))?
            }
        };
        let next = match order.get(at + 1) {
            Some(&jn) if ahead => Some(d.issue(sets, jn)?),
            _ => None,
        };
        run(state, sets, &round, host.of(&round, k))?;
        if let Some(previous) = unfinished.take() {
            finish(state, sets, &previous)?;
        }
        if lag {
            unfinished = Some(round);
        } else {
            finish(state, sets, &round)?;
        }
        if let Some(next) = next {
            ready = Some(host.receive(d.ops, sets, next, (at + 1, k))?);
        }
    }
    if let Some(last) = unfinished {
        finish(state, sets, &last)?;
    }
    Ok(())
}
