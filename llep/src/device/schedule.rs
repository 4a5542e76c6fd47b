//! The layer's passes over [`DeviceOps`]: forward, checkpointed backward, and the saving
//! forward and backward from saved activations of [`Mode::SaveActivations`]. Each reserves the
//! plan's [`Buffers`](crate::Buffers) for its pass once, up front (`reserve`), and runs its
//! rounds through the pipeline (`pipeline`); the expert math is in `expert`.

use flatpeak_common::Workspace;

use super::expert::{self, GroupIo, KeepPre, expert_at, grad_at};
use super::host::{check_call, dw_lists, group, iota, round_lists, scale, tables};
use super::pipeline::{Dispatcher, Issued, MetaHost, RoundSet, Sends, pipelined};
use super::reserve::Reserved;
use super::{DeviceGradients, DeviceInputs, DeviceOps, IndexedRows, Store, need};
use crate::config::{Mode, Shape, WeightLayout};
use crate::error::{Error, Result};
use crate::plan::{Buffers, Pass, RouteMeta};
use crate::route_tables::{Tables, round_counts};
use crate::schedule::Schedule;

fn check_inputs<O: DeviceOps>(
    ops: &O,
    (s, layout): (&Shape, WeightLayout),
    inputs: &DeviceInputs<'_, O::Buf>,
) -> Result<()> {
    let [gate, up, down] = layout.native_lens(s);
    for (what, buf) in
        [("x", inputs.x), ("W_gate", inputs.gate), ("W_up", inputs.up), ("W_down", inputs.down)]
    {
        if ops.buf_len(buf) == 0 {
            continue; // an empty buffer has no dtype to check (W_up under the Linear layout)
        }
        let found = ops.buf_dtype(buf);
        if found != s.dtype {
            return Err(Error::DtypeMismatch { what, expected: s.dtype, found });
        }
    }
    need("x (N·H)", s.tokens * s.hidden, ops.buf_len(inputs.x))?;
    need("W_gate (M·H·I; gate_up M·2I·H in the Linear layout)", gate, ops.buf_len(inputs.gate))?;
    need("W_up (M·H·I; empty in the Linear layout)", up, ops.buf_len(inputs.up))?;
    need("W_down (M·I·H)", down, ops.buf_len(inputs.down))
}

/// What a pass from (or into) the saved-activation store asks of the plan's mode.
const SAVING: &str = "Mode::SaveActivations (a checkpointed plan's passes keep no store)";
const CHECKPOINTED: &str =
    "Mode::Checkpointed (a SaveActivations plan's backward reads the saving forward's store)";

fn check_mode(plan: &Schedule, mode: Mode, how: &'static str) -> Result<()> {
    if plan.config().mode == mode {
        Ok(())
    } else {
        Err(Error::invalid_config("mode", plan.config().mode, how))
    }
}

/// Owners send each transferred expert's weights to its helper's foreign slot: per transfer and
/// part, one all-to-all in which only the owner sends (every rank takes part).
fn fetch_foreign<O: DeviceOps>(
    ops: &O,
    plan: &Schedule,
    inputs: &DeviceInputs<'_, O::Buf>,
    foreign: &mut O::Buf,
) -> Result<()> {
    let s = plan.shape();
    let (hi, m, p, me) = (s.hidden * s.intermediate, s.local_experts(), s.ranks, ops.rank());
    let (tensors, layout) = ([inputs.gate, inputs.up, inputs.down], plan.config().weight_layout);
    for t in plan.assignment().transfers() {
        for part in 0..3 {
            // Each part is H·I contiguous elements in either layout.
            let (tensor, native_at) = layout.part_at(s, t.expert.saturating_sub(me * m), part);
            let src = tensors[tensor];
            let (mut sc, mut rc) = (vec![0; p], vec![0; p]);
            let (mut send_at, mut recv_at) = (0, 0);
            if t.owner == me {
                sc[t.helper] = hi;
                send_at = native_at;
            }
            if t.helper == me {
                rc[t.owner] = hi;
                recv_at = t.slot * 3 * hi + part * hi;
            }
            ops.all_to_all_v((src, send_at), &sc, (&mut *foreign, recv_at), &rc)?;
        }
    }
    Ok(())
}

