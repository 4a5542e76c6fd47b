//! flatpeak's [`Communicator`] over a caller's `torch.distributed` process group.
//!
//! The schedules are written once, in Rust, against [`Communicator`]; this is the binding's
//! implementation of it: each exchange calls back into `torch.distributed` (with the GIL taken
//! for the call) on tensors that wrap the schedule's own send and receive buffers without a copy.
//! Only collectives that gloo and NCCL both offer are used: `all_to_all_single` with split sizes
//! (every exchange of llep's schedule, and the all-gathers of its counts and of the input
//! verdicts) and `all_reduce`. Point-to-point messages (`batch_isend_irecv` can hang on gloo)
//! are refused with a typed error.
//!
//! A failing collective (a peer that died, the group's timeout) comes back as the Python
//! exception `torch.distributed` raised, carried in [`flatpeak_common::Error::Collective`].

use std::os::raw::{c_char, c_int};

use flatpeak_common::{Communicator, Error, ReduceOp, Result};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// CPython's `PyBUF_WRITE` (`pybuffer.h`), the flag of a writable memoryview: a value of the
/// stable ABI that pyo3 exports only for the full API.
const PYBUF_WRITE: c_int = 0x200;

/// One rank's endpoint of a `torch.distributed` process group (`None`: the default group; no
/// group at all is a [`LocalGroup`](flatpeak_common::LocalGroup) of one, made by the caller).
pub struct TorchGroup {
    dist: Py<PyModule>,
    torch: Py<PyModule>,
    group: Py<PyAny>,
    rank: usize,
    world: usize,
}

impl TorchGroup {
    /// The endpoint of this process in `group` (a `ProcessGroup`, or `None` for the default
    /// group), which must be initialised.
    pub fn new(py: Python<'_>, group: Bound<'_, PyAny>) -> PyResult<Self> {
        let dist = py.import("torch.distributed")?;
        if !dist.call_method0("is_initialized")?.extract::<bool>()? {
            return Err(pyo3::exceptions::PyRuntimeError::new_err(
                "group: torch.distributed is not initialised (call torch.distributed.init_process_group first)",
            ));
        }
        let kwargs = PyDict::new(py);
        kwargs.set_item("group", &group)?;
        let rank: i64 = dist.call_method("get_rank", (), Some(&kwargs))?.extract()?;
        let world: usize = dist.call_method("get_world_size", (), Some(&kwargs))?.extract()?;
        let rank = usize::try_from(rank).map_err(|_| {
            pyo3::exceptions::PyValueError::new_err(format!(
                "group: this process is not a member of the group (torch.distributed.get_rank(group) = {rank})"
            ))
        })?;
        Ok(Self {
            dist: dist.unbind(),
            torch: py.import("torch")?.unbind(),
            group: group.unbind(),
            rank,
            world,
        })
    }

    /// A uint8 tensor over `len` bytes at `ptr` (an empty tensor for none).
    ///
    /// # Safety
    /// `ptr..ptr + len` must be valid for reads and writes for as long as the returned tensor is
    /// used, and the tensor must not outlive the collective it is made for.
    unsafe fn wrap<'py>(&self, py: Python<'py>, ptr: *mut u8, len: usize) -> PyResult<Bound<'py, PyAny>> {
        let torch = self.torch.bind(py);
        if len == 0 {
            let kwargs = PyDict::new(py);
            kwargs.set_item("dtype", torch.getattr("uint8")?)?;
            return torch.call_method("empty", (0,), Some(&kwargs));
        }
        let size = isize::try_from(len).map_err(|_| {
            pyo3::exceptions::PyOverflowError::new_err(format!("{len} bytes exceed a Python buffer"))
        })?;
        // SAFETY: the caller guarantees `ptr..ptr + len` is valid for reads and writes while the
        // view is used; PyBUF_WRITE lets torch.frombuffer wrap it without a copy (and without
        // its warning about read-only buffers: the collective only reads a send buffer).
        let view = unsafe { pyo3::ffi::PyMemoryView_FromMemory(ptr.cast::<c_char>(), size, PYBUF_WRITE) };
        // SAFETY: a new reference (or null with the error set), owned from here on.
        let view = unsafe { Bound::from_owned_ptr_or_err(py, view) }?;
        let kwargs = PyDict::new(py);
        kwargs.set_item("dtype", torch.getattr("uint8")?)?;
        torch.call_method("frombuffer", (view,), Some(&kwargs))
    }

    /// Runs `f` with the GIL, a Python error becoming [`Error::Collective`] for `op`.
    fn call(&self, op: &'static str, f: impl FnOnce(Python<'_>) -> PyResult<()>) -> Result<()> {
        Python::attach(|py| f(py).map_err(|e| Error::Collective { op, message: e.to_string() }))
    }
}

