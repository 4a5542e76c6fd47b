//! The dense pieces of the tiny MoE model around the four primitives: RMSNorm, the top-k
//! softmax router, GEMM helpers and the materialized-logits cross-entropy baseline, each with
//! its backward.

use flatpeak::common::gemm::{Accumulate, MatMut, MatRef, MatmulOptions, matmul};
use flatpeak::common::{Communicator, CommunicatorExt, ReduceOp};

/// RMSNorm's ε.
pub const RMS_EPS: f32 = 1e-6;

/// Errors of the model's own ops (shapes come from the config, so these are views gone wrong).
pub type Result<T> = std::result::Result<T, flatpeak::common::Error>;

/// `C (m×n) [+]= op(A) · op(B)` on row-major storage; `ta`/`tb`: the operand is the transpose of
/// the stored matrix.
pub fn gemm(
    c: &mut [f32],
    (m, n, k): (usize, usize, usize),
    (a, ta): (&[f32], Trans),
    (b, tb): (&[f32], Trans),
    acc: Accumulate,
) -> Result<()> {
    let a = match ta {
        Trans::No => MatRef::row_major(a, m, k)?,
        Trans::Yes => MatRef::row_major(a, k, m)?.t(),
    };
    let b = match tb {
        Trans::No => MatRef::row_major(b, k, n)?,
        Trans::Yes => MatRef::row_major(b, n, k)?.t(),
    };
    matmul(MatMut::row_major(c, m, n)?, a, b, MatmulOptions::with_accumulate(acc))
}

/// Whether a GEMM operand is read transposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trans {
    /// As stored.
    No,
    /// Transposed.
    Yes,
}

/// `u = x / rms(x) ⊙ g` per row of width `h`; returns u and each row's `1/rms`.
pub fn rmsnorm(x: &[f32], g: &[f32], h: usize) -> (Vec<f32>, Vec<f32>) {
    let mut u = vec![0.0; x.len()];
    let inv: Vec<f32> = x
        .chunks_exact(h)
        .zip(u.chunks_exact_mut(h))
        .map(|(row, out)| {
            let ms = row.iter().map(|&v| v * v).sum::<f32>() / h as f32;
            let r = 1.0 / (ms + RMS_EPS).sqrt();
            for ((o, &v), &gj) in out.iter_mut().zip(row).zip(g) {
                *o = v * r * gj;
            }
            r
        })
        .collect();
    (u, inv)
}

/// RMSNorm's backward: `dx = r·(g⊙du) − r³/h · x · Σ_j g_j du_j x_j` per row; `dg += Σ du⊙x·r`.
pub fn rmsnorm_backward(x: &[f32], g: &[f32], inv: &[f32], du: &[f32], h: usize, dg: &mut [f32]) -> Vec<f32> {
    let mut dx = vec![0.0; x.len()];
    for (((row, d), out), &r) in
        x.chunks_exact(h).zip(du.chunks_exact(h)).zip(dx.chunks_exact_mut(h)).zip(inv)
    {
        let dot: f32 = row.iter().zip(d).zip(g).map(|((&xv, &dv), &gv)| gv * dv * xv).sum();
        let c = r * r * r / h as f32 * dot;
        for j in 0..h {
            out[j] = r * g[j] * d[j] - c * row[j];
            dg[j] += d[j] * row[j] * r;
        }
    }
    dx
}

/// The router's choice for N tokens: the k largest of each row of `logits` (N×E, ties to the
/// lower id) and their softmax-renormalized weights.
pub fn top_k(logits: &[f32], e: usize, k: usize) -> (Vec<i64>, Vec<f32>) {
    let mut ids = Vec::with_capacity(logits.len() / e * k);
    let mut weights = Vec::with_capacity(logits.len() / e * k);
    for row in logits.chunks_exact(e) {
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        let chosen = &order[..k];
        let m = row[chosen[0]];
        let exps: Vec<f32> = chosen.iter().map(|&j| (row[j] - m).exp()).collect();
        let s: f32 = exps.iter().sum();
        ids.extend(chosen.iter().map(|&j| j as i64));
        weights.extend(exps.iter().map(|&v| v / s));
    }
    (ids, weights)
}

/// The top-k softmax's backward into the router logits: for the chosen j,
/// `dz_j = w_j·(dw_j − Σ_i w_i·dw_i)`, 0 elsewhere.
pub fn top_k_backward(ids: &[i64], weights: &[f32], d_weights: &[f32], e: usize, k: usize) -> Vec<f32> {
    let n = ids.len() / k;
    let mut dz = vec![0.0; n * e];
    for t in 0..n {
        let (w, dw) = (&weights[t * k..(t + 1) * k], &d_weights[t * k..(t + 1) * k]);
        let dot: f32 = w.iter().zip(dw).map(|(a, b)| a * b).sum();
        for j in 0..k {
            dz[t * e + ids[t * k + j] as usize] += w[j] * (dw[j] - dot);
        }
    }
    dz
}

