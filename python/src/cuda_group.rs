//! The CUDA state the binding keeps per (group, device) for the multi-rank CUDA paths (feature
//! `cuda`): one NCCL communicator of the group's ranks on a stream of its own, and the device
//! state of each schedule that runs over it (llep's `CudaOps`, ring-dtp's `CudaRing` per plan).
//!
//! The communicator is made at the first CUDA call on that group and device, which every rank
//! of the group makes at the same point: rank 0 creates the id and the group all-gathers it
//! (through [`TorchGroup`](crate::torch_group::TorchGroup), the verdict on whether NCCL loads
//! agreed first). Each call orders the communicator's stream after torch's current stream on
//! entry ([`enter`]) and torch's stream after it (and the schedule's own streams) on exit
//! ([`leave`]), so a collective follows the torch work that produced its buffers and torch's later
//! work follows every collective and kernel of the call. Whether every rank's device state is
//! ready is agreed on before the first NCCL call of every call ([`agree_ready`]): NCCL has no
//! timeout to end a wait on a rank that failed. Everything lives for the process, as torch keeps
//! its own NCCL communicators, behind one mutex, so no two calls ever reach one communicator at
//! once (NCCL's thread-safety rule).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use flatpeak_common::comm::{agree_on_inputs, all_gather_words};
use flatpeak_common::cuda::cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr, sys};
use flatpeak_common::cuda::cudarc::nccl::safe::NcclType;
use flatpeak_common::nccl::{DeviceCommunicator, NcclComm, NcclId, nccl_available};
use flatpeak_common::{Communicator, Error as CommonError, ReduceOp};
use llep::cuda::CudaOps;
use pyo3::prelude::*;
use ring_dtp::cuda::ring::CudaRing;

use crate::error::{Refusal, to_py};
use crate::tensor::{TensorDevice, TorchElement, checked};

/// Rings kept at most (one per plan: a training loop uses a handful of shapes); a new one past
/// it drops the others first.
const CACHED_RINGS: usize = 8;

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

/// Everything kept, by key: communicators by (group, device); llep's ops by the same
/// key; ring-dtp's rings by that key and the plan.
#[derive(Default)]
pub(crate) struct CudaStates {
    comms: HashMap<String, SharedNccl>,
    moe: HashMap<String, CudaOps<'static, NcclComm>>,
    rings: HashMap<String, CudaRing<SharedNccl>>,
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

/// The key of (group, device): the group object's address (the Python side keeps every group it
/// passes alive for the process) and the device.
pub(crate) fn group_key(group: &Option<Bound<'_, PyAny>>, ordinal: usize) -> String {
    let group_id = group.as_ref().map_or(0, |g| g.as_ptr() as usize);
    format!("{group_id:x}/{ordinal}")
}

fn join_error(e: flatpeak_common::cuda::cudarc::driver::DriverError) -> PyErr {
    pyo3::exceptions::PyRuntimeError::new_err(format!("cuStreamWaitEvent: {e:?}"))
}

/// On entry: `streams` (the communicator's, a schedule's compute stream) wait for the torch work
/// already on `torch`.
pub(crate) fn enter(torch: &CudaStream, streams: &[&CudaStream]) -> PyResult<()> {
    streams.iter().try_for_each(|s| s.join(torch).map_err(join_error))
}

/// On exit, whatever the call's outcome: `torch` waits for everything issued on `streams`. The
/// call's own result comes first; a failed wait is reported only when the call succeeded.
pub(crate) fn leave<R>(torch: &CudaStream, streams: &[&CudaStream], result: PyResult<R>) -> PyResult<R> {
    let joined = streams.iter().try_for_each(|s| torch.join(s).map_err(join_error));
    let out = result?;
    joined?;
    Ok(out)
}

/// Agrees on every rank's readiness (its device state made, its buffers prepared) before the
/// call's first NCCL operation: a rank that failed raises its error, the others the same kind of
/// exception naming it, instead of waiting in NCCL. Called with the GIL released.
pub(crate) fn agree_ready<T>(host: &dyn Communicator, local: PyResult<T>) -> PyResult<T> {
    let local = local.map_err(|e| Python::attach(|py| Refusal::from_py(py, e)));
    agree_on_inputs(host, local).map_err(|e| Python::attach(|_| e.into_py()))
}

/// A torch CUDA tensor of `T` (checked on device `ordinal` with `shape`) as a cudarc slice of
/// `stream`, for one call; empty tensors included (a rank may bring no tokens). The slice must
/// be given back with [`CudaSlice::leak`], never freed: the tensor owns the memory.
///
/// # Safety
/// The tensor must outlive the slice, and nothing else may write it during the call.
pub(crate) unsafe fn borrow_slice<T: TorchElement + DeviceRepr>(
    stream: &Arc<CudaStream>,
    (name, tensor): (&'static str, &Bound<'_, PyAny>),
    shape: &[Option<usize>],
    ordinal: usize,
) -> PyResult<CudaSlice<T>> {
    let (address, len) = checked::<T>(name, tensor, shape, TensorDevice::Cuda(ordinal))?;
    // SAFETY: `checked` proved a live, contiguous CUDA tensor of `len` elements of `T` on this
    // device at `address` (an empty one is never dereferenced); the caller keeps it alive and
    // unaliased for the call and gives the slice back with `leak`.
    Ok(unsafe { stream.upgrade_device_ptr::<T>(address as sys::CUdeviceptr, len) })
}

/// Copies the first `dst.len()` elements of a schedule's f32 output `src` into the borrowed
/// torch tensor `dst` on `on` (nothing for an empty one: the schedules' buffers hold at least one
/// element, so `src` may be longer than what it holds).
pub(crate) fn copy_prefix(
    on: &Arc<CudaStream>,
    src: &CudaSlice<f32>,
    dst: &mut crate::cuda::Borrowed<f32>,
    what: &'static str,
) -> PyResult<()> {
    if dst.is_empty() {
        return Ok(());
    }
    if src.len() < dst.len() {
        return Err(pyo3::exceptions::PyRuntimeError::new_err(format!(
            "{what}: the schedule returned {} elements for {} (an internal error of flatpeak)",
            src.len(),
            dst.len()
        )));
    }
    on.memcpy_dtod(&src.slice(..dst.len()), &mut **dst)
        .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(format!("cuMemcpyDtoD ({what}): {e:?}")))
}

