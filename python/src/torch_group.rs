//! flatpeak's [`Communicator`] over a caller's `torch.distributed` process group.
//!
//! The schedules are written once, in Rust, against [`Communicator`]; this is the binding's
//! implementation of it: each exchange calls back into `torch.distributed` (with the GIL taken
//! for the call) on tensors that wrap the schedule's own send and receive buffers without a copy.
//! Only collectives that gloo and NCCL both offer are used: `all_to_all_single` with split sizes
//! (every exchange of llep's schedule, and the all-gathers of its counts and of the input
//! verdicts) and `all_reduce`.
//!
//! Point-to-point messages (ring-dtp's rings) are not sent as torch point-to-point calls
//! (`batch_isend_irecv` can hang on gloo). [`Mailbox`] carries them over the same collective: a
//! send is buffered, and a receive that finds nothing from its peer posts every rank's buffered
//! messages in one exchange (`all_to_all_single` of the byte counts, then of the framed
//! messages). This is exact for SPMD schedules, where every rank issues the same sequence of
//! sends and receives (to the same ring neighbours), as flatpeak's rings do: every rank then
//! runs out of messages at the same receive, so the exchanges pair up. A receive that the
//! exchange leaves empty-handed (sequences that differ) is an error, not a wait. The buffering
//! holds one step's messages per link, what the ring's plan already counts as in flight.
//!
//! A failing collective (a peer that died, the group's timeout) comes back as the Python
//! exception `torch.distributed` raised, carried in [`flatpeak_common::Error::Collective`].

use std::collections::VecDeque;
use std::os::raw::{c_char, c_int};
use std::sync::Mutex;

use flatpeak_common::comm::{Parts, PartsMut, check_parts};
use flatpeak_common::{Communicator, Error, LocalGroup, LocalGroupOptions, ReduceOp, Result};
use pyo3::exceptions::PyRuntimeError;
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
    mailbox: Mutex<Mailbox>,
    /// For a group whose backend moves only CUDA tensors (NCCL): the device each collective's
    /// host bytes are staged through (`torch.device`); `None` for gloo.
    staging: Option<Py<PyAny>>,
}

/// Point-to-point messages over collectives (see the module's documentation): the messages this
/// rank has sent and not yet posted, and those it has been delivered and not yet taken, by peer.
#[derive(Debug)]
struct Mailbox {
    /// Per peer: the framed messages (an 8-byte little-endian length, then the bytes) to post.
    outbox: Vec<Vec<u8>>,
    /// Per peer: delivered messages, oldest first.
    inbox: Vec<VecDeque<Vec<u8>>>,
}

/// Bytes of a message's length frame.
const FRAME: usize = std::mem::size_of::<u64>();

impl Mailbox {
    fn new(world: usize) -> Self {
        Self { outbox: vec![Vec::new(); world], inbox: vec![VecDeque::new(); world] }
    }

    fn post(&mut self, peer: usize, data: &[u8]) {
        let frame = &mut self.outbox[peer];
        frame.extend_from_slice(&(data.len() as u64).to_le_bytes());
        frame.extend_from_slice(data);
    }

    /// Splits `bytes` from `peer` into its framed messages.
    fn deliver(&mut self, peer: usize, mut bytes: &[u8]) -> Result<()> {
        while !bytes.is_empty() {
            let len = bytes
                .get(..FRAME)
                .and_then(|b| usize::try_from(u64::from_le_bytes(b.try_into().ok()?)).ok())
                .filter(|&len| len <= bytes.len() - FRAME)
                .ok_or(Error::Internal { invariant: "point-to-point frames from a peer are well formed" })?;
            self.inbox[peer].push_back(bytes[FRAME..FRAME + len].to_vec());
            bytes = &bytes[FRAME + len..];
        }
        Ok(())
    }
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
            let device = torch.call_method1("device", ("cuda", cuda.call_method0("current_device")?))?;
            Some(device.unbind())
        } else {
            None
        };
        Ok(Self {
            dist: dist.unbind(),
            torch: torch.unbind(),
            group: group.unbind(),
            rank,
            world,
            mailbox: Mutex::new(Mailbox::new(world)),
            staging,
        })
    }

    /// Posts every rank's buffered messages: one exchange of the byte counts, one of the bytes.
    fn exchange(&self, mailbox: &mut Mailbox) -> Result<()> {
        let counts: Vec<usize> = mailbox.outbox.iter().map(Vec::len).collect();
        let words: Vec<u8> = counts.iter().flat_map(|&c| (c as u64).to_le_bytes()).collect();
        let mut incoming = vec![0u8; FRAME * self.world];
        let frames = vec![FRAME; self.world];
        self.all_to_all_v_bytes(
            Parts { bytes: &words, counts: &frames },
            PartsMut { bytes: &mut incoming, counts: &frames },
        )?;
        let incoming = incoming
            .chunks_exact(FRAME)
            .map(|w| {
                let mut word = [0u8; FRAME];
                word.copy_from_slice(w);
                let count = u64::from_le_bytes(word);
                usize::try_from(count).map_err(|_| Error::SizeOverflow { what: "point-to-point bytes" })
            })
            .collect::<Result<Vec<usize>>>()?;
        let send: Vec<u8> = mailbox.outbox.iter_mut().flat_map(std::mem::take).collect();
        let total = incoming.iter().try_fold(0usize, |sum, &c| sum.checked_add(c));
        let mut recv = vec![0u8; total.ok_or(Error::SizeOverflow { what: "point-to-point bytes" })?];
        self.all_to_all_v_bytes(
            Parts { bytes: &send, counts: &counts },
            PartsMut { bytes: &mut recv, counts: &incoming },
        )?;
        let mut start = 0;
        for (peer, &len) in incoming.iter().enumerate() {
            mailbox.deliver(peer, &recv[start..start + len])?;
            start += len;
        }
        Ok(())
    }

    fn mailbox(&self) -> std::sync::MutexGuard<'_, Mailbox> {
        self.mailbox.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn check_peer(&self, op: &'static str, peer: usize) -> Result<()> {
        if peer < self.world {
            Ok(())
        } else {
            Err(Error::Collective {
                op,
                message: format!("peer {peer} is not a rank of a group of {}", self.world),
            })
        }
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

    /// `host` on the staging device (a copy), or `host` itself for a group that takes CPU
    /// tensors.
    fn staged<'py>(&self, py: Python<'py>, host: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        match &self.staging {
            Some(device) => host.call_method1("to", (device.bind(py),)),
            None => Ok(host.clone()),
        }
    }

    /// Copies a collective's staged result back into the host tensor it was staged from (a
    /// copy from the device that waits for the collective).
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

