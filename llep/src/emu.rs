//! Emulated launches of this crate's kernels (feature `cuda-emu`): the same `.cu` source the GPU
//! runs, compiled as host C++ and run by the SIMT emulator under two thread schedules (outputs
//! that differ between them are a race: [`flatpeak_common::Error::EmuRace`]). Each function
//! takes host slices of an element type the kernels are instantiated for ([`KernelElem`]: f32
//! and bf16) and checks their lengths before the launch.

use flatpeak_common::emu::{EmuLaunchConfig, launch_into};

use crate::device::{PreAt, ScatterLayout};
use crate::error::{Error, Result};

mod ffi {
    use half::bf16;

    /// Declares row kernels, every one of the same C signature ([`super::RowKernel`]).
    macro_rules! row_kernels {
        ($($name:ident: $s:ty => $d:ty;)*) => {
            unsafe extern "C" {
                $(pub fn $name(
                    src: *const $s,
                    index: *const u32,
                    scale: *const f32,
                    rows: u32,
                    width: u32,
                    dst: *mut $d,
                );)*
            }
        };
    }

    row_kernels! {
        llep_gather_rows: f32 => f32;
        llep_gather_rows_bf16: bf16 => bf16;
        llep_scatter_add_rows: f32 => f32;
        llep_scatter_add_rows_bf16: bf16 => f32;
        llep_scatter_add_rows_bf16_bf16: bf16 => bf16;
        llep_scatter_add_rows_direct: f32 => f32;
        llep_scatter_add_rows_direct_bf16: bf16 => f32;
        llep_scatter_add_rows_direct_bf16_bf16: bf16 => bf16;
    }

    unsafe extern "C" {
        pub fn llep_swiglu(
            gu: *const f32,
            gate_at: u64,
            up_at: u64,
            n: u64,
            width: u32,
            pitch: u64,
            h: *mut f32,
        );
        pub fn llep_swiglu_bf16(
            gu: *const bf16,
            gate_at: u64,
            up_at: u64,
            n: u64,
            width: u32,
            pitch: u64,
            h: *mut bf16,
        );
        pub fn llep_swiglu_backward(
            gu: *mut f32,
            gate_at: u64,
            up_at: u64,
            dh: *const f32,
            n: u64,
            width: u32,
            pitch: u64,
        );
        pub fn llep_swiglu_backward_bf16(
            gu: *mut bf16,
            gate_at: u64,
            up_at: u64,
            dh: *const bf16,
            n: u64,
            width: u32,
            pitch: u64,
        );
        pub fn llep_row_dot(a: *const f32, b: *const f32, width: u32, out: *mut f32);
        pub fn llep_row_dot_bf16(a: *const bf16, b: *const bf16, width: u32, out: *mut f32);
    }
}

/// One instantiation of a kernel: its entry point and its name (for race reports).
#[derive(Debug, Clone, Copy)]
pub struct Kernel<F> {
    /// The instantiation's name.
    pub name: &'static str,
    /// The instantiation's entry point.
    pub entry: F,
}

/// The C signature of a row kernel (`llep_gather_rows`, `llep_scatter_add_rows`): `(src, index,
/// scale, rows, width, dst)`, `index` holding `rows` entries, `scale` null or holding `rows`, rows
/// of width `width`.
pub type RowKernel<S, D> = unsafe extern "C" fn(*const S, *const u32, *const f32, u32, u32, *mut D);

/// The C signature of `llep_swiglu`: `(gu, gate_at, up_at, n, width, pitch, h)`.
pub type SwigluKernel<T> = unsafe extern "C" fn(*const T, u64, u64, u64, u32, u64, *mut T);
/// The C signature of `llep_swiglu_backward`: `(gu, gate_at, up_at, dh, n, width, pitch)`.
pub type SwigluBackwardKernel<T> = unsafe extern "C" fn(*mut T, u64, u64, *const T, u64, u32, u64);

