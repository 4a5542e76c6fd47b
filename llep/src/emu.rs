//! Emulated launches of this crate's kernels (feature `cuda-emu`): the same `.cu` source the GPU
//! runs, compiled as host C++ and run by the SIMT emulator under two thread schedules (outputs
//! that differ between them are a race: [`flatpeak_common::Error::EmuRace`]). Each function
//! takes host slices and checks their lengths before the launch.

use flatpeak_common::emu::{EmuLaunchConfig, launch, race_checked};
use flatpeak_common::kernels::grid_stride_blocks;

use crate::error::{Error, Result};
use crate::kernels::LINEAR_THREADS;

mod ffi {
    unsafe extern "C" {
        pub fn llep_gather_rows(
            src: *const f32,
            index: *const u32,
            scale: *const f32,
            rows: u32,
            width: u32,
            dst: *mut f32,
        );
        pub fn llep_scatter_add_rows(
            src: *const f32,
            index: *const u32,
            scale: *const f32,
            rows: u32,
            width: u32,
            acc: *mut f32,
        );
        pub fn llep_swiglu(gate: *const f32, up: *const f32, n: u64, h: *mut f32);
        pub fn llep_swiglu_backward(gate: *mut f32, up: *mut f32, dh: *const f32, n: u64);
        pub fn llep_row_dot(a: *const f32, b: *const f32, width: u32, out: *mut f32);
    }
}

/// Blocks of an emulated grid-stride launch (every CUDA thread is a fiber here).
const EMU_MAX_BLOCKS: u32 = 4;
/// Threads per block of an emulated per-row launch.
const EMU_ROW_THREADS: u32 = 64;

fn check(what: &'static str, expected: usize, found: usize) -> Result<()> {
    if found >= expected { Ok(()) } else { Err(Error::ShapeMismatch { what, expected, got: found }) }
}

fn check_index(index: &[u32], rows: usize, bound: usize) -> Result<()> {
    match index[..rows].iter().find(|&&i| i as usize >= bound) {
        Some(&i) => Err(Error::ShapeMismatch {
            what: "row index (rows of src)",
            expected: bound,
            got: i as usize + 1,
        }),
        None => Ok(()),
    }
}

/// `dst[r] = scale_r·src[index[r]]` for the first `index.len()` rows of width `width`.
pub fn gather_rows(
    src: &[f32],
    index: &[u32],
    scale: Option<&[f32]>,
    width: usize,
    dst: &mut [f32],
) -> Result<()> {
    let rows = index.len();
    check("gather dst (rows·width)", rows * width, dst.len())?;
    check_index(index, rows, src.len() / width.max(1))?;
    if let Some(s) = scale {
        check("gather scale (rows)", rows, s.len())?;
    }
    let cfg = EmuLaunchConfig::linear(
        grid_stride_blocks(rows * width, LINEAR_THREADS, EMU_MAX_BLOCKS),
        LINEAR_THREADS,
    );
    let out = race_checked("llep_gather_rows", &dst[..rows * width], |schedule, out| {
        let (o, sp) = (out.as_mut_ptr(), scale.map_or(std::ptr::null(), |s| s.as_ptr()));
        // SAFETY: `index` holds `rows` entries, each < src rows (checked); `scale` holds `rows`
        // (or is null); `out` holds rows·width; the kernel touches nothing else.
        let call = || unsafe {
            ffi::llep_gather_rows(src.as_ptr(), index.as_ptr(), sp, rows as u32, width as u32, o)
        };
        // SAFETY: see `call`; LINEAR_THREADS is a multiple of 32.
        unsafe { launch("llep_gather_rows", &cfg, schedule, &call) }
    })?;
    dst[..rows * width].copy_from_slice(&out);
    Ok(())
}

