//! Registry of CUDA C sources. Each crate lists its `kernels/*.cu` files as [`KernelSource`]s
//! in a `KERNELS` constant; the NVRTC compile check (`tests/tests/nvrtc_compile.rs`) and the
//! run-time [`KernelCache`](crate::cuda::KernelCache) both read from there, so a kernel that
//! ships is a kernel that is checked. The sources are plain strings: listing them needs no CUDA.

/// One `.cu` file, embedded at build time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSource {
    /// File stem, unique in the workspace (`common`, `ring_dtp`, ...).
    pub name: &'static str,
    /// The CUDA C++ source.
    pub source: &'static str,
    /// The `extern "C"` entry points it defines, for loading and for the compile check.
    pub entry_points: &'static [&'static str],
}

/// Kernels of `flatpeak-common` (`kernels/common.cu`).
pub const COMMON: KernelSource = KernelSource {
    name: "common",
    source: include_str!("../kernels/common.cu"),
    entry_points: &["fill_f32", "checksum_f32", "cast_f32_to_bf16"],
};

/// Every kernel source of this crate.
pub const KERNELS: &[KernelSource] = &[COMMON];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_points_are_defined_in_the_source() {
        for k in KERNELS {
            for entry in k.entry_points {
                let decl = format!("__global__ void {entry}(");
                assert!(k.source.contains(&decl), "{} lacks {decl}", k.name);
            }
        }
    }
}
