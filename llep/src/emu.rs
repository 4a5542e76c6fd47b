//! Emulated launches of this crate's kernels (feature `cuda-emu`): the same `.cu` source the GPU
//! runs, compiled as host C++ and run by the SIMT emulator under two thread schedules (outputs
//! that differ between them are a race: [`flatpeak_common::Error::EmuRace`]). Each function
//! takes host slices of an element type the kernels are instantiated for ([`KernelElem`]: f32
//! and bf16) and checks their lengths before the launch.

use flatpeak_common::emu::{EmuLaunchConfig, launch, race_checked};
use flatpeak_common::kernels::grid_stride_blocks;

use crate::error::{Error, Result};
use crate::kernels::LINEAR_THREADS;

mod ffi {
    use half::bf16;

    unsafe extern "C" {
        pub fn llep_gather_rows(
            src: *const f32,
            index: *const u32,
            scale: *const f32,
            rows: u32,
            width: u32,
            dst: *mut f32,
        );
        pub fn llep_gather_rows_bf16(
            src: *const bf16,
            index: *const u32,
            scale: *const f32,
            rows: u32,
            width: u32,
            dst: *mut bf16,
        );
        pub fn llep_scatter_add_rows(
            src: *const f32,
            index: *const u32,
            scale: *const f32,
            rows: u32,
            width: u32,
            acc: *mut f32,
        );
        pub fn llep_scatter_add_rows_bf16(
            src: *const bf16,
            index: *const u32,
            scale: *const f32,
            rows: u32,
            width: u32,
            acc: *mut f32,
        );
        pub fn llep_scatter_add_rows_bf16_bf16(
            src: *const bf16,
            index: *const u32,
            scale: *const f32,
            rows: u32,
            width: u32,
            acc: *mut bf16,
        );
        pub fn llep_swiglu(gate: *const f32, up: *const f32, n: u64, h: *mut f32);
        pub fn llep_swiglu_bf16(gate: *const bf16, up: *const bf16, n: u64, h: *mut bf16);
        pub fn llep_swiglu_backward(gate: *mut f32, up: *mut f32, dh: *const f32, n: u64);
        pub fn llep_swiglu_backward_bf16(gate: *mut bf16, up: *mut bf16, dh: *const bf16, n: u64);
        pub fn llep_row_dot(a: *const f32, b: *const f32, width: u32, out: *mut f32);
        pub fn llep_row_dot_bf16(a: *const bf16, b: *const bf16, width: u32, out: *mut f32);
    }
}

/// An element type `kernels/llep.cu` is instantiated for (f32 and bf16): its entry points.
/// Sealed by the private module it names.
pub trait KernelElem: bytemuck::Pod + sealed::Sealed {
    /// The name of the instantiation's `llep_gather_rows`, for race reports.
    const GATHER: &'static str;
    /// The `llep_swiglu` instantiation's name.
    const SWIGLU: &'static str;
    /// The `llep_swiglu_backward` instantiation's name.
    const SWIGLU_BACKWARD: &'static str;
    /// The `llep_row_dot` instantiation's name.
    const ROW_DOT: &'static str;
    /// `llep_gather_rows` of this type.
    ///
    /// # Safety
    /// As the kernel: `index` holds `rows` entries, each a row of `src`; `scale` is null or
    /// holds `rows`; `dst` holds rows·width.
    unsafe fn gather(
        src: *const Self,
        index: *const u32,
        scale: *const f32,
        rows: u32,
        width: u32,
        dst: *mut Self,
    );
    /// `llep_swiglu` of this type.
    ///
    /// # Safety
    /// `gate`, `up` and `h` hold `n` elements.
    unsafe fn swiglu(gate: *const Self, up: *const Self, n: u64, h: *mut Self);
    /// `llep_swiglu_backward` of this type.
    ///
    /// # Safety
    /// `gate`, `up` and `dh` hold `n` elements.
    unsafe fn swiglu_backward(gate: *mut Self, up: *mut Self, dh: *const Self, n: u64);
    /// `llep_row_dot` of this type (one block per row of `out`).
    ///
    /// # Safety
    /// `a` and `b` hold (blocks)·width elements, `out` one per block.
    unsafe fn row_dot(a: *const Self, b: *const Self, width: u32, out: *mut f32);
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
}

