//! [`Mode::SaveActivations`] on the host: the store forward keeps every round's received rows,
//! their routes and each route's SwiGLU pre-activations in ([`SavedActivations`]), carved as the
//! round schedule's [`Store`] for [`Executor::forward_saving`](crate::Executor::forward_saving)
//! and [`Executor::backward_saved`](crate::Executor::backward_saved), which dispatch dY only and
//! run each expert's backward from what was kept (six GEMMs per group, no recompute).
//!
//! Memory: the store of rank d is [`Schedule::saved_bytes`]`(d)` =
//! `Σ_s R[s][d]·(H·b + 8·k) + 2·L_d·I·b + 4·(K + 1)` bytes (b bytes per element of the storage
//! type; rows received over all rounds, routes computed there), reserved once per schedule and held from forward to backward; at
//! most [`Buffers::saved_activation_bytes`](crate::Buffers::saved_activation_bytes) for this K.
//! Unlike the dispatch buffers it grows with the routing: this is the larger bound the
//! checkpointed mode avoids. The per-round workspace is the checkpointed one's
//! ([`Schedule::buffers`]).

use flatpeak_common::{Communicator, DType, Workspace};

use super::ops::HostBuf;
use super::{check_dy, host_device_inputs, host_grads, host_inputs, host_ops};
use crate::config::Mode;
use crate::device::{self, Store};
use crate::error::{Error, Result};
use crate::layer::{Gradients, LayerElement, RankInputs};
use crate::plan::RouteMeta;
use crate::schedule::Schedule;

/// What one rank's forward keeps for backward in [`Mode::SaveActivations`]: a reservation of
/// [`Schedule::saved_bytes`] made before the forward, filled by
/// [`Executor::forward_saving`](crate::Executor::forward_saving), read by
/// [`Executor::backward_saved`](crate::Executor::backward_saved).
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
        Ok(Self { store: Workspace::new(plan.saved_bytes(rank))?, filled: None })
    }

    /// Bytes reserved.
    pub fn bytes(&self) -> usize {
        self.store.capacity()
    }

    fn stamp(plan: &Schedule, rank: usize) -> [usize; 4] {
        [rank, plan.rounds(), plan.recv_rows_total(rank), plan.assignment().rank_load(rank)]
    }
}

/// The store's regions, carved as [`Schedule::saved_regions`] lays them out.
struct StoreParts<'s> {
    x: HostBuf<'s>,
    meta: &'s mut [RouteMeta],
    gate: HostBuf<'s>,
    up: HostBuf<'s>,
    route_start: &'s mut [u32],
}

fn carve<'s>(store: &'s mut Workspace, plan: &Schedule, rank: usize) -> Result<StoreParts<'s>> {
    store.reset();
    let store: &'s Workspace = store;
    let s = plan.shape();
    let [_, rounds, rows, routes] = SavedActivations::stamp(plan, rank);
    // Rows and pre-activations in the storage type, as `Schedule::saved_regions` sizes them.
    let rows_of = |len: usize| -> Result<HostBuf<'s>> {
        Ok(match s.dtype {
            DType::Bf16 => HostBuf::CarvedBf16(store.take(len)?),
            _ => HostBuf::Carved(store.take(len)?),
        })
    };
    let x = rows_of(rows * s.hidden)?;
    let meta = store.take(rows * s.top_k)?;
    let (gate, up) = (rows_of(routes * s.intermediate)?, rows_of(routes * s.intermediate)?);
    Ok(StoreParts { x, meta, gate, up, route_start: store.take(rounds + 1)? })
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

/// The saving forward on the host, its buffers from `ws` (reset), its store `saved`.
pub(crate) fn forward_saving<C: Communicator + ?Sized, T: LayerElement>(
    comm: &C,
    ws: &Workspace,
    plan: &Schedule,
    inputs: &RankInputs<'_, T>,
    saved: &mut SavedActivations,
) -> Result<Vec<f32>> {
    check_mode(plan)?;
    let ops = host_ops(comm, ws, plan, inputs)?;
    let me = comm.rank();
    saved.filled = None;
    let StoreParts { mut x, meta, mut gate, mut up, route_start } = carve(&mut saved.store, plan, me)?;
    let mut store = Store { x: &mut x, meta, gate: &mut gate, up: &mut up, route_start };
    let [x, g, u, d] = host_inputs(inputs);
    let dev = host_device_inputs(inputs, [&x, &g, &u, &d]);
    let y = device::forward_saving(&ops, ws, plan, &dev, &mut store)?.into_vec()?;
    saved.filled = Some(SavedActivations::stamp(plan, me));
    Ok(y)
}

/// The backward from saved activations on the host, its buffers from `ws` (reset).
pub(crate) fn backward_saved<C: Communicator + ?Sized, T: LayerElement>(
    comm: &C,
    ws: &Workspace,
    plan: &Schedule,
    inputs: &RankInputs<'_, T>,
    dy: &[T],
    saved: &mut SavedActivations,
) -> Result<Gradients> {
    check_mode(plan)?;
    let ops = host_ops(comm, ws, plan, inputs)?;
    check_dy(plan, inputs, dy)?;
    let me = comm.rank();
    let stamp = SavedActivations::stamp(plan, me);
    if saved.filled != Some(stamp) {
        let found = saved.filled.map_or(0, |f| f[1]);
        return Err(Error::ScheduleMismatch {
            what: "rounds of the saved forward",
            planned: stamp[1],
            found,
        });
    }
    // Carving again finds the same regions, as the forward left them.
    let StoreParts { mut x, meta, mut gate, mut up, route_start } = carve(&mut saved.store, plan, me)?;
    let mut store = Store { x: &mut x, meta, gate: &mut gate, up: &mut up, route_start };
    let [x, g, u, d] = host_inputs(inputs);
    let dev = host_device_inputs(inputs, [&x, &g, &u, &d]);
    let dy = super::host_tensor(dy);
    host_grads(device::backward_saved(&ops, ws, plan, &dev, &dy, &mut store)?)
}
