//! [`Mode::SaveActivations`]: forward keeps every round's received rows, their routes and each
//! route's SwiGLU pre-activations in a [`SavedActivations`] store; backward then dispatches dY
//! rows only and runs each expert's backward from what was kept (six GEMMs per group, no
//! recompute).
//!
//! Memory: the store of rank d is [`Schedule::saved_bytes`]`(d)` =
//! `Σ_s R[s][d]·(H·4 + 8·k) + 2·L_d·I·4 + 4·(K + 1)` bytes (rows received over all rounds,
//! routes computed there), reserved once per call and held from forward to backward; at most
//! [`Buffers::saved_activation_bytes`](crate::Buffers::saved_activation_bytes) for this K.
//! Unlike the dispatch buffers it grows with the routing: this is the larger bound the
//! checkpointed mode avoids. The per-round workspace is the checkpointed one's
//! ([`Schedule::buffers`]); the x receive buffers go unused (rows land in the store).

use flatpeak_common::{Communicator, CommunicatorExt, Workspace};

use super::{Carved, Ctx, expert, group, run_forward, scale};
use crate::config::Mode;
use crate::error::{Error, Result};
use crate::layer::{Gradients, RankInputs, check_len};
use crate::plan::{Pass, RouteMeta};
use crate::schedule::Schedule;
use expert::{expert_grad, zero_gradients};

/// What one rank's forward keeps for backward in [`Mode::SaveActivations`]: a reservation of
/// [`Schedule::saved_bytes`] made before the forward, filled by [`forward_saving`], read by
/// [`backward_saved`].
#[derive(Debug)]
pub struct SavedActivations {
    store: Workspace,
    /// (rank, rounds, rows, routes) of the forward that filled the store.
    filled: Option<[usize; 4]>,
}

impl SavedActivations {
    /// Reserves rank `rank`'s store for `plan` (a plan in [`Mode::SaveActivations`]).
    pub fn new(plan: &Schedule, rank: usize) -> Result<Self> {
        check_mode(plan)?;
        Ok(Self { store: Workspace::new(plan.saved_bytes(rank)), filled: None })
    }

    /// Bytes reserved.
    pub fn bytes(&self) -> usize {
        self.store.capacity()
    }

    fn stamp(plan: &Schedule, rank: usize) -> [usize; 4] {
        [rank, plan.rounds(), plan.recv_rows_total(rank), plan.assignment().rank_load(rank)]
    }

    /// The store carved as [`Schedule::saved_regions`] lays it out.
    fn carve(&mut self, plan: &Schedule, rank: usize) -> Result<Store<'_>> {
        self.store.reset();
        let s = plan.shape();
        let [_, rounds, rows, routes] = Self::stamp(plan, rank);
        let ws = &self.store;
        Ok(Store {
            x: ws.take(rows * s.hidden)?,
            meta: ws.take(rows * s.top_k)?,
            gate: ws.take(routes * s.intermediate)?,
            up: ws.take(routes * s.intermediate)?,
            route_start: ws.take(rounds + 1)?,
            hidden: s.hidden,
            top_k: s.top_k,
            intermediate: s.intermediate,
        })
    }
}

/// The carved store: received x rows and metadata of all rounds in round order, every route's
/// pre-activations in round and group order, and each round's first route.
pub(super) struct Store<'s> {
    x: &'s mut [f32],
    meta: &'s mut [RouteMeta],
    gate: &'s mut [f32],
    up: &'s mut [f32],
    pub(super) route_start: &'s mut [u32],
    hidden: usize,
    top_k: usize,
    intermediate: usize,
}

/// One round's part of the store: x rows, metadata, and the pre-activations from its first route.
type RoundStore<'a> = (&'a mut [f32], &'a mut [RouteMeta], (&'a mut [f32], &'a mut [f32]));

impl Store<'_> {
    /// Round slices: `rows` x rows and metadata from row `row_base`, pre-activations from route
    /// `route_base` to the end.
    pub(super) fn round(
        &mut self,
        row_base: usize,
        rows: usize,
        route_base: usize,
    ) -> Result<RoundStore<'_>> {
        let (h, k, i) = (self.hidden, self.top_k, self.intermediate);
        let short = |planned: usize, found: usize| Error::ScheduleMismatch {
            what: "rows or routes of the saved-activation store",
            planned,
            found,
        };
        let total_rows = self.x.len() / h.max(1);
        let x =
            self.x.get_mut(row_base * h..(row_base + rows) * h).ok_or(short(total_rows, row_base + rows))?;
        let meta = self
            .meta
            .get_mut(row_base * k..(row_base + rows) * k)
            .ok_or(short(total_rows, row_base + rows))?;
        let routes = self.gate.len() / i.max(1);
        let gate = self.gate.get_mut(route_base * i..).ok_or(short(routes, route_base))?;
        let up = self.up.get_mut(route_base * i..).ok_or(short(routes, route_base))?;
        Ok((x, meta, (gate, up)))
    }
}

fn check_mode(plan: &Schedule) -> Result<()> {
    if plan.config().mode == Mode::SaveActivations {
        Ok(())
    } else {
        Err(Error::invalid_config(
            "mode",
            plan.config().mode,
            "Mode::SaveActivations (checkpointed plans run through forward and backward)",
        ))
    }
}

