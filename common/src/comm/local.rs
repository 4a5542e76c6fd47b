//! [`LocalGroup`]: P ranks as threads of one process, talking over channels.
//!
//! Every ordered pair of ranks (self included, so a ring of one works) has its own FIFO
//! channel; messages carry the operation that sent them, so ranks that disagree on the program
//! get [`Error::CollectiveMismatch`] instead of garbage. A rank that panics or drops its
//! endpoint disconnects its channels: peers waiting on it get [`Error::PeerLost`] at once,
//! naming the rank where the failure started, and a peer that is merely silent makes them
//! return [`Error::Timeout`] after [`LocalGroupOptions::timeout`].
//!
//! Message buffers are recycled: a receiver hands each payload's buffer back to its sender
//! over a return channel once it has copied the bytes out, and the sender refills a returned
//! buffer before it allocates. In steady state a collective allocates nothing, so the ranks
//! do not contend in the allocator (with more rank threads than malloc arenas, per-message
//! allocation and cross-thread frees made one rank's CPU time 15–20% above its peers' on
//! identical work). A pair holds at most as many buffers as it has had messages in flight.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::Duration;

use super::parts::{Parts, PartsMut, check_parts};
use super::{Communicator, ReduceOp};
use crate::error::{Error, Result};

/// Options of a [`LocalGroup`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct LocalGroupOptions {
    /// Longest wait for one message before [`Error::Timeout`].
    pub timeout: Duration,
}

impl Default for LocalGroupOptions {
    fn default() -> Self {
        Self { timeout: Duration::from_secs(120) }
    }
}

impl LocalGroupOptions {
    /// These options with another timeout.
    pub fn with_timeout(timeout: Duration) -> Self {
        Self { timeout }
    }
    /// A zero timeout would fail every wait at once: [`Error::InvalidConfig`].
    pub fn validate(&self) -> Result<()> {
        if self.timeout.is_zero() {
            return Err(Error::invalid_config("timeout", self.timeout, "longer than zero"));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    PointToPoint,
    AllToAllV,
    AllReduceSum,
    AllReduceMax,
    Barrier,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::PointToPoint => "send/recv",
            Op::AllToAllV => "all_to_all_v",
            Op::AllReduceSum => "all_reduce(sum)",
            Op::AllReduceMax => "all_reduce(max)",
            Op::Barrier => "barrier",
        }
    }
}

#[derive(Debug)]
struct Message {
    op: Op,
    payload: Vec<u8>,
}

const NO_CAUSE: usize = usize::MAX;

/// The most ranks one [`LocalGroup`] runs: each is a thread of this process and each pair a
/// channel (P² of them), so P is bounded where a larger one would exhaust threads or memory
/// instead of failing cleanly.
pub const MAX_LOCAL_WORLD: usize = 256;

/// Namespace for building groups of thread ranks.
#[derive(Debug, Clone, Copy)]
pub struct LocalGroup;

