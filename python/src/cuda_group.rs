//! The CUDA state the binding keeps per (group, device, stream) for the multi-rank CUDA paths
//! (feature `cuda`): one NCCL communicator of the group's ranks, and the device state of each
//! schedule that runs over it (llep's `CudaOps`, ring-dtp's `CudaRing` per plan).
//!
//! The communicator is made at the first CUDA call on that group, device and stream, which every
//! rank of the group makes at the same point: rank 0 creates the id and the group all-gathers it
//! (through [`TorchGroup`](crate::torch_group::TorchGroup), the verdict on whether NCCL loads
//! agreed first). It runs on torch's current stream, so a collective follows the torch work
//! already on it and torch's later work follows the collective. Everything lives for the
//! process, as torch keeps its own NCCL communicators; it sits behind one mutex, so no two calls
//! ever reach one communicator at once (NCCL's thread-safety rule).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use flatpeak_common::comm::{agree_on_inputs, all_gather_words};
use flatpeak_common::cuda::cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr};
use flatpeak_common::cuda::cudarc::nccl::safe::NcclType;
use flatpeak_common::nccl::{DeviceCommunicator, NcclComm, NcclId, nccl_available};
use flatpeak_common::{Communicator, Error as CommonError, ReduceOp};
use llep::cuda::CudaOps;
use pyo3::prelude::*;
use ring_dtp::cuda::ring::CudaRing;

use crate::error::to_py;

/// A communicator that lives for the process, shared by the schedules of its group.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SharedNccl(&'static NcclComm);

// SAFETY: a `SharedNccl` is made only by `CudaStates::comm` and used only inside the schedules
// `CudaStates` holds, by the thread holding its lock (see `CudaStates`'s `Send`): no two calls
// reach the communicator at once, on whichever thread they run.
unsafe impl Send for SharedNccl {}

impl DeviceCommunicator for SharedNccl {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.0.stream()
    }
    fn exchange<T: NcclType + DeviceRepr>(
        &self,
        send: &[CudaView<'_, T>],
        to: usize,
        recv: &mut [CudaViewMut<'_, T>],
        from: usize,
    ) -> flatpeak_common::Result<()> {
        self.0.exchange(send, to, recv, from)
    }
    fn all_to_all_v<T: NcclType + DeviceRepr>(
        &self,
        send: &CudaView<'_, T>,
        send_counts: &[usize],
        recv: &mut CudaViewMut<'_, T>,
        recv_counts: &[usize],
    ) -> flatpeak_common::Result<()> {
        self.0.all_to_all_v(send, send_counts, recv, recv_counts)
    }
    fn all_reduce<T: NcclType + DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> flatpeak_common::Result<()> {
        self.0.all_reduce(buf, op)
    }
}

/// Everything kept, by key: communicators by (group, device, stream); llep's ops by the same
/// key; ring-dtp's rings by that key and the plan.
#[derive(Default)]
pub(crate) struct CudaStates {
    comms: HashMap<String, SharedNccl>,
    pub(crate) moe: HashMap<String, CudaOps<'static, NcclComm>>,
    pub(crate) rings: HashMap<String, CudaRing<SharedNccl>>,
}

// SAFETY: `CudaStates` lives in one mutex and is used only by the thread holding the lock, so no
// two calls reach a communicator at once (NCCL's rule, the reason `NcclComm` is `Send` but not
// `Sync`, which is all that keeps `&'static NcclComm` from being `Send`); the rest (streams,
// kernel caches, cuBLAS handles, device buffers) are cudarc handles that may move between threads.
unsafe impl Send for CudaStates {}

/// The process's CUDA state, locked (with the GIL released by the caller: a thread waiting for
/// the lock must not hold the GIL the thread inside needs for its collectives).
pub(crate) fn cuda_states() -> MutexGuard<'static, CudaStates> {
    static STATES: OnceLock<Mutex<CudaStates>> = OnceLock::new();
    STATES
        .get_or_init(|| Mutex::new(CudaStates::default()))
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The key of (group, device, stream).
pub(crate) fn group_key(
    group: &Option<Bound<'_, PyAny>>,
    ordinal: usize,
    stream: &Arc<CudaStream>,
) -> String {
    let group_id = group.as_ref().map_or(0, |g| g.as_ptr() as usize);
    format!("{group_id:x}/{ordinal}/{:p}", stream.cu_stream())
}

impl CudaStates {
    /// The communicator of `key`, made at the first call (every rank of `host`'s group makes it
    /// at the same call).
    pub(crate) fn comm(
        &mut self,
        host: &dyn Communicator,
        key: &str,
        stream: &Arc<CudaStream>,
    ) -> PyResult<SharedNccl> {
        if let Some(comm) = self.comms.get(key) {
            return Ok(*comm);
        }
        let comm = SharedNccl(Box::leak(Box::new(bootstrap(host, stream.clone())?)));
        self.comms.insert(key.to_string(), comm);
        Ok(comm)
    }

    /// llep's CUDA ops over the communicator of `key`, made once.
    pub(crate) fn moe_ops(
        &mut self,
        host: &dyn Communicator,
        key: &str,
        stream: &Arc<CudaStream>,
    ) -> PyResult<&CudaOps<'static, NcclComm>> {
        if !self.moe.contains_key(key) {
            let SharedNccl(comm) = self.comm(host, key, stream)?;
            self.moe.insert(key.to_string(), CudaOps::new(comm).map_err(to_py)?);
        }
        self.moe.get(key).ok_or_else(|| {
            pyo3::exceptions::PyRuntimeError::new_err("llep's CUDA ops were cached just above")
        })
    }
}

/// The NCCL communicator of the group's ranks on `stream`: rank 0 makes the id, the group
/// all-gathers it. A rank without NCCL refuses on every rank.
fn bootstrap(host: &dyn Communicator, stream: Arc<CudaStream>) -> PyResult<NcclComm> {
    let (rank, world) = (host.rank(), host.world_size());
    let local: Result<[u64; 16], CommonError> = if !nccl_available() {
        Err(CommonError::CudaUnavailable {
            reason: format!("rank {rank}: the NCCL library (libnccl.so.2) cannot be loaded"),
        })
    } else if rank == 0 {
        NcclId::new().map(|id| {
            let mut words = [0u64; 16];
            for (w, chunk) in words.iter_mut().zip(id.0.chunks_exact(8)) {
                let mut bytes = [0u8; 8];
                bytes.copy_from_slice(chunk);
                *w = u64::from_le_bytes(bytes);
            }
            words
        })
    } else {
        Ok([0u64; 16])
    };
    let mine = agree_on_inputs(host, local).map_err(to_py)?;
    let all = all_gather_words(host, &mine).map_err(to_py)?;
    let mut id = [0u8; 128];
    for (chunk, w) in id.chunks_exact_mut(8).zip(&all[..16]) {
        chunk.copy_from_slice(&w.to_le_bytes());
    }
    NcclComm::from_rank(stream, rank, world, NcclId(id)).map_err(to_py)
}