impl CudaStates {
    /// The communicator of `key` (group, device `ordinal`), made at the first call on a stream of
    /// its own (every rank of `host`'s group makes it at the same call).
    pub(crate) fn comm(
        &mut self,
        host: &dyn Communicator,
        key: &str,
        ordinal: usize,
    ) -> PyResult<SharedNccl> {
        if let Some(comm) = self.comms.get(key) {
            return Ok(*comm);
        }
        let ctx = flatpeak_common::cuda::context(ordinal).map_err(to_py)?;
        let stream = ctx
            .new_stream()
            .map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(format!("cuStreamCreate: {e:?}")))?;
        let comm = SharedNccl(Box::leak(Box::new(bootstrap(host, stream)?)));
        self.comms.insert(key.to_string(), comm);
        Ok(comm)
    }

    /// llep's CUDA ops over the communicator of `key`, made once.
    pub(crate) fn moe_ops(
        &mut self,
        host: &dyn Communicator,
        key: &str,
        ordinal: usize,
    ) -> PyResult<&CudaOps<'static, NcclComm>> {
        if !self.moe.contains_key(key) {
            let SharedNccl(comm) = self.comm(host, key, ordinal)?;
            self.moe.insert(key.to_string(), CudaOps::new(comm).map_err(to_py)?);
        }
        self.moe.get(key).ok_or_else(|| {
            pyo3::exceptions::PyRuntimeError::new_err("llep's CUDA ops were cached just above")
        })
    }

    /// ring-dtp's ring of `plan` over the communicator of `key`, made at the first call of that
    /// plan (its buffers reserved at the plan's size); at most [`CACHED_RINGS`] are kept.
    pub(crate) fn ring(
        &mut self,
        host: &dyn Communicator,
        (key, ordinal): (&str, usize),
        plan: ring_dtp::RingPlan,
    ) -> PyResult<&mut CudaRing<SharedNccl>> {
        let ring_key = format!("{key}/{plan:?}");
        if !self.rings.contains_key(&ring_key) {
            if self.rings.len() >= CACHED_RINGS {
                self.rings.clear(); // the old rings' buffers go before a new one's are reserved
            }
            let comm = self.comm(host, key, ordinal)?;
            self.rings.insert(ring_key.clone(), CudaRing::new(plan, comm).map_err(to_py)?);
        }
        self.rings
            .get_mut(&ring_key)
            .ok_or_else(|| pyo3::exceptions::PyRuntimeError::new_err("the CUDA ring was cached just above"))
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
