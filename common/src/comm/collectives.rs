//! [`OverCollectives`]: a [`Communicator`] for a transport that offers only collectives (a
//! framework's process group: `torch.distributed` over gloo or NCCL), its point-to-point
//! messages carried by the transport's all-to-all.
//!
//! The ring schedules send point to point; a framework's own point-to-point calls may hang
//! (`batch_isend_irecv` on gloo), so the messages travel in the collective every backend has. A
//! send is buffered; a receive that finds nothing from its peer posts every rank's buffered
//! messages in one exchange (an all-to-all of the byte counts, then of the framed messages).
//! This is exact for SPMD schedules, where every rank issues the same sequence of sends and
//! receives (to the same ring neighbours), as flatpeak's rings do: every rank then runs out of
//! messages at the same receive, so the exchanges pair up. A receive that the exchange leaves
//! empty-handed (sequences that differ) is an error, not a wait. The buffering holds one step's
//! messages per link, what a ring's plan already counts as in flight.
//!
//! ```
//! use flatpeak_common::comm::{Collectives, OverCollectives, Parts, PartsMut};
//! use flatpeak_common::{Communicator, CommunicatorExt, LocalComm, LocalGroup, LocalGroupOptions, ReduceOp, Result};
//!
//! /// A transport with collectives only: a thread group's, standing in for a framework's.
//! struct ProcessGroup(LocalComm);
//! impl Collectives for ProcessGroup {
//!     fn rank(&self) -> usize { self.0.rank() }
//!     fn world_size(&self) -> usize { self.0.world_size() }
//!     fn all_to_all_v_bytes(&self, send: Parts<'_>, recv: PartsMut<'_>) -> Result<()> {
//!         self.0.all_to_all_v_bytes(send, recv)
//!     }
//!     fn all_reduce_f32(&self, buf: &mut [f32], op: ReduceOp) -> Result<()> { self.0.all_reduce_f32(buf, op) }
//! }
//!
//! let ranks = LocalGroup::endpoints(3, LocalGroupOptions::default())?;
//! let got: Vec<u32> = std::thread::scope(|s| {
//!     let threads: Vec<_> = ranks
//!         .into_iter()
//!         .map(|local| {
//!             s.spawn(move || {
//!                 let comm = OverCollectives::new(ProcessGroup(local));
//!                 let mut got = [0u32];
//!                 comm.ring_shift(&[comm.rank() as u32], &mut got).map(|()| got[0])
//!             })
//!         })
//!         .collect();
//!     threads.into_iter().map(|t| t.join().unwrap().unwrap()).collect()
//! });
//! assert_eq!(got, vec![2, 0, 1]); // each rank received its previous neighbour's rank
//! # Ok::<(), flatpeak_common::Error>(())
//! ```

use std::collections::VecDeque;
use std::sync::Mutex;

use super::parts::{Parts, PartsMut};
use super::{Communicator, ReduceOp};
use crate::error::{Error, Result};

/// The collectives of a transport that has no usable point-to-point messages. Semantics are
/// [`Communicator`]'s: every rank issues the same collectives in the same order.
pub trait Collectives: Send {
    /// This rank, in `0..world_size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn world_size(&self) -> usize;
    /// All-to-all with variable counts ([`Communicator::all_to_all_v_bytes`]); an implementation
    /// checks both sides with [`check_parts`](super::check_parts) before any byte moves.
    fn all_to_all_v_bytes(&self, send: Parts<'_>, recv: PartsMut<'_>) -> Result<()>;
    /// In-place all-reduce of `buf` ([`Communicator::all_reduce_f32`]).
    fn all_reduce_f32(&self, buf: &mut [f32], op: ReduceOp) -> Result<()>;
}

/// A [`Communicator`] over a transport's [`Collectives`]: point-to-point messages buffered and
/// carried by its all-to-all (see the module docs).
#[derive(Debug)]
pub struct OverCollectives<C> {
    inner: C,
    mailbox: Mutex<Mailbox>,
}

/// The messages this rank has sent and not yet posted, and those it has been delivered and not
/// yet taken, by peer.
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

impl<C: Collectives> OverCollectives<C> {
    /// A communicator over `inner`'s collectives.
    pub fn new(inner: C) -> Self {
        let world = inner.world_size();
        Self { inner, mailbox: Mutex::new(Mailbox::new(world)) }
    }

    /// The transport.
    pub fn inner(&self) -> &C {
        &self.inner
    }

    fn mailbox(&self) -> std::sync::MutexGuard<'_, Mailbox> {
        self.mailbox.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn check_peer(&self, op: &'static str, peer: usize) -> Result<()> {
        let world = self.inner.world_size();
        if peer < world {
            Ok(())
        } else {
            Err(Error::Collective { op, message: format!("peer {peer} is not a rank of a group of {world}") })
        }
    }

