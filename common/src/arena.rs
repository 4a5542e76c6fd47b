//! Pure bump arithmetic shared by the host and device workspaces: sizing apart from compute.
//!
//! An [`Arena`] hands out aligned, typed [`Region`]s of one fixed reservation. It never grows:
//! a carve past capacity is [`Error::WorkspaceExhausted`]. It tracks the high-water mark so a
//! schedule can report the bytes it actually touched against what its plan reserved.

use std::marker::PhantomData;

use crate::error::{Error, Result};

/// Alignment of every region in bytes: one host cache line, and a multiple of the 16 B that the
/// kernels' vector loads need. (A device reservation itself starts 256 B aligned.)
pub const REGION_ALIGN: usize = 64;

/// A typed window `[offset, offset + len·size_of::<T>())` of a workspace, in bytes.
#[derive(Debug)]
pub struct Region<T> {
    offset: usize,
    len: usize,
    _ty: PhantomData<fn() -> T>,
}

impl<T> Clone for Region<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Region<T> {}

impl<T> Region<T> {
    /// Byte offset of the first element.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Number of `T` elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// True when the region holds no element.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Size in bytes.
    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
}

/// Bump allocator over `capacity` bytes. Pure bookkeeping: it owns no memory.
#[derive(Debug, Clone)]
pub struct Arena {
    capacity: usize,
    used: usize,
    high_water: usize,
}

impl Arena {
    /// An empty arena over `capacity` bytes.
    pub fn new(capacity: usize) -> Self {
        Self { capacity, used: 0, high_water: 0 }
    }

    /// Bytes a sequence of carves of these element byte sizes needs, padding included: the
    /// `*_req` half of "size, then compute". Feed it to [`Arena::new`] to hold exactly them.
    pub fn bytes_for(sizes_in_bytes: &[usize]) -> Result<usize> {
        let mut total = 0usize;
        for &bytes in sizes_in_bytes {
            total =
                align_up(total)?.checked_add(bytes).ok_or(Error::SizeOverflow { what: "arena request" })?;
        }
        Ok(total)
    }

    /// Carves `len` elements of `T`, aligned to [`REGION_ALIGN`].
    pub fn carve<T>(&mut self, len: usize) -> Result<Region<T>> {
        const { assert!(std::mem::align_of::<T>() <= REGION_ALIGN, "type aligned past 64 B") };
        let bytes =
            len.checked_mul(std::mem::size_of::<T>()).ok_or(Error::SizeOverflow { what: "region bytes" })?;
        let offset = align_up(self.used)?;
        let end = offset.checked_add(bytes).ok_or(Error::SizeOverflow { what: "region end" })?;
        if end > self.capacity {
            return Err(Error::WorkspaceExhausted {
                requested: end - self.used,
                used: self.used,
                capacity: self.capacity,
            });
        }
        self.used = end;
        self.high_water = self.high_water.max(end);
        Ok(Region { offset, len, _ty: PhantomData })
    }

    /// Releases every region (the high-water mark is kept).
    pub fn reset(&mut self) {
        self.used = 0;
    }

    /// Bytes reserved at launch.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
    /// Bytes carved since the last reset, padding included.
    pub fn used(&self) -> usize {
        self.used
    }
    /// The most bytes ever carved at once.
    pub fn high_water(&self) -> usize {
        self.high_water
    }
}

fn align_up(x: usize) -> Result<usize> {
    x.checked_add(REGION_ALIGN - 1)
        .map(|v| v & !(REGION_ALIGN - 1))
        .ok_or(Error::SizeOverflow { what: "alignment padding" })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carves_aligned_disjoint_regions() {
        let mut arena = Arena::new(1024);
        let a = arena.carve::<f32>(3).unwrap();
        let b = arena.carve::<u8>(5).unwrap();
        let c = arena.carve::<f64>(0).unwrap();
        assert_eq!((a.offset(), a.bytes()), (0, 12));
        assert_eq!((b.offset(), b.bytes()), (64, 5));
        assert_eq!(c.offset(), 128);
        assert!(c.is_empty());
        assert_eq!(arena.used(), 128);
        assert_eq!(Arena::bytes_for(&[12, 5, 0]).unwrap(), 128);
    }

    #[test]
    fn exhaustion_is_a_typed_error_and_leaves_state() {
        let mut arena = Arena::new(100);
        arena.carve::<u8>(60).unwrap();
        let err = arena.carve::<u8>(40).unwrap_err();
        assert_eq!(err, Error::WorkspaceExhausted { requested: 44, used: 60, capacity: 100 });
        assert_eq!(arena.used(), 60);
        let exact = arena.carve::<u8>(36).unwrap();
        assert_eq!(exact.offset(), 64);
        assert_eq!(arena.used(), 100);
    }

    #[test]
    fn high_water_survives_reset() {
        let mut arena = Arena::new(4096);
        arena.carve::<f32>(256).unwrap();
        arena.reset();
        arena.carve::<f32>(16).unwrap();
        assert_eq!(arena.high_water(), 1024);
        assert_eq!(arena.used(), 64);
    }

    #[test]
    fn overflow_is_reported() {
        let mut arena = Arena::new(usize::MAX);
        assert_eq!(
            arena.carve::<f64>(usize::MAX / 4).unwrap_err(),
            Error::SizeOverflow { what: "region bytes" }
        );
        assert!(Arena::bytes_for(&[usize::MAX, 1]).is_err());
    }
}
