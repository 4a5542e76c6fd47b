//! [`ScatterGroups`]: a scatter-add's rows grouped by destination, the layout
//! `llep_scatter_add_rows` reads so that every (destination row, column) is one thread and the
//! additions into it stay in input order. Written once, for every backend that runs the kernel
//! (the CUDA device and the SIMT emulator).
//!
//! `acc[index[r]] += scale_r · src[r]` for r = 0, 1, …, rows − 1 is, per destination d, the sum
//! over the rows r with `index[r] = d` in increasing r. Grouping the rows by destination (a
//! stable counting sort: O(rows + destinations) on the host, which already holds the index)
//! keeps that order inside each group and makes the groups independent: the kernel's
//! parallelism is groups × width instead of width, with the same additions in the same order
//! (bitwise the same result, no atomics). Device bytes: 4·(2·groups + 1 + rows).

use crate::error::{Error, Result};

/// The rows of a scatter-add grouped by destination, packed in one u32 buffer:
/// `offsets[0..=groups]`, then `dests[0..groups]` (ascending), then `sources[0..rows]` (group g's
/// rows are `sources[offsets[g]..offsets[g + 1]]`, ascending).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScatterGroups {
    packed: Vec<u32>,
    groups: usize,
}

impl ScatterGroups {
    /// Groups `index` (each entry a destination row below `bound`) by destination.
    /// [`Error::ShapeMismatch`] names the first entry out of bounds; more rows than a u32 counts
    /// is [`Error::SizeOverflow`](flatpeak_common::Error::SizeOverflow).
    pub fn new(index: &[u32], bound: usize) -> Result<Self> {
        let rows = index.len();
        if u32::try_from(rows).is_err() {
            return Err(flatpeak_common::Error::SizeOverflow { what: "llep scatter rows (u32)" }.into());
        }
        if let Some(&i) = index.iter().find(|&&i| i as usize >= bound) {
            return Err(Error::ShapeMismatch {
                what: "row index (rows of acc)",
                expected: bound,
                got: i as usize + 1,
            });
        }
        // Counting sort: the rows of each destination, in input order.
        let mut count = vec![0u32; bound];
        for &d in index {
            count[d as usize] += 1;
        }
        let dests: Vec<u32> = (0..bound as u32).filter(|&d| count[d as usize] > 0).collect();
        let groups = dests.len();
        let mut packed = Vec::with_capacity(2 * groups + 1 + rows);
        packed.push(0u32);
        let mut start = vec![0u32; bound];
        let mut end = 0u32;
        for &d in &dests {
            start[d as usize] = end;
            end += count[d as usize];
            packed.push(end);
        }
        packed.extend_from_slice(&dests);
        let base = packed.len();
        packed.resize(base + rows, 0);
        for (r, &d) in index.iter().enumerate() {
            let at = &mut start[d as usize];
            packed[base + *at as usize] = r as u32;
            *at += 1;
        }
        Ok(Self { packed, groups })
    }

    /// The number of destinations the scatter adds into.
    pub fn groups(&self) -> usize {
        self.groups
    }

    /// The packed buffer the kernel reads (offsets, destinations, sources).
    pub fn packed(&self) -> &[u32] {
        &self.packed
    }
}

/// How a scatter-add runs on a device: [`Direct`](ScatterLayout::Direct) when no destination
/// takes two rows (then row r's thread adds into `acc[index[r]]` alone: the serial order's result
/// with nothing to upload, reading the index already on the device), else
/// [`Grouped`](ScatterLayout::Grouped) by destination. A round's expert group takes each received
/// row at most once (a token's top-k experts are distinct), so its scatters are direct; a
/// caller's duplicate token indices are grouped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScatterLayout {
    /// Every destination distinct: one thread per (row, column), the index as it is.
    Direct,
    /// Some destination repeated: the rows grouped by destination, uploaded for the kernel.
    Grouped(ScatterGroups),
}