    /// Posts every rank's buffered messages: one exchange of the byte counts, one of the bytes.
    fn exchange(&self, mailbox: &mut Mailbox) -> Result<()> {
        let world = self.inner.world_size();
        let counts: Vec<usize> = mailbox.outbox.iter().map(Vec::len).collect();
        let words: Vec<u8> = counts.iter().flat_map(|&c| (c as u64).to_le_bytes()).collect();
        let mut incoming = vec![0u8; FRAME * world];
        let frames = vec![FRAME; world];
        self.inner.all_to_all_v_bytes(
            Parts { bytes: &words, counts: &frames },
            PartsMut { bytes: &mut incoming, counts: &frames },
        )?;
        let incoming = incoming
            .chunks_exact(FRAME)
            .map(|w| {
                let mut word = [0u8; FRAME];
                word.copy_from_slice(w);
                usize::try_from(u64::from_le_bytes(word))
                    .map_err(|_| Error::SizeOverflow { what: "point-to-point bytes" })
            })
            .collect::<Result<Vec<usize>>>()?;
        let send: Vec<u8> = mailbox.outbox.iter_mut().flat_map(std::mem::take).collect();
        let total = incoming.iter().try_fold(0usize, |sum, &c| sum.checked_add(c));
        let mut recv = vec![0u8; total.ok_or(Error::SizeOverflow { what: "point-to-point bytes" })?];
        self.inner.all_to_all_v_bytes(
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
}

impl<C: Collectives> Communicator for OverCollectives<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
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
                self.inner.rank()
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
        self.inner.all_to_all_v_bytes(send, recv)
    }

    fn all_reduce_f32(&self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        self.inner.all_reduce_f32(buf, op)
    }

    fn barrier(&self) -> Result<()> {
        self.inner.all_reduce_f32(&mut [0.0], ReduceOp::Sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::comm::CommunicatorExt;
    use crate::{LocalComm, LocalGroup, LocalGroupOptions};

    /// A thread group's endpoint with its collectives only.
    struct ProcessGroup(LocalComm);

    impl Collectives for ProcessGroup {
        fn rank(&self) -> usize {
            self.0.rank()
        }
        fn world_size(&self) -> usize {
            self.0.world_size()
        }
        fn all_to_all_v_bytes(&self, send: Parts<'_>, recv: PartsMut<'_>) -> Result<()> {
            self.0.all_to_all_v_bytes(send, recv)
        }
        fn all_reduce_f32(&self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
            self.0.all_reduce_f32(buf, op)
        }
    }

    /// `f` on every rank of a thread group of `p`, each over its endpoint's collectives only.
    fn over_collectives<R: Send>(
        p: usize,
        f: impl Fn(&OverCollectives<ProcessGroup>) -> Result<R> + Sync,
    ) -> Vec<Result<R>> {
        let ranks = LocalGroup::endpoints(p, LocalGroupOptions::default()).unwrap();
        std::thread::scope(|s| {
            let f = &f;
            let threads: Vec<_> = ranks
                .into_iter()
                .map(|local| s.spawn(move || f(&OverCollectives::new(ProcessGroup(local)))))
                .collect();
            threads.into_iter().map(|t| t.join().unwrap()).collect()
        })
    }

    #[test]
    fn messages_arrive_in_order_per_peer_across_several_sends() {
        let out = over_collectives(4, |comm| {
            let (me, p) = (comm.rank(), comm.world_size());
            // Two messages of different lengths to the next rank before one receive, an empty one
            // included, then a ring step back the other way.
            comm.send(comm.next_rank(), &[me as u64, 7])?;
            comm.send::<u64>(comm.next_rank(), &[])?;
            let (mut first, mut empty) = ([0u64; 2], [0u64; 0]);
            comm.recv(comm.prev_rank(), &mut first)?;
            comm.recv(comm.prev_rank(), &mut empty)?;
            let mut back = [0u64];
            comm.send(comm.prev_rank(), &[100 + me as u64])?;
            comm.recv(comm.next_rank(), &mut back)?;
            Ok((first, back[0], (me + p - 1) % p, (me + 1) % p))
        });
        for r in out {
            let (first, back, prev, next) = r.unwrap();
            assert_eq!(first, [prev as u64, 7]);
            assert_eq!(back, 100 + next as u64);
        }
    }

    #[test]
    fn a_receive_with_nothing_posted_or_of_the_wrong_size_is_an_error_not_a_wait() {
        let out = over_collectives(2, |comm| {
            let peer = 1 - comm.rank();
            let mut one = [0u8; 1];
            let nothing = comm.recv(peer, &mut one);
            comm.send(peer, &[1u8, 2])?;
            let wrong_size = comm.recv(peer, &mut one);
            let bad_peer = comm.send(5, &[0u8]);
            Ok((nothing, wrong_size, bad_peer))
        });
        for r in out {
            let (nothing, wrong_size, bad_peer) = r.unwrap();
            assert!(matches!(nothing, Err(Error::Collective { op: "recv", .. })), "{nothing:?}");
            assert!(matches!(wrong_size, Err(Error::ShapeMismatch { expected: 1, got: 2, .. })));
            assert!(matches!(bad_peer, Err(Error::Collective { op: "send", .. })));
        }
    }
}
