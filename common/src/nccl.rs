//! NCCL through cudarc (feature `cuda`): [`NcclComm`], the multi-GPU transport of the ring and
//! dispatch schedules, behind [`DeviceCommunicator`], the device-buffer counterpart of the host
//! [`Communicator`]. Point-to-point messages are NCCL send/recv issued on the
//! communicator's stream; a ring step is one grouped send + receive, so every rank's send to its
//! next neighbour and receive from its previous one proceed together (NCCL's rendezvous holds no
//! message in flight beyond the two buffers the caller owns).
//!
//! NCCL is loaded at run time: [`nccl_available`] probes for the library without panicking, and
//! every constructor returns [`Error::CudaUnavailable`] naming what is missing.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr};
use cudarc::nccl::safe::{Comm, Id, NcclType, ReduceOp as NcclReduceOp, group_end, group_start};

use crate::comm::{Communicator, ReduceOp, agree_on_inputs, all_gather_words};
use crate::error::{Error, Result};

fn nccl_error(op: &'static str) -> impl Fn(cudarc::nccl::result::NcclError) -> Error {
    move |e| Error::Cuda { op, message: format!("{:?}", e.0) }
}

/// Whether the NCCL library can be loaded (a dlopen probe over the names cudarc would try;
/// always true when cudarc links it, feature `cuda-linked`).
pub fn nccl_available() -> bool {
    #[cfg(not(feature = "cuda-linked"))]
    let present = cudarc::get_lib_name_candidates("nccl").iter().any(|name| {
        // SAFETY: loading libnccl runs its initializers, which have no preconditions; the handle
        // is dropped at once and no symbol is called.
        unsafe { libloading::Library::new(name) }.is_ok()
    });
    #[cfg(feature = "cuda-linked")]
    let present = true;
    present
}

fn ensure_nccl() -> Result<()> {
    if nccl_available() {
        Ok(())
    } else {
        Err(Error::CudaUnavailable {
            reason: "the NCCL library (libnccl.so) is not installed or not on the loader path".into(),
        })
    }
}

/// A communicator whose messages are device buffers on one CUDA stream.
pub trait DeviceCommunicator: Send {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// The stream operations are ordered on.
    fn stream(&self) -> &Arc<CudaStream>;
    /// One ring step: sends `send` to rank `to` and receives `recv` (its exact length) from rank
    /// `from`, as one grouped operation. Several pairs may be given (the parts of one message),
    /// sent and received in order.
    fn exchange<T: NcclType + DeviceRepr>(
        &self,
        send: &[CudaView<'_, T>],
        to: usize,
        recv: &mut [CudaViewMut<'_, T>],
        from: usize,
    ) -> Result<()>;
    /// All-to-all with variable counts, as [`Communicator::all_to_all_v_bytes`](crate::Communicator)
    /// but in elements of device buffers: `send` is the concatenation of the parts for ranks
    /// 0..P (`send_counts[d]` elements for rank d), `recv` receives `recv_counts[s]` elements from
    /// each rank s in rank order. One NCCL group of send/recv pairs.
    fn all_to_all_v<T: NcclType + DeviceRepr>(
        &self,
        send: &CudaView<'_, T>,
        send_counts: &[usize],
        recv: &mut CudaViewMut<'_, T>,
        recv_counts: &[usize],
    ) -> Result<()>;
    /// In-place all-reduce of `buf` over the ranks.
    fn all_reduce<T: NcclType + DeviceRepr>(&self, buf: &mut CudaSlice<T>, op: ReduceOp) -> Result<()>;
}

/// The 128-byte identifier rank 0 creates and every rank passes to [`NcclComm::from_rank`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NcclId(pub [u8; 128]);

impl NcclId {
    /// A fresh identifier (on rank 0; send its bytes to the other ranks out of band).
    pub fn new() -> Result<Self> {
        ensure_nccl()?;
        let id = Id::new().map_err(nccl_error("ncclGetUniqueId"))?;
        Ok(Self(id.internal().map(|c| c as u8)))
    }
}

/// One rank of an NCCL communicator.
pub struct NcclComm {
    comm: Comm,
    stream: Arc<CudaStream>,
}

// SAFETY: an NCCL communicator may be used from any thread provided no two calls on it run
// concurrently (NCCL user guide, "Thread safety"); `NcclComm` is `Send` but not `Sync`, so it is
// owned by one thread at a time and its `&self` methods never race. The stream handle it holds
// is an `Arc<CudaStream>`, itself `Send`.
unsafe impl Send for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.comm.rank())
            .field("world", &self.comm.world_size())
            .finish()
    }
}

