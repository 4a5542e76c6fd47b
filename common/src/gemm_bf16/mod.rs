//! The bf16 GEMM of the CPU paths: `dst (m×n, f32) ← [dst +] scale·(a · b)` for bf16 views
//! `a` (m×k) and `b` (k×n) of any strides, on the CPU's bf16 instructions, detected at run
//! time: AMX tiles (`tdpbf16ps`, Xeons since Sapphire Rapids) where the CPU and OS allow them,
//! else AVX512-BF16 dot products (`vdpbf16ps`).
//!
//! Each product of two bf16 values is exact in f32 and every sum is an f32 sum, so the result is
//! the widened f32 GEMM's up to the order of the additions: exact in the same sense, at many
//! times the multiply-adds per instruction and half the bytes read.
//!
//! [`Bf16Gemm::detect`] returns a handle only on a CPU with the instructions; callers keep their
//! widening path for the others ([`Bf16Kernel`] chooses). The handle is the proof the
//! instructions exist, so its [`matmul`](Bf16Gemm::matmul) is safe.
//!
//! Schedule: columns of `b` in blocks of [`NC`], k in chunks of [`KC`]. Per (block, chunk) `b` is
//! packed once into panels of [`NR`] columns, shared by every thread; rows of `a` are split
//! into tasks of [`ROW_BLOCK`], and a task packs its rows of `a` for the chunk. Both are
//! pair-interleaved (a u32 holds the bf16 of k = 2p and 2p + 1), whatever the operands'
//! strides, zero-padded to whole tile steps of 16 pairs. The AVX512-BF16 micro-kernel then
//! runs an [`MR`]×[`NR`] tile: per pair of k two panel loads, `MR` broadcasts of `a`'s pair and
//! `2·MR` `vdpbf16ps`; the AMX one a 32×[`NR`] block in four 16×16 f32 tiles: per 16 pairs
//! of k two tile loads of `a`, two of the panel and four `tdpbf16ps` (the packs are already
//! the tiles' layouts). Either adds its block into `dst`. Every output element is summed by one
//! task, chunk after chunk, so the result is bitwise identical for every thread count. Scratch:
//! at most [`SCRATCH_BYTES_PER_THREAD`] per thread, whatever the shapes.
//!
//! ```
//! use flatpeak_common::gemm::{MatMut, MatRef, MatmulOptions};
//! use flatpeak_common::gemm_bf16::Bf16Gemm;
//! use half::bf16;
//!
//! let a: Vec<bf16> = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0].map(bf16::from_f32).to_vec(); // 2×3
//! let b: Vec<bf16> = [1.0f32, 0.0, 1.0, 0.0, 1.0, 0.0].map(bf16::from_f32).to_vec(); // 2×3
//! let mut c = [0.0f32; 4];
//! if let Some(gemm) = Bf16Gemm::detect() {
//!     // c = a · bᵀ
//!     let (a, bt) = (MatRef::row_major(&a, 2, 3)?, MatRef::row_major(&b, 2, 3)?.t());
//!     gemm.matmul(MatMut::row_major(&mut c, 2, 2)?, a, bt, MatmulOptions::default())?;
//!     assert_eq!(c, [4.0, 2.0, 10.0, 5.0]);
//! }
//! # Ok::<(), flatpeak_common::Error>(())
//! ```

use half::bf16;
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::gemm::{Accumulate, MatMut, MatRef, MatmulOptions, Threads};
use pack::{Avx512, pack_a, pack_b_block};

mod amx;
mod avx512;
mod pack;
#[cfg(test)]
mod tests;

/// Rows of `a` per micro-kernel call.
pub const MR: usize = 8;
/// Columns of `b` (of the output) per packed panel: two 16-lane registers.
pub const NR: usize = 32;
/// Rows of `a` per task.
pub const ROW_BLOCK: usize = 128;
/// k per packed chunk (even).
pub const KC: usize = 1024;
/// Pairs of k per packed chunk.
const KP: usize = KC / 2;
/// u32 between consecutive packed rows of `a`: [`KP`] plus one cache line, so the 16 rows a
/// tile or the micro-kernel reads do not all map to the same few L1 sets (a power-of-two
/// stride of 2 KiB would).
const A_STRIDE: usize = KP + 16;
/// Columns of `b` per packed block (a multiple of [`NR`]).
pub const NC: usize = 1024;
/// Bytes a call allocates per thread, an upper bound: a task's rows of `a` packed for one chunk
/// of k, plus (counted per thread, though one copy is shared) one packed chunk of `b`'s column
/// block.
pub const SCRATCH_BYTES_PER_THREAD: usize = (ROW_BLOCK * A_STRIDE + KP * NC) * 4;

