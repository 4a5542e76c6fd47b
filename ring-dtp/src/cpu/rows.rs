//! The per-row loops of the fold and the gradient pass, one token block's row of C logits at a
//! time, compiled for AVX-512 and AVX2 besides the baseline and chosen at run time
//! (`multiversion`), as `stream-adamw` does for Adam. Without them these loops run 4 lanes
//! wide (the crate is built for baseline x86-64) next to GEMMs that use all 16.
//!
//! Every lane is independent (per-token constants, per-token f64 accumulators, no horizontal
//! reduction) and Rust never contracts `a·b + c` into an FMA, so each target computes the same
//! IEEE operations in the same order: the results are bitwise identical whichever is chosen.

use multiversion::multiversion;

use super::exp::exp;

/// `s[k] += row[k]` in f64 (Σz for label smoothing).
#[multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
pub(super) fn add_f64(s: &mut [f64], row: &[f32]) {
    let n = s.len().min(row.len());
    let (s, row) = (&mut s[..n], &row[..n]);
    for k in 0..n {
        s[k] += row[k] as f64;
    }
}

/// `m[k] = max(m[k], row[k])`.
#[multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
pub(super) fn max_into(m: &mut [f32], row: &[f32]) {
    let n = m.len().min(row.len());
    let (m, row) = (&mut m[..n], &row[..n]);
    for k in 0..n {
        m[k] = m[k].max(row[k]);
    }
}

/// `s[k] += e^(row[k] − m[k])` in f64; with `keep`, `row[k]` is left holding the exponential.
#[multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
pub(super) fn exp_sum(row: &mut [f32], m: &[f32], s: &mut [f64], keep: bool) {
    let n = row.len().min(m.len()).min(s.len());
    let (row, m, s) = (&mut row[..n], &m[..n], &mut s[..n]);
    if keep {
        for k in 0..n {
            let e = exp(row[k] - m[k]);
            row[k] = e;
            s[k] += e as f64;
        }
    } else {
        for k in 0..n {
            s[k] += exp(row[k] - m[k]) as f64;
        }
    }
}

/// Per-token constants of the gradient pass over one row (see `ColumnGrads`).
#[derive(Debug, Clone, Copy)]
pub(super) struct GradConsts<'a> {
    /// The row's gradient scale c.
    pub c: &'a [f32],
    /// The smoothing constant off the target.
    pub b: &'a [f32],
    /// The multiplier of p from the z-loss and the lse gradient.
    pub z: &'a [f32],
}

/// `g = c·p − b + z·p` in place with `p = g·inv` (the row holds e^(z − max); `inv` = 1/S).
#[multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
pub(super) fn grad_from_exp(row: &mut [f32], k: GradConsts<'_>, inv: &[f32]) {
    let n = row.len().min(k.c.len()).min(k.b.len()).min(k.z.len()).min(inv.len());
    let (row, c, b, z, inv) = (&mut row[..n], &k.c[..n], &k.b[..n], &k.z[..n], &inv[..n]);
    for i in 0..n {
        let p = row[i] * inv[i];
        row[i] = c[i] * p - b[i] + z[i] * p;
    }
}

/// `g = c·p − b + z·p` in place with `p = e^(logit − lse)`.
#[multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
pub(super) fn grad_from_logits(row: &mut [f32], k: GradConsts<'_>, lse: &[f32]) {
    let n = row.len().min(k.c.len()).min(k.b.len()).min(k.z.len()).min(lse.len());
    let (row, c, b, z, lse) = (&mut row[..n], &k.c[..n], &k.b[..n], &k.z[..n], &lse[..n]);
    for i in 0..n {
        let p = exp(row[i] - lse[i]);
        row[i] = c[i] * p - b[i] + z[i] * p;
    }
}

/// [`grad_from_logits`] times the softcap derivative `1 − (z/cap)²` of the capped logit z.
#[multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
pub(super) fn grad_from_capped_logits(row: &mut [f32], k: GradConsts<'_>, lse: &[f32], cap: f32) {
    let n = row.len().min(k.c.len()).min(k.b.len()).min(k.z.len()).min(lse.len());
    let (row, c, b, z, lse) = (&mut row[..n], &k.c[..n], &k.b[..n], &k.z[..n], &lse[..n]);
    for i in 0..n {
        let (p, t) = (exp(row[i] - lse[i]), row[i] / cap);
        row[i] = (c[i] * p - b[i] + z[i] * p) * (1.0 - t * t);
    }
}

/// The bf16 nearest to the f32 of bits `x` (ties to even; a NaN stays a NaN, made quiet), as
/// bits: `half`'s conversion, written without branches so a row of them vectorizes.
#[inline(always)]
fn bf16_bits(x: u32) -> u16 {
    let nan = (x & 0x7FFF_FFFF) > 0x7F80_0000;
    // Adding 0x7FFF plus the kept part's lowest bit carries into it exactly when the dropped
    // half is above one half, or is one half and the kept part is odd.
    let rounded = x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16;
    (if nan { (x >> 16) | 0x40 } else { rounded }) as u16
}

