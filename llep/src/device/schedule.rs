//! The round schedule over [`DeviceOps`]: the CPU executor's forward and checkpointed backward
//! (`crate::cpu`), step for step, with device buffers reserved once per call at the plan's
//! [`Buffers`] sizes.

use flatpeak_common::gemm::Accumulate;

use super::host::{GroupLists, tables};
use super::pipeline::{Issued, RoundSet, dispatch, pipelined};
use super::{DeviceGradients, DeviceInputs, DeviceOps, GemmDims, Operand, need};
use crate::config::{Mode, Shape};
use crate::cpu::{group, scale};
use crate::error::{Error, Result};
use crate::plan::{Buffers, GroupEntry, Pass, RouteMeta};
use crate::schedule::Schedule;

/// The expert scratch of G rows: X, Y (and dY) G×H; gate, up, h G×I; the G routes' dots.
#[derive(Debug)]
struct Scratch<B> {
    x: B,
    y: B,
    dy: B,
    gate: B,
    up: B,
    h: B,
    dots: B,
}

/// Every device buffer of one call, reserved up front from [`Buffers`], and the host-side
/// grouping arrays.
#[derive(Debug)]
struct Reserved<B, I> {
    foreign: B,
    foreign_grad: B,
    grad_return: B,
    sets: Vec<RoundSet<B, I>>,
    group_rows: I,
    group_meta: I,
    group_weights: B,
    dw_src: I,
    dw_dst: I,
    dw_gathered: B,
    one: I,
    scratch: Scratch<B>,
    groups: Vec<GroupEntry>,
    offsets: Vec<u32>,
}

impl<B, I> Reserved<B, I> {
    fn new<O: DeviceOps<Buf = B, Index = I>>(ops: &O, b: &Buffers) -> Result<Self> {
        let s = b.shape();
        let (h, i, k) = (s.hidden, s.intermediate, s.top_k);
        let bwd = b.pass() == Pass::Backward;
        let maybe = |len: usize| ops.alloc(if bwd { len } else { 0 });
        let maybe_index = |len: usize| ops.alloc_index(if bwd { len } else { 0 });
        let (sr, rr, g) = (b.send_rows(), b.recv_rows(), b.expert_rows());
        let mut sets = Vec::with_capacity(b.depth());
        for _ in 0..b.depth() {
            sets.push(RoundSet {
                send_tokens: ops.alloc_index(sr)?,
                send_x: ops.alloc(sr * h)?,
                recv_x: ops.alloc(rr * h)?,
                out: ops.alloc(rr * h)?,
                send_meta: ops.alloc_index(sr * k * 2)?,
                recv_meta: ops.alloc_index(rr * k * 2)?,
                send_dy: maybe(sr * h)?,
                recv_dy: maybe(rr * h)?,
                dw_out: maybe(rr * k)?,
                dw_back: maybe(sr * k)?,
            });
        }
        Ok(Self {
            foreign: ops.alloc(b.foreign_slots() * s.expert_elems())?,
            foreign_grad: maybe(b.foreign_slots() * s.expert_elems())?,
            grad_return: maybe(h * i)?,
            sets,
            group_rows: ops.alloc_index(g)?,
            group_meta: maybe_index(g)?,
            group_weights: ops.alloc(g)?,
            dw_src: maybe_index(sr * k)?,
            dw_dst: maybe_index(sr * k)?,
            dw_gathered: maybe(sr * k)?,
            one: ops.alloc_index(1)?,
            scratch: Scratch {
                x: ops.alloc(g * h)?,
                y: ops.alloc(g * h)?,
                dy: maybe(g * h)?,
                gate: ops.alloc(g * i)?,
                up: ops.alloc(g * i)?,
                h: ops.alloc(g * i)?,
                dots: maybe(g)?,
            },
            groups: vec![GroupEntry { row: 0, meta: 0 }; rr * k],
            offsets: vec![0; b.local_slots() + 1],
        })
    }
}

