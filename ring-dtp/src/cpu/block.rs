//! The block kernels every schedule is made of, single device and ring alike: form a logits
//! block (`C×Vb`, token-major) with one GEMM, fold it into per-token statistics, turn it into the
//! logit gradient G in place, and project G into dX and dW. Blocks are described by explicit
//! slices (a token block's rows and resolved targets; a vocabulary block's rows, bias and global
//! offset), so the same code runs whether W is local, a travelling ring shard or a sub-block.

use flatpeak_common::gemm::{Accumulate, MatMut, MatRef, MatmulOptions, matmul};
use rayon::prelude::*;

use crate::config::{LinearCrossEntropy, Softcap};
use crate::error::Result;
use crate::inputs::{Inputs, Matrix};

/// Vocabulary rows per dW GEMM (see [`accumulate_grads`]).
pub const DW_SUB_BLOCK: usize = 2048;

/// A resolved target meaning "this row predicts nothing" (ignored, or shifted past the end).
pub(crate) const NO_TARGET: u32 = u32::MAX;

pub(crate) fn gemm(
    dst: MatMut<'_, f32>,
    a: MatRef<'_, f32>,
    b: MatRef<'_, f32>,
    acc: Accumulate,
) -> Result<()> {
    Ok(matmul(dst, a, b, MatmulOptions::with_accumulate(acc))?)
}

/// The resolved targets of rows `t0..t0 + out.len()` (global vocabulary ids, or [`NO_TARGET`]).
pub(crate) fn resolve_targets(config: &LinearCrossEntropy, inputs: &Inputs<'_>, t0: usize, out: &mut [u32]) {
    for (k, o) in out.iter_mut().enumerate() {
        *o = inputs.target(config, t0 + k).map_or(NO_TARGET, |y| y as u32);
    }
}

/// A token block: `c` rows of X (f32, `c×d`) and their resolved targets.
#[derive(Debug, Clone, Copy)]
pub(crate) struct TokenBlock<'a> {
    pub x: &'a [f32],
    pub targets: &'a [u32],
}

impl TokenBlock<'_> {
    pub fn rows(&self) -> usize {
        self.targets.len()
    }
    /// The target of row `k` as an index into a vocabulary block starting at `v0` of `vb` rows.
    #[inline]
    fn local_target(&self, k: usize, v0: usize, vb: usize) -> Option<usize> {
        let y = self.targets[k];
        (y != NO_TARGET && (v0..v0 + vb).contains(&(y as usize))).then(|| y as usize - v0)
    }
}

/// A vocabulary block: `vb` rows of W (f32, `vb×d`) and of the bias.
#[derive(Debug, Clone, Copy)]
pub(crate) struct VocabBlock<'a> {
    pub w: &'a [f32],
    pub bias: Option<&'a [f32]>,
    pub vb: usize,
}

/// `logits (c×vb) = X_blk·W_blkᵀ`, then bias and softcap, in place.
pub(crate) fn form_logits(
    config: &LinearCrossEntropy,
    d: usize,
    tokens: TokenBlock<'_>,
    vocab: VocabBlock<'_>,
    logits: &mut [f32],
) -> Result<()> {
    let (c, vb) = (tokens.rows(), vocab.vb);
    let logits = &mut logits[..vb * c];
    gemm(
        MatMut::row_major(logits, c, vb)?,
        MatRef::row_major(&tokens.x[..c * d], c, d)?,
        MatRef::row_major(&vocab.w[..vb * d], vb, d)?.t(),
        Accumulate::Replace,
    )?;
    epilogue(config, vocab.bias, logits, vb);
    Ok(())
}

/// `z = softcap(u + bias)` in place over a `c×vb` logits block.
pub(crate) fn epilogue(config: &LinearCrossEntropy, bias: Option<&[f32]>, logits: &mut [f32], vb: usize) {
    let softcap = config.softcap;
    if (bias.is_some() || softcap != Softcap::Off) && vb > 0 {
        logits.par_chunks_mut(vb).for_each(|row| {
            for (j, z) in row.iter_mut().enumerate() {
                let u = *z + bias.map_or(0.0, |b| b[j]);
                *z = match softcap {
                    Softcap::Off => u,
                    Softcap::Tanh { cap } => cap * (u / cap).tanh(),
                };
            }
        });
    }
}

