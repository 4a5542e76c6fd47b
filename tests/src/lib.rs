//! Cross-crate test support for the flatpeak workspace: the list of every kernel source that
//! ships, for the NVRTC compile check. The tests themselves live in `tests/tests/`.

use flatpeak_common::kernels::KernelSource;

/// Every CUDA source of every crate in the workspace. A crate that adds kernels adds its
/// `KernelSource` here, so the compile check (`tests/nvrtc_compile.rs`) covers it.
pub fn all_kernels() -> Vec<KernelSource> {
    vec![
        flatpeak_common::kernels::COMMON,
        llep::kernels::LLEP,
        ring_dtp::kernels::RING_DTP,
        stream_adamw::kernels::STREAM_ADAMW,
    ]
}

#[cfg(test)]
mod tests {
    #[test]
    fn kernel_names_are_unique() {
        let kernels = super::all_kernels();
        let mut names: Vec<_> = kernels.iter().map(|k| k.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), kernels.len());
        assert!(!kernels.is_empty());
    }
}