/// Local expert `slot`'s weights: (buffer, offset) of W_gate, W_up (H×I) and W_down (I×H).
#[derive(Debug)]
struct ExpertAt<'a, B> {
    gate: (&'a B, usize),
    up: (&'a B, usize),
    down: (&'a B, usize),
}

impl<B> Clone for ExpertAt<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for ExpertAt<'_, B> {}

fn expert_at<'a, B>(s: &Shape, inputs: &DeviceInputs<'a, B>, foreign: &'a B, slot: usize) -> ExpertAt<'a, B> {
    let hi = s.hidden * s.intermediate;
    let m = s.local_experts();
    if slot < m {
        ExpertAt {
            gate: (inputs.gate, slot * hi),
            up: (inputs.up, slot * hi),
            down: (inputs.down, slot * hi),
        }
    } else {
        let o = (slot - m) * 3 * hi;
        ExpertAt { gate: (foreign, o), up: (foreign, o + hi), down: (foreign, o + 2 * hi) }
    }
}

/// Where local expert `slot`'s weight gradients accumulate: the native gradients or the
/// foreign slot's gradient buffer (returned home at the end).
enum GradAt<'a, B> {
    Native { parts: [&'a mut B; 3], offset: usize },
    Foreign { buf: &'a mut B, offset: usize, hi: usize },
}

impl<B> GradAt<'_, B> {
    /// Part 0 (W_gate), 1 (W_up) or 2 (W_down): buffer and offset.
    fn part(&mut self, part: usize) -> (&mut B, usize) {
        match self {
            GradAt::Native { parts, offset } => (&mut *parts[part], *offset),
            GradAt::Foreign { buf, offset, hi } => (&mut **buf, *offset + part * *hi),
        }
    }
}

fn grad_at<'a, B>(
    s: &Shape,
    g: &'a mut DeviceGradients<B>,
    foreign_grad: &'a mut B,
    slot: usize,
) -> GradAt<'a, B> {
    let hi = s.hidden * s.intermediate;
    let m = s.local_experts();
    if slot < m {
        GradAt::Native { parts: [&mut g.d_gate, &mut g.d_up, &mut g.d_down], offset: slot * hi }
    } else {
        GradAt::Foreign { buf: foreign_grad, offset: (slot - m) * 3 * hi, hi }
    }
}

/// `gate ← X·W_gate`, `up ← X·W_up`, `h ← silu(gate) ⊙ up`, `y ← h·W_down` for `n` rows of the
/// scratch.
fn expert_forward<O: DeviceOps>(
    ops: &O,
    w: ExpertAt<'_, O::Buf>,
    (h, i): (usize, usize),
    n: usize,
    sc: &mut Scratch<O::Buf>,
) -> Result<()> {
    let proj = GemmDims { m: n, n: i, k: h };
    ops.gemm(
        proj,
        Operand::plain(&sc.x, 0),
        Operand::plain(w.gate.0, w.gate.1),
        &mut sc.gate,
        0,
        Accumulate::Replace,
    )?;
    ops.gemm(
        proj,
        Operand::plain(&sc.x, 0),
        Operand::plain(w.up.0, w.up.1),
        &mut sc.up,
        0,
        Accumulate::Replace,
    )?;
    ops.swiglu(&sc.gate, &sc.up, n * i, &mut sc.h)?;
    let down = GemmDims { m: n, n: h, k: i };
    ops.gemm(
        down,
        Operand::plain(&sc.h, 0),
        Operand::plain(w.down.0, w.down.1),
        &mut sc.y,
        0,
        Accumulate::Replace,
    )
}

fn check_inputs<O: DeviceOps>(ops: &O, s: &Shape, inputs: &DeviceInputs<'_, O::Buf>) -> Result<()> {
    let native = s.local_experts() * s.hidden * s.intermediate;
    need("x (N·H)", s.tokens * s.hidden, ops.buf_len(inputs.x))?;
    need("W_gate (M·H·I)", native, ops.buf_len(inputs.gate))?;
    need("W_up (M·H·I)", native, ops.buf_len(inputs.up))?;
    need("W_down (M·I·H)", native, ops.buf_len(inputs.down))
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
    for t in plan.assignment().transfers() {
        for (part, src) in [inputs.gate, inputs.up, inputs.down].into_iter().enumerate() {
            let (mut sc, mut rc) = (vec![0; p], vec![0; p]);
            let mut send_at = 0;
            if t.owner == me {
                sc[t.helper] = hi;
                send_at = (t.expert - me * m) * hi;
            }
            let mut recv_at = 0;
            if t.helper == me {
                rc[t.owner] = hi;
                recv_at = t.slot * 3 * hi + part * hi;
            }
            ops.all_to_all_v((src, send_at), &sc, (&mut *foreign, recv_at), &rc)?;
        }
    }
    Ok(())
}

/// The layer's forward on this rank's device: `y_i = Σ_j w_ij·FFN_{e_ij}(x_i)`, N×H fp32 (a
/// new buffer). Same schedule, orders and result as [`crate::cpu::forward`]; device memory is
/// the plan's forward [`Buffers`] (one more G×I buffer for h) plus the index buffers. Round
/// j+1's dispatch is issued before round j's experts (two or more buffer copies; the issue
/// order is in the `pipeline` module).
pub fn forward<O: DeviceOps>(ops: &O, plan: &Schedule, inputs: &DeviceInputs<'_, O::Buf>) -> Result<O::Buf> {
    let me = ops.rank();
    let (s, t) = tables(plan, me, ops.world_size(), &inputs.routing)?;
    check_inputs(ops, &s, inputs)?;
    let bufs = plan.buffers(me, Pass::Forward);
    ops.fence()?;
    let mut c = Reserved::new(ops, &bufs)?;
    fetch_foreign(ops, plan, inputs, &mut c.foreign)?;
    let mut y = ops.alloc(s.tokens * s.hidden)?;
    let (h, i, k) = (s.hidden, s.intermediate, s.top_k);
    let order: Vec<usize> = (0..plan.rounds()).collect();
    let Reserved { sets, foreign, scratch, groups, offsets, group_rows, group_weights, .. } = &mut c;
    let issue =
        |sets: &mut [RoundSet<O::Buf, O::Index>], j| dispatch(ops, plan, (&s, &t), (inputs, None), sets, j);
    let run =
        |_: &mut O::Buf, sets: &mut [RoundSet<O::Buf, O::Index>], round: &Issued, meta: &[RouteMeta]| {
            let set = &mut sets[round.set];
            let got = round.got();
            group(meta, k, bufs.local_slots(), groups, offsets)?;
            ops.zero(&mut set.out, got * h)?;
            for slot in 0..bufs.local_slots() {
                let entries = &groups[offsets[slot] as usize..offsets[slot + 1] as usize];
                for chunk in entries.chunks(bufs.expert_rows().max(1)) {
                    let n = chunk.len();
                    let lists = GroupLists::new(chunk, meta);
                    ops.write_index(&lists.rows, group_rows)?;
                    ops.write(&lists.weights, group_weights)?;
                    ops.gather_rows(&set.recv_x, group_rows, n, None, h, &mut scratch.x)?;
                    let w = expert_at(&s, inputs, foreign, slot);
                    expert_forward(ops, w, (h, i), n, scratch)?;
                    ops.scatter_add_rows(&scratch.y, group_rows, n, Some(group_weights), h, &mut set.out)?;
                }
            }
            let (sh, rh) = (scale(&round.send_counts, h), scale(&round.recv_counts, h));
            ops.all_to_all_v((&set.out, 0), &rh, (&mut set.send_x, 0), &sh)
        };
    let finish = |y: &mut O::Buf, sets: &mut [RoundSet<O::Buf, O::Index>], round: &Issued| {
        let set = &sets[round.set];
        ops.scatter_add_rows(&set.send_x, &set.send_tokens, round.sent(), None, h, y)
    };
    pipelined(ops, &order, sets, (k, &mut y), issue, run, finish)?;
    ops.fence()?;
    Ok(y)
}

/// The round buffers and group lists one expert group's backward reads and fills.
struct GroupBackward<'a, O: DeviceOps> {
    recv_dy: &'a O::Buf,
    dx_rows: &'a mut O::Buf,
    dw: &'a mut O::Buf,
    rows: &'a O::Index,
    meta: &'a O::Index,
    weights: &'a O::Buf,
}