/// `acc[index[r]] += scale_r·src[r]` for r in order, rows of width `width`.
pub fn scatter_add_rows(
    src: &[f32],
    index: &[u32],
    scale: Option<&[f32]>,
    width: usize,
    acc: &mut [f32],
) -> Result<()> {
    let rows = index.len();
    check("scatter src (rows·width)", rows * width, src.len())?;
    check_index(index, rows, acc.len() / width.max(1))?;
    if let Some(s) = scale {
        check("scatter scale (rows)", rows, s.len())?;
    }
    let cfg =
        EmuLaunchConfig::linear(grid_stride_blocks(width, LINEAR_THREADS, EMU_MAX_BLOCKS), LINEAR_THREADS);
    let out = race_checked("llep_scatter_add_rows", acc, |schedule, out| {
        let (o, sp) = (out.as_mut_ptr(), scale.map_or(std::ptr::null(), |s| s.as_ptr()));
        // SAFETY: `src` holds rows·width, `index` rows entries each < acc rows (checked),
        // `scale` rows (or null); thread c touches column c of `acc` only.
        let call = || unsafe {
            ffi::llep_scatter_add_rows(src.as_ptr(), index.as_ptr(), sp, rows as u32, width as u32, o)
        };
        // SAFETY: see `call`.
        unsafe { launch("llep_scatter_add_rows", &cfg, schedule, &call) }
    })?;
    acc.copy_from_slice(&out);
    Ok(())
}

/// `h = silu(gate) ⊙ up` over `h.len()` elements.
pub fn swiglu(gate: &[f32], up: &[f32], h: &mut [f32]) -> Result<()> {
    let n = h.len();
    check("swiglu gate", n, gate.len())?;
    check("swiglu up", n, up.len())?;
    let cfg = EmuLaunchConfig::linear(grid_stride_blocks(n, LINEAR_THREADS, EMU_MAX_BLOCKS), LINEAR_THREADS);
    let out = race_checked("llep_swiglu", h, |schedule, out| {
        let o = out.as_mut_ptr();
        // SAFETY: `gate`, `up` and `out` hold `n` elements (checked).
        let call = || unsafe { ffi::llep_swiglu(gate.as_ptr(), up.as_ptr(), n as u64, o) };
        // SAFETY: see `call`.
        unsafe { launch("llep_swiglu", &cfg, schedule, &call) }
    })?;
    h.copy_from_slice(&out);
    Ok(())
}

/// In place: `gate ← dh ⊙ up ⊙ silu'(gate)`, `up ← dh ⊙ silu(gate)`.
pub fn swiglu_backward(gate: &mut [f32], up: &mut [f32], dh: &[f32]) -> Result<()> {
    let n = dh.len();
    check("swiglu_backward gate", n, gate.len())?;
    check("swiglu_backward up", n, up.len())?;
    let cfg = EmuLaunchConfig::linear(grid_stride_blocks(n, LINEAR_THREADS, EMU_MAX_BLOCKS), LINEAR_THREADS);
    let both: Vec<f32> = gate[..n].iter().chain(&up[..n]).copied().collect();
    let out = race_checked("llep_swiglu_backward", &both, |schedule, out| {
        let (g, u) = out.split_at_mut(n);
        let (g, u) = (g.as_mut_ptr(), u.as_mut_ptr());
        // SAFETY: `g`, `u` and `dh` hold `n` elements each.
        let call = || unsafe { ffi::llep_swiglu_backward(g, u, dh.as_ptr(), n as u64) };
        // SAFETY: see `call`.
        unsafe { launch("llep_swiglu_backward", &cfg, schedule, &call) }
    })?;
    gate[..n].copy_from_slice(&out[..n]);
    up[..n].copy_from_slice(&out[n..]);
    Ok(())
}

/// `out[r] = ⟨a_r, b_r⟩` for the first `out.len()` rows of width `width`.
pub fn row_dot(a: &[f32], b: &[f32], width: usize, out: &mut [f32]) -> Result<()> {
    let rows = out.len();
    check("row_dot a", rows * width, a.len())?;
    check("row_dot b", rows * width, b.len())?;
    if rows == 0 {
        return Ok(());
    }
    let cfg = EmuLaunchConfig::linear(rows as u32, EMU_ROW_THREADS);
    let res = race_checked("llep_row_dot", out, |schedule, o| {
        let o = o.as_mut_ptr();
        // SAFETY: `a` and `b` hold rows·width, `o` rows; block r writes o[r] only.
        let call = || unsafe { ffi::llep_row_dot(a.as_ptr(), b.as_ptr(), width as u32, o) };
        // SAFETY: see `call`; EMU_ROW_THREADS is a multiple of 32.
        unsafe { launch("llep_row_dot", &cfg, schedule, &call) }
    })?;
    out.copy_from_slice(&res);
    Ok(())
}