/// An element type `kernels/llep.cu` is instantiated for (f32 and bf16): its entry points, each
/// unsafe to call with the contract of its kernel. Sealed by the private module it names.
pub trait KernelElem: bytemuck::Pod + sealed::Sealed {
    /// `llep_gather_rows` of this type: `index` holds `rows` entries, each a row of `src`;
    /// `scale` is null or holds `rows`; `dst` holds rows·width.
    const GATHER: Kernel<RowKernel<Self, Self>>;
    /// `llep_swiglu` of this type, `(gu, gate_at, up_at, n, width, pitch, h)`: `gu` holds the n
    /// gate and n up elements of that layout ([`PreAt::layout`]), `h` holds `n`.
    const SWIGLU: Kernel<SwigluKernel<Self>>;
    /// `llep_swiglu_backward` of this type, `(gu, gate_at, up_at, dh, n, width, pitch)`: `gu` as
    /// for [`SWIGLU`](Self::SWIGLU), rewritten in place; `dh` holds `n`.
    const SWIGLU_BACKWARD: Kernel<SwigluBackwardKernel<Self>>;
    /// `llep_row_dot` of this type, `(a, b, width, out)`, one block per row of `out`: `a` and `b`
    /// hold (blocks)·width elements, `out` one per block.
    const ROW_DOT: Kernel<unsafe extern "C" fn(*const Self, *const Self, u32, *mut f32)>;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
}

/// The [`Kernel`] of entry point `ffi::$f`.
macro_rules! kernel {
    ($f:ident) => {
        Kernel { name: stringify!($f), entry: ffi::$f }
    };
}

macro_rules! kernel_elem {
    ($t:ty, $gather:ident, $swiglu:ident, $swiglu_backward:ident, $row_dot:ident) => {
        impl KernelElem for $t {
            const GATHER: Kernel<RowKernel<Self, Self>> = kernel!($gather);
            const SWIGLU: Kernel<SwigluKernel<Self>> = kernel!($swiglu);
            const SWIGLU_BACKWARD: Kernel<SwigluBackwardKernel<Self>> = kernel!($swiglu_backward);
            const ROW_DOT: Kernel<unsafe extern "C" fn(*const Self, *const Self, u32, *mut f32)> =
                kernel!($row_dot);
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
    /// `llep_scatter_add_rows` of this pair, `(src, groups, scale, n_groups, width, acc)`:
    /// `groups` in [`ScatterGroups`](crate::device::ScatterGroups)' layout for `n_groups` destinations (rows of `acc`, distinct)
    /// over rows of `src` (which holds them, width `width`), `scale` null or one per row.
    const SCATTER: Kernel<RowKernel<Self, A>>;
    /// `llep_scatter_add_rows_direct` of this pair, `(src, index, scale, rows, width, acc)`:
    /// `index` holding `rows` distinct rows of `acc`.
    const SCATTER_DIRECT: Kernel<RowKernel<Self, A>>;
}

macro_rules! scatter_into {
    ($s:ty => $a:ty, $f:ident, $direct:ident) => {
        impl ScatterInto<$a> for $s {
            const SCATTER: Kernel<RowKernel<Self, $a>> = kernel!($f);
            const SCATTER_DIRECT: Kernel<RowKernel<Self, $a>> = kernel!($direct);
        }
    };
}

scatter_into!(f32 => f32, llep_scatter_add_rows, llep_scatter_add_rows_direct);
scatter_into!(half::bf16 => f32, llep_scatter_add_rows_bf16, llep_scatter_add_rows_direct_bf16);
scatter_into!(half::bf16 => half::bf16, llep_scatter_add_rows_bf16_bf16, llep_scatter_add_rows_direct_bf16_bf16);

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
    EmuLaunchConfig::grid_stride(n, EMU_MAX_BLOCKS)
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
    let sp = scale.map_or(std::ptr::null(), |s| s.as_ptr());
    let call = |o: *mut T| {
        // SAFETY: `index` holds `rows` entries, each a row of `src` (checked), `o` (the first
        // rows·width of `dst`, checked) and `scale` holds `rows` (or is null); each thread writes
        // its own element of `o`.
        unsafe { (T::GATHER.entry)(src.as_ptr(), index.as_ptr(), sp, rows as u32, width as u32, o) }
    };
    // SAFETY: `call` is valid for the whole grid (see it); its blocks are whole warps (LINEAR_THREADS).
    Ok(unsafe { launch_into(T::GATHER.name, &linear_cfg(rows * width), &mut dst[..rows * width], call) }?)
}

/// `acc[index[r]] += scale_r·src[r]` for r in order, rows of width `width`, in the layout a
/// device runs it ([`ScatterLayout`]): distinct destinations directly (one emulated thread per
/// (row, column), the index as it is), else the rows grouped by destination on the host
/// ([`ScatterGroups`](crate::device::ScatterGroups)), one emulated thread per (destination, column).
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
    let sp = scale.map_or(std::ptr::null(), |s| s.as_ptr());
    match ScatterLayout::of(index, acc.len() / width.max(1))? {
        ScatterLayout::Direct => {
            let call = |o: *mut A| {
                // SAFETY: `index` holds `rows` distinct rows of `o` (the accumulators, checked
                // above), `src` holds rows·width (checked) and `scale` `rows` (or is null); each
                // thread's (row, column) element of `o` is its own (destinations distinct).
                unsafe {
                    (S::SCATTER_DIRECT.entry)(src.as_ptr(), index.as_ptr(), sp, rows as u32, width as u32, o)
                }
            };
            // SAFETY: `call` is valid for the whole grid (see it); its blocks are whole warps.
            Ok(unsafe { launch_into(S::SCATTER_DIRECT.name, &linear_cfg(rows * width), acc, call) }?)
        }
        ScatterLayout::Grouped(groups) => {
            let (packed, n) = (groups.packed(), groups.groups());
            let call = |o: *mut A| {
                // SAFETY: `packed` is `ScatterGroups`' layout for `n` groups over `rows` rows of
                // `src` (which holds rows·width, checked), each destination a row of `o` (the
                // accumulators, checked above); `scale` holds `rows` (or is null). Destinations are
                // distinct, so each thread's (destination, column) element of `o` is its own.
                unsafe { (S::SCATTER.entry)(src.as_ptr(), packed.as_ptr(), sp, n as u32, width as u32, o) }
            };
            // SAFETY: `call` is valid for the whole grid (see it); its blocks are whole warps.
            Ok(unsafe { launch_into(S::SCATTER.name, &linear_cfg(n * width), acc, call) }?)
        }
    }
}