/// Backward of one expert group of `n` routes whose X rows, routing weights and metadata
/// entries are in the scratch and group lists, recomputing its forward: `dw_t = ⟨dY_t, y_t⟩`,
/// `δ = w ⊙ dY`, `dW_down += hᵀ·δ`, `dh = δ·W_downᵀ`, SwiGLU backward, `dW_gate += Xᵀ·dg`,
/// `dW_up += Xᵀ·du`, `dX_t = dg·W_gateᵀ + du·W_upᵀ` added to the group's rows of `dx_rows`.
fn expert_backward<O: DeviceOps>(
    ops: &O,
    w: ExpertAt<'_, O::Buf>,
    mut grad: GradAt<'_, O::Buf>,
    (h, i): (usize, usize),
    n: usize,
    io: GroupBackward<'_, O>,
    sc: &mut Scratch<O::Buf>,
) -> Result<()> {
    ops.gather_rows(io.recv_dy, io.rows, n, None, h, &mut sc.dy)?;
    expert_forward(ops, w, (h, i), n, sc)?;
    ops.row_dot(&sc.dy, &sc.y, n, h, &mut sc.dots)?;
    ops.scatter_add_rows(&sc.dots, io.meta, n, None, 1, io.dw)?;
    ops.gather_rows(io.recv_dy, io.rows, n, Some(io.weights), h, &mut sc.dy)?;
    let (buf, at) = grad.part(2);
    let d_down = GemmDims { m: i, n: h, k: n };
    ops.gemm(d_down, Operand::t(&sc.h, 0), Operand::plain(&sc.dy, 0), buf, at, Accumulate::Add)?;
    let dh = GemmDims { m: n, n: i, k: h };
    ops.gemm(
        dh,
        Operand::plain(&sc.dy, 0),
        Operand::t(w.down.0, w.down.1),
        &mut sc.h,
        0,
        Accumulate::Replace,
    )?;
    ops.swiglu_backward(&mut sc.gate, &mut sc.up, &sc.h, n * i)?;
    let dw_in = GemmDims { m: h, n: i, k: n };
    let (buf, at) = grad.part(0);
    ops.gemm(dw_in, Operand::t(&sc.x, 0), Operand::plain(&sc.gate, 0), buf, at, Accumulate::Add)?;
    let (buf, at) = grad.part(1);
    ops.gemm(dw_in, Operand::t(&sc.x, 0), Operand::plain(&sc.up, 0), buf, at, Accumulate::Add)?;
    let dx = GemmDims { m: n, n: h, k: i };
    ops.gemm(
        dx,
        Operand::plain(&sc.gate, 0),
        Operand::t(w.gate.0, w.gate.1),
        &mut sc.y,
        0,
        Accumulate::Replace,
    )?;
    ops.gemm(dx, Operand::plain(&sc.up, 0), Operand::t(w.up.0, w.up.1), &mut sc.y, 0, Accumulate::Add)?;
    ops.scatter_add_rows(&sc.y, io.rows, n, None, h, io.dx_rows)
}

