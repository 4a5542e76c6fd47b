//! The SIMT emulation backend (feature `cuda-emu`): the crate's `.cu` kernels, compiled unmodified
//! as host C++ against `emu/simt_emu.hpp`, launched on the CPU with one fiber per CUDA thread,
//! real `__syncthreads` and warp rendezvous, checked shared-memory bounds, and every launch run
//! under two thread schedules (forward and reverse) whose outputs must agree bitwise.
//!
//! What this proves: indexing, bounds, barrier placement, warp masks, reduction order and the
//! math of the kernels. What only a GPU can: timing, tensor cores, the cudarc host code, cuBLAS,
//! NCCL, and global-memory bounds (an out-of-bounds global access here may crash, not report).
//!
//! Like `cuda.rs`, this is a file with kernel-launch `unsafe`: the emulated kernels take raw
//! pointers exactly as on the device.

use std::ffi::{c_char, c_int, c_void};

use bytemuck::Pod;

use crate::error::{Error, Result};
use crate::kernels::{LINEAR_THREADS, grid_stride_blocks};

#[repr(C)]
struct RawConfig {
    grid: [u32; 3],
    block: [u32; 3],
    dynamic_shared_bytes: usize,
    schedule: u32,
    fiber_stack_bytes: usize,
}
const _: () = assert!(std::mem::size_of::<RawConfig>() == 48, "matches flatpeak_emu_config");

unsafe extern "C" {
    fn flatpeak_emu_launch(
        cfg: *const RawConfig,
        thunk: unsafe extern "C" fn(*mut c_void),
        ctx: *mut c_void,
        message: *mut c_char,
        message_capacity: usize,
    ) -> c_int;
}

/// The order in which the emulator resumes runnable threads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadOrder {
    /// Lowest linear thread id first.
    Forward,
    /// Highest linear thread id first.
    Reverse,
}

/// Shape of an emulated launch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EmuLaunchConfig {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Bytes of `extern __shared__` memory per block.
    pub dynamic_shared_bytes: usize,
}

impl EmuLaunchConfig {
    /// A 1-D launch of `blocks × threads`.
    pub fn linear(blocks: u32, threads: u32) -> Self {
        Self { grid: (blocks, 1, 1), block: (threads, 1, 1), dynamic_shared_bytes: 0 }
    }

    /// A 1-D grid-stride launch over `n` elements: [`LINEAR_THREADS`] per block, at most
    /// `max_blocks` blocks (the kernel's loop covers the rest).
    pub fn grid_stride(n: usize, max_blocks: u32) -> Self {
        Self::linear(grid_stride_blocks(n, LINEAR_THREADS, max_blocks), LINEAR_THREADS)
    }
}

unsafe extern "C" fn trampoline(ctx: *mut c_void) {
    // SAFETY: `ctx` is the `&&dyn Fn()` that `launch` passed, alive for the whole launch.
    let kernel = unsafe { &*(ctx as *const &dyn Fn()) };
    kernel();
}

/// Runs `kernel` (a call of one emulated entry point) as every thread of the grid.
///
/// # Safety
/// `kernel` must call an entry point of an emulated kernel with arguments valid for the whole
/// grid exactly as on a device: every pointer valid for every access the kernel makes for this
/// shape, and no two launches writing the same memory concurrently. `kernel` must not panic (a
/// panic cannot unwind through the emulator's C frames and aborts).
pub unsafe fn launch(
    name: &str,
    cfg: &EmuLaunchConfig,
    schedule: ThreadOrder,
    kernel: &dyn Fn(),
) -> Result<()> {
    let raw = RawConfig {
        grid: [cfg.grid.0, cfg.grid.1, cfg.grid.2],
        block: [cfg.block.0, cfg.block.1, cfg.block.2],
        dynamic_shared_bytes: cfg.dynamic_shared_bytes,
        schedule: match schedule {
            ThreadOrder::Forward => 0,
            ThreadOrder::Reverse => 1,
        },
        fiber_stack_bytes: 0,
    };
    let mut message = vec![0 as c_char; 2048];
    let ctx: *const &dyn Fn() = &kernel;
    // SAFETY: `raw` matches the C struct layout (size asserted); `ctx` outlives the call, which
    // returns only after every fiber finished or was abandoned; `message` has the stated capacity.
    let code = unsafe {
        flatpeak_emu_launch(&raw, trampoline, ctx as *mut c_void, message.as_mut_ptr(), message.len())
    };
    if code == 0 {
        return Ok(());
    }
    let bytes: Vec<u8> = message.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    Err(Error::EmuFault { kernel: name.into(), message: String::from_utf8_lossy(&bytes).into_owned() })
}

/// Runs a launch under both schedules from the same `initial` outputs and returns the outputs,
/// or [`Error::EmuRace`] when the two differ anywhere (compared bitwise).
pub fn race_checked<T: Pod>(
    name: &str,
    initial: &[T],
    mut run: impl FnMut(ThreadOrder, &mut [T]) -> Result<()>,
) -> Result<Vec<T>> {
    let mut outputs = initial.to_vec();
    race_checked_state(
        name,
        &mut outputs,
        |o| bytemuck::cast_slice(o).to_vec(),
        |schedule, o| run(schedule, o),
    )?;
    Ok(outputs)
}