/// The bf16 GEMM on one of this CPU's bf16 instruction sets; a value exists only where the
/// CPU (and, for AMX, the OS) runs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bf16Gemm {
    isa: Isa,
}

/// The instructions a [`Bf16Gemm`] runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Isa {
    /// AVX512-BF16 `vdpbf16ps` (the [`MR`]×[`NR`] micro-kernel).
    Avx512Bf16,
    /// AMX `tdpbf16ps` on tiles (32×32 blocks), AVX512F for the epilogue.
    Amx,
}

/// Which CPU kernel multiplies bf16 operands. Every kernel forms each product of two bf16
/// values exactly in f32 and sums in f32; they differ only in the order of those sums (and in
/// speed). Default: [`Bf16Kernel::Detect`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Bf16Kernel {
    /// The fastest this CPU has: AMX tiles, else AVX512-BF16 dot products, else
    /// [`Bf16Kernel::Widened`].
    #[default]
    Detect,
    /// AVX512-BF16 dot products even where AMX is available (else [`Bf16Kernel::Widened`]).
    Avx512Bf16,
    /// The operands widened to f32 block by block, then the f32 GEMM: what a CPU without the
    /// bf16 instructions runs. Chosen on any CPU, it reproduces such a CPU's results bit for
    /// bit, and tests or measures the fallback.
    Widened,
}

impl Bf16Kernel {
    /// The bf16 GEMM this choice runs on this CPU: `None` means the widening path.
    pub fn select(self) -> Option<Bf16Gemm> {
        match self {
            Self::Detect => Bf16Gemm::detect(),
            Self::Avx512Bf16 => Bf16Gemm::avx512_bf16(),
            Self::Widened => None,
        }
    }

    /// A short name for reports: `detect`, `avx512-bf16` or `widened`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Detect => "detect",
            Self::Avx512Bf16 => "avx512-bf16",
            Self::Widened => "widened",
        }
    }

    /// The name of the path this choice runs on this CPU: `amx`, `avx512-bf16` or `widened`.
    pub fn path_name(self) -> &'static str {
        self.select().map_or("widened", Bf16Gemm::name)
    }
}

impl Bf16Gemm {
    /// The fastest kernel this CPU has: AMX tiles where the CPU has AMX-TILE, AMX-BF16 and
    /// AVX512F and the OS grants this process the tile state (asked once, on Linux), else
    /// AVX512-BF16 dot products; `None` without either (callers then widen: [`Bf16Kernel`]
    /// chooses among them).
    pub fn detect() -> Option<Self> {
        if amx::available() {
            return Some(Self { isa: Isa::Amx });
        }
        Self::avx512_bf16()
    }