/// Helpers send foreign experts' gradients home (per transfer and part, one all-to-all); owners
/// add them to their native gradients, in transfer order.
fn return_foreign_grads<O: DeviceOps>(
    ops: &O,
    plan: &Schedule,
    c: &mut Reserved<O::Buf, O::Index>,
    g: &mut DeviceGradients<O::Buf>,
) -> Result<()> {
    let s = plan.shape();
    let (hi, m, p, me) = (s.hidden * s.intermediate, s.local_experts(), s.ranks, ops.rank());
    for t in plan.assignment().transfers() {
        let native = [&mut g.d_gate, &mut g.d_up, &mut g.d_down];
        for (part, dst) in native.into_iter().enumerate() {
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
                ops.write_index(&[(t.expert - me * m) as u32], &mut c.one)?;
                ops.scatter_add_rows(&c.grad_return, &c.one, 1, None, hi, dst)?;
            }
        }
    }
    Ok(())
}

/// The layer's backward on this rank's device, checkpointed: rounds in reverse, each
/// re-dispatching x and dY rows and recomputing its expert forward before its backward. Same
/// schedule, orders and results as [`crate::cpu::backward`]; device memory is the plan's
/// backward [`Buffers`] plus the index buffers, and the returned gradients. As in [`forward`],
/// the next round's dispatch is issued before this round's experts.
pub fn backward<O: DeviceOps>(
    ops: &O,
    plan: &Schedule,
    inputs: &DeviceInputs<'_, O::Buf>,
    dy: &O::Buf,
) -> Result<DeviceGradients<O::Buf>> {
    let me = ops.rank();
    let (s, t) = tables(plan, me, ops.world_size(), &inputs.routing)?;
    check_inputs(ops, &s, inputs)?;
    need("dY (N·H)", s.tokens * s.hidden, ops.buf_len(dy))?;
    if plan.config().mode != Mode::Checkpointed {
        return Err(Error::invalid_config(
            "mode",
            plan.config().mode,
            "Mode::Checkpointed (the device executor recomputes)",
        ));
    }
    let bufs = plan.buffers(me, Pass::Backward);
    ops.fence()?;
    let mut c = Reserved::new(ops, &bufs)?;
    fetch_foreign(ops, plan, inputs, &mut c.foreign)?;
    let (n, h, i, k) = (s.tokens, s.hidden, s.intermediate, s.top_k);
    let native = s.local_experts() * h * i;
    let mut g = DeviceGradients {
        dx: ops.alloc(n * h)?,
        d_weights: ops.alloc(n * k)?,
        d_gate: ops.alloc(native)?,
        d_up: ops.alloc(native)?,
        d_down: ops.alloc(native)?,
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
            group_rows,
            group_meta,
            group_weights,
            dw_src,
            dw_dst,
            dw_gathered,
            ..
        } = &mut c;
        let issue = |sets: &mut [RoundSet<O::Buf, O::Index>], j| {
            dispatch(ops, plan, (&s, &t), (inputs, Some(dy)), sets, j)
        };
        let run = |g: &mut DeviceGradients<O::Buf>,
                   sets: &mut [RoundSet<O::Buf, O::Index>],
                   round: &Issued,
                   meta: &[RouteMeta]| {
            let set = &mut sets[round.set];
            let got = round.got();
            group(meta, k, bufs.local_slots(), groups, offsets)?;
            ops.zero(&mut set.out, got * h)?;
            ops.zero(&mut set.dw_out, got * k)?;
            for slot in 0..bufs.local_slots() {
                let entries = &groups[offsets[slot] as usize..offsets[slot + 1] as usize];
                for chunk in entries.chunks(bufs.expert_rows().max(1)) {
                    let rows = chunk.len();
                    let lists = GroupLists::new(chunk, meta);
                    ops.write_index(&lists.rows, group_rows)?;
                    ops.write_index(&lists.meta, group_meta)?;
                    ops.write(&lists.weights, group_weights)?;
                    ops.gather_rows(&set.recv_x, group_rows, rows, None, h, &mut scratch.x)?;
                    let w = expert_at(&s, inputs, foreign, slot);
                    let grad = grad_at(&s, g, foreign_grad, slot);
                    let io = GroupBackward::<O> {
                        recv_dy: &set.recv_dy,
                        dx_rows: &mut set.out,
                        dw: &mut set.dw_out,
                        rows: group_rows,
                        meta: group_meta,
                        weights: group_weights,
                    };
                    expert_backward(ops, w, grad, (h, i), rows, io, scratch)?;
                }
            }
            let (sh, rh) = (scale(&round.send_counts, h), scale(&round.recv_counts, h));
            let (sk, rk) = (scale(&round.send_counts, k), scale(&round.recv_counts, k));
            ops.all_to_all_v((&set.out, 0), &rh, (&mut set.send_x, 0), &sh)?;
            ops.all_to_all_v((&set.dw_out, 0), &rk, (&mut set.dw_back, 0), &sk)
        };
        let finish =
            |g: &mut DeviceGradients<O::Buf>, sets: &mut [RoundSet<O::Buf, O::Index>], round: &Issued| {
                let set = &sets[round.set];
                ops.scatter_add_rows(&set.send_x, &set.send_tokens, round.sent(), None, h, &mut g.dx)?;
                let routes = round.lists.dw_src.len();
                ops.write_index(&round.lists.dw_src, dw_src)?;
                ops.write_index(&round.lists.dw_dst, dw_dst)?;
                ops.gather_rows(&set.dw_back, dw_src, routes, None, 1, dw_gathered)?;
                ops.scatter_add_rows(dw_gathered, dw_dst, routes, None, 1, &mut g.d_weights)
            };
        pipelined(ops, &order, sets, (k, &mut g), issue, run, finish)?;
    }
    return_foreign_grads(ops, plan, &mut c, &mut g)?;
    ops.fence()?;
    Ok(g)
}
