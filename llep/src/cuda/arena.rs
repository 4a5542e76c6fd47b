//! Device memory a caller lends for one call's buffers ([`DeviceArena`]) and the buffer type that
//! knows whether it may free its memory ([`DevSlice`]).
//!
//! A framework with its own caching allocator (torch's) lends one zeroed byte buffer of the
//! plan's [`device_arena_bytes`](crate::Plan::device_arena_bytes); every buffer the call
//! allocates (dispatch buffers, expert scratch, index lists, outputs) is carved from it in
//! order, [`DeviceArena::ALIGN`]-aligned, so the framework's allocator sees the whole device
//! working set and reuses it. A carve is never freed by llep: the lender frees the memory after
//! the call's last operation.

use std::cell::Cell;
use std::fmt;
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};

use flatpeak_common::cuda::cudarc::driver::CudaSlice;

use crate::error::{Error, Result};

/// One call's lent device memory: `len` bytes from device address `base`, carved front to back.
#[derive(Debug)]
pub struct DeviceArena {
    base: u64,
    len: usize,
    next: Cell<usize>,
}

impl DeviceArena {
    /// The alignment of every carve (cuBLAS's and the kernels' vector loads need 16; 256 is
    /// what CUDA's allocators give): [`Buffers::DEVICE_ALIGN`](crate::Buffers::DEVICE_ALIGN).
    pub const ALIGN: usize = crate::Buffers::DEVICE_ALIGN;

    /// The `len` bytes at device address `base`.
    ///
    /// # Safety
    /// `base..base + len` is device memory of the CUDA context the ops run in, `ALIGN`-aligned
    /// and zeroed; nothing else reads or writes it from now until every operation issued on
    /// buffers carved from it has completed, and it stays allocated until then (the lender frees
    /// it only after the call's streams are done with it).
    pub unsafe fn new(base: u64, len: usize) -> Self {
        Self { base, len, next: Cell::new(0) }
    }

    /// Bytes carved so far, alignment included.
    pub fn used(&self) -> usize {
        self.next.get()
    }

    /// The device address of `bytes` fresh bytes: the next `ALIGN`-aligned offset, disjoint from
    /// every earlier carve; [`Error::ShapeMismatch`] naming the bytes needed when they do not fit.
    pub(super) fn carve(&self, bytes: usize) -> Result<u64> {
        let at = self.next.get().next_multiple_of(Self::ALIGN);
        let end = at.checked_add(bytes).filter(|&end| end <= self.len).ok_or(Error::ShapeMismatch {
            what: "device memory lent for the call (bytes)",
            expected: at.saturating_add(bytes),
            got: self.len,
        })?;
        self.next.set(end);
        Ok(self.base + at as u64)
    }
}

/// Who frees a [`DevSlice`]'s memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Owner {
    /// llep allocated it through cudarc: freed (in stream order) on drop.
    Llep,
    /// A caller lent it (a [`DeviceArena`] carve, a framework's tensor): never freed here.
    Lender,
}

/// A device buffer: one llep allocated (freed when dropped) or one over memory a caller lent
/// (given back untouched when dropped). Derefs to the cudarc slice every operation takes.
pub struct DevSlice<T> {
    slice: ManuallyDrop<CudaSlice<T>>,
    owner: Owner,
}

impl<T> DevSlice<T> {
    /// A buffer llep allocated: freed on drop.
    pub fn owned(slice: CudaSlice<T>) -> Self {
        Self { slice: ManuallyDrop::new(slice), owner: Owner::Llep }
    }

    /// A buffer over lent memory: dropping it leaks the slice (the memory is the lender's).
    pub fn lent(slice: CudaSlice<T>) -> Self {
        Self { slice: ManuallyDrop::new(slice), owner: Owner::Lender }
    }
}

impl<T> Drop for DevSlice<T> {
    fn drop(&mut self) {
        // SAFETY: `slice` is taken once, here, and never used again.
        let slice = unsafe { ManuallyDrop::take(&mut self.slice) };
        match self.owner {
            Owner::Llep => drop(slice),
            Owner::Lender => {
                let _ = slice.leak();
            }
        }
    }
}

impl<T> Deref for DevSlice<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T> DerefMut for DevSlice<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}

impl<T> fmt::Debug for DevSlice<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DevSlice").field("len", &self.slice.len()).field("owner", &self.owner).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carves_are_aligned_disjoint_and_bounded() {
        // SAFETY: nothing is read or written through these addresses; only the carving is tested.
        let arena = unsafe { DeviceArena::new(1 << 20, 1024) };
        let a = arena.carve(10).unwrap();
        let b = arena.carve(1).unwrap();
        let c = arena.carve(256).unwrap();
        assert_eq!((a, b, c), ((1 << 20), (1 << 20) + 256, (1 << 20) + 512));
        assert_eq!(arena.used(), 768);
        // 256 more bytes fit exactly; one more byte does not, and the error names the bytes.
        let e = arena.carve(257).unwrap_err();
        assert!(matches!(e, Error::ShapeMismatch { expected: 1025, got: 1024, .. }), "{e}");
        assert_eq!(arena.used(), 768, "a refused carve takes nothing");
        assert_eq!(arena.carve(256).unwrap(), (1 << 20) + 768);
        assert!(arena.carve(usize::MAX).is_err(), "no overflow");
    }
}