/// `h = silu(gate) ⊙ up` over `h.len()` elements, gate and up the pre-activations of `gu` at
/// `at` (split blocks or fused rows, checked).
pub fn swiglu<T: KernelElem>(gu: &[T], at: PreAt, h: &mut [T]) -> Result<()> {
    let n = h.len();
    at.check(n, gu.len())?;
    let (gate_at, up_at, width, pitch) = at.layout(n);
    let call = |o: *mut T| {
        // SAFETY: `gu` holds the n gate and n up elements of this layout (checked) and `o` n.
        unsafe {
            (T::SWIGLU.entry)(
                gu.as_ptr(),
                gate_at as u64,
                up_at as u64,
                n as u64,
                width as u32,
                pitch as u64,
                o,
            )
        }
    };
    // SAFETY: `call` is valid for the whole grid (see it); its blocks are whole warps (LINEAR_THREADS).
    Ok(unsafe { launch_into(T::SWIGLU.name, &linear_cfg(n), h, call) }?)
}

/// In place over the pre-activations of `gu` at `at` (split blocks or fused rows, checked):
/// `gate ← dh ⊙ up ⊙ silu'(gate)`, `up ← dh ⊙ silu(gate)`, for the `dh.len()` elements.
pub fn swiglu_backward<T: KernelElem>(gu: &mut [T], at: PreAt, dh: &[T]) -> Result<()> {
    let n = dh.len();
    at.check(n, gu.len())?;
    let (gate_at, up_at, width, pitch) = at.layout(n);
    let call = |o: *mut T| {
        // SAFETY: `o` holds `gu`'s elements, among them the n gate and n up elements of this
        // layout (checked, disjoint), each rewritten by its element's thread only; `dh` holds n.
        unsafe {
            (T::SWIGLU_BACKWARD.entry)(
                o,
                gate_at as u64,
                up_at as u64,
                dh.as_ptr(),
                n as u64,
                width as u32,
                pitch as u64,
            )
        }
    };
    // SAFETY: `call` is valid for the whole grid (see it); its blocks are whole warps (LINEAR_THREADS).
    Ok(unsafe { launch_into(T::SWIGLU_BACKWARD.name, &linear_cfg(n), gu, call) }?)
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
    let call = |o: *mut f32| {
        // SAFETY: `a` and `b` hold rows·width, `o` rows; block r writes o[r] only.
        unsafe { (T::ROW_DOT.entry)(a.as_ptr(), b.as_ptr(), width as u32, o) }
    };
    // SAFETY: `call` is valid for the whole grid (see it); EMU_ROW_THREADS is a multiple of 32.
    Ok(unsafe { launch_into(T::ROW_DOT.name, &cfg, out, call) }?)
}