impl LocalGroup {
    /// Endpoints of a new group of `world_size` ranks, endpoint `r` for rank `r`. Hand each to
    /// its own thread (or use [`LocalGroup::run`]). [`Error::InvalidConfig`] for invalid
    /// options or more than [`MAX_LOCAL_WORLD`] ranks.
    pub fn endpoints(world_size: usize, options: LocalGroupOptions) -> Result<Vec<LocalComm>> {
        options.validate()?;
        if world_size > MAX_LOCAL_WORLD {
            return Err(Error::invalid_config(
                "world_size",
                world_size,
                "at most MAX_LOCAL_WORLD = 256 thread ranks",
            ));
        }
        let mut senders: Vec<Vec<Option<Sender<Message>>>> =
            (0..world_size).map(|_| vec![None; world_size]).collect();
        let mut receivers: Vec<Vec<Option<Receiver<Message>>>> =
            (0..world_size).map(|_| (0..world_size).map(|_| None).collect()).collect();
        let mut returners: Vec<Vec<Option<Sender<Vec<u8>>>>> =
            (0..world_size).map(|_| vec![None; world_size]).collect();
        let mut spares: Vec<Vec<Option<Receiver<Vec<u8>>>>> =
            (0..world_size).map(|_| (0..world_size).map(|_| None).collect()).collect();
        for src in 0..world_size {
            for dst in 0..world_size {
                let (tx, rx) = channel();
                senders[src][dst] = Some(tx);
                receivers[dst][src] = Some(rx);
                let (back_tx, back_rx) = channel();
                returners[dst][src] = Some(back_tx);
                spares[src][dst] = Some(back_rx);
            }
        }
        let lost_because: Arc<[AtomicUsize]> = (0..world_size).map(|_| AtomicUsize::new(NO_CAUSE)).collect();
        Ok(senders
            .into_iter()
            .zip(receivers)
            .zip(returners.into_iter().zip(spares))
            .enumerate()
            .map(|(rank, ((tx, rx), (back, spare)))| LocalComm {
                rank,
                world_size,
                to: tx.into_iter().flatten().collect(),
                from: rx.into_iter().flatten().collect(),
                give_back: back.into_iter().flatten().collect(),
                spares: spare.into_iter().flatten().collect(),
                timeout: options.timeout,
                lost_because: Arc::clone(&lost_because),
            })
            .collect())
    }

    /// Runs `f` on `world_size` ranks, one scoped thread each, and returns each rank's result in
    /// rank order. A rank that panics yields [`Error::RankPanicked`]; its peers see
    /// [`Error::PeerLost`] from their next operation that involves it.
    pub fn run<R, F>(world_size: usize, options: LocalGroupOptions, f: F) -> Vec<Result<R>>
    where
        R: Send,
        F: Fn(&LocalComm) -> Result<R> + Sync,
    {
        let comms = match LocalGroup::endpoints(world_size, options) {
            Ok(comms) => comms,
            // No rank runs: each reports the options' error.
            Err(err) => return (0..world_size).map(|_| Err(err.clone())).collect(),
        };
        std::thread::scope(|scope| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|comm| {
                    let f = &f;
                    scope.spawn(move || {
                        let rank = comm.rank;
                        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&comm)));
                        drop(comm); // disconnect now, so waiting peers learn at once
                        outcome.unwrap_or_else(|payload| {
                            Err(Error::RankPanicked { rank, message: panic_message(&*payload) })
                        })
                    })
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(rank, h)| {
                    h.join()
                        .unwrap_or_else(|p| Err(Error::RankPanicked { rank, message: panic_message(&*p) }))
                })
                .collect()
        })
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}

/// One rank's endpoint of a [`LocalGroup`].
#[derive(Debug)]
pub struct LocalComm {
    rank: usize,
    world_size: usize,
    /// `to[d]`: channel to rank d.
    to: Vec<Sender<Message>>,
    /// `from[s]`: channel from rank s.
    from: Vec<Receiver<Message>>,
    /// `give_back[s]`: returns rank s's emptied message buffers to it.
    give_back: Vec<Sender<Vec<u8>>>,
    /// `spares[d]`: buffers rank d has emptied, for the next message to d.
    spares: Vec<Receiver<Vec<u8>>>,
    timeout: Duration,
    /// `lost_because[r]`: the rank whose loss made rank r give up, so a cascade of failures is
    /// reported by its root cause.
    lost_because: Arc<[AtomicUsize]>,
}

impl LocalComm {
    fn check_peer(&self, peer: usize) -> Result<()> {
        if peer < self.world_size {
            Ok(())
        } else {
            Err(Error::RankOutOfRange { rank: peer, world_size: self.world_size })
        }
    }