impl NcclComm {
    /// One communicator per stream's device, all in this process (one thread may drive them all,
    /// or one thread each).
    pub fn for_devices(streams: Vec<Arc<CudaStream>>) -> Result<Vec<Self>> {
        ensure_nccl()?;
        let comms = Comm::from_devices(streams.clone()).map_err(nccl_error("ncclCommInitAll"))?;
        Ok(comms.into_iter().zip(streams).map(|(comm, stream)| Self { comm, stream }).collect())
    }

    /// Rank `rank` of `world` (one process or thread per rank), joined through `id`.
    pub fn from_rank(stream: Arc<CudaStream>, rank: usize, world: usize, id: NcclId) -> Result<Self> {
        ensure_nccl()?;
        if rank >= world {
            return Err(Error::RankOutOfRange { rank, world_size: world });
        }
        let id = Id::uninit(id.0.map(|b| b as core::ffi::c_char));
        let comm =
            Comm::from_rank(stream.clone(), rank, world, id).map_err(nccl_error("ncclCommInitRank"))?;
        Ok(Self { comm, stream })
    }

    /// The NCCL communicator of `host`'s ranks on `stream` (this rank's device), bootstrapped
    /// through `host` (a host [`Communicator`]: a framework's process group, a
    /// [`LocalGroup`](crate::LocalGroup)): the id of [`NcclId::agree`], then `ncclCommInitRank`.
    /// Every rank of `host` calls it at the same point.
    pub fn bootstrap<C: Communicator + ?Sized>(host: &C, stream: Arc<CudaStream>) -> Result<Self> {
        let id = NcclId::agree(host)?;
        Self::from_rank(stream, host.rank(), host.world_size(), id)
    }
}

impl NcclId {
    /// The id of a new communicator of `host`'s ranks, on every rank: rank 0 makes it and the
    /// group gathers it. Whether every rank can load NCCL (and rank 0 make the id) is agreed on
    /// first ([`agree_on_inputs`]): a rank without it is an error on every rank, naming it,
    /// never a wait inside `ncclCommInitRank`, which has no timeout.
    pub fn agree<C: Communicator + ?Sized>(host: &C) -> Result<Self> {
        let rank = host.rank();
        let local = ensure_nccl()
            .map_err(|e| match e {
                Error::CudaUnavailable { reason } => {
                    Error::CudaUnavailable { reason: format!("rank {rank}: {reason}") }
                }
                other => other,
            })
            .and_then(|()| if rank == 0 { NcclId::new().map(NcclId::to_words) } else { Ok([0u64; 16]) });
        let mine = agree_on_inputs(host, local)?;
        let all = all_gather_words(host, &mine)?;
        Ok(Self::from_words(&all[..16]))
    }

    /// The id's 128 bytes as 16 little-endian words (to gather through a host communicator).
    fn to_words(self) -> [u64; 16] {
        let mut words = [0u64; 16];
        for (w, chunk) in words.iter_mut().zip(self.0.chunks_exact(8)) {
            let mut bytes = [0u8; 8];
            bytes.copy_from_slice(chunk);
            *w = u64::from_le_bytes(bytes);
        }
        words
    }

    /// The id of [`to_words`](Self::to_words)' words.
    fn from_words(words: &[u64]) -> Self {
        let mut id = [0u8; 128];
        for (chunk, w) in id.chunks_exact_mut(8).zip(words) {
            chunk.copy_from_slice(&w.to_le_bytes());
        }
        Self(id)
    }
}

/// Records the buffers' cudarc events on `stream` behind a closed NCCL group.
///
/// When a context has several streams, cudarc orders each buffer across them by a read and a
/// write event, recorded when an operation's device-pointer guard drops. Inside
/// `ncclGroupStart`/`ncclGroupEnd` the guards of `send`/`recv` drop as those calls return, but
/// NCCL enqueues the group's kernel only at `ncclGroupEnd`: the events would then mark the
/// stream *before* the transfer, and another stream waiting on them would race it (read a
/// receive buffer before it arrives, overwrite a send buffer while it is read). Taking each
/// pointer again once the group is closed records the events behind the kernel. With one
/// stream cudarc records nothing and this does nothing.
fn record_after_group<T>(stream: &CudaStream, send: &[CudaView<'_, T>], recv: &mut [CudaViewMut<'_, T>]) {
    for s in send {
        let (_, record) = s.device_ptr(stream);
        drop(record);
    }
    for r in recv.iter_mut() {
        let (_, record) = r.device_ptr_mut(stream);
        drop(record);
    }
}

