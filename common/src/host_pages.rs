//! Page-level advice for large host buffers: transparent huge pages for a buffer streamed every
//! step, and giving back the pages of a buffer's part that is done with.

/// Asks the kernel to back `buf` with transparent huge pages (Linux `madvise(MADV_HUGEPAGE)`)
/// before it is first touched. A large buffer the CPU streams through every step (the offloaded
/// optimizer's state) then faults in 2 MiB pages, and its passes need 512× fewer page-table
/// entries than with 4 KiB pages. Advisory only: the whole 2 MiB pages inside `buf` are advised,
/// a refusal (THP disabled, another OS) changes nothing, and no byte is read or written.
pub fn advise_huge_pages<T>(buf: &mut [std::mem::MaybeUninit<T>]) {
    #[cfg(target_os = "linux")]
    {
        const HUGE_PAGE: usize = 2 << 20;
        let start = buf.as_mut_ptr() as usize;
        let end = start.saturating_add(std::mem::size_of_val(buf));
        let (lo, hi) = (start.next_multiple_of(HUGE_PAGE), end / HUGE_PAGE * HUGE_PAGE);
        if hi > lo {
            // SAFETY: `lo..hi` lies inside `buf`, memory this process has mapped for at least
            // the borrow; MADV_HUGEPAGE changes only how the kernel backs those pages, never their
            // contents, mapping or protection, so no Rust reference is affected. Its result is
            // advisory and deliberately ignored.
            unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE) };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = buf;
}

/// The system's page size in bytes (4096 where it cannot be asked).
pub fn page_bytes() -> usize {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: sysconf has no preconditions; a failure returns -1, replaced below.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(page).ok().filter(|&p| p > 0).unwrap_or(4096)
    }
    #[cfg(not(target_os = "linux"))]
    4096
}

/// A vector of `len` zeroed elements from `calloc` (the global allocator's `alloc_zeroed`): a
/// large one is fresh zero pages the system maps on first touch, not written here, so it counts
/// in the resident set only where it is written. A size the system refuses is
/// [`Error::HostAlloc`](crate::Error::HostAlloc) naming `what` and the bytes, never an abort.
pub fn zeroed_vec<T: bytemuck::Zeroable + Copy>(len: usize, what: &'static str) -> crate::Result<Vec<T>> {
    let size = std::mem::size_of::<T>();
    if len == 0 || size == 0 {
        return Ok(vec![T::zeroed(); len]);
    }
    let refused = crate::Error::HostAlloc { what, bytes: len.saturating_mul(size) };
    let layout = std::alloc::Layout::array::<T>(len).map_err(|_| refused.clone())?;
    // SAFETY: `layout` has a non-zero size (len ≥ 1 elements of a sized, non-zero-size T).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
    if ptr.is_null() {
        return Err(refused);
    }
    // SAFETY: `ptr` is a fresh global-allocator allocation of exactly `Layout::array::<T>(len)`
    // (what a `Vec<T>` of capacity `len` frees with); its bytes are zero, a valid `T`
    // (`Zeroable`), so all `len` elements are initialised; the vector takes sole ownership.
    Ok(unsafe { Vec::from_raw_parts(ptr, len, len) })
}

/// Gives the whole pages inside `buf` back to the kernel (Linux `madvise(MADV_DONTNEED)`), so a
/// buffer that was written and is done with, part by part, stops counting in the resident set
/// part by part instead of all at once when it is freed. The buffer stays allocated and
/// borrowable: each released element afterwards reads as zero (private anonymous memory, what
/// the global allocator hands out) or keeps its value (any other mapping), both valid `T`
/// (`Zeroable`). Elements on the partial pages at either end keep their values. Returns the
/// bytes released (0 on another OS, or when the kernel refuses).
pub fn release_pages<T: bytemuck::Zeroable>(buf: &mut [T]) -> usize {
    #[cfg(target_os = "linux")]
    {
        let page = page_bytes();
        let start = buf.as_mut_ptr() as usize;
        let end = start.saturating_add(std::mem::size_of_val(buf));
        let (lo, hi) = (start.next_multiple_of(page), end / page * page);
        if hi <= lo {
            return 0;
        }
        // SAFETY: `lo..hi` lies inside `buf`, which this call borrows uniquely, so no other
        // reference observes the pages; MADV_DONTNEED keeps the mapping and its protection and
        // only drops the contents, which then read as zero or as before (both valid for a
        // `Zeroable` T). The pointer is derived from the unique borrow, so the compiler treats
        // the call as a write through it.
        let refused = unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_DONTNEED) };
        if refused == 0 { hi - lo } else { 0 }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = buf;
        0
    }
}

