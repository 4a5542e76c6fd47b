//! The bf16 GEMM of the CPU paths: `dst (m×n, f32) ← [dst +] scale·(a · bᵀ)` for row-major bf16
//! `a` (m×k) and `b` (n×k), on the CPU's bf16 dot-product instruction (AVX512-BF16
//! `vdpbf16ps`), detected at run time.
//!
//! Both operands are read along k, the layout of a logits block (`W_blk · X_blkᵀ`: vocabulary
//! rows against token rows). Each product of two bf16 values is exact in f32 and every sum is
//! an f32 sum, so the result is the widened f32 GEMM's up to the order of the additions: exact
//! in the same sense, at twice the multiply-adds per instruction and half the bytes read.
//!
//! [`Bf16Gemm::detect`] returns a handle only on a CPU with the instructions; callers keep their
//! widening path for the others. The handle is the proof the instructions exist, so its
//! [`matmul_nt`](Bf16Gemm::matmul_nt) is safe.
//!
//! Schedule: rows of `a` are split into blocks of [`ROW_BLOCK`] across threads; a task packs `b`
//! one panel of [`NR`] rows at a time into pair-interleaved form (`[k/2][NR]` of `u32`, each
//! holding `b[j][2p], b[j][2p+1]`), then runs an [`MR`]×[`NR`] micro-kernel over its rows: per
//! pair of k, two panel loads, `MR` broadcasts of `a`'s pair and `2·MR` `vdpbf16ps`. Every
//! output element is summed by one task in one order, so the result is bitwise identical for
//! every thread count. Scratch: one panel per task, [`Bf16Gemm::scratch_bytes_per_thread`].
//!
//! ```
//! use flatpeak_common::gemm::{MatMut, MatmulOptions};
//! use flatpeak_common::gemm_bf16::Bf16Gemm;
//! use half::bf16;
//!
//! let a: Vec<bf16> = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0].map(bf16::from_f32).to_vec(); // 2×3
//! let b: Vec<bf16> = [1.0f32, 0.0, 1.0, 0.0, 1.0, 0.0].map(bf16::from_f32).to_vec(); // 2×3
//! let mut c = [0.0f32; 4];
//! if let Some(gemm) = Bf16Gemm::detect() {
//!     gemm.matmul_nt(MatMut::row_major(&mut c, 2, 2)?, &a, &b, 3, MatmulOptions::default())?;
//!     assert_eq!(c, [4.0, 2.0, 10.0, 5.0]);
//! }
//! # Ok::<(), flatpeak_common::Error>(())
//! ```

use half::bf16;
use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::gemm::{Accumulate, MatMut, MatmulOptions, Threads};

/// Rows of `a` per micro-kernel call.
pub const MR: usize = 8;
/// Rows of `b` (columns of the output) per packed panel: two 16-lane registers.
pub const NR: usize = 32;
/// Rows of `a` per task.
pub const ROW_BLOCK: usize = 128;

/// The AVX512-BF16 GEMM, available on CPUs that have the instructions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bf16Gemm {
    _proof: (),
}

impl Bf16Gemm {
    /// The kernel, when this CPU has AVX512F and AVX512-BF16; `None` elsewhere, and when the
    /// environment sets `FLATPEAK_BF16_GEMM=off` (to measure or test the widening fallback on a
    /// CPU that has the instructions).
    pub fn detect() -> Option<Self> {
        if std::env::var_os("FLATPEAK_BF16_GEMM").is_some_and(|v| v == "off") {
            return None;
        }
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") && std::arch::is_x86_feature_detected!("avx512bf16")
        {
            return Some(Self { _proof: () });
        }
        None
    }

    /// Bytes one task allocates: a packed panel of [`NR`] rows of `b`, k rounded up to even
    /// (saturating: a size past `usize` is `usize::MAX`, which no budget admits).
    pub fn scratch_bytes_per_thread(k: usize) -> usize {
        k.div_ceil(2).saturating_mul(NR * 4)
    }