    fn lost(&self, peer: usize) -> Error {
        let cause = self.lost_because[peer].load(Ordering::Relaxed);
        let root = if cause == NO_CAUSE { peer } else { cause };
        let _ = self.lost_because[self.rank].compare_exchange(
            NO_CAUSE,
            root,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
        Error::PeerLost { rank: root }
    }

    /// Sends a copy of `data` to `peer`, in a buffer `peer` returned earlier when there is one.
    fn post(&self, peer: usize, op: Op, data: &[u8]) -> Result<()> {
        // An empty message (a barrier) needs no buffer: it must not take a spare, which its
        // receiver would have no bytes to copy out of and so would never hand back.
        let mut payload =
            if data.is_empty() { Vec::new() } else { self.spares[peer].try_recv().unwrap_or_default() };
        payload.clear();
        payload.extend_from_slice(data);
        self.to[peer].send(Message { op, payload }).map_err(|_| self.lost(peer))
    }

    /// Hands an emptied buffer back to the rank that sent it (dropped if that rank is gone).
    fn recycle(&self, peer: usize, payload: Vec<u8>) {
        if payload.capacity() > 0 {
            let _ = self.give_back[peer].send(payload);
        }
    }

    fn take(&self, peer: usize, op: Op) -> Result<Vec<u8>> {
        let msg = match self.from[peer].recv_timeout(self.timeout) {
            Ok(msg) => msg,
            Err(RecvTimeoutError::Disconnected) => return Err(self.lost(peer)),
            Err(RecvTimeoutError::Timeout) => {
                return Err(Error::Timeout { rank: self.rank, peer, waited: self.timeout });
            }
        };
        if msg.op != op {
            return Err(Error::CollectiveMismatch {
                rank: self.rank,
                peer,
                expected: op.name(),
                found: msg.op.name(),
            });
        }
        Ok(msg.payload)
    }

    fn take_exact(&self, peer: usize, op: Op, out: &mut [u8], what: &'static str) -> Result<()> {
        let payload = self.take(peer, op)?;
        if payload.len() != out.len() {
            return Err(Error::ShapeMismatch { what, expected: out.len(), got: payload.len() });
        }
        out.copy_from_slice(&payload);
        self.recycle(peer, payload);
        Ok(())
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn send_bytes(&self, peer: usize, data: &[u8]) -> Result<()> {
        self.check_peer(peer)?;
        self.post(peer, Op::PointToPoint, data)
    }

    fn recv_bytes(&self, peer: usize, out: &mut [u8]) -> Result<()> {
        self.check_peer(peer)?;
        self.take_exact(peer, Op::PointToPoint, out, "received message bytes")
    }

    fn all_to_all_v_bytes(&self, send: Parts<'_>, mut recv: PartsMut<'_>) -> Result<()> {
        check_parts(self.world_size, &send, &recv)?;
        for (dst, part) in send.iter().enumerate() {
            self.post(dst, Op::AllToAllV, part)?;
        }
        for (src, part) in recv.iter_mut().enumerate() {
            self.take_exact(src, Op::AllToAllV, part, "all_to_all_v bytes from a peer")?;
        }
        Ok(())
    }

    fn all_reduce_f32(&self, buf: &mut [f32], op: ReduceOp) -> Result<()> {
        let tag = match op {
            ReduceOp::Sum => Op::AllReduceSum,
            ReduceOp::Max => Op::AllReduceMax,
        };
        let mine: &[u8] = bytemuck::cast_slice(buf);
        for dst in (0..self.world_size).filter(|&d| d != self.rank) {
            self.post(dst, tag, mine)?;
        }
        // Fold in rank order 0..P on every rank, so every rank holds the same bits.
        let own = buf.to_vec();
        let mut incoming = vec![0f32; buf.len()];
        for src in 0..self.world_size {
            let part: &[f32] = if src == self.rank {
                &own
            } else {
                self.take_exact(
                    src,
                    tag,
                    bytemuck::cast_slice_mut(&mut incoming),
                    "all_reduce bytes from a peer",
                )?;
                &incoming
            };
            if src == 0 {
                buf.copy_from_slice(part);
                continue;
            }
            match op {
                ReduceOp::Sum => buf.iter_mut().zip(part).for_each(|(a, b)| *a += b),
                ReduceOp::Max => buf
                    .iter_mut()
                    .zip(part)
                    .for_each(|(a, b)| *a = if a.is_nan() || b.is_nan() { f32::NAN } else { a.max(*b) }),
            }
        }
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        for dst in (0..self.world_size).filter(|&d| d != self.rank) {
            self.post(dst, Op::Barrier, &[])?;
        }
        for src in (0..self.world_size).filter(|&s| s != self.rank) {
            self.take(src, Op::Barrier)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_received_buffer_goes_back_to_its_sender_and_carries_the_next_message() {
        let ranks = LocalGroup::endpoints(2, LocalGroupOptions::default()).unwrap();
        let (a, b) = (&ranks[0], &ranks[1]);
        let first = vec![7u8; 4096];
        a.send_bytes(1, &first).unwrap();
        assert!(a.spares[1].try_recv().is_err(), "nothing is returned before the receive");
        let mut out = vec![0u8; 4096];
        b.recv_bytes(0, &mut out).unwrap();
        assert_eq!(out, first);

        // The emptied buffer is back with rank 0; the next message to rank 1 travels in it.
        let spare = a.spares[1].try_recv().expect("the receiver returned the buffer");
        assert!(spare.capacity() >= 4096);
        let address = spare.as_ptr();
        b.recycle(0, spare); // put it back where the send looks for it
        a.send_bytes(1, &[1, 2, 3]).unwrap();
        assert!(a.spares[1].try_recv().is_err(), "the spare was taken by the send");
        let msg = b.from[0].recv().unwrap();
        assert_eq!(msg.payload, [1, 2, 3]);
        assert_eq!(msg.payload.as_ptr(), address, "the message reused the returned buffer");

        // Barrier messages are empty and are not returned.
        b.recycle(0, Vec::new());
        assert!(a.spares[1].try_recv().is_err());
    }

    #[test]
    fn a_barrier_leaves_the_spare_buffers_where_they_are() {
        let mut ranks = LocalGroup::endpoints(2, LocalGroupOptions::default()).unwrap();
        let (b, a) = (ranks.pop().unwrap(), ranks.pop().unwrap());
        a.send_bytes(1, &[9u8; 256]).unwrap();
        b.recv_bytes(0, &mut [0u8; 256]).unwrap(); // rank 0 now holds one spare for rank 1
        let peer = std::thread::spawn(move || b.barrier().map(|()| b));
        a.barrier().unwrap();
        let _b = peer.join().unwrap().unwrap(); // kept alive until the spare is checked
        let spare = a.spares[1].try_recv().expect("the barrier did not consume the spare");
        assert!(spare.capacity() >= 256);
    }

    #[test]
    fn typed_counts_whose_bytes_overflow_are_a_typed_error() {
        use crate::comm::CommunicatorExt;
        let ranks = LocalGroup::endpoints(1, LocalGroupOptions::default()).unwrap();
        let (send, mut recv) = ([0u64; 2], [0u64; 2]);
        let err = ranks[0].all_to_all_v(&send, &[usize::MAX / 4], &mut recv, &[2]).unwrap_err();
        assert!(matches!(err, Error::SizeOverflow { what: "all_to_all_v count in bytes" }), "{err}");
        let err = ranks[0].all_to_all_v(&send, &[2], &mut recv, &[usize::MAX]).unwrap_err();
        assert!(matches!(err, Error::SizeOverflow { .. }), "{err}");
    }

    #[test]
    fn a_world_too_large_for_threads_is_a_typed_error_not_an_abort() {
        let err = LocalGroup::endpoints(4096, LocalGroupOptions::default()).err();
        assert!(matches!(err, Some(Error::InvalidConfig { field: "world_size", .. })), "{err:?}");
        let ranks = LocalGroup::run(MAX_LOCAL_WORLD + 1, LocalGroupOptions::default(), |_| Ok(()));
        assert!(ranks.iter().all(|r| matches!(r, Err(Error::InvalidConfig { field: "world_size", .. }))));
    }
}