    /// The AVX512-BF16 kernel, where this CPU has AVX512F and AVX512-BF16.
    pub fn avx512_bf16() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bf16")
        {
            return Some(Self { isa: Isa::Avx512Bf16 });
        }
        None
    }

    /// `amx` or `avx512-bf16`: the instructions this kernel runs on.
    pub fn name(self) -> &'static str {
        match self.isa {
            Isa::Avx512Bf16 => "avx512-bf16",
            Isa::Amx => "amx",
        }
    }

    /// `dst ← [dst +] scale·(a · bᵀ)` for row-major bf16 `a` (m×k) and `b` (n×k): the layout
    /// of a logits block, vocabulary rows against token rows.
    pub fn matmul_nt(
        self,
        dst: MatMut<'_, f32>,
        a: &[bf16],
        b: &[bf16],
        k: usize,
        options: MatmulOptions<f32>,
    ) -> Result<()> {
        let (m, n) = dst.shape();
        for (what, expected, got) in [("a (m·k)", m * k, a.len()), ("b (n·k)", n * k, b.len())] {
            if expected != got {
                return Err(Error::ShapeMismatch { what, expected, got });
            }
        }
        self.matmul(dst, MatRef::row_major(a, m, k)?, MatRef::row_major(b, n, k)?.t(), options)
    }

    /// `dst ← [dst +] scale·(a · b)`: `a` is an m×k and `b` a k×n view of bf16 with any strides,
    /// `dst` an m×n view with unit column stride. Shapes are checked before any work: a
    /// mismatch is a typed error.
    pub fn matmul(
        self,
        dst: MatMut<'_, f32>,
        a: MatRef<'_, bf16>,
        b: MatRef<'_, bf16>,
        options: MatmulOptions<f32>,
    ) -> Result<()> {
        let (data, m, n, row_stride, col_stride) = dst.into_parts();
        let k = a.cols();
        for (what, expected, got) in [
            ("a rows (m)", m, a.rows()),
            ("b rows (k)", k, b.rows()),
            ("b columns (n)", n, b.cols()),
            ("dst column stride", 1, col_stride),
        ] {
            if expected != got {
                return Err(Error::ShapeMismatch { what, expected, got });
            }
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        if m > 1 && row_stride < n {
            return Err(Error::ShapeMismatch {
                what: "dst row stride (≥ n)", expected: n, got: row_stride
            });
        }
        let needed = (m - 1) * row_stride + n;
        if data.len() < needed {
            return Err(Error::ShapeMismatch { what: "dst elements", expected: needed, got: data.len() });
        }
        let tile = Tile {
            n,
            row_stride,
            scale: options.scale,
            add: options.accumulate == Accumulate::Add,
            isa: self.isa,
            simd: Avx512::detect(),
        };
        let parallel = !matches!(options.threads, Threads::Single | Threads::Exactly(0 | 1));
        let data = &mut data[..needed];
        if k == 0 {
            tile.zero_unless_adding(data, m);
            return Ok(());
        }
        // B is packed once per (column block, chunk of k) and shared; each task packs its rows
        // of A. Tasks own disjoint rows, so the parallel loop needs no synchronisation, and each
        // output element is summed by one task, chunk after chunk, in a fixed order.
        let mut b_pack = vec![0u32; KP * NC.min(n.next_multiple_of(NR))];
        let mut a_packs: Vec<Vec<u32>> = Vec::new();
        for jc in (0..n).step_by(NC) {
            let nc = NC.min(n - jc);
            for k0 in (0..k).step_by(KC) {
                let kc = KC.min(k - k0);
                pack_b_block(tile.simd, b, (k0, kc), (jc, nc), &mut b_pack, parallel);
                let chunk = Chunk { k0, kc, jc, nc, b_pack: &b_pack };
                let tasks = data.chunks_mut(ROW_BLOCK * row_stride).enumerate();
                if parallel {
                    // A packing buffer per worker, not per task: allocating and zeroing 264 KiB
                    // for each task of 128 rows took 2% of a ring-dtp call (glibc's memset).
                    let a_pack = || vec![0u32; ROW_BLOCK * A_STRIDE];
                    tasks.par_bridge().for_each_init(a_pack, |a_pack, (t, rows)| {
                        tile.rows(rows, (t * ROW_BLOCK, ROW_BLOCK.min(m - t * ROW_BLOCK)), a, chunk, a_pack);
                    });
                } else {
                    let a_pack = match a_packs.first_mut() {
                        Some(buf) => buf,
                        None => {
                            a_packs.push(vec![0u32; ROW_BLOCK * A_STRIDE]);
                            &mut a_packs[0]
                        }
                    };
                    for (t, rows) in tasks {
                        tile.rows(rows, (t * ROW_BLOCK, ROW_BLOCK.min(m - t * ROW_BLOCK)), a, chunk, a_pack);
                    }
                }
            }
        }
        Ok(())
    }
}

/// One call's shape and epilogue.
#[derive(Debug, Clone, Copy)]
struct Tile {
    n: usize,
    row_stride: usize,
    scale: f32,
    add: bool,
    isa: Isa,
    /// The packs' vector walks (every [`Isa`] has AVX512F).
    simd: Option<Avx512>,
}

/// One (column block, chunk of k) of B, packed: panels of [`NR`] columns, `KP·NR` u32 each.
#[derive(Debug, Clone, Copy)]
struct Chunk<'p> {
    k0: usize,
    kc: usize,
    jc: usize,
    nc: usize,
    b_pack: &'p [u32],
}

impl Tile {
    /// `dst ← 0` for an empty reduction (k = 0), unless adding.
    fn zero_unless_adding(&self, dst: &mut [f32], m: usize) {
        if !self.add {
            for i in 0..m {
                dst[i * self.row_stride..i * self.row_stride + self.n].fill(0.0);
            }
        }
    }