    /// `dst ← [dst +] scale·(a · bᵀ)`: `a` is m×k and `b` n×k, both row-major bf16, `dst` an
    /// m×n view with unit column stride. Shapes are checked before any work: a mismatch is a
    /// typed error.
    pub fn matmul_nt(
        self,
        dst: MatMut<'_, f32>,
        a: &[bf16],
        b: &[bf16],
        k: usize,
        options: MatmulOptions<f32>,
    ) -> Result<()> {
        let (data, m, n, row_stride, col_stride) = dst.into_parts();
        for (what, expected, got) in
            [("a (m·k)", m * k, a.len()), ("b (n·k)", n * k, b.len()), ("dst column stride", 1, col_stride)]
        {
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
        let tile =
            Tile { k, n, row_stride, scale: options.scale, add: options.accumulate == Accumulate::Add };
        let row_blocks = data[..needed].chunks_mut(ROW_BLOCK * row_stride).zip(a.chunks(ROW_BLOCK * k));
        let run = |(dst_rows, a_rows): (&mut [f32], &[bf16])| tile.rows(dst_rows, a_rows, b);
        match options.threads {
            Threads::Single | Threads::Exactly(0 | 1) => row_blocks.for_each(run),
            Threads::All | Threads::Exactly(_) => row_blocks.par_bridge().for_each(run),
        }
        Ok(())
    }
}

/// One call's shape and epilogue.
#[derive(Debug, Clone, Copy)]
struct Tile {
    k: usize,
    n: usize,
    row_stride: usize,
    scale: f32,
    add: bool,
}

impl Tile {
    /// The output rows of one task (`a_rows.len() / k` rows of `dst`, the last possibly short).
    fn rows(&self, dst: &mut [f32], a_rows: &[bf16], b: &[bf16]) {
        let (k, pairs) = (self.k, self.k.div_ceil(2));
        let m = a_rows.len() / k.max(1);
        let mut panel = vec![0u32; NR * pairs];
        for j0 in (0..self.n).step_by(NR) {
            let nr = NR.min(self.n - j0);
            pack_panel(&b[j0 * k..(j0 + nr) * k], k, &mut panel);
            for i0 in (0..m).step_by(MR) {
                let mr = MR.min(m - i0);
                let out = &mut dst[i0 * self.row_stride..];
                // SAFETY: `Bf16Gemm` exists only where `detect` found AVX512F and AVX512-BF16.
                // `a_rows[i0·k..]` holds `mr` rows of k; `panel` holds `pairs·NR` u32; `out`
                // holds `mr` rows of stride `row_stride ≥ nr` from column j0 (the caller
                // checked `(m−1)·row_stride + n` elements and j0 + nr ≤ n).
                unsafe { kernel(self, &a_rows[i0 * k..(i0 + mr) * k], &panel, (mr, nr, j0), out) };
            }
        }
    }
}

/// Packs `nr ≤ NR` rows of b (`nr×k`) as `[pairs][NR]` u32, each `b[j][2p] | b[j][2p+1] << 16`
/// (0 past k and past nr).
fn pack_panel(b: &[bf16], k: usize, panel: &mut [u32]) {
    let nr = b.len() / k.max(1);
    panel.fill(0);
    for j in 0..nr {
        let row = &b[j * k..(j + 1) * k];
        for (p, pair) in row.chunks(2).enumerate() {
            let lo = pair[0].to_bits() as u32;
            let hi = pair.get(1).map_or(0, |h| h.to_bits() as u32);
            panel[p * NR + j] = lo | (hi << 16);
        }
    }
}

/// The `mr × nr` micro-kernel at output column `j0`.
///
/// # Safety
/// The CPU must have AVX512F and AVX512-BF16; `a` is `mr` rows of `k`, `panel` is
/// `⌈k/2⌉·NR` u32, and `out` holds `mr` rows of `row_stride` floats starting at column `j0`,
/// each with at least `j0 + nr` columns.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn kernel(
    tile: &Tile,
    a: &[bf16],
    panel: &[u32],
    (mr, nr, j0): (usize, usize, usize),
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let (k, full_pairs) = (tile.k, tile.k / 2);
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    let a_ptr = a.as_ptr();
    let p_ptr = panel.as_ptr();
    for p in 0..tile.k.div_ceil(2) {
        // SAFETY: p < ⌈k/2⌉, so the panel's row p (NR u32 = two 512-bit loads) is in bounds;
        // the transmutes reinterpret 64 bytes of vector data, valid as either type.
        let (b0, b1) = unsafe {
            let row = p_ptr.add(p * NR) as *const __m512i;
            (
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(row)),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(row.add(1))),
            )
        };
        for (i, acc_i) in acc.iter_mut().enumerate().take(mr) {
            let pair = if p < full_pairs {
                // SAFETY: row i < mr and 2p + 1 < k: both bf16 of the pair are in `a`.
                unsafe { (a_ptr.add(i * k + 2 * p) as *const u32).read_unaligned() }
            } else {
                // The odd last element of k, paired with zero.
                a[i * k + 2 * p].to_bits() as u32
            };
            // SAFETY: __m512i and __m512bh are both 64 bytes of plain vector data; every bit
            // pattern is a valid value of either.
            let broadcast =
                unsafe { std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(pair as i32)) };
            acc_i[0] = _mm512_dpbf16_ps(acc_i[0], broadcast, b0);
            acc_i[1] = _mm512_dpbf16_ps(acc_i[1], broadcast, b1);
        }
    }
    let scale = _mm512_set1_ps(tile.scale);
    for (i, acc_i) in acc.iter().enumerate().take(mr) {
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
                let ptr = out.as_mut_ptr().add(i * tile.row_stride + j0 + c0);
                let mut value = _mm512_mul_ps(*acc_h, scale);
                if tile.add {
                    value = _mm512_add_ps(value, _mm512_maskz_loadu_ps(mask, ptr));
                }
                _mm512_mask_storeu_ps(ptr, mask, value);
            }
        }
    }
}

/// Never called: [`Bf16Gemm::detect`] returns `None` off x86-64.
#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel(_: &Tile, _: &[bf16], _: &[u32], _: (usize, usize, usize), _: &mut [f32]) {}

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
                for &k in &[1, 2, 3, 16, 17, 128, 129] {
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

    #[test]
    fn scratch_size_saturates() {
        assert_eq!(Bf16Gemm::scratch_bytes_per_thread(1024), NR * 512 * 4);
        assert_eq!(Bf16Gemm::scratch_bytes_per_thread(usize::MAX), usize::MAX);
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
        let err =
            gemm.matmul_nt(MatMut::col_major(&mut c, 2, 2).unwrap(), &a, &a, 3, MatmulOptions::default());
        assert!(matches!(err, Err(Error::ShapeMismatch { what: "dst column stride", .. })), "{err:?}");
    }
}