/// Rounds a row of f32 to bf16 (to nearest, ties to even), in place: bf16 value i lands in the
/// row's i-th 16-bit slot, so the row's first half of bytes holds it as bf16. Sixteen values
/// at a time are read, then their 16 results written over the first 8 of them; a write to
/// slot i touches f32 value ⌊i/2⌋ ≤ i, read already, so nothing unread is overwritten.
#[multiversion(targets("x86_64+avx512f+avx512bw+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
pub(super) fn round_to_bf16_in_place(row: &mut [f32]) {
    const L: usize = 16;
    let n = row.len();
    let mut i0 = 0;
    while i0 + L <= n {
        let chunk: &[f32; L] = row[i0..i0 + L].try_into().expect("L values");
        let out: [u16; L] = std::array::from_fn(|l| bf16_bits(chunk[l].to_bits()));
        let slots: &mut [u16] = bytemuck::cast_slice_mut(&mut row[i0 / 2..i0 / 2 + L / 2]);
        slots.copy_from_slice(&out);
        i0 += L;
    }
    for i in i0..n {
        let b = bf16_bits(row[i].to_bits());
        let slots: &mut [u16] = bytemuck::cast_slice_mut(&mut row[i / 2..i / 2 + 1]);
        slots[i % 2] = b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The dispatched loops against the same arithmetic written out per element (what the
    /// baseline build computes), bit for bit, on a row with a SIMD tail.
    #[test]
    fn dispatched_rows_equal_the_scalar_arithmetic() {
        let n = 37;
        let row: Vec<f32> = (0..n).map(|i| ((i * 7919) % 113) as f32 / 9.0 - 6.0).collect();
        let m: Vec<f32> = (0..n).map(|i| ((i * 31) % 17) as f32 / 3.0).collect();
        let (c, b, z) = (vec![0.25f32; n], vec![1e-3f32; n], vec![-2e-4f32; n]);
        let consts = GradConsts { c: &c, b: &b, z: &z };

        let mut s = vec![0.5f64; n];
        let mut kept = row.clone();
        exp_sum(&mut kept, &m, &mut s, true);
        for i in 0..n {
            let e = exp(row[i] - m[i]);
            assert_eq!(kept[i].to_bits(), e.to_bits());
            assert_eq!(s[i].to_bits(), (0.5 + e as f64).to_bits());
        }
        let mut mx = m.clone();
        max_into(&mut mx, &row);
        assert!((0..n).all(|i| mx[i].to_bits() == m[i].max(row[i]).to_bits()));
        let mut acc = vec![1.0f64; n];
        add_f64(&mut acc, &row);
        assert!((0..n).all(|i| acc[i].to_bits() == (1.0 + row[i] as f64).to_bits()));

        let inv = vec![0.125f32; n];
        let mut g = kept.clone();
        grad_from_exp(&mut g, consts, &inv);
        for i in 0..n {
            let p = kept[i] * inv[i];
            assert_eq!(g[i].to_bits(), (c[i] * p - b[i] + z[i] * p).to_bits());
        }
        let mut g = row.clone();
        grad_from_logits(&mut g, consts, &m);
        for i in 0..n {
            let p = exp(row[i] - m[i]);
            assert_eq!(g[i].to_bits(), (c[i] * p - b[i] + z[i] * p).to_bits());
        }
        let mut g = row.clone();
        grad_from_capped_logits(&mut g, consts, &m, 30.0);
        for i in 0..n {
            let (p, t) = (exp(row[i] - m[i]), row[i] / 30.0);
            assert_eq!(g[i].to_bits(), ((c[i] * p - b[i] + z[i] * p) * (1.0 - t * t)).to_bits());
        }
    }

    /// The in-place rounding against `half`'s conversion, bit for bit: ties both ways, NaN of
    /// either sign and payload, infinities, denormals, the overflow to infinity, and a tail.
    #[test]
    fn rounding_in_place_matches_half() {
        let mut bits: Vec<u32> = vec![
            0x3F80_8000,
            0x3F81_8000,
            0x3F80_8001,
            0x3F80_7FFF,
            0x7F80_0000,
            0xFF80_0000,
            0x7FC0_0001,
            0xFF80_0001,
            0x7F80_0001,
            0x0000_8000,
            0x0001_8000,
            0x8000_0001,
            0x7F7F_FFFF,
            0xFF7F_8000,
            0,
            0x8000_0000,
        ];
        let mut rng = flatpeak_common::rng::SplitMix64::new(3);
        bits.extend((0..77).map(|_| rng.next_u64() as u32));
        for n in [0, 1, 15, 16, 17, bits.len()] {
            let mut row: Vec<f32> = bits[..n].iter().map(|&b| f32::from_bits(b)).collect();
            round_to_bf16_in_place(&mut row);
            let slots: &[u16] = bytemuck::cast_slice(&row);
            for (i, &b) in bits[..n].iter().enumerate() {
                let want = half::bf16::from_f32(f32::from_bits(b)).to_bits();
                assert_eq!(slots[i], want, "n={n} i={i} bits={b:#010x}");
            }
        }
    }
}