impl ScatterLayout {
    /// The layout of a scatter of `index`'s rows into `bound` destination rows (one O(rows +
    /// bound) pass; [`ScatterGroups::new`] only on a repeat). Errors as [`ScatterGroups::new`].
    pub fn of(index: &[u32], bound: usize) -> Result<Self> {
        let mut seen = vec![0u64; bound.div_ceil(64)];
        for &d in index {
            let d = d as usize;
            if d >= bound {
                return Err(Error::ShapeMismatch {
                    what: "row index (rows of acc)",
                    expected: bound,
                    got: d + 1,
                });
            }
            let (word, bit) = (d / 64, 1u64 << (d % 64));
            if seen[word] & bit != 0 {
                return ScatterGroups::new(index, bound).map(Self::Grouped);
            }
            seen[word] |= bit;
        }
        Ok(Self::Direct)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinct_destinations_scatter_directly_and_a_repeat_is_grouped() {
        assert_eq!(ScatterLayout::of(&[3, 0, 2], 4).unwrap(), ScatterLayout::Direct);
        assert_eq!(ScatterLayout::of(&[], 0).unwrap(), ScatterLayout::Direct);
        let grouped = ScatterLayout::of(&[3, 0, 3], 4).unwrap();
        assert_eq!(grouped, ScatterLayout::Grouped(ScatterGroups::new(&[3, 0, 3], 4).unwrap()));
        let e = ScatterLayout::of(&[1, 4], 4).unwrap_err();
        assert!(matches!(e, Error::ShapeMismatch { expected: 4, got: 5, .. }), "{e}");
        // A repeat after an out-of-bounds entry's position is still refused by the grouping.
        let e = ScatterLayout::of(&[1, 1, 9], 4).unwrap_err();
        assert!(matches!(e, Error::ShapeMismatch { expected: 4, got: 10, .. }), "{e}");
    }

    #[test]
    fn rows_are_grouped_by_destination_in_input_order() {
        let g = ScatterGroups::new(&[4, 1, 4, 0, 1, 4], 6).unwrap();
        assert_eq!(g.groups(), 3);
        // offsets, destinations ascending, then each destination's rows ascending.
        assert_eq!(g.packed(), &[0, 1, 3, 6, 0, 1, 4, 3, 1, 4, 0, 2, 5]);
        let injective = ScatterGroups::new(&[2, 0, 1], 3).unwrap();
        assert_eq!(injective.packed(), &[0, 1, 2, 3, 0, 1, 2, 1, 2, 0]);
        let empty = ScatterGroups::new(&[], 0).unwrap();
        assert_eq!((empty.groups(), empty.packed()), (0, &[0u32][..]));
        let e = ScatterGroups::new(&[0, 7], 7).unwrap_err();
        assert!(matches!(e, Error::ShapeMismatch { expected: 7, got: 8, .. }), "{e}");
    }

    #[test]
    fn replaying_the_groups_gives_the_serial_sums_bit_for_bit() {
        // f32 additions in a different order would differ in the last bits: the groups must
        // replay each destination's additions in input order.
        let index: Vec<u32> = (0..500u32).map(|r| (r * 7919 + r / 3) % 37).collect();
        let values: Vec<f32> = (0..500).map(|r| 1.0 + (r as f32) * 1e-3 + 1e7 * ((r % 5) as f32)).collect();
        let mut serial = vec![0.5f32; 37];
        for (r, &d) in index.iter().enumerate() {
            serial[d as usize] += values[r];
        }
        let g = ScatterGroups::new(&index, 37).unwrap();
        let (offsets, rest) = g.packed().split_at(g.groups() + 1);
        let (dests, sources) = rest.split_at(g.groups());
        let mut grouped = vec![0.5f32; 37];
        for (u, &d) in dests.iter().enumerate() {
            for &r in &sources[offsets[u] as usize..offsets[u + 1] as usize] {
                grouped[d as usize] += values[r as usize];
            }
        }
        assert_eq!(grouped, serial);
    }
}
