//! The CPU side of the layer: the call's [`schedule`] over any [`Communicator`] (on
//! [`LocalGroup`](flatpeak_common::LocalGroup): P ranks as threads), the host backend
//! [`HostOps`] the round schedule ([`crate::device`]) runs on when the [`Executor`](crate::Executor)'s
//! device is the CPU, the [`SavedActivations`] store of [`Mode::SaveActivations`](crate::Mode),
//! and the dense f64 [`reference`](mod@reference).
//!
//! On the CPU every buffer of a pass is carved from the executor's one [`Workspace`] in the
//! order of [`Buffers::regions`](crate::Buffers::regions): the route tables, the D copies of the
//! dispatch buffers, the grouping arrays and the expert scratch; the round loop, its orders and
//! its arithmetic are the device's, so the CPU, the emulator and a GPU run one schedule. The
//! [`Communicator`]'s calls are synchronous, so the rounds run one after another here.
//!
//! Reproducible: fixed round, destination, expert and row orders, and the CPU GEMM is bitwise
//! identical for any thread count.

pub(crate) mod elem;
mod ops;
pub mod reference;
mod saved;

use bytemuck::Pod;
use flatpeak_common::comm::agree_on_inputs;
use flatpeak_common::{Communicator, CommunicatorExt, Workspace};

use crate::assign::{Assignment, RouteCounts, local_counts};
use crate::device::{self, DeviceGradients, DeviceInputs};
use crate::error::Result;
use crate::layer::{Gradients, LayerElement, RankInputs, Routing, check_len};
use crate::plan::Plan;
use crate::route_tables::{check_call_shape, check_world_size};
use crate::schedule::{Schedule, pair_rows};
pub use elem::{MIN_STAGE_ROWS, STAGE_BYTES, stage_rows};
#[cfg(feature = "cuda-emu")]
pub(crate) use elem::{span, span_mut};
#[cfg(feature = "cuda-emu")]
pub(crate) use ops::host_gemm;
pub use ops::{HostBuf, HostOps};
pub use saved::SavedActivations;
use saved::StoreUse;

/// Every rank's copy of every rank's `mine` (equal lengths), in rank order.
pub fn all_gather<C: Communicator + ?Sized, T: Pod>(comm: &C, mine: &[T]) -> Result<Vec<T>> {
    let p = comm.world_size();
    let send: Vec<T> = (0..p).flat_map(|_| mine.iter().copied()).collect();
    let mut recv = vec![T::zeroed(); p * mine.len()];
    let counts = vec![mine.len(); p];
    comm.all_to_all_v(&send, &counts, &mut recv, &counts)?;
    Ok(recv)
}

/// The schedule of one layer call, from this rank's routing: validates it, all-gathers the P×E
/// route counts, runs the assignment, all-gathers the P×P row counts. Every rank gets the same
/// schedule. A rank with bad routing returns its error; its peers see the group fail
/// ([`flatpeak_common::Error::PeerLost`]) instead of hanging.
pub fn schedule<C: Communicator + ?Sized>(comm: &C, plan: &Plan, routing: &Routing<'_>) -> Result<Schedule> {
    let (config, shape) = (plan.config(), plan.shape());
    check_world_size(comm.world_size(), shape)?;
    // Checked on every rank and agreed on before the first exchange: a bad routing on one rank
    // is an error on every rank (`PeerInput` on the others), never a wait.
    let local = shape
        .for_call(routing.ids.len())
        .and_then(|call| routing.validate(&call))
        .and_then(|()| local_counts(shape, routing.ids));
    let counts: Vec<u64> = agree_on_inputs(comm, local)?.into_iter().map(|c| c as u64).collect();
    let counts = all_gather(comm, &counts)?.into_iter().map(|c| c as usize).collect();
    let assignment = Assignment::new(config, shape, RouteCounts::new(shape.ranks, shape.experts, counts)?)?;
    let rows: Vec<u64> =
        pair_rows(&assignment, shape, comm.rank(), routing.ids)?.into_iter().map(|r| r as u64).collect();
    let rows = all_gather(comm, &rows)?.into_iter().map(|r| r as usize).collect();
    Schedule::new(plan, assignment, rows)
}