impl Communicator for TorchGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn send_bytes(&self, peer: usize, data: &[u8]) -> Result<()> {
        self.check_peer("send", peer)?;
        self.mailbox().post(peer, data);
        Ok(())
    }

    fn recv_bytes(&self, peer: usize, out: &mut [u8]) -> Result<()> {
        self.check_peer("recv", peer)?;
        let mut mailbox = self.mailbox();
        if mailbox.inbox[peer].is_empty() {
            self.exchange(&mut mailbox)?;
        }
        let message = mailbox.inbox[peer].pop_front().ok_or_else(|| Error::Collective {
            op: "recv",
            message: format!(
                "rank {} expected a message from rank {peer} and none was posted: the ranks' \
                 point-to-point sequences differ",
                self.rank
            ),
        })?;
        if message.len() != out.len() {
            return Err(Error::ShapeMismatch {
                what: "point-to-point message bytes",
                expected: out.len(),
                got: message.len(),
            });
        }
        out.copy_from_slice(&message);
        Ok(())
    }

    fn all_to_all_v_bytes(&self, send: Parts<'_>, recv: PartsMut<'_>) -> Result<()> {
        check_parts(self.world, &send, &recv)?;
        let (send_len, recv_len) = (send.bytes.len(), recv.bytes.len());
        self.call("torch.distributed.all_to_all_single", |py| {
            // SAFETY: both buffers are borrowed for this whole call, which the tensors do not
            // outlive (all_to_all_single is synchronous: async_op=False); torch only reads the
            // send tensor and writes the receive one within its length, which the counts sum to
            // (`check_parts` above).
            let (send_t, recv_t) = unsafe {
                let send_ptr = send.bytes.as_ptr().cast_mut();
                (self.wrap(py, send_ptr, send_len)?, self.wrap(py, recv.bytes.as_mut_ptr(), recv_len)?)
            };
            let kwargs = PyDict::new(py);
            kwargs.set_item("output_split_sizes", PyList::new(py, recv.counts)?)?;
            kwargs.set_item("input_split_sizes", PyList::new(py, send.counts)?)?;
            kwargs.set_item("group", self.group.bind(py))?;
            let (out, input) = (self.staged(py, &recv_t)?, self.staged(py, &send_t)?);
            self.dist.bind(py).call_method("all_to_all_single", (&out, input), Some(&kwargs))?;
            self.unstage(&recv_t, &out)
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
            let staged = self.staged(py, &tensor)?;
            self.dist.bind(py).call_method("all_reduce", (&staged,), Some(&kwargs))?;
            self.unstage(&tensor, &staged)
        })
    }

    fn barrier(&self) -> Result<()> {
        self.all_reduce_f32(&mut [0.0], ReduceOp::Sum)
    }
}

/// A call's communicator, moved out while the GIL is released.
pub(crate) type Comm = Option<Box<dyn Communicator>>;

/// Runs `f` on `comm` with the GIL released (the torch group's collectives take it back for each
/// call). The communicator moves into the closure and back: it is `Send`, not `Sync`.
pub(crate) fn detached<R: Send>(
    py: Python<'_>,
    comm: &mut Option<Box<dyn Communicator>>,
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
/// on what `hold` returns: a CPU executor's many parallel steps (each GEMM, gather and SwiGLU
/// of every expert) then fork from a pool thread, which shares its work with the others
/// directly, instead of each handing a job to the pool and sleeping until it returns.
///
/// `hold` runs first, on the calling thread with the GIL released: it takes the locks `f`
/// needs (the cached executor's). A pool thread therefore never waits for a lock: one that
/// did could be the very thread the lock's holder is parked on (a pool thread waiting at a
/// join runs queued jobs, another call's included), a deadlock.
pub(crate) fn detached_in_pool<G, T, R>(
    py: Python<'_>,
    comm: &mut Option<Box<dyn Communicator>>,
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

/// The group's communicator: the caller's torch group, or one process alone.
pub(crate) fn communicator(
    py: Python<'_>,
    group: Option<Bound<'_, PyAny>>,
) -> PyResult<Box<dyn Communicator>> {
    match group {
        Some(g) => Ok(Box::new(TorchGroup::new(py, g)?)),
        None => {
            let mut alone =
                LocalGroup::endpoints(1, LocalGroupOptions::default()).map_err(crate::error::to_py)?;
            Ok(Box::new(alone.pop().ok_or_else(|| PyRuntimeError::new_err("a group of one has one rank"))?))
        }
    }
}
