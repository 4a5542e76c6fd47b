//! The AMX micro-kernel: a 32×32 block of the output in four f32 tiles, per 16 pairs of k two
//! tiles of `a` (16 rows each), two of a panel (16 columns each) and four `tdpbf16ps`.
//!
//! AMX (Advanced Matrix Extensions, on Xeons since Sapphire Rapids) multiplies 16×32 bf16 by
//! 32×16 bf16 into a 16×16 f32 tile in one instruction. Its operand layouts are the packs'
//! own: a row of an `a` tile is 16 u32 of a packed row (k pairs, row stride [`A_STRIDE`]·4
//! bytes),
//! a row of a `b` tile is one pair of k across 16 columns of a panel (row stride [`NR`]·4
//! bytes). Products of bf16 values are exact in f32 and the sums f32, like `vdpbf16ps`, and
//! like it the instruction treats denormal inputs as zero and flushes denormal results.
//!
//! Linux grants a process the 8 KiB of tile state only on request
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`): [`available`] asks once, and the
//! kernel runs only where the CPU has AMX-TILE and AMX-BF16 and the kernel said yes. A task
//! loads the tile configuration once ([`configure`]) before its blocks and releases the tiles
//! after them ([`release`]), so no state outlives it.

use super::{A_STRIDE, KP, NR, Step};

/// Output rows per call: two tiles of 16.
pub(super) const ROWS: usize = 32;
/// Pairs of k per tile step (a tile row is 64 bytes: 16 u32).
pub(super) const PAIRS_PER_STEP: usize = 16;

const _: () = assert!(NR == 32, "a panel is two tiles of 16 columns");
const _: () = assert!(KP.is_multiple_of(PAIRS_PER_STEP), "a chunk is whole tile steps");
const _: () = assert!(super::ROW_BLOCK.is_multiple_of(ROWS), "a task is whole 32-row blocks");

/// Whether this CPU and OS run AMX bf16 tiles for this process (asks the OS once).
pub(super) fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(request_tiles)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tiles() -> bool {
    use std::arch::x86_64::{__cpuid_count, __get_cpuid_max};
    /// `arch_prctl` code: request permission for a dynamically enabled XSAVE feature.
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    /// XSAVE feature number of the tile data (XTILEDATA).
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: CPUID is available on every x86-64 CPU; leaf 7 is read only when the highest
    // basic leaf reaches it. (The intrinsics are safe functions in newer Rust.)
    #[allow(unused_unsafe)]
    let leaf7 = unsafe {
        if __get_cpuid_max(0).0 < 7 {
            return false;
        }
        __cpuid_count(7, 0)
    };
    let (amx_bf16, amx_tile) = ((leaf7.edx >> 22) & 1 == 1, (leaf7.edx >> 24) & 1 == 1);
    if !(amx_bf16 && amx_tile && std::arch::is_x86_feature_detected!("avx512f")) {
        return false;
    }
    // SAFETY: arch_prctl with ARCH_REQ_XCOMP_PERM takes two integers and touches no memory of
    // this process; it fails (non-zero) where the kernel does not support AMX.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn request_tiles() -> bool {
    false
}

/// The tile configuration (palette 1): tiles 0–7 all 16 rows of 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

const CONFIG: TileConfig = {
    let mut c = [0u8; 64];
    c[0] = 1; // palette
    let mut t = 0;
    while t < 8 {
        c[16 + 2 * t] = 64; // bytes per row (u16, little-endian)
        c[48 + t] = 16; // rows
        t += 1;
    }
    TileConfig(c)
};

/// Loads the tile configuration (eight tiles of 16 rows × 64 bytes) for this thread: the
/// [`block`]s that follow use it, and [`release`] ends it.
///
/// # Safety
/// [`available`] must have returned true, and this thread must call [`release`] before it
/// returns to code that does not know the tiles are configured (nothing else in this crate
/// uses them).
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn configure() {
    // SAFETY: `available()` established AMX-TILE and the OS's grant of the tile state;
    // `ldtilecfg` reads the 64 bytes of CONFIG and touches nothing else.
    unsafe {
        std::arch::asm!("ldtilecfg [{cfg}]", cfg = in(reg) CONFIG.0.as_ptr(), options(nostack, readonly))
    };
}

/// Releases the tiles [`configure`] set up (their state returns to the initial one).
///
/// # Safety
/// As [`configure`], which must have run on this thread.
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn release() {
    // SAFETY: `tilerelease` resets this thread's tile state; no tile value is read after it.
    unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
}

/// Never called: [`available`] is false off x86-64.
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn configure() {}

/// Never called: [`available`] is false off x86-64.
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn release() {}

/// The `mr × nr` block at output rows `0..mr` of `out` and columns `j0..j0 + nr`, adding or
/// writing one chunk of k: `out ← [out +] scale·(a · panel)`. The tiles accumulate from zero
/// and go through `c` and an AVX-512 epilogue. (Accumulating in the tiles from `out` itself
/// and storing them straight back was slower here: `out`'s rows lie a power-of-two stride
/// apart in ring-dtp's shapes, so a tile's 16 rows compete for a few cache sets.)
///
/// # Safety
/// [`configure`] must have run on this thread (so [`available`] returned true). `a` holds
/// [`ROWS`] packed rows of [`KP`] u32 at a stride of [`A_STRIDE`] (rows past `mr` may hold
/// anything: their results are discarded) whose pairs from `step.pairs` up to the next
/// multiple of [`PAIRS_PER_STEP`] are zero; `panel` is `KP·NR` u32 with its rows from
/// `step.pairs` to that multiple zero; `1 ≤ step.pairs ≤ KP`; `mr ≤ ROWS`, `nr ≤ NR`; and `out`
/// holds `mr` rows of `step.row_stride` floats, each with at least `j0 + nr` columns. `c` is
/// scratch for the f32 tiles (its contents on entry do not matter).
#[cfg(target_arch = "x86_64")]
pub(super) unsafe fn block(
    step: Step,
    (a, panel): (&[u32], &[u32]),
    (mr, nr, j0): (usize, usize, usize),
    out: &mut [f32],
    c: &mut [f32; ROWS * NR],
) {
    debug_assert!(a.len() >= (ROWS - 1) * A_STRIDE + KP && panel.len() >= KP * NR && mr <= ROWS && nr <= NR);
    let steps = step.pairs.div_ceil(PAIRS_PER_STEP);
    // SAFETY: the tiles read `a` rows 0..32 and pairs 0..16·steps ≤ KP (row stride
    // A_STRIDE·4 bytes), and panel rows 0..16·steps at columns 0..32 (stride NR·4 bytes):
    // inside both slices by the caller's contract; they write the 32×32 floats of `c`.
    // `configure()` ran on this thread, so the tiles have the 16 × 64-byte shape these loads
    // assume. Only the tiles and the named registers change.
    unsafe {
        std::arch::asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "2:",
            "tileloadd tmm4, [{a0} + {sa}*1]",
            "tileloadd tmm6, [{b0} + {sb}*1]",
            "tileloadd tmm7, [{b1} + {sb}*1]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tileloadd tmm5, [{a1} + {sa}*1]",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "add {a0}, 64",
            "add {a1}, 64",
            "add {b0}, {b_step}",
            "add {b1}, {b_step}",
            "dec {steps}",
            "jnz 2b",
            "tilestored [{c0} + {sc}*1], tmm0",
            "tilestored [{c0} + {sc}*1 + 64], tmm1",
            "tilestored [{c1} + {sc}*1], tmm2",
            "tilestored [{c1} + {sc}*1 + 64], tmm3",
            a0 = inout(reg) a.as_ptr() => _,
            a1 = inout(reg) a.as_ptr().add(16 * A_STRIDE) => _,
            b0 = inout(reg) panel.as_ptr() => _,
            b1 = inout(reg) panel.as_ptr().add(16) => _,
            sa = in(reg) A_STRIDE * 4,
            sb = in(reg) NR * 4,
            b_step = in(reg) PAIRS_PER_STEP * NR * 4,
            steps = inout(reg) steps => _,
            c0 = in(reg) c.as_mut_ptr(),
            c1 = in(reg) c.as_mut_ptr().add(16 * NR),
            sc = in(reg) NR * 4,
            options(nostack),
        );
        // SAFETY: as for `block`, whose contract covers `out`; AMX implies AVX512F (checked by
        // `available`).
        store(step, c, (mr, nr, j0), out);
    }
}

/// Never called: [`available`] is false off x86-64.
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn block(
    _: Step,
    _: (&[u32], &[u32]),
    _: (usize, usize, usize),
    _: &mut [f32],
    _: &mut [f32; ROWS * NR],
) {
}

/// `out[i][j0 + j] ← [out +] scale·c[i][j]` for `i < mr`, `j < nr` (`c` is 32×32).
///
/// # Safety
/// The CPU must have AVX512F; `out` holds `mr` rows of `step.row_stride` floats, each with at
/// least `j0 + nr` columns; `mr ≤ ROWS`, `nr ≤ NR`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn store(step: Step, c: &[f32; ROWS * NR], (mr, nr, j0): (usize, usize, usize), out: &mut [f32]) {
    use std::arch::x86_64::_mm512_loadu_ps;
    for i in 0..mr {
        for half in 0..2 {
            let c0 = half * 16;
            if c0 >= nr {
                break;
            }
            // SAFETY: row i < mr ≤ 32 and columns c0..c0 + 16 ≤ 32 lie in `c`; columns
            // j0 + c0 .. j0 + c0 + min(nr − c0, 16) ≤ j0 + nr of row i lie in `out` (the
            // caller's contract); AVX512F is this function's target feature.
            unsafe {
                let value = _mm512_loadu_ps(c.as_ptr().add(i * NR + c0));
                let ptr = out.as_mut_ptr().add(i * step.row_stride + j0 + c0);
                super::avx512::store_lanes(step, value, ptr, (nr - c0).min(16));
            }
        }
    }
}
