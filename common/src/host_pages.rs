//! Transparent huge pages for large host buffers.

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

#[cfg(test)]
mod tests {
    use super::*;

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