/// Helpers send foreign experts' gradients home (per transfer and part, one all-to-all); owners
/// add them to their native gradients, in transfer order.
fn return_foreign_grads<O: DeviceOps>(
    ops: &O,
    plan: &Schedule,
    c: &mut Reserved<'_, O::Buf, O::Index>,
    g: &mut DeviceGradients<O::Buf>,
) -> Result<()> {
    let s = plan.shape();
    let (hi, m, p, me) = (s.hidden * s.intermediate, s.local_experts(), s.ranks, ops.rank());
    let layout = plan.config().weight_layout;
    for t in plan.assignment().transfers() {
        for part in 0..3 {
            // The part's H·I elements are row `native_at / H·I` of its tensor, as rows of H·I.
            let (tensor, native_at) = layout.part_at(s, t.expert.saturating_sub(me * m), part);
            let dst = [&mut g.d_gate, &mut g.d_up, &mut g.d_down]
                .into_iter()
                .nth(tensor)
                .ok_or(Error::internal("a weight part in one of three tensors"))?;
            let (mut sc, mut rc) = (vec![0; p], vec![0; p]);
            let mut send_at = 0;
            if t.helper == me {
                sc[t.owner] = hi;
                send_at = t.slot * 3 * hi + part * hi;
            }
            if t.owner == me {
                rc[t.helper] = hi;
            }
            ops.all_to_all_v((&c.foreign_grad, send_at), &sc, (&mut c.grad_return, 0), &rc)?;
            if t.owner == me {
                ops.write_index(&[(native_at / hi) as u32], &mut c.one)?;
                ops.scatter_add_rows(IndexedRows::new(&c.grad_return, &c.one, 1, hi), dst)?;
            }
        }
    }
    Ok(())
}

/// Round j's first row in the saved store: rows received in rounds before j.
fn row_starts(plan: &Schedule, me: usize) -> Vec<usize> {
    let mut starts = Vec::with_capacity(plan.rounds() + 1);
    let mut at = 0usize;
    starts.push(at);
    for j in 0..plan.rounds() {
        at += round_counts(plan, me, j).1.iter().sum::<usize>();
        starts.push(at);
    }
    starts
}

/// `store[at·width..(at + len)·width]` is there, or [`Error::ScheduleMismatch`] naming `what`.
fn store_holds(len_elems: usize, width: usize, (at, len): (usize, usize), what: &'static str) -> Result<()> {
    let held = len_elems / width.max(1);
    if at + len <= held {
        Ok(())
    } else {
        Err(Error::ScheduleMismatch { what, planned: held, found: at + len })
    }
}

/// The saved-activation store as a pass uses it (the saving forward writes it, the backward
/// from it reads it), but for its metadata, which goes to the pipeline.
struct Saved<'a, B> {
    x: &'a mut B,
    pre: &'a mut B,
    route_start: &'a mut [u32],
    /// Round j's first row of `x` (and of the metadata).
    row_start: Vec<usize>,
}

impl<'a, B> Saved<'a, B> {
    /// Splits `store` into its metadata and the rest, after checking it has the plan's K + 1
    /// round starts.
    fn open(plan: &Schedule, me: usize, store: &'a mut Store<'_, B>) -> Result<(&'a mut [RouteMeta], Self)> {
        let row_start = row_starts(plan, me);
        let rounds = (0, plan.rounds() + 1);
        store_holds(store.route_start.len(), 1, rounds, "rounds of the saved-activation store")?;
        let Store { x, meta, pre, route_start } = store;
        Ok((&mut **meta, Self { x, pre, route_start, row_start }))
    }

    /// Round `round`'s first route and first row in the store, after checking that its `routes`
    /// routes' pre-activations and its received rows are there.
    fn round_at<O: DeviceOps<Buf = B>>(
        &self,
        ops: &O,
        s: &Shape,
        round: &Issued,
        routes: usize,
    ) -> Result<(usize, usize)> {
        let (cursor, row) = (self.route_start[round.round] as usize, self.row_start[round.round]);
        let what = "routes computed on this rank (saved pre-activations)";
        store_holds(ops.buf_len(self.pre), 2 * s.intermediate, (cursor, routes), what)?;
        let rows = (row, round.got());
        store_holds(ops.buf_len(self.x), s.hidden, rows, "rows of the saved-activation store")?;
        Ok((cursor, row))
    }
}