/// [`form_logits`] for a bf16 W: the `vb` rows from `v0` are widened `DW_SUB_BLOCK` rows at a
/// time into `w_buf` (so the working set holds a sub-block of W in f32, never the block), each
/// sub-block's logits columns formed by one GEMM.
pub(crate) fn form_logits_widening(
    config: &LinearCrossEntropy,
    d: usize,
    tokens: TokenBlock<'_>,
    (w, v0, vb, bias): (&Matrix<'_>, usize, usize, Option<&[f32]>),
    w_buf: &mut [f32],
    logits: &mut [f32],
) -> Result<()> {
    let c = tokens.rows();
    let logits = &mut logits[..vb * c];
    let x = MatRef::row_major(&tokens.x[..c * d], c, d)?;
    for j0 in (0..vb).step_by(DW_SUB_BLOCK) {
        let j1 = (j0 + DW_SUB_BLOCK).min(vb);
        w.rows_f32(v0 + j0..v0 + j1, d, w_buf);
        let w_sub = MatRef::row_major(&w_buf[..(j1 - j0) * d], j1 - j0, d)?;
        gemm(MatMut::strided(&mut logits[j0..], c, j1 - j0, vb, 1)?, x, w_sub.t(), Accumulate::Replace)?;
    }
    epilogue(config, bias, logits, vb);
    Ok(())
}

/// Per-token running statistics of the fold, owned.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Stats {
    pub max: Vec<f32>,
    pub sum: Vec<f64>,
    pub target_logit: Vec<f32>,
    pub logit_sum: Vec<f64>,
}

impl Stats {
    pub fn new(n: usize) -> Self {
        Self {
            max: vec![f32::NEG_INFINITY; n],
            sum: vec![0.0; n],
            target_logit: vec![0.0; n],
            logit_sum: vec![0.0; n],
        }
    }
    /// The statistics of rows `t0..t0 + c`.
    pub fn rows_mut(&mut self, t0: usize, c: usize) -> StatsMut<'_> {
        StatsMut {
            max: &mut self.max[t0..t0 + c],
            sum: &mut self.sum[t0..t0 + c],
            target_logit: &mut self.target_logit[t0..t0 + c],
            logit_sum: &mut self.logit_sum[t0..t0 + c],
        }
    }
    /// `lse = M + ln S` of row `t`.
    pub fn lse(&self, t: usize) -> f64 {
        self.max[t] as f64 + self.sum[t].ln()
    }
}

/// A token block's statistics, borrowed (from [`Stats`] or a ring packet).
#[derive(Debug)]
pub(crate) struct StatsMut<'a> {
    pub max: &'a mut [f32],
    pub sum: &'a mut [f64],
    pub target_logit: &'a mut [f32],
    pub logit_sum: &'a mut [f64],
}

/// Folds a logits block into the statistics, one parallel task per token row:
/// M' = max(M, row max), S' = S·e^(M−M') + Σ e^(z−M'), Σz for smoothing, the target logit.
/// With `keep_exp`, the row is left holding e^(z − M').
pub(crate) fn fold(
    config: &LinearCrossEntropy,
    tokens: TokenBlock<'_>,
    (v0, vb): (usize, usize),
    logits: &mut [f32],
    keep_exp: bool,
    stats: StatsMut<'_>,
) {
    let c = tokens.rows();
    if vb == 0 || c == 0 {
        return;
    }
    let smoothing = config.label_smoothing != 0.0;
    let rows = logits[..vb * c].par_chunks_mut(vb);
    let per_token = stats
        .max
        .par_iter_mut()
        .zip(stats.sum.par_iter_mut())
        .zip(stats.target_logit.par_iter_mut())
        .zip(stats.logit_sum.par_iter_mut());
    rows.zip(per_token).enumerate().for_each(|(k, (row, (((m_run, s_run), zt), zsum)))| {
        if let Some(j) = tokens.local_target(k, v0, vb) {
            *zt = row[j];
        }
        if smoothing {
            *zsum += row.iter().map(|&z| z as f64).sum::<f64>();
        }
        let m_new = row.iter().fold(*m_run, |m, &z| m.max(z));
        let mut block = 0f64;
        if keep_exp {
            for z in row.iter_mut() {
                *z = (*z - m_new).exp();
                block += *z as f64;
            }
        } else {
            block = row.iter().map(|&z| (z - m_new).exp() as f64).sum();
        }
        if *s_run > 0.0 {
            *s_run *= ((*m_run - m_new) as f64).exp();
        }
        *s_run += block;
        *m_run = m_new;
    });
}

