//! The bf16 GEMM of the CPU paths: `dst (m×n, f32) ← [dst +] scale·(a · b)` for bf16 views
//! `a` (m×k) and `b` (k×n) of any strides, on the CPU's bf16 dot-product instruction
//! (AVX512-BF16 `vdpbf16ps`), detected at run time.
//!
//! Each product of two bf16 values is exact in f32 and every sum is an f32 sum, so the result is
//! the widened f32 GEMM's up to the order of the additions: exact in the same sense, at twice the
//! multiply-adds per instruction and half the bytes read.
//!
//! [`Bf16Gemm::detect`] returns a handle only on a CPU with the instructions; callers keep their
//! widening path for the others. The handle is the proof the instructions exist, so its
//! [`matmul`](Bf16Gemm::matmul) is safe.
//!
//! Schedule: columns of `b` in blocks of [`NC`], k in chunks of [`KC`]. Per (block, chunk) `b` is
//! packed once into panels of [`NR`] columns, shared by every thread; rows of `a` are split
//! into tasks of [`ROW_BLOCK`], and a task packs its rows of `a` for the chunk. Both are
//! pair-interleaved (a u32 holds the bf16 of k = 2p and 2p + 1), whatever the operands'
//! strides. An [`MR`]×[`NR`] micro-kernel then runs per pair of k two panel loads, `MR`
//! broadcasts of `a`'s pair and `2·MR` `vdpbf16ps`, and adds its tile into `dst`. Every output
//! element is summed by one task, chunk after chunk, so the result is bitwise identical for
//! every thread count. Scratch: at most [`SCRATCH_BYTES_PER_THREAD`] per thread, whatever the
//! shapes.
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
/// Columns of `b` per packed block (a multiple of [`NR`]).
pub const NC: usize = 1024;
/// Bytes a call allocates per thread, an upper bound: a task's rows of `a` packed for one chunk
/// of k, plus (counted per thread, though one copy is shared) one packed chunk of `b`'s column
/// block.
pub const SCRATCH_BYTES_PER_THREAD: usize = (ROW_BLOCK * KP + KP * NC) * 4;

/// The AVX512-BF16 GEMM, available on CPUs that have the instructions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bf16Gemm {
    _proof: (),
}

/// Which CPU kernel multiplies bf16 operands. Both form every product of two bf16 values exactly
/// in f32 and sum in f32; they differ only in the order of those sums (and in speed).
/// Default: [`Bf16Kernel::Detect`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Bf16Kernel {
    /// [`Bf16Gemm`] where this CPU has AVX512F and AVX512-BF16, else [`Bf16Kernel::Widened`].
    #[default]
    Detect,
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
            Self::Widened => None,
        }
    }

    /// A short name for reports: `detect` or `widened`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Detect => "detect",
            Self::Widened => "widened",
        }
    }
}