fn peer(rank: usize, world: usize) -> Result<i32> {
    if rank < world { Ok(rank as i32) } else { Err(Error::RankOutOfRange { rank, world_size: world }) }
}

impl DeviceCommunicator for NcclComm {
    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn exchange<T: NcclType + DeviceRepr>(
        &self,
        send: &[CudaView<'_, T>],
        to: usize,
        recv: &mut [CudaViewMut<'_, T>],
        from: usize,
    ) -> Result<()> {
        let world = self.world_size();
        let (to, from) = (peer(to, world)?, peer(from, world)?);
        group_start().map_err(nccl_error("ncclGroupStart"))?;
        let mut issue = || -> Result<()> {
            for s in send {
                self.comm.send(s, to).map_err(nccl_error("ncclSend"))?;
            }
            for r in recv.iter_mut() {
                self.comm.recv(r, from).map_err(nccl_error("ncclRecv"))?;
            }
            Ok(())
        };
        let issued = issue();
        // The group is closed whatever happened inside it.
        group_end().map_err(nccl_error("ncclGroupEnd"))?;
        issued?;
        record_after_group(&self.stream, send, recv);
        Ok(())
    }

    fn all_to_all_v<T: NcclType + DeviceRepr>(
        &self,
        send: &CudaView<'_, T>,
        send_counts: &[usize],
        recv: &mut CudaViewMut<'_, T>,
        recv_counts: &[usize],
    ) -> Result<()> {
        let world = self.world_size();
        for (what, counts, len) in [("send", send_counts, send.len()), ("recv", recv_counts, recv.len())] {
            if counts.len() != world {
                return Err(Error::ShapeMismatch {
                    what: "all_to_all_v counts (ranks)",
                    expected: world,
                    got: counts.len(),
                });
            }
            let total: usize = counts.iter().sum();
            if total > len {
                let what =
                    if what == "send" { "all_to_all_v send elements" } else { "all_to_all_v recv elements" };
                return Err(Error::ShapeMismatch { what, expected: total, got: len });
            }
        }
        group_start().map_err(nccl_error("ncclGroupStart"))?;
        let mut issue = || -> Result<()> {
            let (mut s0, mut r0) = (0usize, 0usize);
            for peer in 0..world {
                let (sc, rc) = (send_counts[peer], recv_counts[peer]);
                if sc > 0 {
                    self.comm.send(&send.slice(s0..s0 + sc), peer as i32).map_err(nccl_error("ncclSend"))?;
                }
                if rc > 0 {
                    self.comm
                        .recv(&mut recv.slice_mut(r0..r0 + rc), peer as i32)
                        .map_err(nccl_error("ncclRecv"))?;
                }
                (s0, r0) = (s0 + sc, r0 + rc);
            }
            Ok(())
        };
        let issued = issue();
        group_end().map_err(nccl_error("ncclGroupEnd"))?;
        issued?;
        record_after_group(&self.stream, std::slice::from_ref(send), std::slice::from_mut(recv));
        Ok(())
    }

    fn all_reduce<T: NcclType + DeviceRepr>(&self, buf: &mut CudaSlice<T>, op: ReduceOp) -> Result<()> {
        let op = match op {
            ReduceOp::Sum => NcclReduceOp::Sum,
            ReduceOp::Max => NcclReduceOp::Max,
        };
        self.comm.all_reduce_in_place(buf, &op).map_err(nccl_error("ncclAllReduce"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LocalGroup, LocalGroupOptions};

    #[test]
    fn an_id_survives_its_words() {
        let id = NcclId(std::array::from_fn(|i| (i * 37 % 251) as u8));
        assert_eq!(NcclId::from_words(&id.to_words()), id);
    }

    /// Without NCCL on this machine, every rank of the group refuses together, each with its
    /// own reason (every rank lacks it here), where with it the id would reach every rank.
    #[test]
    fn a_rank_without_nccl_refuses_on_every_rank() {
        let out = LocalGroup::run(2, LocalGroupOptions::default(), |host| Ok(NcclId::agree(host)));
        let out: Vec<Result<NcclId>> = out.into_iter().map(|r| r.unwrap()).collect();
        if nccl_available() {
            assert!(out[0].is_ok() && out[0] == out[1], "every rank holds rank 0's id");
            return;
        }
        for (rank, r) in out.into_iter().enumerate() {
            let err = r.unwrap_err();
            assert!(err.to_string().contains(&format!("rank {rank}: the NCCL library")), "{err}");
        }
    }
}