macro_rules! kernel_elem {
    ($t:ty, $gather:ident, $swiglu:ident, $swiglu_backward:ident, $row_dot:ident) => {
        impl KernelElem for $t {
            const GATHER: &'static str = stringify!($gather);
            const SWIGLU: &'static str = stringify!($swiglu);
            const SWIGLU_BACKWARD: &'static str = stringify!($swiglu_backward);
            const ROW_DOT: &'static str = stringify!($row_dot);
            unsafe fn gather(
                src: *const Self,
                index: *const u32,
                scale: *const f32,
                rows: u32,
                width: u32,
                dst: *mut Self,
            ) {
                // SAFETY: forwarded from this function's contract.
                unsafe { ffi::$gather(src, index, scale, rows, width, dst) }
            }
            unsafe fn swiglu(gate: *const Self, up: *const Self, n: u64, h: *mut Self) {
                // SAFETY: forwarded from this function's contract.
                unsafe { ffi::$swiglu(gate, up, n, h) }
            }
            unsafe fn swiglu_backward(gate: *mut Self, up: *mut Self, dh: *const Self, n: u64) {
                // SAFETY: forwarded from this function's contract.
                unsafe { ffi::$swiglu_backward(gate, up, dh, n) }
            }
            unsafe fn row_dot(a: *const Self, b: *const Self, width: u32, out: *mut f32) {
                // SAFETY: forwarded from this function's contract.
                unsafe { ffi::$row_dot(a, b, width, out) }
            }
        }
    };
}

kernel_elem!(f32, llep_gather_rows, llep_swiglu, llep_swiglu_backward, llep_row_dot);
kernel_elem!(
    half::bf16,
    llep_gather_rows_bf16,
    llep_swiglu_bf16,
    llep_swiglu_backward_bf16,
    llep_row_dot_bf16
);

/// A scatter-add instantiation: rows of `Self` into accumulators of `A` (f32 → f32, bf16 → f32,
/// bf16 → bf16).
pub trait ScatterInto<A>: KernelElem {
    /// The instantiation's name, for race reports.
    const SCATTER: &'static str;
    /// `llep_scatter_add_rows` of this pair.
    ///
    /// # Safety
    /// As the kernel: `src` holds rows·width, `index` `rows` entries each a row of `acc`,
    /// `scale` null or `rows`.
    unsafe fn scatter(
        src: *const Self,
        index: *const u32,
        scale: *const f32,
        rows: u32,
        width: u32,
        acc: *mut A,
    );
}

macro_rules! scatter_into {
    ($s:ty => $a:ty, $f:ident) => {
        impl ScatterInto<$a> for $s {
            const SCATTER: &'static str = stringify!($f);
            unsafe fn scatter(
                src: *const Self,
                index: *const u32,
                scale: *const f32,
                rows: u32,
                width: u32,
                acc: *mut $a,
            ) {
                // SAFETY: forwarded from this function's contract.
                unsafe { ffi::$f(src, index, scale, rows, width, acc) }
            }
        }
    };
}

scatter_into!(f32 => f32, llep_scatter_add_rows);
scatter_into!(half::bf16 => f32, llep_scatter_add_rows_bf16);
scatter_into!(half::bf16 => half::bf16, llep_scatter_add_rows_bf16_bf16);

/// Blocks of an emulated grid-stride launch (every CUDA thread is a fiber here).
const EMU_MAX_BLOCKS: u32 = 4;
/// Threads per block of an emulated per-row launch.
const EMU_ROW_THREADS: u32 = 64;

fn check(what: &'static str, expected: usize, found: usize) -> Result<()> {
    if found >= expected { Ok(()) } else { Err(Error::ShapeMismatch { what, expected, got: found }) }
}

/// Checks a row kernel's `index` (each entry a row of width `width` of a buffer of `len`
/// elements) and its `scale` (none, or at least one per index entry).
fn check_rows(index: &[u32], width: usize, len: usize, scale: Option<&[f32]>) -> Result<()> {
    let bound = len / width.max(1);
    if let Some(&i) = index.iter().find(|&&i| i as usize >= bound) {
        return Err(Error::ShapeMismatch {
            what: "row index (rows of src)",
            expected: bound,
            got: i as usize + 1,
        });
    }
    scale.map_or(Ok(()), |s| check("gather/scatter scale (rows)", index.len(), s.len()))
}

/// The emulated grid-stride launch over `n` elements.
fn linear_cfg(n: usize) -> EmuLaunchConfig {
    EmuLaunchConfig::linear(grid_stride_blocks(n, LINEAR_THREADS, EMU_MAX_BLOCKS), LINEAR_THREADS)
}

/// `dst[r] = scale_r·src[index[r]]` for the first `index.len()` rows of width `width`.
pub fn gather_rows<T: KernelElem>(
    src: &[T],
    index: &[u32],
    scale: Option<&[f32]>,
    width: usize,
    dst: &mut [T],
) -> Result<()> {
    let rows = index.len();
    check("gather dst (rows·width)", rows * width, dst.len())?;
    check_rows(index, width, src.len(), scale)?;
    let cfg = linear_cfg(rows * width);
    let out = race_checked(T::GATHER, &dst[..rows * width], |schedule, out| {
        let (o, sp) = (out.as_mut_ptr(), scale.map_or(std::ptr::null(), |s| s.as_ptr()));
        // SAFETY: `index` holds `rows` entries, each < src rows (checked); `scale` holds `rows`
        // (or is null); `out` holds rows·width; the kernel touches nothing else.
        let call = || unsafe { T::gather(src.as_ptr(), index.as_ptr(), sp, rows as u32, width as u32, o) };
        // SAFETY: see `call`; LINEAR_THREADS is a multiple of 32.
        unsafe { launch(T::GATHER, &cfg, schedule, &call) }
    })?;
    dst[..rows * width].copy_from_slice(&out);
    Ok(())
}