impl Bf16Gemm {
    /// The kernel, when this CPU has AVX512F and AVX512-BF16; `None` elsewhere (callers then
    /// widen: [`Bf16Kernel`] chooses between the two).
    pub fn detect() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bf16")
        {
            return Some(Self { _proof: () });
        }
        None
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
        let tile = Tile { n, row_stride, scale: options.scale, add: options.accumulate == Accumulate::Add };
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
                let panels = b_pack.chunks_mut(KP * NR).zip((jc..jc + nc).step_by(NR));
                let pack =
                    |(panel, j0): (&mut [u32], usize)| pack_b(b, (k0, kc), (j0, NR.min(jc + nc - j0)), panel);
                if parallel {
                    panels.par_bridge().for_each(pack);
                } else {
                    panels.for_each(pack);
                }
                let chunk = Chunk { k0, kc, jc, nc, b_pack: &b_pack };
                let tasks = data.chunks_mut(ROW_BLOCK * row_stride).enumerate();
                if parallel {
                    tasks.par_bridge().for_each(|(t, rows)| {
                        let mut a_pack = vec![0u32; ROW_BLOCK * KP];
                        tile.rows(
                            rows,
                            (t * ROW_BLOCK, ROW_BLOCK.min(m - t * ROW_BLOCK)),
                            a,
                            chunk,
                            &mut a_pack,
                        );
                    });
                } else {
                    let a_pack = match a_packs.first_mut() {
                        Some(buf) => buf,
                        None => {
                            a_packs.push(vec![0u32; ROW_BLOCK * KP]);
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
        pack_a(a, (r0, mt), (k0, kc), a_pack);
        let step = Step {
            pairs: kc.div_ceil(2),
            row_stride: self.row_stride,
            scale: self.scale,
            add: self.add || k0 > 0,
        };
        for (panel, j0) in b_pack.chunks(KP * NR).zip((jc..jc + nc).step_by(NR)) {
            let nr = NR.min(jc + nc - j0);
            for i0 in (0..mt).step_by(MR) {
                let mr = MR.min(mt - i0);
                let out = &mut dst[i0 * self.row_stride..];
                // SAFETY: `Bf16Gemm` exists only where `detect` found AVX512F and AVX512-BF16.
                // `a_pack[i0·KP..]` holds `mr` packed rows of `KP` pairs and `panel` `KP·NR`
                // u32, with `step.pairs ≤ KP`; `out` holds `mr` rows of stride
                // `row_stride ≥ n ≥ j0 + nr` from row i0 (the caller checked
                // `(m−1)·row_stride + n` elements, and this task's slice starts at row r0).
                unsafe { kernel_rows(step, &a_pack[i0 * KP..(i0 + mr) * KP], panel, (mr, nr, j0), out) };
            }
        }
    }
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

/// Packs rows `r0..r0+mt`, columns `k0..k0+kc` of `a` as `[mt][KP]` u32, each holding
/// `a[i][2p] | a[i][2p+1] << 16` (0 past kc), walking whichever of a's dimensions is
/// contiguous innermost.
fn pack_a(a: MatRef<'_, bf16>, (r0, mt): (usize, usize), (k0, kc): (usize, usize), out: &mut [u32]) {
    let (data, _, _, rs, cs) = a.parts();
    let el = |i: usize, p: usize| {
        if p < kc { u32::from(data[(r0 + i) * rs + (k0 + p) * cs].to_bits()) } else { 0 }
    };
    let pairs = kc.div_ceil(2);
    if cs <= rs {
        for i in 0..mt {
            for (p2, o) in out[i * KP..i * KP + pairs].iter_mut().enumerate() {
                *o = el(i, 2 * p2) | (el(i, 2 * p2 + 1) << 16);
            }
        }
    } else {
        for p2 in 0..pairs {
            for i in 0..mt {
                out[i * KP + p2] = el(i, 2 * p2) | (el(i, 2 * p2 + 1) << 16);
            }
        }
    }
}

/// Packs rows `k0..k0+kc`, columns `j0..j0+nr` (nr ≤ NR) of `b` as `[KP][NR]` u32, each
/// holding `b[2p][j] | b[2p+1][j] << 16` (0 past kc and past nr), walking whichever of b's
/// dimensions is contiguous innermost.
fn pack_b(b: MatRef<'_, bf16>, (k0, kc): (usize, usize), (j0, nr): (usize, usize), panel: &mut [u32]) {
    let (data, _, _, rs, cs) = b.parts();
    let el = |p: usize, j: usize| {
        if p < kc { u32::from(data[(k0 + p) * rs + (j0 + j) * cs].to_bits()) } else { 0 }
    };
    let pairs = kc.div_ceil(2);
    if rs <= cs {
        for j in 0..nr {
            for p2 in 0..pairs {
                panel[p2 * NR + j] = el(2 * p2, j) | (el(2 * p2 + 1, j) << 16);
            }
        }
    } else {
        for p2 in 0..pairs {
            for (j, o) in panel[p2 * NR..p2 * NR + nr].iter_mut().enumerate() {
                *o = el(2 * p2, j) | (el(2 * p2 + 1, j) << 16);
            }
        }
    }
    if nr < NR {
        for p2 in 0..pairs {
            panel[p2 * NR + nr..(p2 + 1) * NR].fill(0);
        }
    }
}

/// The `M × nr` micro-kernel at output column `j0`, adding or writing one chunk of k.
///
/// # Safety
/// The CPU must have AVX512F and AVX512-BF16; `a` is `M` packed rows of [`KP`] u32, `panel`
/// is `KP·NR` u32, `step.pairs ≤ KP`, and `out` holds `M` rows of `step.row_stride` floats
/// starting at column `j0`, each with at least `j0 + nr` columns.
/// [`kernel`] with the row count `mr` as a constant, so its accumulators stay in registers.
///
/// # Safety
/// As [`kernel`].
unsafe fn kernel_rows(
    step: Step,
    a: &[u32],
    panel: &[u32],
    (mr, nr, j0): (usize, usize, usize),
    out: &mut [f32],
) {
    // SAFETY: the caller's contract is `kernel`'s, for every row count.
    unsafe {
        match mr {
            8 => kernel::<8>(step, a, panel, (nr, j0), out),
            7 => kernel::<7>(step, a, panel, (nr, j0), out),
            6 => kernel::<6>(step, a, panel, (nr, j0), out),
            5 => kernel::<5>(step, a, panel, (nr, j0), out),
            4 => kernel::<4>(step, a, panel, (nr, j0), out),
            3 => kernel::<3>(step, a, panel, (nr, j0), out),
            2 => kernel::<2>(step, a, panel, (nr, j0), out),
            _ => kernel::<1>(step, a, panel, (nr, j0), out),
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn kernel<const M: usize>(
    step: Step,
    a: &[u32],
    panel: &[u32],
    (nr, j0): (usize, usize),
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; M];
    let a_ptr = a.as_ptr();
    let p_ptr = panel.as_ptr();
    for p in 0..step.pairs {
        // SAFETY: p < pairs ≤ KP, so the panel's row p (NR u32 = two 512-bit loads) is in
        // bounds; the transmutes reinterpret 64 bytes of vector data, valid as either type.
        let (b0, b1) = unsafe {
            let row = p_ptr.add(p * NR) as *const __m512i;
            (
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(row)),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(row.add(1))),
            )
        };
        for (i, acc_i) in acc.iter_mut().enumerate() {
            // SAFETY: i < M = mr and p < KP: the pair is inside `a`'s `mr·KP` u32.
            let pair = unsafe { *a_ptr.add(i * KP + p) };
            // SAFETY: __m512i and __m512bh are both 64 bytes of plain vector data; every bit
            // pattern is a valid value of either.
            let broadcast =
                unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair as i32)) };
            acc_i[0] = _mm512_dpbf16_ps(acc_i[0], b0, broadcast);
            acc_i[1] = _mm512_dpbf16_ps(acc_i[1], b1, broadcast);
        }
    }
    let scale = _mm512_set1_ps(step.scale);
    for (i, acc_i) in acc.iter().enumerate() {
        for (half, acc_h) in acc_i.iter().enumerate() {
            let c0 = half * 16;
            if c0 >= nr {
                break;
            }
            let lanes = (nr - c0).min(16);
            let mask: __mmask16 = if lanes == 16 { 0xffff } else { (1u16 << lanes) - 1 };
            // SAFETY: row i < mr and columns j0 + c0 .. j0 + c0 + lanes ≤ j0 + nr lie in `out`
            // (the caller's contract); masked lanes are neither read nor written.
            unsafe {
                let ptr = out.as_mut_ptr().add(i * step.row_stride + j0 + c0);
                let mut value = _mm512_mul_ps(*acc_h, scale);
                if step.add {
                    value = _mm512_add_ps(value, _mm512_maskz_loadu_ps(mask, ptr));
                }
                _mm512_mask_storeu_ps(ptr, mask, value);
            }
        }
    }
}

