//! Emulated launches of this crate's kernels (feature `cuda-emu`): the same `.cu` source the GPU
//! runs, compiled as host C++ and run by the SIMT emulator under two thread schedules.

use flatpeak_common::DType;
use flatpeak_common::emu::{EmuLaunchConfig, launch, race_checked};
use flatpeak_common::kernels::grid_stride_blocks;

use crate::element::GradElement;
use crate::error::Result;
use crate::kernels::{STATS_THREADS, grad_sq_entry};

mod ffi {
    unsafe extern "C" {
        pub fn grad_sq_partial_f32(g: *const f32, n: u64, partial: *mut f64);
        pub fn grad_sq_partial_bf16(g: *const half::bf16, n: u64, partial: *mut f64);
        pub fn grad_sq_partial_f16(g: *const half::f16, n: u64, partial: *mut f64);
    }
}

/// Blocks of an emulated launch are capped small: every CUDA thread is a fiber here.
const MAX_BLOCKS: u32 = 4;

/// Σ g² of the gradients by the device kernel, emulated: per-block f64 partials, summed on the
/// host in block order (as `cuda::grad_sq_sum` does).
pub fn grad_sq_sum<G: GradElement>(grads: &[G]) -> Result<f64> {
    let n = grads.len();
    let cfg = EmuLaunchConfig::linear(grid_stride_blocks(n, STATS_THREADS, MAX_BLOCKS), STATS_THREADS);
    let entry = grad_sq_entry(G::DTYPE);
    let partial = race_checked(entry, &vec![0f64; cfg.grid.0 as usize], |schedule, out| {
        let (g, out) = (grads.as_ptr(), out.as_mut_ptr());
        // The casts below are to `G` itself: `G::DTYPE` names `G`'s storage exactly (the trait
        // is sealed to f32, bf16 and f16).
        let call = || match G::DTYPE {
            // SAFETY: `g` points at `n` f32 gradients, `out` at `gridDim.x` partials (see below).
            DType::F32 => unsafe { ffi::grad_sq_partial_f32(g.cast(), n as u64, out) },
            // SAFETY: as above, `n` bf16 gradients.
            DType::Bf16 => unsafe { ffi::grad_sq_partial_bf16(g.cast(), n as u64, out) },
            // SAFETY: as above, `n` f16 gradients.
            DType::F16 => unsafe { ffi::grad_sq_partial_f16(g.cast(), n as u64, out) },
        };
        // SAFETY: the kernel reads `grads[0..n)` and writes `partial[blockIdx.x]` for each of the
        // `out.len() = gridDim.x` blocks; 256 threads is a multiple of 32 as it requires.
        unsafe { launch(entry, &cfg, schedule, &call) }
    })?;
    Ok(partial.iter().sum())
}
