//! The NCCL communicators the binding keeps per (group, device) for the multi-rank CUDA paths
//! (feature `cuda`): one of the group's ranks on a stream of its own, made at the first CUDA call
//! on that group and device (which every rank makes at the same point) and bootstrapped through
//! the group itself ([`NcclComm::bootstrap`], which agrees on every rank's NCCL first). They live
//! for the process, as torch keeps its own, behind one mutex, so no two calls reach one
//! communicator at once (NCCL's thread-safety rule). Each call orders the communicator's stream
//! after torch's current stream on entry and torch's after it on exit, so a collective follows
//! the torch work that produced its buffers and torch's later work follows the call.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use flatpeak_common::Communicator;
use flatpeak_common::cuda::cuda_error;
use flatpeak_common::cuda::cudarc::driver::CudaStream;
use flatpeak_common::nccl::{DeviceCommunicator, NcclComm};
use pyo3::prelude::*;

use crate::error::to_py;

/// Communicators by (group handle, device ordinal).
static COMMS: Mutex<Option<HashMap<(usize, usize), NcclComm>>> = Mutex::new(None);

/// Runs `f` on the NCCL communicator of `group` (its handle) on device `ordinal`, made through
/// `host` (the group's host communicator) at the first call, between torch's stream `torch` and
/// the communicator's (see the module docs). Called with the GIL released.
pub(crate) fn with_nccl<R>(
    host: &dyn Communicator,
    group: usize,
    ordinal: usize,
    torch: &Arc<CudaStream>,
    f: impl FnOnce(&NcclComm) -> PyResult<R>,
) -> PyResult<R> {
    let mut comms = COMMS.lock().unwrap_or_else(|p| p.into_inner());
    let comms = comms.get_or_insert_with(HashMap::new);
    let comm = match comms.entry((group, ordinal)) {
        std::collections::hash_map::Entry::Occupied(comm) => comm.into_mut(),
        std::collections::hash_map::Entry::Vacant(slot) => {
            let ctx = flatpeak_common::cuda::context(ordinal).map_err(to_py)?;
            let stream = ctx.new_stream().map_err(cuda_error("cuStreamCreate")).map_err(to_py)?;
            slot.insert(NcclComm::bootstrap(host, stream).map_err(to_py)?)
        }
    };
    let join = |waiter: &CudaStream, on: &CudaStream| {
        waiter.join(on).map_err(cuda_error("cuStreamWaitEvent")).map_err(to_py)
    };
    join(comm.stream(), torch)?;
    let out = f(comm);
    // Whatever the call's outcome, torch's stream waits for what it issued; the call's own
    // error comes first.
    let joined = join(torch, comm.stream());
    let out = out?;
    joined?;
    Ok(out)
}