/// What the gradient pass needs per token: `G = (c·p − b + z·p)·f` off the target and
/// `G = ((c·p − t) + z·p)·f` at it, with p = e^(z − lse), f the softcap derivative (1 without
/// softcap) and `t = c·((1 − α) + α/V)` the whole smoothed target mass. The cross-entropy part
/// `c·p − t` is formed first, so it cancels exactly where it should (p → 1 with a one-word
/// vocabulary, a certain prediction) before the z-loss and dlse part is added.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ColumnGrad {
    lse: f32,
    /// The row's gradient scale c.
    c: f32,
    /// Multiplier of p from the z-loss and the lse gradient: 2λ·lse·c + dlse.
    z: f32,
    /// Smoothing constant off the target: c·α/V.
    b: f32,
    /// Target mass at the target: c·((1 − α) + α/V).
    t: f32,
    /// 1/S when the row holds e^(z − max) (then p = e/S), else 0.
    pub inv_sum: f32,
}

/// One [`ColumnGrad`] per row from its gradient scale `coef`, its `lse` and the optional upstream
/// gradient of the lse, for a vocabulary of `v` rows in all.
pub(crate) fn column_grads(
    config: &LinearCrossEntropy,
    v: usize,
    coef: &[f32],
    lse: &[f32],
    dlse: Option<&[f32]>,
    out: &mut Vec<ColumnGrad>,
) {
    out.clear();
    let (alpha, lambda) = (config.label_smoothing, config.z_loss);
    out.extend((0..coef.len()).map(|k| {
        let (c, l) = (coef[k], lse[k]);
        let extra = dlse.map_or(0.0, |g| g[k]);
        ColumnGrad {
            lse: l,
            c,
            z: 2.0 * lambda * l * c + extra,
            b: c * alpha / v as f32,
            t: c * ((1.0 - alpha as f64) + alpha as f64 / v as f64) as f32,
            inv_sum: 0.0,
        }
    }));
}

/// Turns a logits block into its gradient G in place, one parallel task per token row.
pub(crate) fn gradient(
    config: &LinearCrossEntropy,
    tokens: TokenBlock<'_>,
    (v0, vb): (usize, usize),
    logits: &mut [f32],
    cols: &[ColumnGrad],
    holds_exp: bool,
) {
    let c = tokens.rows();
    if vb == 0 || c == 0 {
        return;
    }
    let softcap = config.softcap;
    logits[..vb * c].par_chunks_mut(vb).zip(cols.par_iter()).enumerate().for_each(|(k, (row, col))| {
        let prob = |z: f32| if holds_exp { z * col.inv_sum } else { (z - col.lse).exp() };
        // The target entry, with its one-hot term subtracted first (see ColumnGrad).
        let at_target = tokens.local_target(k, v0, vb).map(|j| {
            let (z, p) = (row[j], prob(row[j]));
            (j, ((col.c * p - col.t) + col.z * p) * softcap_derivative(softcap, z))
        });
        if holds_exp {
            for e in row.iter_mut() {
                let p = *e * col.inv_sum;
                *e = col.c * p - col.b + col.z * p;
            }
        } else {
            for z in row.iter_mut() {
                let p = (*z - col.lse).exp();
                *z = (col.c * p - col.b + col.z * p) * softcap_derivative(softcap, *z);
            }
        }
        if let Some((j, g)) = at_target {
            row[j] = g;
        }
    });
}

#[inline(always)]
fn softcap_derivative(softcap: Softcap, z: f32) -> f32 {
    match softcap {
        Softcap::Off => 1.0,
        Softcap::Tanh { cap } => {
            let t = z / cap;
            1.0 - t * t
        }
    }
}

/// The gradient slices one block accumulates into.
#[derive(Debug)]
pub(crate) struct BlockGrads<'a> {
    pub dx_rows: &'a mut [f32],
    pub dw_blk: &'a mut [f32],
    pub dbias_blk: Option<&'a mut [f32]>,
}