    /// The `mt` output rows from `r0` of one task (`dst` starts at row `r0`), for one chunk:
    /// packs the task's rows of `a` into `a_pack`, then runs the micro-kernel over every panel.
    fn rows(
        &self,
        dst: &mut [f32],
        (r0, mt): (usize, usize),
        a: MatRef<'_, bf16>,
        chunk: Chunk<'_>,
        a_pack: &mut [u32],
    ) {
        let Chunk { k0, kc, jc, nc, b_pack } = chunk;
        pack_a(self.simd, a, (r0, mt), (k0, kc), a_pack);
        let step = Step {
            pairs: kc.div_ceil(2),
            row_stride: self.row_stride,
            scale: self.scale,
            add: self.add || k0 > 0,
        };
        // The AMX kernel's f32 tiles for blocks it cannot accumulate in place (partial, scaled).
        let mut tiles = [0.0f32; amx::ROWS * NR];
        if self.isa == Isa::Amx {
            // SAFETY: this `Isa` exists only where `amx::available()` is true; the tiles are
            // released below, after this task's last block, and nothing between uses them.
            unsafe { amx::configure() };
        }
        for (panel, j0) in b_pack.chunks(KP * NR).zip((jc..jc + nc).step_by(NR)) {
            let nr = NR.min(jc + nc - j0);
            match self.isa {
                Isa::Avx512Bf16 => {
                    for i0 in (0..mt).step_by(MR) {
                        let mr = MR.min(mt - i0);
                        let out = &mut dst[i0 * self.row_stride..];
                        // SAFETY: this `Isa` exists only where `avx512_bf16` found AVX512F and
                        // AVX512-BF16. `a_pack[i0·A_STRIDE..]` holds `mr` packed rows of `KP` pairs
                        // and `panel` `KP·NR` u32, with `step.pairs ≤ KP`; `out` holds `mr`
                        // rows of stride `row_stride ≥ n ≥ j0 + nr` from row i0 (the caller
                        // checked `(m−1)·row_stride + n` elements, and this task's slice
                        // starts at row r0).
                        unsafe {
                            avx512::kernel_rows(
                                step,
                                &a_pack[i0 * A_STRIDE..(i0 + mr) * A_STRIDE],
                                panel,
                                (mr, nr, j0),
                                out,
                            )
                        };
                    }
                }
                Isa::Amx => {
                    for i0 in (0..mt).step_by(amx::ROWS) {
                        let mr = amx::ROWS.min(mt - i0);
                        // The next block's rows of `dst` (below this one, else the first of the
                        // next panel), asked for while this one multiplies: its epilogue reads
                        // them, and they lie a row stride apart, which no prefetcher follows.
                        match i0 + amx::ROWS < mt {
                            true => prefetch_rows(dst, (i0 + amx::ROWS, amx::ROWS), j0, self.row_stride),
                            false => prefetch_rows(dst, (0, amx::ROWS), j0 + NR, self.row_stride),
                        }
                        let out = &mut dst[i0 * self.row_stride..];
                        // SAFETY: `amx::configure()` ran above on this thread. `a_pack` is `ROW_BLOCK·A_STRIDE` u32 and i0 + 32 ≤ ROW_BLOCK (i0 is a
                        // multiple of 32, ROW_BLOCK too), so `a_pack[i0·A_STRIDE..]` holds 32 rows;
                        // `pack_a` and `pack_b` zeroed the pairs from `step.pairs` to the next
                        // multiple of 16 (≤ KP) in the `mt` live rows and in `panel`; rows past
                        // `mt` are discarded; `1 ≤ step.pairs ≤ KP` (k > 0). `out` holds `mr`
                        // rows of stride `row_stride ≥ n ≥ j0 + nr`, as above.
                        unsafe {
                            amx::block(step, (&a_pack[i0 * A_STRIDE..], panel), (mr, nr, j0), out, &mut tiles)
                        };
                    }
                }
            }
        }
        if self.isa == Isa::Amx {
            // SAFETY: `amx::configure()` ran above on this thread.
            unsafe { amx::release() };
        }
    }
}

/// Asks for the cache lines of rows `r0..r0 + rows` of `dst` (stride `row_stride`), columns
/// `j0..j0 + NR`, for writing. A hint: nothing waits for it, and rows or columns past `dst`'s
/// end are skipped.
fn prefetch_rows(dst: &[f32], (r0, rows): (usize, usize), j0: usize, row_stride: usize) {
    #[cfg(target_arch = "x86_64")]
    for r in r0..r0 + rows {
        for col in [j0, j0 + NR / 2] {
            if let Some(at) = dst.get(r * row_stride + col) {
                // SAFETY: a prefetch reads nothing architecturally and cannot fault; the
                // address is that of an element of `dst`.
                unsafe {
                    std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_ET0 }>(
                        std::ptr::from_ref(at).cast(),
                    )
                };
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (dst, r0, rows, j0, row_stride);
}

/// One chunk's micro-kernel parameters.
#[derive(Debug, Clone, Copy)]
struct Step {
    /// Pairs of k in the chunk (≤ [`KP`]).
    pairs: usize,
    row_stride: usize,
    scale: f32,
    /// Add into `dst` (else overwrite).
    add: bool,
}
