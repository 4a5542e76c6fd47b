//! The CPU executor over any [`Communicator`] (on [`LocalGroup`](flatpeak_common::LocalGroup):
//! P ranks as threads).
//!
//! Per call, each rank maps its routes to compute ranks (the plan's assignment), builds its
//! per-destination row lists (a token is sent once per destination with its routes there), and
//! fetches the foreign experts the plan gives it (P2P). Then for each of the K rounds: gather
//! the round's rows straight from the un-expanded N×H input into the send buffer (never an
//! N·k×H copy), all-to-all them into the receive buffer (≤ P·q rows), group the received routes
//! by local expert, run each expert's SwiGLU on groups of ≤ G routes, weight and sum each row's
//! routes, send the rows back and scatter-add them into the fp32 N×H output. Backward runs the
//! rounds in reverse: re-dispatch x and dY rows, recompute the expert forward, run its backward
//! at once (dX rows and d(weights) go back; weight gradients accumulate locally), and return
//! foreign experts' gradients to their owners once at the end. Every buffer is carved from one
//! [`Workspace`] in the order of [`Buffers::regions`]; rounds cycle through D buffer copies
//! (the rounds run in order here: [`Communicator`] calls are synchronous). In
//! [`Mode::SaveActivations`], [`forward_saving`] keeps the received rows and pre-activations and
//! [`backward_saved`] dispatches dY only and skips the recompute (module `saved`).
//!
//! Reproducible: fixed round, destination, expert and row orders, and the CPU GEMM is bitwise
//! identical for any thread count.

mod expert;
pub mod reference;
mod saved;
mod tables;

use bytemuck::Pod;
use flatpeak_common::gemm::Threads;
use flatpeak_common::{Communicator, CommunicatorExt, Workspace};

use crate::assign::{Assignment, RouteCounts, local_counts};
use crate::config::{Mode, Shape};
use crate::error::{Error, Result};
use crate::layer::{Gradients, RankInputs, Routing, check_len};
use crate::plan::{Buffers, GroupEntry, Pass, Plan, RouteMeta};
use crate::schedule::{Schedule, pair_rows};
use expert::{BackwardRound, ExpertRef, Scratch, expert_grad, zero_gradients, zeros};
pub use saved::{SavedActivations, backward_saved, forward_saving};
pub(crate) use tables::{
    Tables, build_tables, check_call_shape, check_planned_counts, round_counts, row_routes,
};

/// Every rank's copy of every rank's `mine` (equal lengths), in rank order.
pub fn all_gather<C: Communicator + ?Sized, T: Pod>(comm: &C, mine: &[T]) -> Result<Vec<T>> {
    let p = comm.world_size();
    let send: Vec<T> = (0..p).flat_map(|_| mine.iter().copied()).collect();
    let mut recv = vec![T::zeroed(); p * mine.len()];
    let counts = vec![mine.len(); p];
    comm.all_to_all_v(&send, &counts, &mut recv, &counts)?;
    Ok(recv)
}

/// The plan of one layer call, from this rank's routing: validates it, all-gathers the P×E
/// route counts, runs the assignment, all-gathers the P×P row counts. Every rank gets the same
/// plan. A rank with bad routing returns its error; its peers see the group fail
/// ([`flatpeak_common::Error::PeerLost`]) instead of hanging.
pub fn schedule<C: Communicator + ?Sized>(comm: &C, plan: &Plan, routing: &Routing<'_>) -> Result<Schedule> {
    let (config, shape) = (plan.config(), plan.shape());
    check_world(comm, shape)?;
    routing.validate(shape)?;
    let counts: Vec<u64> = local_counts(shape, routing.ids)?.into_iter().map(|c| c as u64).collect();
    let counts = all_gather(comm, &counts)?.into_iter().map(|c| c as usize).collect();
    let assignment = Assignment::new(config, shape, RouteCounts::new(shape.ranks, shape.experts, counts)?)?;
    let rows: Vec<u64> =
        pair_rows(&assignment, shape, comm.rank(), routing.ids)?.into_iter().map(|r| r as u64).collect();
    let rows = all_gather(comm, &rows)?.into_iter().map(|r| r as usize).collect();
    Schedule::new(plan, assignment, rows)
}

