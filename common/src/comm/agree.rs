//! Validation agreed on by the group before any data moves. Over a communicator whose peers stay
//! alive (a `torch.distributed` group, unlike a [`LocalGroup`](super::LocalGroup) whose failing
//! rank drops its endpoint), a rank that returned an input error while its peers entered the
//! first exchange would leave them waiting until the group's timeout. Instead every rank checks
//! its own input, then the group exchanges the verdicts in fixed-size collectives that every rank
//! issues whatever its verdict, and all ranks return together: `Ok` everywhere, or an error
//! everywhere.

use super::{Communicator, CommunicatorExt};
use crate::error::{Error, ErrorKind, HasErrorKind, Result};

/// Every rank's copy of every rank's `mine` (the same length on every rank), in rank order: one
/// all-to-all in which each rank sends `mine` to every rank.
pub fn all_gather_words<C: Communicator + ?Sized>(comm: &C, mine: &[u64]) -> Result<Vec<u64>> {
    let p = comm.world_size();
    let send: Vec<u64> = (0..p).flat_map(|_| mine.iter().copied()).collect();
    let mut recv = vec![0u64; p * mine.len()];
    let counts = vec![mine.len(); p];
    comm.all_to_all_v(&send, &counts, &mut recv, &counts)?;
    Ok(recv)
}

fn kind_code(kind: Option<ErrorKind>) -> u64 {
    match kind {
        None => 0,
        Some(ErrorKind::Type) => 1,
        Some(ErrorKind::Value) => 2,
        Some(ErrorKind::Memory) => 3,
        Some(ErrorKind::Runtime) => 4,
    }
}

fn kind_of(code: u64) -> ErrorKind {
    match code {
        1 => ErrorKind::Type,
        2 => ErrorKind::Value,
        3 => ErrorKind::Memory,
        _ => ErrorKind::Runtime,
    }
}

/// Agrees on every rank's verdict on its own input before any of it is exchanged: `local`
/// unchanged on every rank when every rank's is `Ok`; otherwise the refusing ranks return their
/// own errors and every other rank [`Error::PeerInput`] with the lowest refusing rank's kind and
/// message. One all-to-all of two words per rank, and one carrying the messages only when some
/// rank refused; a failure of the exchange itself is returned as is.
///
/// ```
/// use flatpeak_common::comm::agree_on_inputs;
/// use flatpeak_common::{Communicator, Error, ErrorKind, LocalGroup, LocalGroupOptions};
///
/// let verdicts = LocalGroup::run(3, LocalGroupOptions::default(), |comm| {
///     let local = if comm.rank() == 1 { Err(Error::invalid_config("experts", 9, "< 8")) } else { Ok(()) };
///     Ok(agree_on_inputs(comm, local))
/// });
/// let verdicts: Vec<_> = verdicts.into_iter().map(|r| r.unwrap()).collect();
/// assert!(matches!(&verdicts[1], Err(Error::InvalidConfig { field: "experts", .. })));
/// for r in [0, 2] {
///     let Err(Error::PeerInput { rank: 1, kind: ErrorKind::Value, message }) = &verdicts[r] else { panic!() };
///     assert!(message.contains("experts = 9"));
/// }
/// ```
pub fn agree_on_inputs<C, T, E>(comm: &C, local: std::result::Result<T, E>) -> std::result::Result<T, E>
where
    C: Communicator + ?Sized,
    E: HasErrorKind + std::fmt::Display + From<Error>,
{
    agree_and_gather(comm, local, &[]).map(|(value, _)| value)
}

/// [`agree_on_inputs`], with `extra` words from every rank gathered beside the verdicts (the same
/// number on every rank, whatever its verdict): on every rank `Ok` with the value and every
/// rank's words in rank order when every rank's verdict is `Ok`. The one exchange of the
/// verdicts carries them, so a call that needs a few numbers from every rank (a step's Σg²)
/// agrees and gathers in one collective.
pub fn agree_and_gather<C, T, E>(
    comm: &C,
    local: std::result::Result<T, E>,
    extra: &[u64],
) -> std::result::Result<(T, Vec<u64>), E>
where
    C: Communicator + ?Sized,
    E: HasErrorKind + std::fmt::Display + From<Error>,
{
    let refusal = local.as_ref().err().map(|e| (e.error_kind(), e.to_string()));
    match (agree(comm, refusal, extra), local) {
        (_, Err(own)) => Err(own),
        (Err(peer), Ok(_)) => Err(peer.into()),
        (Ok(words), Ok(value)) => Ok((value, words)),
    }
}

