//! The typed record every multi-rank call agrees on before any of its data moves: what each rank
//! brings ([`RankRecord`]: the kind of device, the storage type and the call's sizes and terms),
//! gathered once by [`agree_records`], so every rank holds every rank's record and computes the
//! same verdict from the same words.
//!
//! A rank whose own checks failed (a binding's [`Refusal`](crate::error::Refusal), a crate's validation) still enters
//! the agreement: the group agrees on the verdicts first, in the same exchange that carries the
//! call's name, so a bad input on one rank, or two ranks in different calls, is an error on every
//! rank instead of a wait. A disagreement found from the records is [`Error::Refused`] on the
//! rank it names and [`Error::PeerInput`] on every other ([`Agreed::refuse`]).

use super::Communicator;
use super::agree::{agree_and_gather, all_gather_words};
use crate::device::Device;
use crate::digest::Digest;
use crate::dtype::{DType, DTypeNames};
use crate::error::{Error, ErrorKind, HasErrorKind, Result};

/// The kind of device a rank's tensors live on. Ranks differ in ordinal (each drives its own
/// GPU), never in kind: the two kinds run different exchanges.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// Host memory.
    Cpu,
    /// A CUDA device.
    Cuda,
}

impl From<Device> for DeviceKind {
    fn from(device: Device) -> Self {
        match device {
            Device::Cpu => DeviceKind::Cpu,
            Device::Cuda(_) => DeviceKind::Cuda,
        }
    }
}

impl DeviceKind {
    fn code(self) -> u64 {
        match self {
            DeviceKind::Cpu => 0,
            DeviceKind::Cuda => 1,
        }
    }
    fn of(code: u64) -> Self {
        if code == 1 { DeviceKind::Cuda } else { DeviceKind::Cpu }
    }
    /// `CPU` or `CUDA`, as a message names it.
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::Cpu => "CPU",
            DeviceKind::Cuda => "CUDA",
        }
    }
}

fn dtype_code(dtype: DType) -> u64 {
    match dtype {
        DType::F32 => 0,
        DType::Bf16 => 1,
        DType::F16 => 2,
    }
}

fn dtype_of(code: u64) -> DType {
    match code {
        1 => DType::Bf16,
        2 => DType::F16,
        _ => DType::F32,
    }
}

/// A call's sizes and terms as a fixed number of words, written and read by the same code on
/// every rank (a crate's own typed struct: its tokens, hidden size, options digest, ...).
pub trait Words: Sized {
    /// Words of one rank's record.
    const LEN: usize;
    /// Writes the words into `out` (`LEN` of them).
    fn write(&self, out: &mut [u64]);
    /// Reads what [`write`](Words::write) wrote.
    fn read(words: &[u64]) -> Self;
}

impl<const N: usize> Words for [u64; N] {
    const LEN: usize = N;
    fn write(&self, out: &mut [u64]) {
        out.copy_from_slice(self);
    }
    fn read(words: &[u64]) -> Self {
        let mut out = [0u64; N];
        out.copy_from_slice(words);
        out
    }
}

/// What one rank brings to a multi-rank call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankRecord<S> {
    /// Where its tensors live.
    pub device: DeviceKind,
    /// Their storage type.
    pub dtype: DType,
    /// The call's own sizes and terms.
    pub sizes: S,
}

/// A multi-rank call as its ranks name it: every rank must be in the same one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Call {
    /// The call (`"ring-dtp ring forward"`): two ranks in different calls are refused.
    pub name: &'static str,
    /// How messages name dtypes (a Python binding's users read torch's names).
    pub names: DTypeNames,
}

/// Every rank's [`RankRecord`] of one call, in rank order, the same on every rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Agreed<S> {
    rank: usize,
    names: DTypeNames,
    ranks: Vec<RankRecord<S>>,
}

impl<S> Agreed<S> {
    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Every rank's record, in rank order.
    pub fn ranks(&self) -> &[RankRecord<S>] {
        &self.ranks
    }
    /// This rank's record.
    pub fn mine(&self) -> &RankRecord<S> {
        &self.ranks[self.rank]
    }
    /// How messages name dtypes.
    pub fn names(&self) -> DTypeNames {
        self.names
    }

