//! Packing of the operands into the kernels' layouts: pairs of k interleaved in a u32
//! (`lo | hi << 16`, the bf16 of k = 2p and 2p + 1), rows of `a` at a stride of [`A_STRIDE`],
//! panels of `b` as `[KP][NR]`, zero-padded to whole tile steps.
//!
//! Each pack walks whichever of its operand's dimensions is contiguous innermost. Three of the
//! walks are vectorized on AVX512F (which every [`Bf16Gemm`](super::Bf16Gemm) has), because the
//! backward GEMMs of a bf16 logits block spend a quarter of their time here otherwise:
//! - rows of `a` contiguous in k: a pair is two consecutive values, so a packed row is the
//!   row's bytes (a copy);
//! - rows of `b` contiguous in n (`dX += Gᵀ·W` packs W so): two rows of k make one row of
//!   pairs, 16 at a time (widen both halves to u32, shift one, or them);
//! - columns of `a` contiguous in m (its left operand Gᵀ): a transpose, 16 rows × 16 pairs at
//!   a time through registers instead of 256 scattered stores.
//!
//! The vector and scalar walks write the same bits (tested), so the kernels' results do not
//! depend on which ran.

use half::bf16;

use super::{A_STRIDE, KP, NR, amx};
use crate::gemm::MatRef;

/// Proof that this CPU runs AVX512F: the packs' vector walks take one.
#[derive(Debug, Clone, Copy)]
pub(super) struct Avx512(());

impl Avx512 {
    /// `Some` where the CPU has AVX512F.
    pub(super) fn detect() -> Option<Self> {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Some(Self(()));
        }
        None
    }
}

/// `pairs` rounded up to whole AMX tile steps (at most [`KP`]): the tile kernel reads that
/// far, so the packs zero the pairs between.
fn padded_pairs(pairs: usize) -> usize {
    pairs.next_multiple_of(amx::PAIRS_PER_STEP).min(KP)
}

/// `lo | hi << 16` of two bf16 values: one pair of k, as the kernels read it.
#[inline(always)]
fn pair(lo: bf16, hi: bf16) -> u32 {
    u32::from(lo.to_bits()) | (u32::from(hi.to_bits()) << 16)
}

/// The pairs of a contiguous run of k (`out.len() = src.len().div_ceil(2)`; an odd tail's
/// high half is 0). On a little-endian CPU a pair's u32 has the bytes of its two bf16 in
/// order, so the whole pairs are a copy.
fn pack_pairs(src: &[bf16], out: &mut [u32]) {
    let full = src.len() / 2;
    if cfg!(target_endian = "little") {
        let dst: &mut [bf16] = bytemuck::cast_slice_mut(&mut out[..full]);
        dst.copy_from_slice(&src[..2 * full]);
    } else {
        for (o, two) in out[..full].iter_mut().zip(src.chunks_exact(2)) {
            *o = pair(two[0], two[1]);
        }
    }
    if let [.., last] = src
        && src.len() % 2 == 1
    {
        out[full] = pair(*last, bf16::ZERO);
    }
}

