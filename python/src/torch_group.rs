//! flatpeak's [`Communicator`] over a caller's `torch.distributed` process group: the transport's
//! collectives ([`TorchGroup`], [`Collectives`]), with the point-to-point messages of the rings
//! carried by them (`flatpeak_common::comm::OverCollectives`).
//!
//! The schedules are written once, in Rust, against [`Communicator`]; each exchange calls back
//! into `torch.distributed` (with the GIL taken for the call) on tensors that wrap the schedule's
//! own send and receive buffers without a copy. Only collectives that gloo and NCCL both offer
//! are used: `all_to_all_single` with split sizes and `all_reduce`. A failing collective (a peer
//! that died, the group's timeout) comes back as the Python exception `torch.distributed` raised,
//! in [`Error::Collective`].

use flatpeak_common::comm::{Collectives, OverCollectives, Parts, PartsMut, check_parts};
use flatpeak_common::{Communicator, Error, LocalGroup, LocalGroupOptions, ReduceOp, Result};
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::error::to_py;
use crate::tensor::{with_byte_tensor, with_read_byte_tensor};

/// One rank's endpoint of a `torch.distributed` process group.
pub(crate) struct TorchGroup {
    dist: Py<PyModule>,
    torch: Py<PyModule>,
    group: Py<PyAny>,
    rank: usize,
    world: usize,
    /// For a group whose backend moves only CUDA tensors (NCCL): the device each collective's
    /// host bytes are staged through (`torch.device`); `None` for gloo.
    staging: Option<Py<PyAny>>,
}

impl TorchGroup {
    /// The endpoint of this process in `group` (a `ProcessGroup`), which must be initialised.
    pub(crate) fn new(py: Python<'_>, group: Bound<'_, PyAny>) -> PyResult<Self> {
        let dist = py.import("torch.distributed")?;
        if !dist.call_method0("is_initialized")?.extract::<bool>()? {
            return Err(PyRuntimeError::new_err(
                "group: torch.distributed is not initialised (call torch.distributed.init_process_group first)",
            ));
        }
        let kwargs = PyDict::new(py);
        kwargs.set_item("group", &group)?;
        let rank: i64 = dist.call_method("get_rank", (), Some(&kwargs))?.extract()?;
        let rank = usize::try_from(rank).map_err(|_| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "group: this process is not a member of the group (torch.distributed.get_rank(group) = {rank})"
            ))
        })?;
        let world: usize = dist.call_method("get_world_size", (), Some(&kwargs))?.extract()?;
        let torch = py.import("torch")?;
        let backend: String = dist.call_method1("get_backend", (&group,))?.str()?.to_string();
        // NCCL carries CUDA tensors only: the schedule's host metadata (counts, verdicts) goes
        // through small CUDA tensors on the current device.
        let staging = if backend == "nccl" {
            let cuda = torch.getattr("cuda")?;
            Some(torch.call_method1("device", ("cuda", cuda.call_method0("current_device")?))?.unbind())
        } else {
            None
        };
        Ok(Self { dist: dist.unbind(), torch: torch.unbind(), group: group.unbind(), rank, world, staging })
    }

    /// `host` on the staging device (a copy), or `host` itself for a group that takes CPU
    /// tensors.
    fn staged<'py>(&self, py: Python<'py>, host: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        match &self.staging {
            Some(device) => host.call_method1("to", (device.bind(py),)),
            None => Ok(host.clone()),
        }
    }

    /// Copies a collective's staged result back into the host tensor it was staged from.
    fn unstage(&self, host: &Bound<'_, PyAny>, staged: &Bound<'_, PyAny>) -> PyResult<()> {
        if self.staging.is_some() {
            host.call_method1("copy_", (staged,))?;
        }
        Ok(())
    }

    /// Runs `f` with the GIL, a Python error becoming [`Error::Collective`] for `op`.
    fn call(&self, op: &'static str, f: impl FnOnce(Python<'_>) -> PyResult<()>) -> Result<()> {
        Python::attach(|py| f(py).map_err(|e| Error::Collective { op, message: e.to_string() }))
    }
}