/// The layer's forward on this rank, keeping its activations in `saved` (reserved with
/// [`SavedActivations::new`] for this plan and rank) for [`backward_saved`]. Returns y, N×H,
/// bitwise the same as [`forward`](super::forward)'s.
pub fn forward_saving<C: Communicator + ?Sized>(
    comm: &C,
    plan: &Schedule,
    inputs: &RankInputs<'_>,
    ws: &mut Workspace,
    saved: &mut SavedActivations,
) -> Result<Vec<f32>> {
    check_mode(plan)?;
    let me = comm.rank();
    saved.filled = None;
    let mut store = saved.carve(plan, me)?;
    store.route_start[0] = 0;
    let y = run_forward(comm, plan, inputs, ws, Some(&mut store))?;
    saved.filled = Some(SavedActivations::stamp(plan, me));
    Ok(y)
}

/// The layer's backward on this rank from the activations [`forward_saving`] kept: rounds in
/// reverse, each dispatching dY rows only (x rows and routes are in the store), then every
/// group's backward from its saved pre-activations. Returns what
/// [`backward`](super::backward) returns.
pub fn backward_saved<C: Communicator + ?Sized>(
    comm: &C,
    plan: &Schedule,
    inputs: &RankInputs<'_>,
    dy: &[f32],
    saved: &mut SavedActivations,
    ws: &mut Workspace,
) -> Result<Gradients> {
    check_mode(plan)?;
    let ctx = Ctx::new(comm, plan, inputs)?;
    check_len("dY (N·H)", ctx.s.tokens * ctx.s.hidden, dy.len())?;
    let stamp = SavedActivations::stamp(plan, ctx.me);
    if saved.filled != Some(stamp) {
        let found = saved.filled.map_or(0, |f| f[1]);
        return Err(Error::ScheduleMismatch {
            what: "rounds of the saved forward",
            planned: stamp[1],
            found,
        });
    }
    let mut store = saved.carve(plan, ctx.me)?;
    ws.reset();
    let bufs = plan.buffers(ctx.me, Pass::Backward);
    let mut c = Carved::carve(ws, &bufs, plan.config().gemm_threads)?;
    ctx.build_tables(&mut c)?;
    ctx.fetch_foreign(c.foreign)?;
    c.foreign_grad.fill(0.0);
    let (h, i, k) = (ctx.s.hidden, ctx.s.intermediate, ctx.s.top_k);
    let mut g = zero_gradients(&ctx.s);
    let got_per_round: Vec<usize> = (0..plan.rounds()).map(|j| ctx.round_counts(j).1.iter().sum()).collect();
    let mut row_end: usize = got_per_round.iter().sum();
    for j in (0..plan.rounds()).rev() {
        let set = &mut c.sets[j % bufs.depth()];
        let (send_counts, recv_counts) = ctx.round_counts(j);
        let sent = ctx.pack(&c.tables, j, dy, set.send_dy, None)?;
        let got = got_per_round[j];
        row_end -= got;
        let (sh, rh) = (scale(&send_counts, h), scale(&recv_counts, h));
        let (sk, rk) = (scale(&send_counts, k), scale(&recv_counts, k));
        comm.all_to_all_v(&set.send_dy[..sent * h], &sh, &mut set.recv_dy[..got * h], &rh)?;
        let route_base = store.route_start[j] as usize;
        let route_end = store.route_start[j + 1] as usize;
        let (x, meta, (gate, up)) = store.round(row_end, got, route_base)?;
        let filled = group(meta, k, bufs.local_slots(), c.groups, c.offsets)?;
        if filled != route_end.saturating_sub(route_base) {
            return Err(Error::ScheduleMismatch {
                what: "routes of a saved round",
                planned: route_end.saturating_sub(route_base),
                found: filled,
            });
        }
        set.out[..got * h].fill(0.0);
        set.dw_out[..got * k].fill(0.0);
        let mut round =
            expert::SavedRound { x, meta, recv_dy: set.recv_dy, dx_rows: set.out, dw: set.dw_out };
        let mut cursor = 0usize;
        for slot in 0..bufs.local_slots() {
            let entries = &c.groups[c.offsets[slot] as usize..c.offsets[slot + 1] as usize];
            for chunk in entries.chunks(bufs.expert_rows().max(1)) {
                let w = ctx.expert(c.foreign, slot);
                let grad = expert_grad(&ctx.s, slot, &mut g, c.foreign_grad);
                let span = cursor * i..(cursor + chunk.len()) * i;
                let pre = (&gate[span.clone()], &up[span]);
                expert::backward_saved(w, grad, (h, i), chunk, pre, &mut round, &mut c.scratch)?;
                cursor += chunk.len();
            }
        }
        comm.all_to_all_v(&set.out[..got * h], &rh, &mut set.send_x[..sent * h], &sh)?;
        comm.all_to_all_v(&set.dw_out[..got * k], &rk, &mut set.dw_back[..sent * k], &sk)?;
        ctx.scatter_rows(&c.tables, j, set.send_x, &mut g.dx);
        ctx.scatter_weights(&c.tables, j, set.dw_back, &mut g.d_weights);
    }
    ctx.return_foreign_grads(c.foreign_grad, c.grad_return, &mut g)?;
    Ok(g)
}