/// `acc[index[r]] += scale_r·src[r]` for r in order, rows of width `width`.
pub fn scatter_add_rows<S: ScatterInto<A>, A: KernelElem>(
    src: &[S],
    index: &[u32],
    scale: Option<&[f32]>,
    width: usize,
    acc: &mut [A],
) -> Result<()> {
    let rows = index.len();
    check("scatter src (rows·width)", rows * width, src.len())?;
    check_rows(index, width, acc.len(), scale)?;
    let cfg = linear_cfg(width);
    let out = race_checked(S::SCATTER, acc, |schedule, out| {
        let (o, sp) = (out.as_mut_ptr(), scale.map_or(std::ptr::null(), |s| s.as_ptr()));
        // SAFETY: `src` holds rows·width, `index` rows entries each < acc rows (checked),
        // `scale` rows (or null); thread c touches column c of `acc` only.
        let call = || unsafe { S::scatter(src.as_ptr(), index.as_ptr(), sp, rows as u32, width as u32, o) };
        // SAFETY: see `call`.
        unsafe { launch(S::SCATTER, &cfg, schedule, &call) }
    })?;
    acc.copy_from_slice(&out);
    Ok(())
}

/// `h = silu(gate) ⊙ up` over `h.len()` elements.
pub fn swiglu<T: KernelElem>(gate: &[T], up: &[T], h: &mut [T]) -> Result<()> {
    let n = h.len();
    check("swiglu gate", n, gate.len())?;
    check("swiglu up", n, up.len())?;
    let cfg = linear_cfg(n);
    let out = race_checked(T::SWIGLU, h, |schedule, out| {
        let o = out.as_mut_ptr();
        // SAFETY: `gate`, `up` and `out` hold `n` elements (checked).
        let call = || unsafe { T::swiglu(gate.as_ptr(), up.as_ptr(), n as u64, o) };
        // SAFETY: see `call`.
        unsafe { launch(T::SWIGLU, &cfg, schedule, &call) }
    })?;
    h.copy_from_slice(&out);
    Ok(())
}

/// In place: `gate ← dh ⊙ up ⊙ silu'(gate)`, `up ← dh ⊙ silu(gate)`.
pub fn swiglu_backward<T: KernelElem>(gate: &mut [T], up: &mut [T], dh: &[T]) -> Result<()> {
    let n = dh.len();
    check("swiglu_backward gate", n, gate.len())?;
    check("swiglu_backward up", n, up.len())?;
    let cfg = linear_cfg(n);
    let both: Vec<T> = gate[..n].iter().chain(&up[..n]).copied().collect();
    let out = race_checked(T::SWIGLU_BACKWARD, &both, |schedule, out| {
        let (g, u) = out.split_at_mut(n);
        let (g, u) = (g.as_mut_ptr(), u.as_mut_ptr());
        // SAFETY: `g`, `u` and `dh` hold `n` elements each.
        let call = || unsafe { T::swiglu_backward(g, u, dh.as_ptr(), n as u64) };
        // SAFETY: see `call`.
        unsafe { launch(T::SWIGLU_BACKWARD, &cfg, schedule, &call) }
    })?;
    gate[..n].copy_from_slice(&out[..n]);
    up[..n].copy_from_slice(&out[n..]);
    Ok(())
}

/// `out[r] = ⟨a_r, b_r⟩` for the first `out.len()` rows of width `width`.
pub fn row_dot<T: KernelElem>(a: &[T], b: &[T], width: usize, out: &mut [f32]) -> Result<()> {
    let rows = out.len();
    check("row_dot a", rows * width, a.len())?;
    check("row_dot b", rows * width, b.len())?;
    if rows == 0 {
        return Ok(());
    }
    let cfg = EmuLaunchConfig::linear(rows as u32, EMU_ROW_THREADS);
    let res = race_checked(T::ROW_DOT, out, |schedule, o| {
        let o = o.as_mut_ptr();
        // SAFETY: `a` and `b` hold rows·width, `o` rows; block r writes o[r] only.
        let call = || unsafe { T::row_dot(a.as_ptr(), b.as_ptr(), width as u32, o) };
        // SAFETY: see `call`; EMU_ROW_THREADS is a multiple of 32.
        unsafe { launch(T::ROW_DOT, &cfg, schedule, &call) }
    })?;
    out.copy_from_slice(&res);
    Ok(())
}