impl Collectives for TorchGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn all_to_all_v_bytes(&self, send: Parts<'_>, recv: PartsMut<'_>) -> Result<()> {
        check_parts(self.world, &send, &recv)?;
        let PartsMut { bytes: recv_bytes, counts: recv_counts } = recv;
        self.call("torch.distributed.all_to_all_single", |py| {
            with_read_byte_tensor(py, send.bytes, |send_t| {
                with_byte_tensor(py, recv_bytes, |recv_t| {
                    let kwargs = PyDict::new(py);
                    kwargs.set_item("output_split_sizes", PyList::new(py, recv_counts)?)?;
                    kwargs.set_item("input_split_sizes", PyList::new(py, send.counts)?)?;
                    kwargs.set_item("group", self.group.bind(py))?;
                    let (out, input) = (self.staged(py, recv_t)?, self.staged(py, send_t)?);
                    self.dist.bind(py).call_method("all_to_all_single", (&out, input), Some(&kwargs))?;
                    self.unstage(recv_t, &out)
                })
            })
        })
    }

    fn all_reduce_f32(&self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        self.call("torch.distributed.all_reduce", |py| {
            with_byte_tensor(py, bytemuck_bytes(buf), |raw| {
                let tensor = raw.call_method1("view", (self.torch.bind(py).getattr("float32")?,))?;
                let ops = self.dist.bind(py).getattr("ReduceOp")?;
                let kwargs = PyDict::new(py);
                let name = match op {
                    ReduceOp::Sum => "SUM",
                    ReduceOp::Max => "MAX",
                };
                kwargs.set_item("op", ops.getattr(name)?)?;
                kwargs.set_item("group", self.group.bind(py))?;
                let staged = self.staged(py, &tensor)?;
                self.dist.bind(py).call_method("all_reduce", (&staged,), Some(&kwargs))?;
                self.unstage(&tensor, &staged)
            })
        })
    }
}

/// An f32 buffer's bytes.
fn bytemuck_bytes(buf: &mut [f32]) -> &mut [u8] {
    bytemuck::cast_slice_mut(buf)
}

/// A call's communicator, moved out while the GIL is released.
pub(crate) type Comm = Option<Box<dyn Communicator>>;

/// The handle of a group: its object's address (the Python side keeps the group alive), the key
/// of what is kept per group (its NCCL communicator, its ring executors).
pub(crate) fn group_handle(group: &Bound<'_, PyAny>) -> usize {
    group.as_ptr() as usize
}

/// The group's communicator: the caller's torch group (its collectives, point to point over
/// them), or one process alone.
pub(crate) fn communicator(py: Python<'_>, group: Option<Bound<'_, PyAny>>) -> PyResult<Comm> {
    let comm: Box<dyn Communicator> = match group {
        Some(g) => Box::new(OverCollectives::new(TorchGroup::new(py, g)?)),
        None => {
            let mut alone = LocalGroup::endpoints(1, LocalGroupOptions::default()).map_err(to_py)?;
            Box::new(alone.pop().ok_or_else(|| PyRuntimeError::new_err("a group of one has one rank"))?)
        }
    };
    Ok(Some(comm))
}

/// Runs `f` on `comm` with the GIL released (the torch group's collectives take it back for each
/// call). The communicator moves into the closure and back: it is `Send`, not `Sync`.
pub(crate) fn detached<R: Send>(
    py: Python<'_>,
    comm: &mut Comm,
    f: impl FnOnce(&dyn Communicator) -> R + Send,
) -> PyResult<R> {
    let owned = comm.take().ok_or_else(|| PyRuntimeError::new_err("the communicator is in use"))?;
    let (owned, out) = py.detach(move || {
        let out = f(owned.as_ref());
        (owned, out)
    });
    *comm = Some(owned);
    Ok(out)
}

/// [`detached`], with `f` run on a thread of the global rayon pool (the calling thread waits)
/// on what `hold` returns: a CPU executor's many parallel steps (each GEMM, gather and SwiGLU of
/// every expert) then fork from a pool thread, which shares its work with the others directly,
/// instead of each handing a job to the pool and sleeping until it returns.
///
/// `hold` runs first, on the calling thread with the GIL released: it takes the locks `f` needs.
/// A pool thread therefore never waits for a lock: one that did could be the very thread the
/// lock's holder is parked on (a pool thread waiting at a join runs queued jobs, another call's
/// included), a deadlock.
pub(crate) fn detached_in_pool<G, T, R>(
    py: Python<'_>,
    comm: &mut Comm,
    hold: impl FnOnce() -> G + Send,
    f: impl FnOnce(&dyn Communicator, &mut T) -> R + Send,
) -> PyResult<R>
where
    G: std::ops::DerefMut<Target = T>,
    T: Send + ?Sized,
    R: Send,
{
    let owned = comm.take().ok_or_else(|| PyRuntimeError::new_err("the communicator is in use"))?;
    let (owned, out) = py.detach(move || {
        let mut held = hold();
        let target: &mut T = &mut held;
        rayon::scope(move |_| {
            let out = f(owned.as_ref(), target);
            (owned, out)
        })
    });
    *comm = Some(owned);
    Ok(out)
}