/// Never called: [`Bf16Gemm::detect`] returns `None` off x86-64.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel<const M: usize>(_: Step, _: &[u32], _: &[u32], _: (usize, usize), _: &mut [f32]) {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    fn data(len: usize, seed: u64) -> Vec<bf16> {
        SplitMix64::new(seed).normal_f32(len, 0.0, 1.0).into_iter().map(bf16::from_f32).collect()
    }

    /// `a · bᵀ` in f64 and `Σ|a||b|` per element (the f32 summation's error scale).
    fn naive(m: usize, n: usize, k: usize, a: &[bf16], b: &[bf16]) -> (Vec<f64>, Vec<f64>) {
        let mut c = vec![0.0; m * n];
        let mut abs = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                for p in 0..k {
                    let prod = a[i * k + p].to_f64() * b[j * k + p].to_f64();
                    c[i * n + j] += prod;
                    abs[i * n + j] += prod.abs();
                }
            }
        }
        (c, abs)
    }

    #[test]
    fn matches_naive_on_edge_shapes() {
        let Some(gemm) = Bf16Gemm::detect() else {
            eprintln!("no AVX512-BF16 on this CPU: the kernel is not exercised");
            return;
        };
        let dims = [1, 2, 7, 8, 9, 31, 32, 33, 65, 130];
        let mut seed = 0;
        for &m in &dims {
            for &n in &[1, 15, 16, 17, 32, 33, 64, 70] {
                for &k in &[1, 2, 3, 16, 17, 128, 129, 300] {
                    seed += 1;
                    let (a, b) = (data(m * k, seed), data(n * k, seed + 1000));
                    let (reference, abs) = naive(m, n, k, &a, &b);
                    for (accumulate, scale, threads) in
                        [(Accumulate::Replace, 1.0, Threads::All), (Accumulate::Add, 0.5, Threads::Single)]
                    {
                        // A row stride wider than n: the kernel must leave the gap alone.
                        let stride = n + 3;
                        let mut c = vec![1.0f32; m * stride];
                        let options =
                            MatmulOptions::with_accumulate(accumulate).scale(scale).threads(threads);
                        gemm.matmul_nt(MatMut::strided(&mut c, m, n, stride, 1).unwrap(), &a, &b, k, options)
                            .unwrap();
                        for i in 0..m {
                            for j in 0..n {
                                let base = if accumulate == Accumulate::Add { 1.0 } else { 0.0 };
                                let expected = base + scale as f64 * reference[i * n + j];
                                let got = c[i * stride + j] as f64;
                                let tol = 1e-6 * (k as f64) * abs[i * n + j] + 1e-6;
                                assert!(
                                    (got - expected).abs() <= tol,
                                    "m={m} n={n} k={k} ({i},{j}): {got} vs {expected}"
                                );
                            }
                            assert!(
                                c[i * stride + n..(i + 1) * stride].iter().all(|&g| g == 1.0),
                                "gap written"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn thread_count_does_not_change_bits() {
        let Some(gemm) = Bf16Gemm::detect() else { return };
        let (m, n, k) = (517, 77, 301);
        let (a, b) = (data(m * k, 1), data(n * k, 2));
        let run = |threads| {
            let mut c = vec![0.0f32; m * n];
            let options = MatmulOptions::default().threads(threads);
            gemm.matmul_nt(MatMut::row_major(&mut c, m, n).unwrap(), &a, &b, k, options).unwrap();
            c
        };
        let single = run(Threads::Single);
        assert_eq!(single, run(Threads::All));
        assert_eq!(single, run(Threads::Exactly(3)));
    }

    /// `a · b` for strided views, in f64, and `Σ|a||b|` per element.
    fn naive_views(a: MatRef<'_, bf16>, b: MatRef<'_, bf16>) -> (Vec<f64>, Vec<f64>) {
        let ((ad, m, k, ars, acs), (bd, _, n, brs, bcs)) = (a.parts(), b.parts());
        let mut c = vec![0.0; m * n];
        let mut abs = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                for p in 0..k {
                    let prod = ad[i * ars + p * acs].to_f64() * bd[p * brs + j * bcs].to_f64();
                    c[i * n + j] += prod;
                    abs[i * n + j] += prod.abs();
                }
            }
        }
        (c, abs)
    }

    /// Every layout of the two operands (the backward GEMMs read a transposed gradient and a
    /// transposed weight block), with k within one packed chunk and across three.
    #[test]
    fn strided_operands_match_naive() {
        let Some(gemm) = Bf16Gemm::detect() else { return };
        let mut seed = 50_000;
        for &(m, n, k) in &[
            (1, 1, 1),
            (9, 33, 255),
            (130, 17, 256),
            (33, 70, 257),
            (7, 40, 1023),
            (5, 33, 2 * KC + 3),
            (129, 65, 0),
        ] {
            seed += 1;
            let (a_data, b_data) = (data(m * k, seed), data(k * n, seed + 1));
            for (a_t, b_t) in [(false, false), (true, false), (false, true), (true, true)] {
                let a = if a_t {
                    MatRef::row_major(&a_data, k, m).unwrap().t()
                } else {
                    MatRef::row_major(&a_data, m, k).unwrap()
                };
                let b = if b_t {
                    MatRef::row_major(&b_data, n, k).unwrap().t()
                } else {
                    MatRef::row_major(&b_data, k, n).unwrap()
                };
                let (reference, abs) = naive_views(a, b);
                let mut c = vec![7.0f32; m * n];
                let options = MatmulOptions::default().scale(2.0);
                gemm.matmul(MatMut::row_major(&mut c, m, n).unwrap(), a, b, options).unwrap();
                for (idx, (&got, (&r, &s))) in c.iter().zip(reference.iter().zip(&abs)).enumerate() {
                    let tol = 2e-6 * (k as f64) * s + 1e-6;
                    assert!(
                        (got as f64 - 2.0 * r).abs() <= tol,
                        "m={m} n={n} k={k} a_t={a_t} b_t={b_t} at {idx}: {got} vs {}",
                        2.0 * r
                    );
                }
            }
        }
    }

    #[test]
    fn scratch_is_independent_of_the_shapes() {
        assert_eq!(SCRATCH_BYTES_PER_THREAD, (ROW_BLOCK * KC / 2 + KC / 2 * NC) * 4);
        assert_eq!(NC % NR, 0);
    }

    #[test]
    fn bad_shapes_are_typed_errors() {
        let Some(gemm) = Bf16Gemm::detect() else { return };
        let a = data(6, 1);
        let mut c = vec![0.0f32; 4];
        let err = gemm.matmul_nt(
            MatMut::row_major(&mut c, 2, 2).unwrap(),
            &a,
            &a[..5],
            3,
            MatmulOptions::default(),
        );
        assert!(matches!(err, Err(Error::ShapeMismatch { what: "b (n·k)", expected: 6, got: 5 })), "{err:?}");
        let err = gemm.matmul(
            MatMut::row_major(&mut c, 2, 2).unwrap(),
            MatRef::row_major(&a, 2, 3).unwrap(),
            MatRef::row_major(&a, 3, 2).unwrap().t(),
            MatmulOptions::default(),
        );
        assert!(
            matches!(err, Err(Error::ShapeMismatch { what: "b rows (k)", expected: 3, got: 2 })),
            "{err:?}"
        );
        let err =
            gemm.matmul_nt(MatMut::col_major(&mut c, 2, 2).unwrap(), &a, &a, 3, MatmulOptions::default());
        assert!(matches!(err, Err(Error::ShapeMismatch { what: "dst column stride", .. })), "{err:?}");
    }
}
