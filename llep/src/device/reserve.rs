//! Every buffer of one call, reserved up front in the order of
//! [`Buffers::regions`](crate::Buffers::regions): the device buffers through [`DeviceOps`], the
//! host arrays (the received metadata's staging, the grouping arrays) from the host workspace
//! (the route tables, the first regions, are carved just before: `host::tables`).

use flatpeak_common::DType::F32;
use flatpeak_common::Workspace;

use super::DeviceOps;
use super::host::host_take;
use super::pipeline::RoundSet;
use crate::error::Result;
use crate::plan::staging_slots;
use crate::plan::{Buffers, GroupEntry, Pass, RouteMeta};

/// The expert scratch of G rows: X and dY G×H; Y G×max(H, I) (forward: h, then backward: the
/// pre-activations' gradient r); the gate and up pre-activations 2·G·I (`pre`: split, gate
/// n×I from 0 and up n×I from `up_at` = G·I; or fused, n rows of `[gate | up]`); h G×I; the G
/// routes' dot products.
#[derive(Debug)]
pub(super) struct Scratch<B> {
    pub(super) x: B,
    pub(super) y: B,
    pub(super) pre: B,
    pub(super) up_at: usize,
    pub(super) dy: B,
    pub(super) h: B,
    pub(super) dots: B,
}

/// A round's index lists, every expert group a range of them (grouped by slot, as
/// [`group`](super::host::group) sorts the round's routes): received rows, routing weights and
/// (backward) metadata entries, `recv_rows·k` each, written once per round; and (backward)
/// `0, 1, …, G − 1`, the identity index of a group's rows (`dh = w ⊙ r`), written once per call.
#[derive(Debug)]
pub(super) struct GroupBufs<B, I> {
    pub(super) rows: I,
    pub(super) weights: B,
    pub(super) meta: I,
    pub(super) seq: I,
}

/// Every buffer of one call.
#[derive(Debug)]
pub(super) struct Reserved<'h, B, I> {
    pub(super) foreign: B,
    pub(super) foreign_grad: B,
    pub(super) grad_return: B,
    pub(super) sets: Vec<RoundSet<B, I>>,
    /// Host staging of received metadata: `staging_slots` × `recv_rows·k` entries.
    pub(super) staging: &'h mut [RouteMeta],
    pub(super) staging_slots: usize,
    pub(super) groups: &'h mut [GroupEntry],
    pub(super) offsets: &'h mut [u32],
    pub(super) lists: GroupBufs<B, I>,
    pub(super) dw_src: I,
    pub(super) dw_dst: I,
    pub(super) dw_gathered: B,
    pub(super) one: I,
    pub(super) scratch: Scratch<B>,
}

impl<'h, B, I> Reserved<'h, B, I> {
    /// Reserves `b`'s regions after the route tables: device buffers by `ops`, host arrays
    /// from `host`. Backward-only buffers are empty in forward.
    pub(super) fn new<O: DeviceOps<Buf = B, Index = I>>(
        ops: &O,
        host: &'h Workspace,
        b: &Buffers,
    ) -> Result<Self> {
        let s = b.shape();
        let (h, i, k, dt) = (s.hidden, s.intermediate, s.top_k, s.dtype);
        let bwd = b.pass() == Pass::Backward;
        // Rows, weights and the expert scratch in the storage type; gradients, routing weights
        // and dot products in f32 (as `Buffers::regions` sizes them).
        let maybe = |len: usize, dtype| ops.alloc(if bwd { len } else { 0 }, dtype);
        let maybe_index = |len: usize| ops.alloc_index(if bwd { len } else { 0 });
        let (sr, rr, g) = (b.send_rows(), b.recv_rows(), b.expert_rows());
        let foreign = ops.alloc(b.foreign_slots() * s.expert_elems(), dt)?;
        let foreign_grad = maybe(b.foreign_slots() * s.expert_elems(), F32)?;
        // Foreign gradients' return buffer: an owner's, none with one rank (`Buffers::regions`).
        let grad_return = maybe(if s.ranks > 1 { h * i } else { 0 }, F32)?;
        let mut sets = Vec::with_capacity(b.depth());
        for _ in 0..b.depth() {
            sets.push(RoundSet {
                send_tokens: ops.alloc_index(sr)?,
                send_x: ops.alloc(sr * h, dt)?,
                recv_x: ops.alloc(rr * h, dt)?,
                out: ops.alloc(rr * h, dt)?,
                send_meta: ops.alloc_index(sr * k * 2)?,
                recv_meta: ops.alloc_index(rr * k * 2)?,
                send_dy: maybe(sr * h, dt)?,
                recv_dy: maybe(rr * h, dt)?,
                dw_out: maybe(rr * k, F32)?,
                dw_back: maybe(sr * k, F32)?,
            });
        }
        let staging_slots = staging_slots(b.depth());
        let staging = host_take(host, staging_slots * rr * k)?;
        let groups = host_take(host, rr * k)?;
        let offsets = host_take(host, b.local_slots() + 1)?;
        let lists = GroupBufs {
            rows: ops.alloc_index(rr * k)?,
            weights: ops.alloc(rr * k, F32)?,
            meta: maybe_index(rr * k)?,
            seq: maybe_index(g)?,
        };
        let (dw_src, dw_dst) = (maybe_index(sr * k)?, maybe_index(sr * k)?);
        let (dw_gathered, one) = (maybe(sr * k, F32)?, maybe_index(1)?);
        let scratch = Scratch {
            x: ops.alloc(g * h, dt)?,
            y: ops.alloc(g * h.max(i), dt)?,
            pre: ops.alloc(2 * g * i, dt)?,
            up_at: g * i,
            dy: maybe(g * h, dt)?,
            h: maybe(g * i, dt)?,
            dots: maybe(g, F32)?,
        };
        Ok(Self {
            foreign,
            foreign_grad,
            grad_return,
            sets,
            staging,
            staging_slots,
            groups,
            offsets,
            lists,
            dw_src,
            dw_dst,
            dw_gathered,
            one,
            scratch,
        })
    }
}
