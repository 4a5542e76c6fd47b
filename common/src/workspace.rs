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
    /// Start of the reservation (64-aligned): inside the workspace's own allocation (freed in
    /// `Drop`) or the caller's memory ([`Workspace::from_raw`], never freed here), as `owner`
    /// says.
    lines: NonNull<[CacheLine]>,
    owner: Owner,
    arena: RefCell<Arena>,
}

/// Who frees a workspace's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Owner {
    /// The workspace: it allocated `layout` at `ptr` (`lines` starts at the first 64-aligned
    /// byte of it) and frees it when dropped.
    Workspace { ptr: NonNull<u8>, layout: std::alloc::Layout },
    /// The caller of [`Workspace::from_raw`]: the memory outlives the workspace. (An empty
    /// workspace owns nothing either: its lines are a dangling, zero-length slice.)
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
    /// Reserves `capacity` bytes (zero-filled, rounded up to whole cache lines) now, once. The
    /// bytes come from `calloc` (byte-aligned, then the first cache line boundary taken), so a
    /// large reservation is fresh zero pages the system maps as they are first written: a
    /// region a schedule carves but its path never touches does not count in the resident set.
    /// A reservation the system refuses (or one past `isize::MAX`) is
    /// [`Error::HostAlloc`](crate::Error::HostAlloc) with the size asked for, never an abort.
    pub fn new(capacity: usize) -> Result<Self> {
        let n_lines = capacity.div_ceil(REGION_ALIGN);
        let refused = crate::Error::HostAlloc { what: "a workspace", bytes: capacity };
        if n_lines == 0 {
            let lines = NonNull::slice_from_raw_parts(NonNull::<CacheLine>::dangling(), 0);
            return Ok(Self { lines, owner: Owner::Caller, arena: RefCell::new(Arena::new(0)) });
        }
        let bytes = n_lines.checked_mul(REGION_ALIGN).and_then(|b| b.checked_add(REGION_ALIGN - 1));
        let layout =
            bytes.and_then(|b| std::alloc::Layout::from_size_align(b, 1).ok()).ok_or(refused.clone())?;
        // SAFETY: `layout` has a non-zero size (at least one line of 64 B).
        let ptr = NonNull::new(unsafe { std::alloc::alloc_zeroed(layout) }).ok_or(refused)?;
        let skip = ptr.as_ptr().align_offset(REGION_ALIGN);
        // SAFETY: `skip < 64`, and the allocation holds `n_lines·64 + 63` bytes, so the
        // `n_lines` lines from the first 64-aligned byte lie inside it; they are zero bytes, a
        // valid `CacheLine`, owned by this workspace alone until `Drop` frees the allocation.
        let first = unsafe { NonNull::new_unchecked(ptr.as_ptr().add(skip)) }.cast::<CacheLine>();
        let lines = NonNull::slice_from_raw_parts(first, n_lines);
        Ok(Self { lines, owner: Owner::Workspace { ptr, layout }, arena: RefCell::new(Arena::new(capacity)) })
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
        let Owner::Workspace { ptr, layout } = self.owner else {
            return; // the caller's memory, lent for the workspace's life (or none at all)
        };
        // SAFETY: `ptr` was allocated in `new` with exactly `layout` and is freed only here,
        // once; no carved slice can outlive `&self`, so none is alive now.
        unsafe { std::alloc::dealloc(ptr.as_ptr(), layout) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    /// A reservation's lines count in the resident set only once written (Linux).
    #[cfg(target_os = "linux")]
    #[test]
    fn untouched_lines_are_not_resident() {
        let resident = crate::host_pages::resident_bytes;
        let before = resident();
        let ws = Workspace::new(512 << 20).unwrap();
        let carved = ws.take::<u8>(1 << 20).unwrap();
        assert!(carved.iter().all(|&b| b == 0));
        carved.fill(3);
        let after = resident();
        assert!(after.saturating_sub(before) < 128 << 20, "{before} -> {after}");
        assert_eq!(ws.take::<u64>(4).unwrap(), [0; 4]);
    }

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
