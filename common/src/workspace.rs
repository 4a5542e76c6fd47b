//! [`Workspace`]: one host reservation made at launch, carved into typed, aligned buffers.
//!
//! The schedules of flatpeak size their working set in a plan, reserve it once, and carve every
//! buffer they use out of that reservation. A carve past capacity is
//! [`Error::WorkspaceExhausted`](crate::Error::WorkspaceExhausted): the workspace never grows,
//! so the bytes a plan reports are the bytes the schedule can touch.
//!
//! ```
//! use flatpeak_common::Workspace;
//! let mut ws = Workspace::new(1 << 20)?;
//! let (a, b) = (ws.take::<f32>(1000)?, ws.take_zeroed::<u64>(10)?);
//! a.fill(1.0);
//! assert_eq!(b.iter().sum::<u64>(), 0);
//! assert!(ws.take::<u8>(2 << 20).is_err()); // never grows
//! ws.reset(); // every carve returned; the high-water mark stays
//! assert_eq!(ws.high_water(), 4032 + 80);
//! # Ok::<(), flatpeak_common::Error>(())
//! ```

use std::cell::RefCell;
use std::ptr::NonNull;

use bytemuck::Pod;

use crate::arena::{Arena, REGION_ALIGN};
use crate::error::Result;

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct CacheLine([u8; REGION_ALIGN]);

/// A fixed host reservation carved by a bump allocator.
///
/// Carving takes `&self` and hands out disjoint `&mut` slices (like an arena allocator);
/// [`Workspace::reset`] takes `&mut self`, so it can only run once every slice is gone.
pub struct Workspace {
    /// Start of the reservation: from `Box::into_raw` (freed in `Drop`) or the caller's memory
    /// ([`Workspace::from_raw`], never freed here), as `owner` says.
    lines: NonNull<[CacheLine]>,
    owner: Owner,
    arena: RefCell<Arena>,
}

/// Who frees a workspace's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Owner {
    /// The workspace: it allocated the memory and frees it when dropped.
    Workspace,
    /// The caller of [`Workspace::from_raw`]: the memory outlives the workspace.
    Caller,
}

// SAFETY: `Workspace` has sole access to its reservation, owned (like a `Box<[u8]>`) or lent for
// its whole life under `from_raw`'s contract, and the slices it hands out borrow it, so moving
// it to another thread moves sole access with it.
unsafe impl Send for Workspace {}

impl std::fmt::Debug for Workspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workspace").field("arena", &*self.arena.borrow()).finish()
    }
}

impl Workspace {
    /// Reserves `capacity` bytes (zero-filled, rounded up to whole cache lines) now, once. A
    /// reservation the system refuses (or one past `isize::MAX`) is
    /// [`Error::HostAlloc`](crate::Error::HostAlloc) with the size asked for, never an abort.
    pub fn new(capacity: usize) -> Result<Self> {
        let n_lines = capacity.div_ceil(REGION_ALIGN);
        let refused = crate::Error::HostAlloc { what: "a workspace", bytes: capacity };
        let boxed: Box<[CacheLine]> = if n_lines == 0 {
            Box::new([])
        } else {
            let layout = std::alloc::Layout::array::<CacheLine>(n_lines).map_err(|_| refused.clone())?;
            // SAFETY: `layout` has a non-zero size (n_lines ≥ 1 lines of 64 B).
            let ptr = unsafe { std::alloc::alloc_zeroed(layout) } as *mut CacheLine;
            if ptr.is_null() {
                return Err(refused);
            }
            // SAFETY: `ptr` is a fresh allocation of exactly `Layout::array::<CacheLine>(n_lines)`
            // (the layout `Box<[CacheLine]>` frees with), zero-filled, and all-zero bytes are a
            // valid `CacheLine`; the box takes sole ownership.
            unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr, n_lines)) }
        };
        let lines = NonNull::from(Box::leak(boxed));
        Ok(Self { lines, owner: Owner::Workspace, arena: RefCell::new(Arena::new(capacity)) })
    }

    /// A workspace carved from the caller's `capacity` bytes at `ptr` (a framework's tensor),
    /// which it neither zeroes nor frees. `ptr` must be aligned to 64 bytes
    /// ([`Error::InvalidConfig`](crate::Error::InvalidConfig) otherwise); only whole 64-byte lines
    /// are carved, so the capacity is rounded down to one.
    ///
    /// # Safety
    /// For as long as the workspace lives, the `capacity` bytes at `ptr` must be valid for reads
    /// and writes, initialised, and accessed by nothing else.
    pub unsafe fn from_raw(ptr: NonNull<u8>, capacity: usize) -> Result<Self> {
        if !(ptr.as_ptr() as usize).is_multiple_of(REGION_ALIGN) {
            return Err(crate::Error::InvalidConfig {
                field: "workspace address",
                value: format!("{:#x}", ptr.as_ptr() as usize),
                reason: "a multiple of 64 (a cache line)",
            });
        }
        let n_lines = capacity / REGION_ALIGN;
        let lines = NonNull::slice_from_raw_parts(ptr.cast::<CacheLine>(), n_lines);
        Ok(Self { lines, owner: Owner::Caller, arena: RefCell::new(Arena::new(n_lines * REGION_ALIGN)) })
    }

    /// Carves `len` elements of `T`. Their contents are whatever the last user of those bytes
    /// left (always a valid `T`, since `T: Pod` and the reservation starts zeroed).
    #[allow(clippy::mut_from_ref)] // disjoint carves of an owned reservation, as in bump arenas
    pub fn take<T: Pod>(&self, len: usize) -> Result<&mut [T]> {
        let region = self.arena.borrow_mut().carve::<T>(len)?;
        let base = self.lines.as_ptr() as *mut u8;
        // SAFETY: the arena returned `[offset, offset + bytes)` inside the reservation (it checks
        // `end <= capacity <= n_lines·64`), disjoint from every region carved since the last
        // `reset`, which needs `&mut self` and so cannot run while this borrow of `self` lives.
        // The offset and the base are 64-aligned and `align_of::<T>() <= 64`; every byte was
        // initialised (zero, a previous `Pod` value, or the caller's initialised bytes under
        // `from_raw`) and any bit pattern is a valid `T: Pod`.
        unsafe {
            let ptr = base.add(region.offset()) as *mut T;
            Ok(std::slice::from_raw_parts_mut(ptr, region.len()))
        }
    }

    /// Carves `len` elements of `T`, set to zero.
    #[allow(clippy::mut_from_ref)] // see `take`
    pub fn take_zeroed<T: Pod>(&self, len: usize) -> Result<&mut [T]> {
        let slice = self.take::<T>(len)?;
        slice.fill(T::zeroed());
        Ok(slice)
    }

    /// Returns every carve to the workspace. The high-water mark is kept.
    pub fn reset(&mut self) {
        self.arena.get_mut().reset();
    }

    /// Bytes reserved at launch.
    pub fn capacity(&self) -> usize {
        self.arena.borrow().capacity()
    }
    /// Bytes carved since the last reset, alignment padding included.
    pub fn used(&self) -> usize {
        self.arena.borrow().used()
    }
    /// The most bytes ever carved at once: what the schedule really needed of its plan.
    pub fn high_water(&self) -> usize {
        self.arena.borrow().high_water()
    }
}