/// What a pass sets up before its rounds: the call's shape, the plan's buffers for the pass, the
/// route tables, and every buffer reserved (the foreign experts fetched into theirs).
struct SetUp<'h, O: DeviceOps> {
    me: usize,
    s: Shape,
    bufs: Buffers,
    t: Tables<'h>,
    c: Reserved<'h, O::Buf, O::Index>,
}

/// Checks the call (and `dy`, where given) and sets up pass `pass`.
fn set_up<'h, O: DeviceOps>(
    ops: &O,
    host: &'h Workspace,
    plan: &Schedule,
    inputs: &DeviceInputs<'_, O::Buf>,
    pass: Pass,
    dy: Option<&O::Buf>,
) -> Result<SetUp<'h, O>> {
    let me = ops.rank();
    let s = check_call(plan, me, ops.world_size(), &inputs.routing)?;
    check_inputs(ops, (&s, plan.config().weight_layout), inputs)?;
    if let Some(dy) = dy {
        need("dY (N·H)", s.tokens * s.hidden, ops.buf_len(dy))?;
    }
    let bufs = plan.buffers(me, pass);
    ops.fence()?;
    let t = tables(plan, me, &inputs.routing, host)?;
    let mut c = Reserved::new(ops, host, &bufs)?;
    fetch_foreign(ops, plan, inputs, &mut c.foreign)?;
    Ok(SetUp { me, s, bufs, t, c })
}

/// A round's groups, slot by slot, in chunks of at most `chunk_rows` routes: `(slot, start,
/// rows)`, the chunk being routes `start..start + rows` of the round's grouped lists.
fn slot_chunks(
    offsets: &[u32],
    slots: usize,
    chunk_rows: usize,
) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    (0..slots).flat_map(move |slot| {
        let (start, end) = (offsets[slot] as usize, offsets[slot + 1] as usize);
        (start..end).step_by(chunk_rows).map(move |at| (slot, at, chunk_rows.min(end - at)))
    })
}

/// The layer's forward on this rank: `y_i = Σ_j w_ij·FFN_{e_ij}(x_i)`, N×H fp32 (a new
/// output buffer). Reserves the plan's forward [`Buffers`](crate::Buffers): the host regions
/// from `host` (reset by the caller), the device ones through `ops`. Round j+1's dispatch is
/// issued before round j's experts (two or more buffer copies; the issue order is in the
/// `pipeline` module).
///
/// With `store` `None` it keeps nothing for backward. With a store (the plan in
/// [`Mode::SaveActivations`]) it keeps every round's received rows, routes and pre-activations
/// there, laid out as [`Schedule::saved_regions`], for [`backward`] to read; y is bitwise the
/// same either way.
pub fn forward<O: DeviceOps>(
    ops: &O,
    host: &Workspace,
    plan: &Schedule,
    inputs: &DeviceInputs<'_, O::Buf>,
    store: Option<&mut Store<'_, O::Buf>>,
) -> Result<O::Buf> {
    if store.is_some() {
        check_mode(plan, Mode::SaveActivations, SAVING)?;
    }
    let SetUp { me, s, bufs, t, mut c } = set_up(ops, host, plan, inputs, Pass::Forward, None)?;
    let (h, i, k) = (s.hidden, s.intermediate, s.top_k);
    let mut y = ops.alloc_output(s.tokens * h)?;
    let order: Vec<usize> = (0..plan.rounds()).collect();
    let Reserved { sets, foreign, scratch, groups, offsets, lists, staging, staging_slots, .. } = &mut c;
    let (meta_host, mut keep) = match store {
        Some(st) => {
            let (meta, keep) = Saved::open(plan, me, st)?;
            keep.route_start[0] = 0;
            (MetaHost::Store { meta, row_start: keep.row_start.clone(), download: true }, Some(keep))
        }
        None => (MetaHost::Staging { meta: staging, slots: *staging_slots, len: bufs.recv_rows() * k }, None),
    };
    let (slots, chunk_rows) = (bufs.local_slots(), bufs.expert_rows().max(1));
    let foreign = &*foreign;
    let run = |_: &mut O::Buf,
               sets: &mut [RoundSet<O::Buf, O::Index>],
               round: &Issued,
               meta: &[RouteMeta]| {
        let set = &mut sets[round.set];
        let got = round.got();
        let filled = group(meta, k, slots, groups, offsets)?;
        let mut cursor = 0usize;
        if let Some(kp) = keep.as_mut() {
            let row;
            (cursor, row) = kp.round_at(ops, &s, round, filled)?;
            ops.copy((&set.recv_x, 0), (&mut *kp.x, row * h), got * h)?;
        }
        ops.zero(&mut set.out, got * h)?;
        round_lists(ops, &groups[..filled], meta, (&mut lists.rows, &mut lists.weights, None))?;
        for (slot, start, n) in slot_chunks(offsets, slots, chunk_rows) {
            ops.gather_rows(IndexedRows::new(&set.recv_x, &lists.rows, n, h).from(start), &mut scratch.x)?;
            let w = expert_at((&s, plan.config().weight_layout), inputs, foreign, slot);
            let pre = keep.as_mut().map(|kp| KeepPre { pre: &mut *kp.pre, cursor });
            expert::forward(ops, w, (h, i), n, scratch, pre)?;
            ops.scatter_add_rows(
                IndexedRows::new(&scratch.x, &lists.rows, n, h).scaled(&lists.weights).from(start),
                &mut set.out,
            )?;
            cursor += n;
        }
        if let Some(kp) = keep.as_mut() {
            kp.route_start[round.round + 1] = cursor as u32;
        }
        let (sh, rh) = (scale(&round.send_counts, h), scale(&round.recv_counts, h));
        ops.all_to_all_v((&set.out, 0), &rh, (&mut set.send_x, 0), &sh)
    };
    let finish = |y: &mut O::Buf, sets: &mut [RoundSet<O::Buf, O::Index>], round: &Issued| {
        let set = &sets[round.set];
        ops.scatter_add_rows(IndexedRows::new(&set.send_x, &set.send_tokens, round.sent, h), y)
    };
    let d = Dispatcher { ops, plan, tables: &t, inputs, dy: None, sends: Sends::X };
    pipelined(&d, &order, sets, meta_host, &mut y, run, finish)?;
    ops.fence()?;
    Ok(y)
}

