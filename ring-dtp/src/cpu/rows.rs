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
}