impl Drop for Workspace {
    fn drop(&mut self) {
        if self.owner == Owner::Caller {
            return; // the caller's memory, lent for the workspace's life
        }
        // SAFETY: an owned `lines` came from `Box::leak` in `new` and is freed only here, once;
        // no carved slice can outlive `&self`, so none is alive now.
        drop(unsafe { Box::from_raw(self.lines.as_ptr()) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    #[test]
    fn a_workspace_over_caller_memory_carves_it_and_leaves_it_to_the_caller() {
        let mut backing = vec![CacheLine([7; REGION_ALIGN]); 4];
        let ptr = NonNull::new(backing.as_mut_ptr().cast::<u8>()).unwrap();
        // SAFETY: `backing` holds 256 initialised bytes, 64-aligned, untouched while `ws` lives.
        let ws = unsafe { Workspace::from_raw(ptr, 4 * REGION_ALIGN + 10) }.unwrap();
        assert_eq!(ws.capacity(), 4 * REGION_ALIGN); // whole lines only
        let a = ws.take::<u32>(3).unwrap();
        assert_eq!(a, [0x0707_0707; 3]); // not zeroed: the caller's bytes
        a.fill(1);
        assert!(ws.take::<u8>(4 * REGION_ALIGN).is_err());
        drop(ws);
        assert_eq!(&backing[0].0[..4], &[1, 0, 0, 0]); // written through, not freed
        // SAFETY: the address is one byte past a 64-aligned one; refused before any access.
        let odd = unsafe { Workspace::from_raw(ptr.add(1), 64) };
        assert!(matches!(odd, Err(Error::InvalidConfig { field: "workspace address", .. })));
    }

    #[test]
    fn carves_are_disjoint_and_aligned() {
        let ws = Workspace::new(4096).unwrap();
        let a = ws.take::<f32>(17).unwrap();
        let b = ws.take::<u16>(9).unwrap();
        a.fill(3.0);
        b.fill(7);
        assert!(a.iter().all(|&x| x == 3.0));
        assert_eq!(a.as_ptr() as usize % 64, 0);
        assert_eq!(b.as_ptr() as usize % 64, 0);
        assert_eq!(b.as_ptr() as usize - a.as_ptr() as usize, 128);
        assert_eq!(ws.used(), 128 + 18);
    }

    #[test]
    fn exhaustion_carries_the_numbers() {
        let ws = Workspace::new(256).unwrap();
        ws.take::<u8>(200).unwrap();
        match ws.take::<f32>(10) {
            Err(Error::WorkspaceExhausted { requested, used, capacity }) => {
                assert_eq!((requested, used, capacity), (56 + 40, 200, 256));
            }
            other => panic!("expected exhaustion, got {other:?}"),
        }
    }

    #[test]
    fn reset_reuses_memory_and_keeps_high_water() {
        let mut ws = Workspace::new(1 << 16).unwrap();
        let first = ws.take_zeroed::<u32>(1000).unwrap().as_ptr() as usize;
        ws.reset();
        let again = ws.take::<u32>(10).unwrap();
        assert_eq!(again.as_ptr() as usize, first);
        assert_eq!(ws.high_water(), 4000);
        assert_eq!(ws.capacity(), 1 << 16);
    }

    #[test]
    fn zero_capacity_allows_only_empty_carves() {
        let ws = Workspace::new(0).unwrap();
        assert!(ws.take::<f64>(0).unwrap().is_empty());
        assert!(ws.take::<f64>(1).is_err());
    }

    #[test]
    fn a_reservation_the_system_refuses_is_a_typed_error_not_an_abort() {
        for bytes in [usize::MAX, 1 << 62, 1 << 50] {
            match Workspace::new(bytes) {
                Err(Error::HostAlloc { bytes: asked, .. }) => assert_eq!(asked, bytes),
                other => panic!("{bytes} B: expected HostAlloc, got {other:?}"),
            }
        }
    }
}