    /// The refusal of what rank `rank` brought, as this rank returns it: [`Error::Refused`] on
    /// `rank` itself, [`Error::PeerInput`] on every other rank. Computed from the agreed
    /// records, it is the same verdict on every rank.
    pub fn refuse(&self, rank: usize, kind: ErrorKind, message: String) -> Error {
        if rank == self.rank {
            Error::Refused { kind, message }
        } else {
            Error::PeerInput { rank, kind, message }
        }
    }

    /// The first rank whose `key` differs from rank 0's, with its value and rank 0's.
    pub fn first_differing<T: PartialEq>(&self, key: impl Fn(&S) -> T) -> Option<(usize, T, T)> {
        let first = key(&self.ranks.first()?.sizes);
        self.ranks.iter().enumerate().skip(1).find_map(|(r, rec)| {
            let theirs = key(&rec.sizes);
            (theirs != first).then_some((r, theirs, key(&self.ranks[0].sizes)))
        })
    }
}

/// Agrees on every rank's record of `call` before any data moves, and on the kind of device and
/// the storage type: `local` is this rank's record, or why it has none.
///
/// One exchange carries every rank's verdict with the call's name: a rank that refused returns
/// its own error and every other [`Error::PeerInput`] with the lowest refusing rank's kind and
/// message; ranks in different calls are refused. A second gathers the records. Then every rank
/// checks, from the same records, that every rank's tensors are on the same kind of device and
/// of the same dtype as rank 0's ([`ErrorKind::Type`] otherwise, naming the first rank that
/// differs). The call's own rules over the sizes follow, on the [`Agreed`] records.
///
/// ```
/// use flatpeak_common::comm::{Call, DeviceKind, RankRecord, agree_records};
/// use flatpeak_common::{Communicator, DType, DTypeNames, Error, ErrorKind, LocalGroup, LocalGroupOptions};
///
/// let call = Call { name: "example", names: DTypeNames::Torch };
/// let out = LocalGroup::run(3, LocalGroupOptions::default(), |comm| {
///     let dtype = if comm.rank() == 2 { DType::Bf16 } else { DType::F32 };
///     let mine = RankRecord { device: DeviceKind::Cpu, dtype, sizes: [comm.rank() as u64 * 10, 64] };
///     Ok(agree_records::<_, _, Error>(comm, call, Ok(mine)))
/// });
/// let out: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
/// let Err(Error::Refused { kind: ErrorKind::Type, message }) = &out[2] else { panic!() };
/// assert_eq!(message, "rank 2 passed torch.bfloat16 tensors where rank 0 passed torch.float32");
/// assert!(matches!(&out[0], Err(Error::PeerInput { rank: 2, kind: ErrorKind::Type, .. })));
/// ```
pub fn agree_records<C, S, E>(
    comm: &C,
    call: Call,
    local: std::result::Result<RankRecord<S>, E>,
) -> std::result::Result<Agreed<S>, E>
where
    C: Communicator + ?Sized,
    S: Words,
    E: HasErrorKind + std::fmt::Display + From<Error>,
{
    let tag = Digest::new().str(call.name).usize(S::LEN).finish();
    let (mine, tags) = agree_and_gather(comm, local, &[tag])?;
    let rank = comm.rank();
    if let Some(other) = tags.iter().position(|&t| t != tags[0]) {
        let message = format!(
            "rank {other} is in another multi-rank call than rank 0 (this rank is in `{}`): every rank \
             must make the same calls in the same order",
            call.name
        );
        let refused = Agreed::<S> { rank, names: call.names, ranks: Vec::new() };
        return Err(refused.refuse(other, ErrorKind::Runtime, message).into());
    }
    let mut words = vec![0u64; 2 + S::LEN];
    words[0] = mine.device.code();
    words[1] = dtype_code(mine.dtype);
    mine.sizes.write(&mut words[2..]);
    let all = all_gather_words(comm, &words)?;
    let ranks: Vec<RankRecord<S>> = all
        .chunks_exact(2 + S::LEN)
        .map(|w| RankRecord { device: DeviceKind::of(w[0]), dtype: dtype_of(w[1]), sizes: S::read(&w[2..]) })
        .collect();
    let agreed = Agreed { rank, names: call.names, ranks };
    check_kinds(&agreed).map_err(E::from)?;
    Ok(agreed)
}