/// `out[j] = pair(lo[j], hi[j])` for `j < out.len()` (`lo` and `hi` at least as long).
fn interleave(simd: Option<Avx512>, lo: &[bf16], hi: &[bf16], out: &mut [u32]) {
    let n = out.len();
    let (lo, hi) = (&lo[..n], &hi[..n]);
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if let Some(simd) = simd {
        done = n / 16 * 16;
        for j in (0..done).step_by(16) {
            // SAFETY: `simd` proves AVX512F; j + 16 ≤ n, the length of all three slices.
            unsafe {
                vector::interleave16(
                    simd,
                    lo[j..j + 16].as_ptr(),
                    hi[j..j + 16].as_ptr(),
                    out[j..].as_mut_ptr(),
                )
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = simd;
    for ((o, &l), &h) in out[done..].iter_mut().zip(&lo[done..]).zip(&hi[done..]) {
        *o = pair(l, h);
    }
}

/// Packs rows `r0..r0+mt`, columns `k0..k0+kc` of `a` as `[mt][KP]` u32 at a stride of
/// [`A_STRIDE`], each holding `a[i][2p] | a[i][2p+1] << 16` (0 past kc, up to whole tile
/// steps), walking whichever of a's dimensions is contiguous innermost; `simd` enables the
/// vector walks.
pub(super) fn pack_a(
    simd: Option<Avx512>,
    a: MatRef<'_, bf16>,
    (r0, mt): (usize, usize),
    (k0, kc): (usize, usize),
    out: &mut [u32],
) {
    let (data, _, _, rs, cs) = a.parts();
    let pairs = kc.div_ceil(2);
    // Zero pairs up to whole AMX tile steps (≤ KP): the tile kernel reads them.
    let padded = padded_pairs(pairs);
    for i in 0..mt {
        out[i * A_STRIDE + pairs..i * A_STRIDE + padded].fill(0);
    }
    if cs == 1 {
        // Rows contiguous in k: each row's pairs are its consecutive values.
        for i in 0..mt {
            pack_pairs(&data[(r0 + i) * rs + k0..][..kc], &mut out[i * A_STRIDE..i * A_STRIDE + pairs]);
        }
    } else if rs == 1 {
        // Columns contiguous in m (a transposed): two columns of k make one pair column.
        // Whole 16 × 16 blocks (16 rows, 16 pairs with both halves in k) go through the
        // vector transpose; the scalar walk below does the rest.
        let (mut rows_done, mut pairs_done) = (0, 0);
        #[cfg(target_arch = "x86_64")]
        if let Some(simd) = simd {
            (rows_done, pairs_done) = (mt / 16 * 16, kc / 32 * 16);
            // Pairs outer, rows inner: each column of k is read once, contiguously, and the
            // next 32 columns are prefetched while these are transposed (they lie `cs` apart,
            // a stride the hardware prefetchers do not follow).
            for p0 in (0..pairs_done).step_by(16) {
                for col in k0 + 2 * (p0 + 16)..(k0 + 2 * (p0 + 32)).min(k0 + 2 * pairs_done) {
                    for line in data[col * cs + r0..][..rows_done].chunks(32) {
                        vector::prefetch(line);
                    }
                }
                for i0 in (0..rows_done).step_by(16) {
                    let src = &data[(k0 + 2 * p0) * cs + r0 + i0..][..31 * cs + 16];
                    let dst = &mut out[i0 * A_STRIDE + p0..][..15 * A_STRIDE + 16];
                    // SAFETY: `simd` proves AVX512F; `src` holds the 32 columns of k from
                    // 2·p0 (stride cs, 16 rows each) and `dst` the 16 rows of 16 pairs (stride
                    // A_STRIDE), the extents `transpose16` reads and writes.
                    unsafe { vector::transpose16(simd, src, cs, dst) };
                }
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = simd;
        for p2 in 0..pairs {
            let from = if p2 < pairs_done { rows_done } else { 0 };
            let lo = &data[(k0 + 2 * p2) * cs + r0..][..mt];
            let hi = (2 * p2 + 1 < kc).then(|| &data[(k0 + 2 * p2 + 1) * cs + r0..][..mt]);
            for i in from..mt {
                out[i * A_STRIDE + p2] = pair(lo[i], hi.map_or(bf16::ZERO, |hi| hi[i]));
            }
        }
    } else {
        let el = |i: usize, p: usize| if p < kc { data[(r0 + i) * rs + (k0 + p) * cs] } else { bf16::ZERO };
        for i in 0..mt {
            for (p2, o) in out[i * A_STRIDE..i * A_STRIDE + pairs].iter_mut().enumerate() {
                *o = pair(el(i, 2 * p2), el(i, 2 * p2 + 1));
            }
        }
    }
}

/// Packs rows `k0..k0+kc`, columns `j0..j0+nr` (nr ≤ NR) of `b` as `[KP][NR]` u32, each
/// holding `b[2p][j] | b[2p+1][j] << 16` (0 past kc, up to whole tile steps, and past nr),
/// walking whichever of b's dimensions is contiguous innermost; `simd` enables the vector
/// walk.
pub(super) fn pack_b(
    simd: Option<Avx512>,
    b: MatRef<'_, bf16>,
    (k0, kc): (usize, usize),
    (j0, nr): (usize, usize),
    panel: &mut [u32],
) {
    let (data, _, _, rs, cs) = b.parts();
    let pairs = kc.div_ceil(2);
    if rs == 1 {
        // Columns contiguous in k (b = a weight block transposed): a column's consecutive
        // values are its pairs. Row p2 of the panel takes pair p2 of each of the nr columns:
        // the reads walk nr sequential streams (kc·2 bytes each, in cache together) and the
        // writes are whole panel rows, one after another.
        let columns: [&[bf16]; NR] = std::array::from_fn(|j| match j < nr {
            true => &data[(j0 + j) * cs + k0..][..kc],
            false => &[],
        });
        let full = kc / 2;
        for p2 in 0..full {
            let row = &mut panel[p2 * NR..p2 * NR + nr];
            for (o, col) in row.iter_mut().zip(&columns) {
                *o = pair(col[2 * p2], col[2 * p2 + 1]);
            }
        }
        if kc % 2 == 1 {
            let row = &mut panel[full * NR..full * NR + nr];
            for (o, col) in row.iter_mut().zip(&columns) {
                *o = pair(col[kc - 1], bf16::ZERO);
            }
        }
    } else if cs == 1 {
        // Rows contiguous in n: two rows of k make one row of pairs.
        for p2 in 0..pairs {
            let lo = &data[(k0 + 2 * p2) * rs + j0..][..nr];
            let out = &mut panel[p2 * NR..p2 * NR + nr];
            if 2 * p2 + 1 < kc {
                interleave(simd, lo, &data[(k0 + 2 * p2 + 1) * rs + j0..][..nr], out);
            } else {
                for (o, &l) in out.iter_mut().zip(lo) {
                    *o = pair(l, bf16::ZERO);
                }
            }
        }
    } else {
        let el = |p: usize, j: usize| if p < kc { data[(k0 + p) * rs + (j0 + j) * cs] } else { bf16::ZERO };
        for p2 in 0..pairs {
            for (j, o) in panel[p2 * NR..p2 * NR + nr].iter_mut().enumerate() {
                *o = pair(el(2 * p2, j), el(2 * p2 + 1, j));
            }
        }
    }
    if nr < NR {
        for p2 in 0..pairs {
            panel[p2 * NR + nr..(p2 + 1) * NR].fill(0);
        }
    }
    // Zero pairs up to whole AMX tile steps (≤ KP): the tile kernel reads them.
    let padded = padded_pairs(pairs);
    panel[pairs * NR..padded * NR].fill(0);
}

/// Pair rows per task of [`pack_b_block`].
const PACK_ROWS: usize = 64;

/// Packs rows `k0..k0+kc`, columns `jc..jc+nc` of `b` into `b_pack`, one panel of [`NR`]
/// columns after another (each as [`pack_b`] packs it), on the calling thread or in parallel.
///
/// Where b's rows are contiguous in n (W in `dX += Gᵀ·W`) the walk goes row by row: two whole
/// rows of k make row p of every panel. Panel by panel, it would read only 64 bytes of each of
/// the chunk's rows before moving on to the next, a stride no prefetcher follows, so every line
/// of W would come from memory at full latency.
pub(super) fn pack_b_block(
    simd: Option<Avx512>,
    b: MatRef<'_, bf16>,
    (k0, kc): (usize, usize),
    (jc, nc): (usize, usize),
    b_pack: &mut [u32],
    parallel: bool,
) {
    use rayon::prelude::*;
    let (data, _, _, rs, cs) = b.parts();
    let panels = b_pack.chunks_mut(KP * NR).zip((jc..jc + nc).step_by(NR));
    if cs != 1 || rs == 1 {
        let pack =
            |(panel, j0): (&mut [u32], usize)| pack_b(simd, b, (k0, kc), (j0, NR.min(jc + nc - j0)), panel);
        match parallel {
            true => panels.par_bridge().for_each(pack),
            false => panels.for_each(pack),
        }
        return;
    }
    let pairs = kc.div_ceil(2);
    let padded = padded_pairs(pairs);
    // Task t owns pair rows t·PACK_ROWS.. of every panel.
    let mut tasks: Vec<Vec<&mut [u32]>> = (0..padded.div_ceil(PACK_ROWS)).map(|_| Vec::new()).collect();
    for (panel, _) in panels {
        for (task, rows) in tasks.iter_mut().zip(panel[..padded * NR].chunks_mut(PACK_ROWS * NR)) {
            task.push(rows);
        }
    }
    let pack = |(t, mut rows): (usize, Vec<&mut [u32]>)| {
        for p2 in t * PACK_ROWS..((t + 1) * PACK_ROWS).min(padded) {
            let at = (p2 - t * PACK_ROWS) * NR;
            if p2 >= pairs {
                rows.iter_mut().for_each(|r| r[at..at + NR].fill(0));
                continue;
            }
            let lo = &data[(k0 + 2 * p2) * rs + jc..][..nc];
            let hi = (2 * p2 + 1 < kc).then(|| &data[(k0 + 2 * p2 + 1) * rs + jc..][..nc]);
            for (q, r) in rows.iter_mut().enumerate() {
                let (j, nr) = (q * NR, NR.min(nc - q * NR));
                let row = &mut r[at..at + NR];
                match hi {
                    Some(hi) => interleave(simd, &lo[j..j + nr], &hi[j..j + nr], &mut row[..nr]),
                    None => {
                        row[..nr].iter_mut().zip(&lo[j..j + nr]).for_each(|(o, &l)| *o = pair(l, bf16::ZERO))
                    }
                }
                row[nr..].fill(0);
            }
        }
    };
    match parallel {
        true => tasks.into_par_iter().enumerate().for_each(pack),
        false => tasks.into_iter().enumerate().for_each(pack),
    }
}

/// The AVX512F walks.
#[cfg(target_arch = "x86_64")]
mod vector {
    use std::arch::x86_64::*;

    use half::bf16;

    use super::super::A_STRIDE;
    use super::Avx512;

    /// Asks for the cache line holding `at[0]` (a hint: it never faults, and nothing waits for
    /// it).
    #[inline(always)]
    pub(super) fn prefetch(at: &[bf16]) {
        // SAFETY: a prefetch reads nothing architecturally and cannot fault; the address is
        // that of a live slice (SSE, which the hint needs, is part of x86-64).
        unsafe { _mm_prefetch::<_MM_HINT_T0>(at.as_ptr().cast()) };
    }

    /// `out[j] = lo[j] | hi[j] << 16` for `j < 16`.
    ///
    /// # Safety
    /// `lo` and `hi` point at 16 readable bf16 and `out` at 16 writable u32.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn interleave16(_: Avx512, lo: *const bf16, hi: *const bf16, out: *mut u32) {
        // SAFETY: the 32-byte loads and the 64-byte store stay in the extents the caller
        // guarantees; unaligned forms are used throughout.
        unsafe {
            let lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(lo.cast()));
            let hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(hi.cast()));
            _mm512_storeu_si512(out.cast(), _mm512_or_si512(lo, _mm512_slli_epi32::<16>(hi)));
        }
    }

    /// One 16 × 16 block of a transposed `a`: `dst[i·A_STRIDE + p] = src[2p·cs + i] |
    /// src[(2p+1)·cs + i] << 16` for `i, p < 16`. Column 2p (16 rows, contiguous) and column
    /// 2p + 1 make vector p of the pairs, lane i for row i; a 16 × 16 transpose of u32 turns
    /// those into vector i, lane p, which is row i's 16 packed pairs.
    ///
    /// # Safety
    /// `src` holds at least `31·cs + 16` values and `dst` at least `15·A_STRIDE + 16`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn transpose16(simd: Avx512, src: &[bf16], cs: usize, dst: &mut [u32]) {
        debug_assert!(src.len() > 31 * cs + 15 && dst.len() > 15 * A_STRIDE + 15);
        let mut v = [_mm512_setzero_si512(); 16];
        for (p, v) in v.iter_mut().enumerate() {
            // SAFETY: columns 2p and 2p + 1 start at 2p·cs and (2p + 1)·cs ≤ 31·cs and hold 16
            // values each, inside `src` by the caller's contract; the scratch store is 64
            // bytes into a 64-byte vector.
            unsafe {
                let mut out = _mm512_setzero_si512();
                interleave16(
                    simd,
                    src.as_ptr().add(2 * p * cs),
                    src.as_ptr().add((2 * p + 1) * cs),
                    (&raw mut out).cast(),
                );
                *v = out;
            }
        }
        // 32-bit interleave of neighbouring vectors, then 64-bit: afterwards vector 4k + c
        // holds, in 128-bit lane l, lane 4l + c of vectors 4k..4k + 4.
        let mut a = [_mm512_setzero_si512(); 16];
        for k in 0..8 {
            a[2 * k] = _mm512_unpacklo_epi32(v[2 * k], v[2 * k + 1]);
            a[2 * k + 1] = _mm512_unpackhi_epi32(v[2 * k], v[2 * k + 1]);
        }
        for k in 0..4 {
            v[4 * k] = _mm512_unpacklo_epi64(a[4 * k], a[4 * k + 2]);
            v[4 * k + 1] = _mm512_unpackhi_epi64(a[4 * k], a[4 * k + 2]);
            v[4 * k + 2] = _mm512_unpacklo_epi64(a[4 * k + 1], a[4 * k + 3]);
            v[4 * k + 3] = _mm512_unpackhi_epi64(a[4 * k + 1], a[4 * k + 3]);
        }
        // Row 4l + c of the result is lane l of vectors c, 4 + c, 8 + c and 12 + c.
        for c in 0..4 {
            let (b0, b1, b2, b3) = (v[c], v[4 + c], v[8 + c], v[12 + c]);
            let e0 = _mm512_shuffle_i32x4::<0x44>(b0, b1);
            let e1 = _mm512_shuffle_i32x4::<0xEE>(b0, b1);
            let e2 = _mm512_shuffle_i32x4::<0x44>(b2, b3);
            let e3 = _mm512_shuffle_i32x4::<0xEE>(b2, b3);
            let rows = [
                _mm512_shuffle_i32x4::<0x88>(e0, e2),
                _mm512_shuffle_i32x4::<0xDD>(e0, e2),
                _mm512_shuffle_i32x4::<0x88>(e1, e3),
                _mm512_shuffle_i32x4::<0xDD>(e1, e3),
            ];
            for (l, row) in rows.into_iter().enumerate() {
                let i = 4 * l + c;
                // SAFETY: row i < 16 of `dst` starts at i·A_STRIDE and holds 16 u32 (the
                // caller's contract); the store is unaligned.
                unsafe { _mm512_storeu_si512(dst.as_mut_ptr().add(i * A_STRIDE).cast(), row) };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SplitMix64;

    fn data(len: usize, seed: u64) -> Vec<bf16> {
        let mut rng = SplitMix64::new(seed);
        (0..len).map(|_| bf16::from_bits(rng.next_u64() as u16)).collect()
    }

    /// The vector walks write exactly what the scalar ones do, for every layout, with partial
    /// blocks of rows, pairs and columns and odd k.
    #[test]
    fn vector_packs_equal_scalar_packs() {
        let Some(simd) = Avx512::detect() else { return };
        let mut seed = 7;
        for &(rows, k) in &[(16, 32), (37, 100), (128, 1024), (5, 7), (48, 33), (130, 257)] {
            seed += 1;
            let src = data(rows * k, seed);
            for transposed in [false, true] {
                let a = if transposed {
                    MatRef::row_major(&src, k, rows).unwrap().t()
                } else {
                    MatRef::row_major(&src, rows, k).unwrap()
                };
                for (r0, k0) in [(0, 0), (rows / 3, k / 5)] {
                    let (mt, kc) = ((rows - r0).min(128), (k - k0).min(2 * KP));
                    let mut scalar = vec![u32::MAX; 128 * A_STRIDE];
                    let mut vector = scalar.clone();
                    pack_a(None, a, (r0, mt), (k0, kc), &mut scalar);
                    pack_a(Some(simd), a, (r0, mt), (k0, kc), &mut vector);
                    assert_eq!(
                        scalar, vector,
                        "pack_a rows={rows} k={k} transposed={transposed} r0={r0} k0={k0}"
                    );
                }
                // The same values as b (k × n): rows of b are k.
                let b = if transposed {
                    MatRef::row_major(&src, rows, k).unwrap().t()
                } else {
                    MatRef::row_major(&src, k, rows).unwrap()
                };
                for (k0, j0) in [(0, 0), (k / 5, rows / 3)] {
                    let (kc, nr) = ((k - k0).min(2 * KP), (rows - j0).min(NR));
                    let mut scalar = vec![u32::MAX; KP * NR];
                    let mut vector = scalar.clone();
                    pack_b(None, b, (k0, kc), (j0, nr), &mut scalar);
                    pack_b(Some(simd), b, (k0, kc), (j0, nr), &mut vector);
                    assert_eq!(
                        scalar, vector,
                        "pack_b k={k} n={rows} transposed={transposed} k0={k0} j0={j0}"
                    );
                }
            }
        }
    }

    /// The row-order walk of a whole column block writes what packing each panel does.
    #[test]
    fn block_pack_equals_panel_packs() {
        let cases: [(usize, usize, usize, usize, usize, usize); 3] =
            [(300, 100, 0, 300, 0, 100), (1030, 70, 5, 1023, 3, 67), (64, 40, 0, 63, 0, 40)];
        for (k, n, k0, kc, jc, nc) in cases {
            let src = data(k * n, (k + n) as u64);
            let b = MatRef::row_major(&src, k, n).unwrap();
            for simd in [None, Avx512::detect()] {
                let mut panels = vec![u32::MAX; KP * nc.next_multiple_of(NR)];
                for (panel, j0) in panels.chunks_mut(KP * NR).zip((jc..jc + nc).step_by(NR)) {
                    pack_b(simd, b, (k0, kc), (j0, NR.min(jc + nc - j0)), panel);
                }
                for parallel in [false, true] {
                    let mut block = vec![u32::MAX; KP * nc.next_multiple_of(NR)];
                    pack_b_block(simd, b, (k0, kc), (jc, nc), &mut block, parallel);
                    assert_eq!(panels, block, "k={k} n={n} k0={k0} kc={kc} jc={jc} nc={nc}");
                }
            }
        }
    }

    /// A packed pair is `lo | hi << 16`, whichever walk wrote it.
    #[test]
    fn pairs_hold_lo_in_the_low_half() {
        let src: Vec<bf16> = (1..=5u16).map(bf16::from_bits).collect();
        let mut out = [0u32; 3];
        pack_pairs(&src, &mut out);
        assert_eq!(out, [1 | 2 << 16, 3 | 4 << 16, 5]);
    }
}