fn agree<C: Communicator + ?Sized>(
    comm: &C,
    refusal: Option<(ErrorKind, String)>,
    extra: &[u64],
) -> Result<Vec<u64>> {
    let message = refusal.as_ref().map_or(&[][..], |(_, m)| m.as_bytes());
    let mut mine = vec![kind_code(refusal.as_ref().map(|(k, _)| *k)), message.len() as u64];
    mine.extend_from_slice(extra);
    let width = mine.len();
    let verdicts = all_gather_words(comm, &mine)?;
    let Some(rank) = verdicts.chunks_exact(width).position(|v| v[0] != 0) else {
        return Ok(verdicts.chunks_exact(width).flat_map(|v| v[2..].iter().copied()).collect());
    };
    // Some rank refused: every rank sends its message to every rank (the lengths are known to
    // all), and each returns the lowest refusing rank's.
    let p = comm.world_size();
    let lengths: Vec<usize> = verdicts.chunks_exact(width).map(|v| v[1] as usize).collect();
    let send: Vec<u8> = (0..p).flat_map(|_| message.iter().copied()).collect();
    let mut recv = vec![0u8; lengths.iter().sum()];
    comm.all_to_all_v(&send, &vec![message.len(); p], &mut recv, &lengths)?;
    let start: usize = lengths[..rank].iter().sum();
    let text = String::from_utf8_lossy(&recv[start..start + lengths[rank]]).into_owned();
    Err(Error::PeerInput { rank, kind: kind_of(verdicts[width * rank]), message: text })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LocalGroup, LocalGroupOptions};

    #[test]
    fn every_rank_returns_together_with_the_lowest_refusal() {
        // Ranks 1 and 3 refuse (a dtype and a value): rank 1's error reaches 0 and 2; each
        // refusing rank keeps its own.
        let results = LocalGroup::run(4, LocalGroupOptions::default(), |comm| {
            let local: Result<u32> = match comm.rank() {
                1 => Err(Error::invalid_config("dtype", "float64", "float32 or bfloat16")),
                3 => Err(Error::ShapeMismatch { what: "x", expected: 4, got: 5 }),
                r => Ok(r as u32),
            };
            Ok(agree_on_inputs(comm, local))
        });
        let results: Vec<Result<u32>> = results.into_iter().map(|r| r.unwrap()).collect();
        assert!(matches!(results[1], Err(Error::InvalidConfig { field: "dtype", .. })));
        assert!(matches!(results[3], Err(Error::ShapeMismatch { what: "x", .. })));
        for r in [0, 2] {
            match &results[r] {
                Err(Error::PeerInput { rank: 1, kind: ErrorKind::Value, message }) => {
                    assert!(message.contains("dtype = \"float64\""), "{message}")
                }
                other => panic!("rank {r}: {other:?}"),
            }
        }
        // All fine: every rank keeps its value.
        let fine = LocalGroup::run(3, LocalGroupOptions::default(), |comm| {
            agree_on_inputs::<_, _, Error>(comm, Ok(comm.rank()))
        });
        assert_eq!(fine.into_iter().map(|r| r.unwrap()).collect::<Vec<_>>(), vec![0, 1, 2]);
    }

    #[test]
    fn words_are_gathered_in_rank_order() {
        let out = LocalGroup::run(3, LocalGroupOptions::default(), |comm| {
            all_gather_words(comm, &[comm.rank() as u64, 10 + comm.rank() as u64])
        });
        for r in out {
            assert_eq!(r.unwrap(), vec![0, 10, 1, 11, 2, 12]);
        }
    }
}
