//! [`Parts`] and [`PartsMut`]: the two sides of an all-to-all-v, each a buffer with its per-rank
//! counts, checked in one place for every communicator.

use crate::error::{Error, Result};

/// The sending side of an all-to-all-v: `bytes` cut into one part per rank, `counts[r]` bytes
/// for rank r, in rank order.
#[derive(Debug, Clone, Copy)]
pub struct Parts<'a> {
    /// The concatenated parts.
    pub bytes: &'a [u8],
    /// Bytes per rank.
    pub counts: &'a [usize],
}

/// The receiving side of an all-to-all-v: `bytes` receives `counts[r]` bytes from rank r, in
/// rank order.
#[derive(Debug)]
pub struct PartsMut<'a> {
    /// Where the parts land, concatenated.
    pub bytes: &'a mut [u8],
    /// Bytes per rank.
    pub counts: &'a [usize],
}

impl<'a> Parts<'a> {
    /// The parts, in rank order (after [`check_parts`]: the counts are within the buffer).
    pub(crate) fn iter(&self) -> impl Iterator<Item = &'a [u8]> + '_ {
        offsets(self.counts).map(|(lo, hi)| &self.bytes[lo..hi])
    }
}

impl PartsMut<'_> {
    /// The parts, in rank order (after [`check_parts`]: the counts are within the buffer).
    pub(crate) fn iter_mut(&mut self) -> impl Iterator<Item = &mut [u8]> + '_ {
        let mut rest: &mut [u8] = self.bytes;
        self.counts.iter().map(move |&n| {
            let (part, tail) = std::mem::take(&mut rest).split_at_mut(n);
            rest = tail;
            part
        })
    }
}

/// Checks an all-to-all-v's two sides for a group of `world` ranks: one count per rank on each
/// side, each side's counts summing to its buffer's length ([`Error::ShapeMismatch`] naming the
/// side otherwise, [`Error::SizeOverflow`] when a sum overflows). Every communicator calls it
/// before any byte moves.
pub fn check_parts(world: usize, send: &Parts<'_>, recv: &PartsMut<'_>) -> Result<()> {
    check_side("all_to_all_v send counts", send.counts, world, send.bytes.len())?;
    check_side("all_to_all_v recv counts", recv.counts, world, recv.bytes.len())
}

fn check_side(what: &'static str, counts: &[usize], world: usize, len: usize) -> Result<()> {
    if counts.len() != world {
        return Err(Error::ShapeMismatch { what, expected: world, got: counts.len() });
    }
    let total =
        counts.iter().try_fold(0usize, |a, &c| a.checked_add(c)).ok_or(Error::SizeOverflow { what })?;
    if total != len {
        return Err(Error::ShapeMismatch { what, expected: total, got: len });
    }
    Ok(())
}

fn offsets(counts: &[usize]) -> impl Iterator<Item = (usize, usize)> + '_ {
    counts.iter().scan(0usize, |start, &n| {
        let range = (*start, *start + n);
        *start += n;
        Some(range)
    })
}