/// `dX[rows] += G·W_blk`, `dW[blk] += Gᵀ·X_blk` and `dbias[blk] += Gᵀ·1`.
pub(crate) fn accumulate_grads(
    d: usize,
    g: &[f32],
    tokens: TokenBlock<'_>,
    vocab: VocabBlock<'_>,
    out: BlockGrads<'_>,
) -> Result<()> {
    let (c, vb) = (tokens.rows(), vocab.vb);
    if c == 0 || vb == 0 {
        return Ok(());
    }
    let BlockGrads { dx_rows, dw_blk, dbias_blk } = out;
    let g_all = &g[..vb * c];
    let g = MatRef::row_major(g_all, c, vb)?;
    gemm(
        MatMut::row_major(&mut dx_rows[..c * d], c, d)?,
        g,
        MatRef::row_major(&vocab.w[..vb * d], vb, d)?,
        Accumulate::Add,
    )?;
    // dW in vocabulary sub-blocks: the CPU GEMM copies a transposed left operand whole, so
    // this bounds that copy to C·DW_SUB_BLOCK floats instead of a second logits block.
    for j0 in (0..vb).step_by(DW_SUB_BLOCK) {
        let j1 = (j0 + DW_SUB_BLOCK).min(vb);
        dw_sub(d, g_all, tokens, (j0, j1, vb), &mut dw_blk[j0 * d..j1 * d])?;
    }
    if let Some(db) = dbias_blk {
        bias_sums(g_all, vb, db);
    }
    Ok(())
}

/// [`accumulate_grads`] for a bf16 W: per `DW_SUB_BLOCK` rows, widen W's rows into `w_buf`,
/// then `dX += G[:, sub]·W_sub` and `dW_sub += G[:, sub]ᵀ·X_blk`.
pub(crate) fn accumulate_grads_widening(
    d: usize,
    g: &[f32],
    tokens: TokenBlock<'_>,
    (w, v0, vb): (&Matrix<'_>, usize, usize),
    w_buf: &mut [f32],
    out: BlockGrads<'_>,
) -> Result<()> {
    let c = tokens.rows();
    if c == 0 || vb == 0 {
        return Ok(());
    }
    let BlockGrads { dx_rows, dw_blk, dbias_blk } = out;
    let g_all = &g[..vb * c];
    for j0 in (0..vb).step_by(DW_SUB_BLOCK) {
        let j1 = (j0 + DW_SUB_BLOCK).min(vb);
        w.rows_f32(v0 + j0..v0 + j1, d, w_buf);
        let g_sub = MatRef::strided(&g_all[j0..], c, j1 - j0, vb, 1)?;
        let w_sub = MatRef::row_major(&w_buf[..(j1 - j0) * d], j1 - j0, d)?;
        gemm(MatMut::row_major(&mut dx_rows[..c * d], c, d)?, g_sub, w_sub, Accumulate::Add)?;
        dw_sub(d, g_all, tokens, (j0, j1, vb), &mut dw_blk[j0 * d..j1 * d])?;
    }
    if let Some(db) = dbias_blk {
        bias_sums(g_all, vb, db);
    }
    Ok(())
}

/// `dW_sub += G[:, j0..j1]ᵀ·X_blk`.
fn dw_sub(
    d: usize,
    g_all: &[f32],
    tokens: TokenBlock<'_>,
    (j0, j1, vb): (usize, usize, usize),
    dw: &mut [f32],
) -> Result<()> {
    let c = tokens.rows();
    let x = MatRef::row_major(&tokens.x[..c * d], c, d)?;
    let g_sub = MatRef::strided(&g_all[j0..], c, j1 - j0, vb, 1)?;
    gemm(MatMut::row_major(dw, j1 - j0, d)?, g_sub.t(), x, Accumulate::Add)
}

/// Column sums of G in row order: `dbias += Gᵀ·1`.
fn bias_sums(g_all: &[f32], vb: usize, db: &mut [f32]) {
    for row in g_all.chunks_exact(vb) {
        for (b, &gj) in db[..vb].iter_mut().zip(row) {
            *b += gj;
        }
    }
}