/// Every rank's device kind and dtype equal rank 0's.
fn check_kinds<S>(agreed: &Agreed<S>) -> Result<()> {
    let first = &agreed.ranks[0];
    for (r, rec) in agreed.ranks.iter().enumerate() {
        if rec.device != first.device {
            let message = format!(
                "rank {r} passed {} tensors where rank 0 passed {} tensors",
                rec.device.name(),
                first.device.name()
            );
            return Err(agreed.refuse(r, ErrorKind::Type, message));
        }
        if rec.dtype != first.dtype {
            let names = agreed.names;
            let message = format!(
                "rank {r} passed {} tensors where rank 0 passed {}",
                rec.dtype.name(names),
                first.dtype.name(names)
            );
            return Err(agreed.refuse(r, ErrorKind::Type, message));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LocalGroup, LocalGroupOptions};

    const CALL: Call = Call { name: "test", names: DTypeNames::Rust };

    fn record(device: DeviceKind, sizes: [u64; 2]) -> RankRecord<[u64; 2]> {
        RankRecord { device, dtype: DType::F32, sizes }
    }

    #[test]
    fn every_rank_holds_every_record_in_rank_order() {
        let out = LocalGroup::run(3, LocalGroupOptions::default(), |comm| {
            let r = comm.rank() as u64;
            agree_records::<_, _, Error>(comm, CALL, Ok(record(DeviceKind::Cuda, [r, 100 + r])))
        });
        for (me, agreed) in out.into_iter().enumerate() {
            let agreed = agreed.unwrap();
            assert_eq!(agreed.rank(), me);
            let sizes: Vec<[u64; 2]> = agreed.ranks().iter().map(|r| r.sizes).collect();
            assert_eq!(sizes, vec![[0, 100], [1, 101], [2, 102]]);
            assert_eq!(agreed.first_differing(|s| s[0]), Some((1, 1, 0)));
            assert_eq!(agreed.mine().device, DeviceKind::Cuda);
        }
    }

    #[test]
    fn a_device_kind_that_differs_is_refused_on_every_rank_naming_the_rank() {
        let out = LocalGroup::run(3, LocalGroupOptions::default(), |comm| {
            let device = if comm.rank() == 1 { DeviceKind::Cuda } else { DeviceKind::Cpu };
            Ok(agree_records::<_, _, Error>(comm, CALL, Ok(record(device, [0, 0]))))
        });
        let out: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
        let want = "rank 1 passed CUDA tensors where rank 0 passed CPU tensors";
        assert_eq!(out[1], Err(Error::Refused { kind: ErrorKind::Type, message: want.into() }));
        for r in [0, 2] {
            assert_eq!(
                out[r],
                Err(Error::PeerInput { rank: 1, kind: ErrorKind::Type, message: want.into() })
            );
        }
    }

    #[test]
    fn a_local_refusal_reaches_every_rank_and_the_group_stays_usable() {
        let out = LocalGroup::run(2, LocalGroupOptions::default(), |comm| {
            let local = if comm.rank() == 0 {
                Err(Error::from(crate::error::Refusal { kind: ErrorKind::Value, message: "x: wrong".into() }))
            } else {
                Ok(record(DeviceKind::Cpu, [1, 2]))
            };
            let refused = agree_records(comm, CALL, local);
            let again = agree_records::<_, _, Error>(comm, CALL, Ok(record(DeviceKind::Cpu, [3, 4])))?;
            Ok((refused, again.ranks().len()))
        });
        let out: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
        assert_eq!(out[0].0, Err(Error::Refused { kind: ErrorKind::Value, message: "x: wrong".into() }));
        let peer = Error::PeerInput { rank: 0, kind: ErrorKind::Value, message: "x: wrong".into() };
        assert_eq!(out[1].0, Err(peer));
        assert!(out.iter().all(|(_, n)| *n == 2));
    }

    #[test]
    fn ranks_in_different_calls_are_refused_not_left_waiting() {
        let out = LocalGroup::run(2, LocalGroupOptions::default(), |comm| {
            let call = Call { name: if comm.rank() == 0 { "forward" } else { "backward" }, ..CALL };
            Ok(agree_records::<_, _, Error>(comm, call, Ok(record(DeviceKind::Cpu, [0, 0]))))
        });
        let out: Vec<Error> = out.into_iter().map(|r| r.unwrap().unwrap_err()).collect();
        assert!(
            matches!(&out[0], Error::PeerInput { rank: 1, kind: ErrorKind::Runtime, message }
            if message.contains("another multi-rank call")),
            "{}",
            out[0]
        );
        assert!(matches!(&out[1], Error::Refused { kind: ErrorKind::Runtime, .. }), "{}", out[1]);
    }
}
