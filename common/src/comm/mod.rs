//! Multi-rank communication: the [`Communicator`] trait the ring and dispatch schedules are
//! written against, [`LocalGroup`] (P ranks as threads of one process), [`OverCollectives`] (a
//! communicator over a framework's collectives), and the agreement every multi-rank call makes
//! before any data moves ([`agree_on_inputs`], [`agree_records`]).
//!
//! Semantics follow MPI/NCCL: every rank issues the same collectives in the same order; point to
//! point messages between one pair arrive in the order sent. Sends are buffered (they return
//! once the data is handed off), so a ring step is `send` to the next rank then `recv` from the
//! previous one, on every rank, without deadlock. No call hangs: a peer that panicked or dropped
//! its endpoint is [`Error::PeerLost`], a silent one
//! [`Error::Timeout`].

mod agree;
mod collectives;
mod local;
mod parts;
mod record;

pub use crate::error::Refusal;
pub use agree::{agree_and_gather, agree_on_inputs, all_gather_words};
pub use collectives::{Collectives, OverCollectives};
pub use local::{LocalComm, LocalGroup, LocalGroupOptions, MAX_LOCAL_WORLD};
pub use parts::{Parts, PartsMut, check_parts};
pub use record::{Agreed, Call, DeviceKind, RankRecord, Words, agree_records};

use bytemuck::Pod;

use crate::error::{Error, Result};

/// Element-wise reduction of [`Communicator::all_reduce_f32`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Sum, accumulated in rank order 0, 1, …, P−1 on every rank (bitwise identical results).
    Sum,
    /// Maximum (NaN propagates).
    Max,
}

/// One rank's endpoint of a group of `world_size` ranks.
///
/// The byte-level methods are the object-safe core an implementation provides; typed helpers
/// live in [`CommunicatorExt`], implemented for every communicator.
pub trait Communicator: Send {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn world_size(&self) -> usize;
    /// Sends `data` to `peer` (buffered: returns once handed off).
    fn send_bytes(&self, peer: usize, data: &[u8]) -> Result<()>;
    /// Receives exactly `out.len()` bytes from `peer`; a message of another size is
    /// [`Error::ShapeMismatch`].
    fn recv_bytes(&self, peer: usize, out: &mut [u8]) -> Result<()>;
    /// All-to-all with variable counts: `send` holds the parts for ranks 0..P in rank order,
    /// `recv` receives rank s's part in its s-th part. Counts must agree pairwise across ranks;
    /// an implementation checks both sides with [`check_parts`] before any byte moves.
    fn all_to_all_v_bytes(&self, send: Parts<'_>, recv: PartsMut<'_>) -> Result<()>;
    /// In-place all-reduce of `buf` (same length on every rank).
    fn all_reduce_f32(&self, buf: &mut [f32], op: ReduceOp) -> Result<()>;
    /// Returns once every rank has entered the barrier.
    fn barrier(&self) -> Result<()>;
}

/// Typed conveniences over [`Communicator`]'s byte methods, for any `T: Pod`.
pub trait CommunicatorExt: Communicator {
    /// The next rank on the ring, `(rank + 1) mod P`.
    fn next_rank(&self) -> usize {
        (self.rank() + 1) % self.world_size()
    }
    /// The previous rank on the ring, `(rank + P − 1) mod P`.
    fn prev_rank(&self) -> usize {
        (self.rank() + self.world_size() - 1) % self.world_size()
    }
    /// Sends a typed slice to `peer`.
    fn send<T: Pod>(&self, peer: usize, data: &[T]) -> Result<()> {
        self.send_bytes(peer, bytemuck::cast_slice(data))
    }
    /// Receives a typed slice of exactly `out.len()` elements from `peer`.
    fn recv<T: Pod>(&self, peer: usize, out: &mut [T]) -> Result<()> {
        self.recv_bytes(peer, bytemuck::cast_slice_mut(out))
    }
    /// One ring step: send `data` to the next rank, receive `out` from the previous one.
    fn ring_shift<T: Pod>(&self, data: &[T], out: &mut [T]) -> Result<()> {
        self.send(self.next_rank(), data)?;
        self.recv(self.prev_rank(), out)
    }
    /// Typed all-to-all-v; counts are in elements of `T`.
    fn all_to_all_v<T: Pod>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<()> {
        let size = std::mem::size_of::<T>();
        let to_bytes = |c: &[usize]| -> Result<Vec<usize>> {
            c.iter()
                .map(|&n| {
                    n.checked_mul(size).ok_or(Error::SizeOverflow { what: "all_to_all_v count in bytes" })
                })
                .collect()
        };
        let (send_counts, recv_counts) = (to_bytes(send_counts)?, to_bytes(recv_counts)?);
        self.all_to_all_v_bytes(
            Parts { bytes: bytemuck::cast_slice(send), counts: &send_counts },
            PartsMut { bytes: bytemuck::cast_slice_mut(recv), counts: &recv_counts },
        )
    }
}

impl<C: Communicator + ?Sized> CommunicatorExt for C {}