/// Runs one launch whose only output is `out` under both thread schedules, each from `out`'s
/// current contents ([`race_checked`]: the outputs must agree bitwise), and leaves the result
/// in `out`. `kernel(o)` calls the emulated entry point with `o` pointing at (a copy of) `out`.
///
/// # Safety
/// As [`launch`]: `kernel(o)` calls an emulated entry point whose every access is valid for
/// `cfg`'s grid (its threads per block a multiple of 32 where the kernel requires it), for `o`
/// pointing at `out.len()` elements, and it writes no memory but those.
pub unsafe fn launch_into<T: Pod>(
    name: &str,
    cfg: &EmuLaunchConfig,
    out: &mut [T],
    kernel: impl Fn(*mut T),
) -> Result<()> {
    let result = race_checked(name, out, |schedule, o| {
        let o = o.as_mut_ptr();
        // SAFETY: `o` points at `out.len()` elements; the rest is this function's contract.
        unsafe { launch(name, cfg, schedule, &|| kernel(o)) }
    })?;
    out.copy_from_slice(&result);
    Ok(())
}

/// Runs `launch_one` under both schedules on copies of `state` (any outputs a launch writes,
/// `bytes` serializing them for the comparison) and keeps the forward schedule's `state`, or
/// [`Error::EmuRace`] when the two differ anywhere (compared bitwise).
pub fn race_checked_state<S: Clone, E: From<Error>>(
    name: &str,
    state: &mut S,
    bytes: impl Fn(&S) -> Vec<u8>,
    mut launch_one: impl FnMut(ThreadOrder, &mut S) -> std::result::Result<(), E>,
) -> std::result::Result<(), E> {
    let mut reverse = state.clone();
    launch_one(ThreadOrder::Forward, state)?;
    launch_one(ThreadOrder::Reverse, &mut reverse)?;
    let (a, b) = (bytes(state), bytes(&reverse));
    match a.iter().zip(&b).position(|(x, y)| x != y) {
        None => Ok(()),
        Some(first_difference) => Err(Error::EmuRace { kernel: name.into(), first_difference }.into()),
    }
}

mod ffi {
    unsafe extern "C" {
        pub fn fill_f32(out: *mut f32, value: f32, n: u64);
        pub fn checksum_f32(x: *const f32, n: u64, partial: *mut f64);
        pub fn cast_f32_to_bf16(x: *const f32, out: *mut half::bf16, n: u64);
    }
}

/// The block cap of the emulated launches: small grids, since the emulator runs every thread
/// as a fiber (the grid-stride loops cover any length).
const MAX_BLOCKS: u32 = 4;

fn grid(n: usize) -> EmuLaunchConfig {
    EmuLaunchConfig::grid_stride(n, MAX_BLOCKS)
}

/// Emulated `fill_f32`: `out[i] = value`.
pub fn fill_f32(out: &mut [f32], value: f32) -> Result<()> {
    let n = out.len();
    // SAFETY: `fill_f32` writes `out[0..n)` only, and the pointer it gets holds `n` elements.
    unsafe { launch_into("fill_f32", &grid(n), out, |ptr| ffi::fill_f32(ptr, value, n as u64)) }
}

/// Emulated `checksum_f32`: per-block f64 partial sums, added on the host in block order.
pub fn checksum_f32(x: &[f32]) -> Result<f64> {
    let cfg = grid(x.len());
    let partial = vec![0f64; cfg.grid.0 as usize];
    let partial = race_checked("checksum_f32", &partial, |schedule, out| {
        let (xp, op) = (x.as_ptr(), out.as_mut_ptr());
        // SAFETY: the kernel reads `x[0..n)` and writes `partial[blockIdx.x]` for each of the
        // `out.len() = gridDim.x` blocks; 256 threads is a multiple of 32 as it requires.
        unsafe { launch("checksum_f32", &cfg, schedule, &|| ffi::checksum_f32(xp, x.len() as u64, op)) }
    })?;
    Ok(partial.iter().sum())
}

/// Emulated `cast_f32_to_bf16`: `out[i] = bf16(x[i])`, round to nearest even.
pub fn cast_f32_to_bf16(x: &[f32], out: &mut [half::bf16]) -> Result<()> {
    if x.len() != out.len() {
        return Err(Error::ShapeMismatch { what: "cast output length", expected: x.len(), got: out.len() });
    }
    let (n, xp) = (x.len(), x.as_ptr());
    // SAFETY: both buffers hold `n` elements and the kernel touches indices below `n` only.
    unsafe { launch_into("cast_f32_to_bf16", &grid(n), out, |op| ffi::cast_f32_to_bf16(xp, op, n as u64)) }
}