/// This process's resident set, from `/proc/self/statm` (Linux): what the tests of untouched and
/// released pages measure.
#[cfg(all(test, target_os = "linux"))]
pub(crate) fn resident_bytes() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: usize = statm.split_whitespace().nth(1).and_then(|p| p.parse().ok()).expect("resident pages");
    pages * page_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeroed_vectors_are_zero_untouched_and_refused_sizes_are_errors() {
        let v: Vec<f32> = zeroed_vec(3 << 20, "a test").unwrap();
        assert_eq!(v.len(), 3 << 20);
        assert!(v.iter().all(|&x| x == 0.0));
        assert!(zeroed_vec::<f32>(0, "a test").unwrap().is_empty());
        assert_eq!(zeroed_vec::<()>(5, "a test").unwrap().len(), 5);
        match zeroed_vec::<u64>(usize::MAX / 4, "a test") {
            Err(crate::Error::HostAlloc { what: "a test", bytes }) => assert_eq!(bytes, usize::MAX),
            other => panic!("{other:?}"),
        }
    }

    /// A large zeroed vector is not resident until written.
    #[cfg(target_os = "linux")]
    #[test]
    fn zeroed_vectors_are_resident_only_where_written() {
        let before = resident_bytes();
        let mut v: Vec<u8> = zeroed_vec(512 << 20, "a test").unwrap();
        v[..1 << 20].fill(1);
        let after = resident_bytes();
        assert!(after.saturating_sub(before) < 128 << 20, "{before} -> {after}");
    }

    #[test]
    fn released_pages_read_as_zero_or_unchanged_and_the_edges_keep_their_values() {
        let mut v = vec![3.5f32; 1 << 20];
        let released = release_pages(&mut v[5..(1 << 20) - 5]);
        assert!(v[..5].iter().chain(&v[(1 << 20) - 5..]).all(|&x| x == 3.5));
        assert!(v.iter().all(|&x| x == 3.5 || x == 0.0));
        #[cfg(target_os = "linux")]
        {
            assert!(released >= 4 * ((1 << 20) - 10) - 2 * 65536, "{released}");
            assert_eq!(v.iter().filter(|&&x| x == 0.0).count() * 4, released);
        }
        let _ = released;
        assert_eq!(release_pages::<f32>(&mut []), 0);
        assert_eq!(release_pages(&mut [1u8; 10]), 0);
    }

    /// The resident set drops by what was released (other tests' threads allocate meanwhile, so
    /// only most of it is asserted).
    #[cfg(target_os = "linux")]
    #[test]
    fn released_pages_leave_the_resident_set() {
        let mut v = vec![1u8; 64 << 20];
        let before = resident_bytes();
        let released = release_pages(&mut v);
        let after = resident_bytes();
        assert!(released > 63 << 20, "{released}");
        assert!(before.saturating_sub(after) > 32 << 20, "{before} -> {after}");
        assert!(v[..4096].iter().all(|&b| b == 0 || b == 1));
    }

    #[test]
    fn advising_changes_no_value_and_accepts_any_buffer() {
        let mut v: Vec<f32> = Vec::with_capacity(3 << 20);
        advise_huge_pages(v.spare_capacity_mut());
        v.resize(3 << 20, 1.5);
        assert!(v.iter().all(|&x| x == 1.5));
        let mut empty: Vec<u8> = Vec::new();
        advise_huge_pages(empty.spare_capacity_mut());
        let mut small = vec![0u64; 3];
        advise_huge_pages(small.spare_capacity_mut());
        assert_eq!(small, [0, 0, 0]);
    }
}