impl Communicator for TorchGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn send_bytes(&self, _peer: usize, _data: &[u8]) -> Result<()> {
        Err(Error::Collective {
            op: "send",
            message: "point-to-point messages are not offered over a torch.distributed group: flatpeak's \
                      schedules exchange through all_to_all_single there"
                .into(),
        })
    }

    fn recv_bytes(&self, _peer: usize, _out: &mut [u8]) -> Result<()> {
        Err(Error::Collective {
            op: "recv",
            message: "point-to-point messages are not offered over a torch.distributed group".into(),
        })
    }

    fn all_to_all_v_bytes(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> Result<()> {
        let p = self.world;
        let sums = (send_counts.iter().sum::<usize>(), recv_counts.iter().sum::<usize>());
        if send_counts.len() != p || recv_counts.len() != p || sums.0 > send.len() || sums.1 > recv.len() {
            return Err(Error::ShapeMismatch {
                what: "all_to_all_v counts (P, within the buffers)",
                expected: p,
                got: send_counts.len(),
            });
        }
        self.call("torch.distributed.all_to_all_single", |py| {
            // SAFETY: `send` and `recv` are borrowed for this whole call, which the tensors do not
            // outlive (all_to_all_single is synchronous: async_op=False); torch only reads the
            // send tensor and writes `sums.1` bytes of the receive one, the counts checked above.
            let (send_t, recv_t) = unsafe {
                (self.wrap(py, send.as_ptr().cast_mut(), sums.0)?, self.wrap(py, recv.as_mut_ptr(), sums.1)?)
            };
            let kwargs = PyDict::new(py);
            kwargs.set_item("output_split_sizes", PyList::new(py, recv_counts)?)?;
            kwargs.set_item("input_split_sizes", PyList::new(py, send_counts)?)?;
            kwargs.set_item("group", self.group.bind(py))?;
            self.dist.bind(py).call_method("all_to_all_single", (recv_t, send_t), Some(&kwargs))?;
            Ok(())
        })
    }

    fn all_reduce_f32(&self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        self.call("torch.distributed.all_reduce", |py| {
            let bytes = std::mem::size_of_val(buf);
            // SAFETY: `buf` is borrowed mutably for this synchronous call, which the tensor does
            // not outlive.
            let raw = unsafe { self.wrap(py, buf.as_mut_ptr().cast::<u8>(), bytes)? };
            let tensor = raw.call_method1("view", (self.torch.bind(py).getattr("float32")?,))?;
            let ops = self.dist.bind(py).getattr("ReduceOp")?;
            let kwargs = PyDict::new(py);
            kwargs.set_item(
                "op",
                ops.getattr(match op {
                    ReduceOp::Sum => "SUM",
                    ReduceOp::Max => "MAX",
                })?,
            )?;
            kwargs.set_item("group", self.group.bind(py))?;
            self.dist.bind(py).call_method("all_reduce", (tensor,), Some(&kwargs))?;
            Ok(())
        })
    }

    fn barrier(&self) -> Result<()> {
        self.all_reduce_f32(&mut [0.0], ReduceOp::Sum)
    }
}