/// The baseline loss: gather the whole W (every rank's vocabulary shard), materialize this
/// rank's N×V fp32 logits and their gradient, mean cross-entropy over every rank's valid
/// targets; returns the global loss, dX (N×H) and this rank's shard of dW (summed over ranks).
/// Its working set is `8·N·V` bytes of logits and gradient plus two V×H copies of W.
pub fn materialized_loss<C: Communicator + ?Sized>(
    comm: &C,
    x: &[f32],
    w_shard: &[f32],
    shards: &[std::ops::Range<usize>],
    targets: &[i64],
    (n, h, v): (usize, usize, usize),
) -> Result<(f64, Vec<f32>, Vec<f32>)> {
    let p = comm.world_size();
    let rows: Vec<usize> = shards.iter().map(|s| s.len() * h).collect();
    let send: Vec<f32> = (0..p).flat_map(|_| w_shard.iter().copied()).collect();
    let mut w = vec![0.0; v * h];
    comm.all_to_all_v(&send, &vec![w_shard.len(); p], &mut w, &rows)?;
    let mut logits = vec![0.0; n * v];
    gemm(&mut logits, (n, v, h), (x, Trans::No), (&w, Trans::Yes), Accumulate::Replace)?;
    let mut counts = [targets.iter().filter(|&&t| t >= 0).count() as f32];
    comm.all_reduce_f32(&mut counts, ReduceOp::Sum)?;
    let denom = counts[0].max(1.0) as f64;
    let mut local = 0f64;
    for (row, &t) in logits.chunks_exact_mut(v).zip(targets) {
        let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let s: f64 = row.iter().map(|&z| ((z - m) as f64).exp()).sum();
        let lse = m as f64 + s.ln();
        if t < 0 {
            row.fill(0.0);
            continue;
        }
        local += lse - row[t as usize] as f64;
        for z in row.iter_mut() {
            *z = (((*z as f64) - lse).exp() / denom) as f32;
        }
        row[t as usize] -= (1.0 / denom) as f32;
    }
    let mut dx = vec![0.0; n * h];
    gemm(&mut dx, (n, h, v), (&logits, Trans::No), (&w, Trans::No), Accumulate::Replace)?;
    let mut dw = vec![0.0; v * h];
    gemm(&mut dw, (v, h, n), (&logits, Trans::Yes), (x, Trans::No), Accumulate::Replace)?;
    comm.all_reduce_f32(&mut dw, ReduceOp::Sum)?;
    let mut total = [local as f32];
    // The loss sum travels in f32 here; the ring sums it in f64 (both well inside the tolerance).
    comm.all_reduce_f32(&mut total, ReduceOp::Sum)?;
    let mine = &shards[comm.rank()];
    Ok((total[0] as f64 / denom, dx, dw[mine.start * h..mine.end * h].to_vec()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rmsnorm_backward_matches_finite_differences() {
        let h = 5;
        let x: Vec<f32> = (0..2 * h).map(|i| (i as f32 * 0.37).sin() + 0.1).collect();
        let g: Vec<f32> = (0..h).map(|i| 0.5 + i as f32 * 0.1).collect();
        let du: Vec<f32> = (0..2 * h).map(|i| (i as f32 * 0.91).cos()).collect();
        let (_, inv) = rmsnorm(&x, &g, h);
        let mut dg = vec![0.0; h];
        let dx = rmsnorm_backward(&x, &g, &inv, &du, h, &mut dg);
        let loss =
            |x: &[f32]| -> f64 { rmsnorm(x, &g, h).0.iter().zip(&du).map(|(&a, &b)| (a * b) as f64).sum() };
        for i in 0..x.len() {
            let (mut a, mut b) = (x.clone(), x.clone());
            a[i] += 1e-2;
            b[i] -= 1e-2;
            let fd = (loss(&a) - loss(&b)) / 2e-2;
            assert!((fd - dx[i] as f64).abs() < 1e-3, "dx[{i}]: {fd} vs {}", dx[i]);
        }
    }

    #[test]
    fn top_k_backward_matches_finite_differences() {
        let (e, k) = (6, 3);
        let z: Vec<f32> = (0..e).map(|i| (i as f32 * 1.3).sin()).collect();
        let dw = [0.3f32, -0.7, 1.1];
        let (ids, w) = top_k(&z, e, k);
        let dz = top_k_backward(&ids, &w, &dw, e, k);
        let f = |z: &[f32]| -> f64 {
            let (i2, w2) = top_k(z, e, k);
            assert_eq!(i2, ids);
            w2.iter().zip(&dw).map(|(&a, &b)| (a * b) as f64).sum()
        };
        for j in 0..e {
            let (mut a, mut b) = (z.clone(), z.clone());
            a[j] += 1e-3;
            b[j] -= 1e-3;
            let fd = (f(&a) - f(&b)) / 2e-3;
            assert!((fd - dz[j] as f64).abs() < 1e-3, "dz[{j}]: {fd} vs {}", dz[j]);
        }
    }
}