/// The layer's forward on this rank: `y_i = Σ_j w_ij·FFN_{e_ij}(x_i)`, N×H. Keeps nothing for
/// backward. Buffers come from `ws` (reserve [`Schedule::buffers`]`(rank, Pass::Forward)` or
/// more; PipelinedLLEP's size is the launch [`Plan::workspace_bytes`](crate::Plan::workspace_bytes)).
pub fn forward<C: Communicator + ?Sized>(
    comm: &C,
    plan: &Schedule,
    inputs: &RankInputs<'_>,
    ws: &mut Workspace,
) -> Result<Vec<f32>> {
    run_forward(comm, plan, inputs, ws, None)
}

/// The forward round loop; with `save`, received rows and routes land in the saved store and
/// every route's pre-activations are kept there (round j's routes from `route_start[j]`).
fn run_forward<C: Communicator + ?Sized>(
    comm: &C,
    plan: &Schedule,
    inputs: &RankInputs<'_>,
    ws: &mut Workspace,
    mut save: Option<&mut saved::Store<'_>>,
) -> Result<Vec<f32>> {
    let ctx = Ctx::new(comm, plan, inputs)?;
    ws.reset();
    let bufs = plan.buffers(ctx.me, Pass::Forward);
    let mut c = Carved::carve(ws, &bufs, plan.config().gemm_threads)?;
    ctx.build_tables(&mut c)?;
    ctx.fetch_foreign(c.foreign)?;
    let mut y = zeros(ctx.s.tokens * ctx.s.hidden);
    let (h, i, k) = (ctx.s.hidden, ctx.s.intermediate, ctx.s.top_k);
    let (mut row_base, mut route_base) = (0usize, 0usize);
    for j in 0..plan.rounds() {
        let set = &mut c.sets[j % bufs.depth()];
        let (send_counts, recv_counts) = ctx.round_counts(j);
        let sent = ctx.pack(&c.tables, j, inputs.x, set.send_x, Some(set.send_meta))?;
        let got: usize = recv_counts.iter().sum();
        let (recv_x, recv_meta, mut pre) = match save.as_deref_mut() {
            Some(st) => {
                let (x, meta, pre) = st.round(row_base, got, route_base)?;
                (x, meta, Some(pre))
            }
            None => (&mut set.recv_x[..got * h], &mut set.recv_meta[..got * k], None),
        };
        comm.all_to_all_v(&set.send_x[..sent * h], &scale(&send_counts, h), recv_x, &scale(&recv_counts, h))?;
        comm.all_to_all_v(
            &set.send_meta[..sent * k],
            &scale(&send_counts, k),
            recv_meta,
            &scale(&recv_counts, k),
        )?;
        let filled = group(recv_meta, k, bufs.local_slots(), c.groups, c.offsets)?;
        if let Some((gate, _)) = &pre
            && gate.len() < filled * i
        {
            return Err(Error::ScheduleMismatch {
                what: "routes computed on this rank (saved pre-activations)",
                planned: route_base + gate.len() / i.max(1),
                found: route_base + filled,
            });
        }
        set.out[..got * h].fill(0.0);
        let mut round = expert::ForwardRound { recv: recv_x, meta: recv_meta, out: set.out };
        let mut cursor = 0usize;
        for slot in 0..bufs.local_slots() {
            let entries = &c.groups[c.offsets[slot] as usize..c.offsets[slot + 1] as usize];
            for chunk in entries.chunks(bufs.expert_rows().max(1)) {
                let w = ctx.expert(c.foreign, slot);
                let span = cursor * i..(cursor + chunk.len()) * i;
                let keep = pre.as_mut().map(|(gate, up)| expert::SavedPre {
                    gate: &mut gate[span.clone()],
                    up: &mut up[span.clone()],
                });
                expert::forward(w, (h, i), chunk, &mut round, keep, &mut c.scratch)?;
                cursor += chunk.len();
            }
        }
        debug_assert_eq!(filled, cursor);
        row_base += got;
        route_base += filled;
        if let Some(st) = save.as_deref_mut() {
            st.route_start[j + 1] = route_base as u32;
        }
        comm.all_to_all_v(
            &set.out[..got * h],
            &scale(&recv_counts, h),
            &mut set.send_x[..sent * h],
            &scale(&send_counts, h),
        )?;
        ctx.scatter_rows(&c.tables, j, set.send_x, &mut y);
    }
    Ok(y)
}