/// The layer's backward on this rank. Returns dX, the routing weights' gradient and the native
/// experts' weight gradients (foreign contributions returned and added), in new output
/// buffers. Reserves the plan's backward [`Buffers`](crate::Buffers) as [`forward`] does; the
/// next round's dispatch is issued before this round's experts.
///
/// With `store` `None` (a [`Mode::Checkpointed`] plan) it runs the rounds in reverse, each
/// re-dispatching x and dY rows and recomputing its expert forward before its backward. With
/// the store a saving [`forward`] filled (a [`Mode::SaveActivations`] plan) each round
/// dispatches dY rows only (x rows and routes are in the store), then runs every group's
/// backward from its saved pre-activations (six GEMMs, no recompute).
pub fn backward<O: DeviceOps>(
    ops: &O,
    host: &Workspace,
    plan: &Schedule,
    inputs: &DeviceInputs<'_, O::Buf>,
    dy: &O::Buf,
    store: Option<&mut Store<'_, O::Buf>>,
) -> Result<DeviceGradients<O::Buf>> {
    match store {
        Some(_) => check_mode(plan, Mode::SaveActivations, SAVING)?,
        None => check_mode(plan, Mode::Checkpointed, CHECKPOINTED)?,
    }
    let SetUp { me, s, bufs, t, mut c } = set_up(ops, host, plan, inputs, Pass::Backward, Some(dy))?;
    ops.zero(&mut c.foreign_grad, bufs.foreign_slots() * s.expert_elems())?;
    let (n, h, i, k) = (s.tokens, s.hidden, s.intermediate, s.top_k);
    let [gate, up, down] = plan.config().weight_layout.native_lens(&s);
    let mut g = DeviceGradients {
        dx: ops.alloc_output(n * h)?,
        d_weights: ops.alloc_output(n * k)?,
        d_gate: ops.alloc_output(gate)?,
        d_up: ops.alloc_output(up)?,
        d_down: ops.alloc_output(down)?,
    };
    let order: Vec<usize> = (0..plan.rounds()).rev().collect();
    {
        let Reserved {
            sets,
            foreign,
            foreign_grad,
            scratch,
            groups,
            offsets,
            lists,
            staging,
            staging_slots,
            dw_src,
            dw_dst,
            dw_gathered,
            ..
        } = &mut c;
        // The identity index of a group's rows (scaling them in place order), once a call.
        iota(ops, &mut lists.seq, bufs.expert_rows())?;
        let (meta_host, saved, sends) = match store {
            Some(st) => {
                let (meta, saved) = Saved::open(plan, me, st)?;
                let host = MetaHost::Store { meta, row_start: saved.row_start.clone(), download: false };
                (host, Some(saved), Sends::Dy)
            }
            None => {
                let len = bufs.recv_rows() * k;
                (MetaHost::Staging { meta: staging, slots: *staging_slots, len }, None, Sends::XAndDy)
            }
        };
        let (slots, chunk_rows) = (bufs.local_slots(), bufs.expert_rows().max(1));
        let foreign = &*foreign;
        let run = |g: &mut DeviceGradients<O::Buf>,
                   sets: &mut [RoundSet<O::Buf, O::Index>],
                   round: &Issued,
                   meta: &[RouteMeta]| {
            let set = &mut sets[round.set];
            let got = round.got();
            let filled = group(meta, k, slots, groups, offsets)?;
            let mut cursor = 0usize;
            if let Some(sv) = &saved {
                let j = round.round;
                let (start, end) = (sv.route_start[j] as usize, sv.route_start[j + 1] as usize);
                if filled != end.saturating_sub(start) {
                    let planned = end.saturating_sub(start);
                    return Err(Error::ScheduleMismatch {
                        what: "routes of a saved round",
                        planned,
                        found: filled,
                    });
                }
                let row;
                (cursor, row) = sv.round_at(ops, &s, round, filled)?;
                ops.copy((&*sv.x, row * h), (&mut set.recv_x, 0), got * h)?;
            }
            ops.zero(&mut set.out, got * h)?;
            ops.zero(&mut set.dw_out, got * k)?;
            let lists_of_round = (&mut lists.rows, &mut lists.weights, Some(&mut lists.meta));
            round_lists(ops, &groups[..filled], meta, lists_of_round)?;
            for (slot, start, rows) in slot_chunks(offsets, slots, chunk_rows) {
                ops.gather_rows(
                    IndexedRows::new(&set.recv_x, &lists.rows, rows, h).from(start),
                    &mut scratch.x,
                )?;
                let w = expert_at((&s, plan.config().weight_layout), inputs, foreign, slot);
                let grad = grad_at((&s, plan.config().weight_layout), g, foreign_grad, slot);
                let io = GroupIo::<O> {
                    recv_dy: &set.recv_dy,
                    dx_rows: &mut set.out,
                    dw: &mut set.dw_out,
                    lists: &*lists,
                    start,
                };
                match &saved {
                    Some(sv) => {
                        let pre = &*sv.pre;
                        expert::backward_saved(ops, w, grad, (h, i), (rows, cursor), pre, io, scratch)?
                    }
                    None => expert::backward(ops, w, grad, (h, i), rows, io, scratch)?,
                }
                cursor += rows;
            }
            let (sh, rh) = (scale(&round.send_counts, h), scale(&round.recv_counts, h));
            let (sk, rk) = (scale(&round.send_counts, k), scale(&round.recv_counts, k));
            ops.all_to_all_v((&set.out, 0), &rh, (&mut set.send_x, 0), &sh)?;
            ops.all_to_all_v((&set.dw_out, 0), &rk, (&mut set.dw_back, 0), &sk)
        };
        let finish = |g: &mut DeviceGradients<O::Buf>,
                      sets: &mut [RoundSet<O::Buf, O::Index>],
                      round: &Issued| {
            let set = &sets[round.set];
            ops.scatter_add_rows(IndexedRows::new(&set.send_x, &set.send_tokens, round.sent, h), &mut g.dx)?;
            let call = (plan, me, &t, &inputs.routing);
            let routes = dw_lists(ops, call, round.round, (&mut *dw_src, &mut *dw_dst))?;
            ops.gather_rows(IndexedRows::new(&set.dw_back, dw_src, routes, 1), dw_gathered)?;
            ops.scatter_add_rows(IndexedRows::new(dw_gathered, dw_dst, routes, 1), &mut g.d_weights)
        };
        let d = Dispatcher { ops, plan, tables: &t, inputs, dy: Some(dy), sends };
        pipelined(&d, &order, sets, meta_host, &mut g, run, finish)?;
    }
    return_foreign_grads(ops, plan, &mut c, &mut g)?;
    ops.fence()?;
    Ok(g)
}
