//! Registry of CUDA C sources. Each crate declares its `kernels/<crate>.cu` file as a
//! [`KernelSource`] constant; the NVRTC compile check (`tests/tests/nvrtc_compile.rs`) and the
//! run-time `cuda::KernelCache` (feature `cuda`) both read from there, so a kernel that
//! ships is a kernel that is checked. The sources are plain strings: listing them needs no CUDA.

/// A device header shared by several kernels (`common/kernels/include/flatpeak/*.cuh`), handed
/// to NVRTC by name, and found on the include path of the emulated build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelHeader {
    /// The name kernels `#include`, e.g. `flatpeak/block_reduce.cuh`.
    pub include_name: &'static str,
    /// Its source.
    pub source: &'static str,
}

/// `flatpeak/block_reduce.cuh`: fixed-order block reductions.
pub const BLOCK_REDUCE: KernelHeader = KernelHeader {
    include_name: "flatpeak/block_reduce.cuh",
    source: include_str!("../kernels/include/flatpeak/block_reduce.cuh"),
};

/// One `.cu` file, embedded at build time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelSource {
    /// File stem, unique in the workspace (`common`, `ring_dtp`, ...).
    pub name: &'static str,
    /// The CUDA C++ source.
    pub source: &'static str,
    /// The `extern "C"` entry points it defines, for loading and for the compile check.
    pub entry_points: &'static [&'static str],
    /// The shared headers it includes.
    pub headers: &'static [KernelHeader],
}

/// Declares a crate's [`KernelSource`] from its file stem: the source is the calling crate's
/// `kernels/<name>.cu`, so a kernel's name and its file cannot drift apart (`ring_dtp` is
/// `kernels/ring_dtp.cu`, and nothing else).
///
/// ```
/// use flatpeak_common::kernels::{BLOCK_REDUCE, KernelSource};
/// use flatpeak_common::kernel_source;
///
/// const MINE: KernelSource = kernel_source!("common", [BLOCK_REDUCE], ["fill_f32"]);
/// assert!(MINE.source.contains("fill_f32"));
/// ```
#[macro_export]
macro_rules! kernel_source {
    ($name:literal, [$($header:expr),* $(,)?], [$($entry:literal),* $(,)?] $(,)?) => {
        $crate::kernels::KernelSource {
            name: $name,
            source: include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/", $name, ".cu")),
            entry_points: &[$($entry),*],
            headers: &[$($header),*],
        }
    };
}

/// Kernels of `flatpeak-common` (`kernels/common.cu`).
pub const COMMON: KernelSource =
    crate::kernel_source!("common", [BLOCK_REDUCE], ["fill_f32", "checksum_f32", "cast_f32_to_bf16"]);

/// Threads per block of every crate's 1-D grid-stride kernels (a multiple of the warp size; the
/// kernels' loops cover any length, so the count is a launch choice, not a kernel constant).
pub const LINEAR_THREADS: u32 = 256;

/// Grid of a 1-D grid-stride kernel over `n` elements: `threads` per block, enough blocks to
/// give every element a thread, clamped to `1..=max_blocks` (the loop covers the rest).
pub fn grid_stride_blocks(n: usize, threads: u32, max_blocks: u32) -> u32 {
    n.div_ceil(threads as usize).clamp(1, max_blocks as usize) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_stride_shapes() {
        assert_eq!(grid_stride_blocks(0, 256, 8), 1);
        assert_eq!(grid_stride_blocks(257, 256, 8), 2);
        assert_eq!(grid_stride_blocks(1 << 30, 256, 8), 8);
    }

    #[test]
    fn entry_points_are_defined_in_the_source() {
        for k in [COMMON] {
            for h in k.headers {
                assert!(k.source.contains(&format!("#include \"{}\"", h.include_name)), "{}", k.name);
            }
            for entry in k.entry_points {
                let decl = format!("__global__ void {entry}(");
                assert!(k.source.contains(&decl), "{} lacks {decl}", k.name);
            }
        }
    }
}