/// The layer's backward on this rank, checkpointed: rounds in reverse, each re-dispatching x
/// and dY rows and recomputing its expert forward before its backward. Returns dX, the routing
/// weights' gradient and the native experts' weight gradients (foreign contributions included).
pub fn backward<C: Communicator + ?Sized>(
    comm: &C,
    plan: &Schedule,
    inputs: &RankInputs<'_>,
    dy: &[f32],
    ws: &mut Workspace,
) -> Result<Gradients> {
    let ctx = Ctx::new(comm, plan, inputs)?;
    check_len("dY (N·H)", ctx.s.tokens * ctx.s.hidden, dy.len())?;
    if plan.config().mode != Mode::Checkpointed {
        return Err(Error::invalid_config(
            "mode",
            plan.config().mode,
            "Mode::Checkpointed (SaveActivations runs through forward_saving and backward_saved)",
        ));
    }
    ws.reset();
    let bufs = plan.buffers(ctx.me, Pass::Backward);
    let mut c = Carved::carve(ws, &bufs, plan.config().gemm_threads)?;
    ctx.build_tables(&mut c)?;
    ctx.fetch_foreign(c.foreign)?;
    c.foreign_grad.fill(0.0);
    let (h, i, k) = (ctx.s.hidden, ctx.s.intermediate, ctx.s.top_k);
    let mut g = zero_gradients(&ctx.s);
    for j in (0..plan.rounds()).rev() {
        let set = &mut c.sets[j % bufs.depth()];
        let (send_counts, recv_counts) = ctx.round_counts(j);
        let sent = ctx.pack(&c.tables, j, inputs.x, set.send_x, Some(set.send_meta))?;
        ctx.pack(&c.tables, j, dy, set.send_dy, None)?;
        let got: usize = recv_counts.iter().sum();
        let (sh, rh) = (scale(&send_counts, h), scale(&recv_counts, h));
        let (sk, rk) = (scale(&send_counts, k), scale(&recv_counts, k));
        comm.all_to_all_v(&set.send_x[..sent * h], &sh, &mut set.recv_x[..got * h], &rh)?;
        comm.all_to_all_v(&set.send_dy[..sent * h], &sh, &mut set.recv_dy[..got * h], &rh)?;
        comm.all_to_all_v(&set.send_meta[..sent * k], &sk, &mut set.recv_meta[..got * k], &rk)?;
        group(&set.recv_meta[..got * k], k, bufs.local_slots(), c.groups, c.offsets)?;
        set.out[..got * h].fill(0.0);
        set.dw_out[..got * k].fill(0.0);
        let mut round = BackwardRound {
            recv_x: set.recv_x,
            recv_dy: set.recv_dy,
            meta: set.recv_meta,
            dx_rows: set.out,
            dw: set.dw_out,
        };
        for slot in 0..bufs.local_slots() {
            let entries = &c.groups[c.offsets[slot] as usize..c.offsets[slot + 1] as usize];
            for chunk in entries.chunks(bufs.expert_rows().max(1)) {
                let w = ctx.expert(c.foreign, slot);
                let grad = expert_grad(&ctx.s, slot, &mut g, c.foreign_grad);
                expert::backward(w, grad, (h, i), chunk, &mut round, &mut c.scratch)?;
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

pub(crate) fn scale(counts: &[usize], width: usize) -> Vec<usize> {
    counts.iter().map(|&c| c * width).collect()
}

fn check_world<C: Communicator + ?Sized>(comm: &C, shape: &Shape) -> Result<()> {
    check_world_size(comm.world_size(), shape)
}

/// The group size against the shape's ranks.
pub(crate) fn check_world_size(world: usize, shape: &Shape) -> Result<()> {
    if world != shape.ranks {
        return Err(Error::ScheduleMismatch { what: "ranks", planned: shape.ranks, found: world });
    }
    Ok(())
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
    Ok(offsets[slots] as usize)
}

/// The buffers of one call, carved in the order of [`Buffers::regions`].
struct Carved<'w> {
    tables: Tables<'w>,
    foreign: &'w mut [f32],
    foreign_grad: &'w mut [f32],
    grad_return: &'w mut [f32],
    sets: Vec<RoundSet<'w>>,
    groups: &'w mut [GroupEntry],
    offsets: &'w mut [u32],
    scratch: Scratch<'w>,
}

struct RoundSet<'w> {
    send_x: &'w mut [f32],
    recv_x: &'w mut [f32],
    out: &'w mut [f32],
    send_meta: &'w mut [RouteMeta],
    recv_meta: &'w mut [RouteMeta],
    send_dy: &'w mut [f32],
    recv_dy: &'w mut [f32],
    dw_out: &'w mut [f32],
    dw_back: &'w mut [f32],
}

impl<'w> Carved<'w> {
    fn carve(ws: &'w Workspace, b: &Buffers, threads: Threads) -> Result<Self> {
        let s = b.shape();
        let (n, h, i, k) = (s.tokens, s.hidden, s.intermediate, s.top_k);
        let bwd = b.pass() == Pass::Backward;
        let maybe = |len: usize| if bwd { ws.take::<f32>(len) } else { Ok(<&mut [f32]>::default()) };
        let tables =
            Tables { dest: ws.take(n * k)?, row_tokens: ws.take(n * k)?, row_start: ws.take(s.ranks + 1)? };
        let foreign = ws.take(b.foreign_slots() * s.expert_elems())?;
        let foreign_grad = maybe(b.foreign_slots() * s.expert_elems())?;
        let grad_return = maybe(h * i)?;
        let mut sets = Vec::with_capacity(b.depth());
        for _ in 0..b.depth() {
            let (send_x, recv_x, out) =
                (ws.take(b.send_rows() * h)?, ws.take(b.recv_rows() * h)?, ws.take(b.recv_rows() * h)?);
            let (send_meta, recv_meta) = (ws.take(b.send_rows() * k)?, ws.take(b.recv_rows() * k)?);
            let (send_dy, recv_dy) = (maybe(b.send_rows() * h)?, maybe(b.recv_rows() * h)?);
            let (dw_out, dw_back) = (maybe(b.recv_rows() * k)?, maybe(b.send_rows() * k)?);
            sets.push(RoundSet {
                send_x,
                recv_x,
                out,
                send_meta,
                recv_meta,
                send_dy,
                recv_dy,
                dw_out,
                dw_back,
            });
        }
        let g = b.expert_rows();
        let groups = ws.take(b.recv_rows() * k)?;
        let offsets = ws.take(b.local_slots() + 1)?;
        let (x, y, gate, up) = (ws.take(g * h)?, ws.take(g * h)?, ws.take(g * i)?, ws.take(g * i)?);
        let (dy, hbuf) = (maybe(g * h)?, maybe(g * i)?);
        let scratch = Scratch { threads, x, y, gate, up, dy, h: hbuf };
        Ok(Self { tables, foreign, foreign_grad, grad_return, sets, groups, offsets, scratch })
    }
}

/// One call's fixed context: the group, the plan, this rank's inputs.
struct Ctx<'a, C: ?Sized> {
    comm: &'a C,
    plan: &'a Schedule,
    inputs: &'a RankInputs<'a>,
    s: Shape,
    me: usize,
}

impl<'a, C: Communicator + ?Sized> Ctx<'a, C> {
    fn new(comm: &'a C, plan: &'a Schedule, inputs: &'a RankInputs<'a>) -> Result<Self> {
        let s = check_call_shape(plan, comm.world_size())?;
        inputs.validate(&s)?;
        let me = comm.rank();
        check_planned_counts(plan, me, inputs.routing.ids)?;
        Ok(Self { comm, plan, inputs, s, me })
    }

    /// Route → compute rank, and the per-destination row lists (tokens ascending).
    fn build_tables(&self, c: &mut Carved<'_>) -> Result<()> {
        build_tables(self.plan, self.me, self.inputs.routing.ids, &mut c.tables)
    }

    /// Rows this rank sends each destination, and receives from each source, in round j.
    fn round_counts(&self, j: usize) -> (Vec<usize>, Vec<usize>) {
        round_counts(self.plan, self.me, j)
    }

    /// Gathers round j's rows of `src` (N×H) into `dst`, destination-major; with `meta`, also
    /// each row's routes there (local slot, weight), padded to k. Returns the row count.
    fn pack(
        &self,
        t: &Tables<'_>,
        j: usize,
        src: &[f32],
        dst: &mut [f32],
        meta: Option<&mut [RouteMeta]>,
    ) -> Result<usize> {
        let (h, k) = (self.s.hidden, self.s.top_k);
        let a = self.plan.assignment();
        let routing = &self.inputs.routing;
        let mut meta = meta;
        let mut o = 0usize;
        for d in 0..self.s.ranks {
            let start = t.row_start[d] as usize;
            for r in self.plan.round_row_indices(self.me, d, j) {
                let i = t.row_tokens[start + r] as usize;
                dst[o * h..(o + 1) * h].copy_from_slice(&src[i * h..(i + 1) * h]);
                if let Some(meta) = meta.as_deref_mut() {
                    let row = &mut meta[o * k..(o + 1) * k];
                    row.fill(RouteMeta::EMPTY);
                    row_routes(a, routing, t.dest, (i, d, k), |m, _, route| row[m] = route)?;
                }
                o += 1;
            }
        }
        Ok(o)
    }

    /// `acc[token] += row` for every row of round j coming back, in send order.
    fn scatter_rows(&self, t: &Tables<'_>, j: usize, rows: &[f32], acc: &mut [f32]) {
        let h = self.s.hidden;
        let mut o = 0usize;
        for d in 0..self.s.ranks {
            let start = t.row_start[d] as usize;
            for r in self.plan.round_row_indices(self.me, d, j) {
                let i = t.row_tokens[start + r] as usize;
                for (a, v) in acc[i * h..(i + 1) * h].iter_mut().zip(&rows[o * h..(o + 1) * h]) {
                    *a += v;
                }
                o += 1;
            }
        }
    }

    /// `d_weights[i, jj] = dw` for every route of round j, matching the packing order.
    fn scatter_weights(&self, t: &Tables<'_>, j: usize, dw: &[f32], d_weights: &mut [f32]) {
        let k = self.s.top_k;
        let mut o = 0usize;
        for d in 0..self.s.ranks {
            let start = t.row_start[d] as usize;
            for r in self.plan.round_row_indices(self.me, d, j) {
                let i = t.row_tokens[start + r] as usize;
                for (m, jj) in (0..k).filter(|&jj| t.dest[i * k + jj] as usize == d).enumerate() {
                    d_weights[i * k + jj] = dw[o * k + m];
                }
                o += 1;
            }
        }
    }

    /// Local expert `slot`'s weights: native from the inputs, foreign from the fetched slots.
    fn expert<'b>(&'b self, foreign: &'b [f32], slot: usize) -> ExpertRef<'b> {
        let hi = self.s.hidden * self.s.intermediate;
        let m = self.s.local_experts();
        if slot < m {
            let w = &self.inputs.experts;
            ExpertRef {
                gate: &w.gate[slot * hi..][..hi],
                up: &w.up[slot * hi..][..hi],
                down: &w.down[slot * hi..][..hi],
            }
        } else {
            let f = &foreign[(slot - m) * 3 * hi..][..3 * hi];
            ExpertRef { gate: &f[..hi], up: &f[hi..2 * hi], down: &f[2 * hi..] }
        }
    }

    /// Owners send each transferred expert's weights; helpers receive them into their slots.
    fn fetch_foreign(&self, foreign: &mut [f32]) -> Result<()> {
        let hi = self.s.hidden * self.s.intermediate;
        let m = self.s.local_experts();
        let transfers = self.plan.assignment().transfers();
        for t in transfers.iter().filter(|t| t.owner == self.me) {
            let w = self.expert(foreign, t.expert - self.me * m);
            for part in [w.gate, w.up, w.down] {
                self.comm.send(t.helper, part)?;
            }
        }
        for t in transfers.iter().filter(|t| t.helper == self.me) {
            let dst = &mut foreign[t.slot * 3 * hi..][..3 * hi];
            for part in dst.chunks_exact_mut(hi) {
                self.comm.recv(t.owner, part)?;
            }
        }
        Ok(())
    }

    /// Helpers send foreign experts' gradients home; owners add them, in transfer order.
    fn return_foreign_grads(&self, grads: &[f32], buf: &mut [f32], g: &mut Gradients) -> Result<()> {
        let hi = self.s.hidden * self.s.intermediate;
        let m = self.s.local_experts();
        let transfers = self.plan.assignment().transfers();
        for t in transfers.iter().filter(|t| t.helper == self.me) {
            for part in grads[t.slot * 3 * hi..][..3 * hi].chunks_exact(hi) {
                self.comm.send(t.owner, part)?;
            }
        }
        for t in transfers.iter().filter(|t| t.owner == self.me) {
            let local = t.expert - self.me * m;
            for dst in [&mut g.d_gate, &mut g.d_up, &mut g.d_down] {
                self.comm.recv(t.helper, buf)?;
                for (a, v) in dst[local * hi..][..hi].iter_mut().zip(buf.iter()) {
                    *a += v;
                }
            }
        }
        Ok(())
    }
}