/// Checks the call's shape and every input length exactly, then the host device of `comm`'s
/// rank over `ws`.
fn host_ops<'w, C: Communicator + ?Sized, T: LayerElement>(
    comm: &'w C,
    ws: &'w Workspace,
    plan: &Schedule,
    inputs: &RankInputs<'_, T>,
) -> Result<HostOps<'w, C>> {
    let s = check_call_shape(plan, comm.world_size())?.for_call(inputs.routing.ids.len())?;
    inputs.validate(&s, plan.config().weight_layout)?;
    let config = plan.config();
    Ok(HostOps::new(comm, ws, config.gemm_threads).with_bf16_kernel(config.bf16_kernel))
}

/// The caller's tensors, read in place: x, W_gate, W_up, W_down.
fn host_inputs<'a, T: LayerElement>(inputs: &RankInputs<'a, T>) -> [HostBuf<'a>; 4] {
    let w = &inputs.experts;
    [inputs.x, w.gate, w.up, w.down].map(host_tensor)
}

/// A caller's tensor of the storage type, read in place.
fn host_tensor<T: LayerElement>(t: &[T]) -> HostBuf<'_> {
    // `LayerElement` is sealed to f32 and bf16, and DTYPE names which: each cast is to T itself.
    match T::DTYPE {
        flatpeak_common::DType::Bf16 => HostBuf::InputBf16(bytemuck::cast_slice(t)),
        _ => HostBuf::Input(bytemuck::cast_slice(t)),
    }
}

fn host_device_inputs<'b, 'a: 'b, T>(
    inputs: &RankInputs<'a, T>,
    [x, gate, up, down]: [&'b HostBuf<'a>; 4],
) -> DeviceInputs<'b, HostBuf<'a>> {
    DeviceInputs { x, routing: inputs.routing, gate, up, down }
}

/// Checks dY's length: the call's N·H.
fn check_dy<T>(plan: &Schedule, inputs: &RankInputs<'_, T>, dy: &[T]) -> Result<()> {
    let n = plan.shape().for_call(inputs.routing.ids.len())?.tokens;
    check_len("dY (n·H)", n * plan.shape().hidden, dy.len())
}

fn host_grads(g: DeviceGradients<HostBuf<'_>>) -> Result<Gradients> {
    Ok(Gradients {
        dx: g.dx.into_vec()?,
        d_weights: g.d_weights.into_vec()?,
        d_gate: g.d_gate.into_vec()?,
        d_up: g.d_up.into_vec()?,
        d_down: g.d_down.into_vec()?,
    })
}

/// The forward on the host, its buffers carved from `ws` (reset). With `saving` (a
/// [`Mode::SaveActivations`](crate::Mode::SaveActivations) plan's store), it keeps what
/// [`backward`] then reads there.
pub(crate) fn forward<C: Communicator + ?Sized, T: LayerElement>(
    comm: &C,
    ws: &Workspace,
    plan: &Schedule,
    inputs: &RankInputs<'_, T>,
    saving: Option<&mut SavedActivations>,
) -> Result<Vec<f32>> {
    if saving.is_some() {
        saved::check_mode(plan)?;
    }
    let ops = host_ops(comm, ws, plan, inputs)?;
    let [x, g, u, d] = host_inputs(inputs);
    let dev = host_device_inputs(inputs, [&x, &g, &u, &d]);
    match saving {
        None => device::forward(&ops, ws, plan, &dev, None)?.into_vec(),
        Some(saved) => saved.with_store(plan, comm.rank(), StoreUse::Fill, |store| {
            device::forward(&ops, ws, plan, &dev, Some(store))?.into_vec()
        }),
    }
}

/// The backward on the host, its buffers carved from `ws` (reset): checkpointed without a
/// store, else from what the saving [`forward`] kept in `saved`.
pub(crate) fn backward<C: Communicator + ?Sized, T: LayerElement>(
    comm: &C,
    ws: &Workspace,
    plan: &Schedule,
    inputs: &RankInputs<'_, T>,
    dy: &[T],
    saved: Option<&mut SavedActivations>,
) -> Result<Gradients> {
    if saved.is_some() {
        saved::check_mode(plan)?;
    }
    let ops = host_ops(comm, ws, plan, inputs)?;
    check_dy(plan, inputs, dy)?;
    let [x, g, u, d] = host_inputs(inputs);
    let dev = host_device_inputs(inputs, [&x, &g, &u, &d]);
    let dy = host_tensor(dy);
    match saved {
        None => host_grads(device::backward(&ops, ws, plan, &dev, &dy, None)?),
        Some(saved) => saved.with_store(plan, comm.rank(), StoreUse::Read, |store| {
            host_grads(device::backward(&ops, ws, plan, &dev, &dy, Some(store))?)
        }),
    }
}
