//! The block kernels every schedule is made of, single device and ring alike: form a logits
//! block with one GEMM, fold it into per-token statistics, turn it into the logit gradient G in
//! place, and project G into dX and dW. Blocks are described by explicit slices (a token block's
//! rows and resolved targets; a vocabulary block's rows, bias and global offset), so the same
//! code runs whether W is local, a travelling ring shard or a sub-block.
//!
//! A logits block is stored **vocabulary-major**, `Vb×C` (row j: vocabulary row v0 + j; column
//! k: token k of the block). Then every GEMM reads its operands in layouts the CPU GEMM takes
//! without a transposed copy (`L = W_blk·X_blkᵀ`, `dX += Lᵀ·W_blk`, `dW += L·X_blk`), and the
//! fold and the gradient run along rows of C tokens, so they vectorize across tokens with
//! per-token constants in arrays. Work is split over fixed row ranges that depend only on the
//! block's shape, and partial results are combined in task order: bitwise identical for any
//! thread count.

use flatpeak_common::gemm::{Accumulate, MatMut, MatRef, MatmulOptions, Threads, matmul};
use flatpeak_common::gemm_bf16::Bf16Gemm;
use half::bf16;
use rayon::prelude::*;

use crate::config::{Config, Softcap};
use crate::error::Result;
use crate::inputs::{Inputs, Matrix};
use crate::loss::StatsMut;
use crate::plan::{FOLD_TASKS, SPLIT_K_MIN_ROWS, WIDEN_ROWS};

use super::exp::exp;
use super::rows;

/// Vocabulary rows per task of the gradient pass.
const GRADIENT_ROWS: usize = 32;

/// A resolved target meaning "this row predicts nothing" (ignored, or shifted past the end).
pub(crate) const NO_TARGET: u32 = u32::MAX;

pub(crate) fn gemm(
    dst: MatMut<'_, f32>,
    a: MatRef<'_, f32>,
    b: MatRef<'_, f32>,
    acc: Accumulate,
) -> Result<()> {
    gemm_on(dst, a, b, acc, Threads::All)
}

/// [`gemm`] on the given threads (bitwise the same result for every choice).
pub(crate) fn gemm_on(
    dst: MatMut<'_, f32>,
    a: MatRef<'_, f32>,
    b: MatRef<'_, f32>,
    acc: Accumulate,
    threads: Threads,
) -> Result<()> {
    Ok(matmul(dst, a, b, MatmulOptions::with_accumulate(acc).threads(threads))?)
}

/// The resolved targets of rows `t0..t0 + out.len()` (global vocabulary ids, or [`NO_TARGET`]).
pub(crate) fn resolve_targets(config: &Config, inputs: &Inputs<'_>, t0: usize, out: &mut [u32]) {
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

/// `logits (vb×c) = W_blk·X_blkᵀ` (the GEMM on `threads`), then bias and softcap, in place.
pub(crate) fn form_logits(
    config: &Config,
    d: usize,
    tokens: TokenBlock<'_>,
    vocab: VocabBlock<'_>,
    logits: &mut [f32],
    threads: Threads,
) -> Result<()> {
    let (c, vb) = (tokens.rows(), vocab.vb);
    let logits = &mut logits[..vb * c];
    gemm_on(
        MatMut::row_major(logits, vb, c)?,
        MatRef::row_major(&vocab.w[..vb * d], vb, d)?,
        MatRef::row_major(&tokens.x[..c * d], c, d)?.t(),
        Accumulate::Replace,
        threads,
    )?;
    epilogue(config, vocab.bias, logits, (vb, c));
    Ok(())
}

/// `z = softcap(u + bias)` in place over a `vb×c` logits block.
pub(crate) fn epilogue(config: &Config, bias: Option<&[f32]>, logits: &mut [f32], (vb, c): (usize, usize)) {
    let softcap = config.softcap;
    if (bias.is_none() && softcap == Softcap::Off) || vb == 0 || c == 0 {
        return;
    }
    logits[..vb * c].par_chunks_mut(c).enumerate().for_each(|(j, row)| {
        let b = bias.map_or(0.0, |b| b[j]);
        match softcap {
            Softcap::Off => row.iter_mut().for_each(|z| *z += b),
            Softcap::Tanh { cap } => row.iter_mut().for_each(|z| *z = cap * ((*z + b) / cap).tanh()),
        }
    });
}

/// [`form_logits`] for a bf16 W: the `vb` rows from `v0` are widened `WIDEN_ROWS` rows at a
/// time into `w_buf` (so the working set holds a sub-block of W in f32, never the block), each
/// sub-block's logits rows formed by one GEMM.
pub(crate) fn form_logits_widening(
    config: &Config,
    d: usize,
    tokens: TokenBlock<'_>,
    (w, v0, vb, bias): (&Matrix<'_>, usize, usize, Option<&[f32]>),
    w_buf: &mut [f32],
    logits: &mut [f32],
) -> Result<()> {
    let c = tokens.rows();
    let logits = &mut logits[..vb * c];
    let x_t = MatRef::row_major(&tokens.x[..c * d], c, d)?.t();
    for j0 in (0..vb).step_by(WIDEN_ROWS) {
        let j1 = (j0 + WIDEN_ROWS).min(vb);
        w.rows_f32(v0 + j0..v0 + j1, d, w_buf);
        let w_sub = MatRef::row_major(&w_buf[..(j1 - j0) * d], j1 - j0, d)?;
        gemm(MatMut::row_major(&mut logits[j0 * c..j1 * c], j1 - j0, c)?, w_sub, x_t, Accumulate::Replace)?;
    }
    epilogue(config, bias, logits, (vb, c));
    Ok(())
}

/// [`form_logits`] for bf16 X and W on the CPU's bf16 dot products ([`Bf16Gemm`]): the block's
/// rows of both are read in place, nothing is widened, and every product is exact in f32 with
/// f32 sums, as in the widened GEMM (only the order of the additions differs).
pub(crate) fn form_logits_bf16(
    config: &Config,
    d: usize,
    (x, c): (&[bf16], usize),
    (w, vb, bias): (&[bf16], usize, Option<&[f32]>),
    logits: &mut [f32],
    gemm: Bf16Gemm,
) -> Result<()> {
    let logits = &mut logits[..vb * c];
    gemm.matmul_nt(
        MatMut::row_major(logits, vb, c)?,
        &w[..vb * d],
        &x[..c * d],
        d,
        MatmulOptions::default(),
    )?;
    epilogue(config, bias, logits, (vb, c));
    Ok(())
}

/// Folds a `vb×c` logits block into the statistics of its c tokens:
/// M' = max(M, block max), S' = S·e^(M−M') + Σ e^(z−M'), Σz for smoothing, the target logit.
/// Two passes over fixed row ranges (maxima, then sums of exponentials), each range's partials
/// combined in range order. With `keep_exp`, the block is left holding e^(z − M').
pub(crate) fn fold(
    config: &Config,
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
    let logits = &mut logits[..vb * c];
    for k in 0..c {
        if let Some(j) = tokens.local_target(k, v0, vb) {
            stats.target_logit[k] = logits[j * c + k];
        }
    }
    let range = vb.div_ceil(FOLD_TASKS) * c;
    let tasks = logits.len().div_ceil(range);
    let mut sums = vec![0f64; tasks * c];
    if config.label_smoothing != 0.0 {
        sums.par_chunks_mut(c).zip(logits.par_chunks(range)).for_each(|(s, rows)| {
            rows.chunks_exact(c).for_each(|row| rows::add_f64(s, row));
        });
        add_partials(&sums, stats.logit_sum);
    }
    let mut m_new = stats.max.to_vec();
    let mut maxima = vec![f32::NEG_INFINITY; tasks * c];
    maxima.par_chunks_mut(c).zip(logits.par_chunks(range)).for_each(|(m, rows)| {
        rows.chunks_exact(c).for_each(|row| rows::max_into(m, row));
    });
    maxima.chunks_exact(c).for_each(|part| rows::max_into(&mut m_new, part));
    drop(maxima);
    sums.fill(0.0);
    let m = &m_new[..c];
    sums.par_chunks_mut(c).zip(logits.par_chunks_mut(range)).for_each(|(s, rows)| {
        rows.chunks_exact_mut(c).for_each(|row| rows::exp_sum(row, m, s, keep_exp));
    });
    for ((s_run, m_run), &m) in stats.sum.iter_mut().zip(stats.max.iter_mut()).zip(m) {
        if *s_run > 0.0 {
            *s_run *= ((*m_run - m) as f64).exp();
        }
        *m_run = m;
    }
    add_partials(&sums, stats.sum);
}

/// `acc[k] += Σ_t partials[t·c + k]`, in task order.
fn add_partials(partials: &[f64], acc: &mut [f64]) {
    let c = acc.len();
    for part in partials.chunks_exact(c) {
        acc.iter_mut().zip(part).for_each(|(a, &p)| *a += p);
    }
}

/// What the gradient pass needs per token, as arrays over a block's tokens:
/// `G = (c·p − b + z·p)·f` off the target and `G = ((c·p − t) + z·p)·f` at it, with
/// p = e^(z − lse), f the softcap derivative (1 without softcap) and `t = c·((1 − α) + α/V)` the
/// whole smoothed target mass. The cross-entropy part `c·p − t` is formed first, so it cancels
/// exactly where it should (p → 1 with a one-word vocabulary, a certain prediction) before the
/// z-loss and dlse part is added.
#[derive(Debug, Clone, Default)]
pub(crate) struct ColumnGrads {
    lse: Vec<f32>,
    /// The row's gradient scale c.
    c: Vec<f32>,
    /// Multiplier of p from the z-loss and the lse gradient: 2λ·lse·c + dlse.
    z: Vec<f32>,
    /// Smoothing constant off the target: c·α/V.
    b: Vec<f32>,
    /// Target mass at the target: c·((1 − α) + α/V).
    t: Vec<f32>,
    /// 1/S when the block holds e^(z − max) (then p = e/S), else 0.
    pub inv_sum: Vec<f32>,
}

impl ColumnGrads {
    /// Room for a block of `c` tokens.
    pub fn with_capacity(c: usize) -> Self {
        let v = || Vec::with_capacity(c);
        Self { lse: v(), c: v(), z: v(), b: v(), t: v(), inv_sum: v() }
    }
}

/// The [`ColumnGrads`] of a block from each token's gradient scale `coef`, its `lse` and the
/// optional upstream gradient of the lse, for a vocabulary of `v` rows in all.
pub(crate) fn column_grads(
    config: &Config,
    v: usize,
    coef: &[f32],
    lse: &[f32],
    dlse: Option<&[f32]>,
    out: &mut ColumnGrads,
) {
    let (alpha, lambda) = (config.label_smoothing, config.z_loss);
    let n = coef.len();
    out.lse.clear();
    out.lse.extend_from_slice(&lse[..n]);
    out.c.clear();
    out.c.extend_from_slice(coef);
    out.z.clear();
    out.z.extend((0..n).map(|k| 2.0 * lambda * lse[k] * coef[k] + dlse.map_or(0.0, |g| g[k])));
    out.b.clear();
    out.b.extend(coef.iter().map(|&c| c * alpha / v as f32));
    let mass = ((1.0 - alpha as f64) + alpha as f64 / v as f64) as f32;
    out.t.clear();
    out.t.extend(coef.iter().map(|&c| c * mass));
    out.inv_sum.clear();
    out.inv_sum.resize(n, 0.0);
}

/// Turns a `vb×c` logits block into its gradient G in place, over fixed ranges of rows.
pub(crate) fn gradient(
    config: &Config,
    tokens: TokenBlock<'_>,
    (v0, vb): (usize, usize),
    logits: &mut [f32],
    cols: &ColumnGrads,
    holds_exp: bool,
) {
    let c = tokens.rows();
    if vb == 0 || c == 0 {
        return;
    }
    let logits = &mut logits[..vb * c];
    let softcap = config.softcap;
    let (lse, cc, zc, b, inv_sum) =
        (&cols.lse[..c], &cols.c[..c], &cols.z[..c], &cols.b[..c], &cols.inv_sum[..c]);
    // The target entries, with the one-hot term subtracted first (see ColumnGrads), before the
    // dense pass overwrites their logits.
    let at_target: Vec<(usize, f32)> = (0..c)
        .filter_map(|k| {
            let j = tokens.local_target(k, v0, vb)?;
            let z = logits[j * c + k];
            let p = if holds_exp { z * inv_sum[k] } else { exp(z - lse[k]) };
            Some((j * c + k, ((cc[k] * p - cols.t[k]) + zc[k] * p) * softcap_derivative(softcap, z)))
        })
        .collect();
    let consts = rows::GradConsts { c: cc, b, z: zc };
    logits.par_chunks_mut(GRADIENT_ROWS * c).for_each(|block_rows| {
        for row in block_rows.chunks_exact_mut(c) {
            match (holds_exp, softcap) {
                (true, _) => rows::grad_from_exp(row, consts, inv_sum),
                (false, Softcap::Off) => rows::grad_from_logits(row, consts, lse),
                (false, Softcap::Tanh { cap }) => rows::grad_from_capped_logits(row, consts, lse, cap),
            }
        }
    });
    for (at, g) in at_target {
        logits[at] = g;
    }
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

/// The gradient slices one block accumulates into, and whether each of dX and dW already
/// holds a contribution ([`Accumulate::Add`]) or this block is its first
/// ([`Accumulate::Replace`]: written without being read, so a freshly allocated output is not
/// faulted in twice). A gradient that is not computed ([`Want::Skip`]) has no slice, and its
/// GEMM is not run.
///
/// [`Want::Skip`]: crate::inputs::Want::Skip
#[derive(Debug)]
pub(crate) struct BlockGrads<'a> {
    pub dx_rows: Option<&'a mut [f32]>,
    pub dx_mode: Accumulate,
    pub dw_blk: Option<&'a mut [f32]>,
    pub dw_mode: Accumulate,
    pub dbias_blk: Option<&'a mut [f32]>,
    pub dx_partial: Option<DxPartial<'a>>,
}

/// A `C×D` scratch for a second partial sum of a token block's dX.
///
/// `dX += Gᵀ·W_blk` has a small output (C×D) and a long reduction (k = Vb rows); the CPU GEMM
/// splits only output tiles across threads, and on this shape its threads re-read all of
/// W_blk and G. With a partial, a GEMM of at least [`SPLIT_K_MIN_ROWS`] rows of k splits k at
/// ⌊k/2⌋: the first half goes into dX and the second into the partial, the two GEMMs side by
/// side (each on half the requested threads), and the block adds the partial into dX once at its
/// end (`dX = (dX + G₁ᵀW₁) + G₂ᵀW₂`). The split depends only on the shapes, never on the
/// thread count, so results stay bitwise identical for any number of threads (each GEMM is).
#[derive(Debug)]
pub(crate) struct DxPartial<'a> {
    buf: &'a mut [f32],
    /// Whether `buf` holds a contribution of this block yet.
    holds: bool,
}

impl<'a> DxPartial<'a> {
    /// A partial over `buf` (at least `C·D` elements), empty.
    pub fn new(buf: &'a mut [f32]) -> Self {
        Self { buf, holds: false }
    }
}

/// `dx (c×d) {=,+=} Gᵀ·W` for a `kb×c` gradient G and `kb×d` rows of W, with k = kb split in
/// two through `partial` when it is given and k is long enough ([`DxPartial`]).
fn accumulate_dx(
    (dx, mode): (&mut [f32], Accumulate),
    partial: Option<&mut DxPartial<'_>>,
    (g, w): (&[f32], &[f32]),
    (c, kb, d): (usize, usize, usize),
    threads: Threads,
) -> Result<()> {
    let Some(partial) = partial.filter(|p| kb >= SPLIT_K_MIN_ROWS && p.buf.len() >= c * d) else {
        let g = MatRef::row_major(&g[..kb * c], kb, c)?;
        let w = MatRef::row_major(&w[..kb * d], kb, d)?;
        return gemm_on(MatMut::row_major(&mut dx[..c * d], c, d)?, g.t(), w, mode, threads);
    };
    let h = kb / 2;
    let (g1, g2) =
        (MatRef::row_major(&g[..h * c], h, c)?.t(), MatRef::row_major(&g[h * c..kb * c], kb - h, c)?.t());
    let (w1, w2) = (MatRef::row_major(&w[..h * d], h, d)?, MatRef::row_major(&w[h * d..kb * d], kb - h, d)?);
    let dx = MatMut::row_major(&mut dx[..c * d], c, d)?;
    let part_mode = if partial.holds { Accumulate::Add } else { Accumulate::Replace };
    let part = MatMut::row_major(&mut partial.buf[..c * d], c, d)?;
    side_by_side(threads, |t| gemm_on(dx, g1, w1, mode, t), |t| gemm_on(part, g2, w2, part_mode, t))?;
    partial.holds = true;
    Ok(())
}

/// Runs the two halves of a split GEMM side by side, the requested threads shared between them
/// (on two threads, one each), or one after the other on one thread.
fn side_by_side(
    threads: Threads,
    first: impl FnOnce(Threads) -> Result<()> + Send,
    second: impl FnOnce(Threads) -> Result<()> + Send,
) -> Result<()> {
    let total = match threads {
        Threads::Single => 1,
        Threads::All => rayon::current_num_threads(),
        Threads::Exactly(t) => t,
    };
    let (a, b) = if total <= 1 {
        (first(Threads::Single), second(Threads::Single))
    } else {
        rayon::join(|| first(Threads::Exactly(total.div_ceil(2))), || second(Threads::Exactly(total / 2)))
    };
    a.and(b)
}

/// Adds a partial's contribution into `dx` (in element order) and empties it.
fn add_partial(dx: &mut [f32], partial: Option<&mut DxPartial<'_>>) {
    let Some(partial) = partial.filter(|p| p.holds) else { return };
    let n = dx.len();
    dx.par_chunks_mut(1 << 14).zip(partial.buf[..n].par_chunks(1 << 14)).for_each(|(a, b)| {
        a.iter_mut().zip(b).for_each(|(a, &b)| *a += b);
    });
    partial.holds = false;
}

/// `dX[rows] += Gᵀ·W_blk`, `dW[blk] += G·X_blk` and `dbias[blk] += G·1` for a `vb×c` gradient
/// block G, the GEMMs on `threads` (each only for a gradient `out` has a slice of).
pub(crate) fn accumulate_grads(
    d: usize,
    g: &[f32],
    tokens: TokenBlock<'_>,
    vocab: VocabBlock<'_>,
    out: BlockGrads<'_>,
    threads: Threads,
) -> Result<()> {
    let (c, vb) = (tokens.rows(), vocab.vb);
    if c == 0 || vb == 0 {
        return Ok(());
    }
    let BlockGrads { dx_rows, dx_mode, dw_blk, dw_mode, dbias_blk, mut dx_partial } = out;
    let g = &g[..vb * c];
    if let Some(dx_rows) = dx_rows {
        let dx_rows = &mut dx_rows[..c * d];
        accumulate_dx((dx_rows, dx_mode), dx_partial.as_mut(), (g, vocab.w), (c, vb, d), threads)?;
        add_partial(dx_rows, dx_partial.as_mut());
    }
    if let Some(dw_blk) = dw_blk {
        let g_mat = MatRef::row_major(g, vb, c)?;
        let x = MatRef::row_major(&tokens.x[..c * d], c, d)?;
        gemm_on(MatMut::row_major(&mut dw_blk[..vb * d], vb, d)?, g_mat, x, dw_mode, threads)?;
    }
    if let Some(db) = dbias_blk {
        row_sums(g, c, &mut db[..vb]);
    }
    Ok(())
}

/// [`accumulate_grads`] for a bf16 W: per `WIDEN_ROWS` rows, widen W's rows into `w_buf`, then
/// `dX += G_subᵀ·W_sub` and `dW_sub += G_sub·X_blk` (W is widened only for dX's GEMM: not at
/// all when dX is skipped).
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
    let BlockGrads { mut dx_rows, dx_mode, mut dw_blk, dw_mode, dbias_blk, mut dx_partial } = out;
    let g = &g[..vb * c];
    let x = MatRef::row_major(&tokens.x[..c * d], c, d)?;
    for j0 in (0..vb).step_by(WIDEN_ROWS) {
        let j1 = (j0 + WIDEN_ROWS).min(vb);
        let g_sub = &g[j0 * c..j1 * c];
        if let Some(dx_rows) = dx_rows.as_deref_mut() {
            w.rows_f32(v0 + j0..v0 + j1, d, w_buf);
            let dx_mode = if j0 == 0 { dx_mode } else { Accumulate::Add };
            accumulate_dx(
                (&mut dx_rows[..c * d], dx_mode),
                dx_partial.as_mut(),
                (g_sub, &w_buf[..(j1 - j0) * d]),
                (c, j1 - j0, d),
                Threads::All,
            )?;
        }
        if let Some(dw_blk) = dw_blk.as_deref_mut() {
            let g_sub = MatRef::row_major(g_sub, j1 - j0, c)?;
            gemm(MatMut::row_major(&mut dw_blk[j0 * d..j1 * d], j1 - j0, d)?, g_sub, x, dw_mode)?;
        }
    }
    if let Some(dx_rows) = dx_rows {
        add_partial(&mut dx_rows[..c * d], dx_partial.as_mut());
    }
    if let Some(db) = dbias_blk {
        row_sums(g, c, &mut db[..vb]);
    }
    Ok(())
}

/// [`accumulate_grads`] for bf16 X and W under [`Precision::Native`](flatpeak_common::Precision):
/// dbias from the f32 G, then G rounded to bf16 in place, row by row (`rows::round_to_bf16_in_place`) and
/// `dX += Gᵀ·W_blk`, `dW = G·X_blk` on bf16 operands with f32 accumulation — on the CPU's bf16
/// dot products when `gemm` is given, else with G's rounded values kept in f32 and W widened
/// (the same products, as the GEMMs of autograd on a bf16 matmul).
pub(crate) fn accumulate_grads_bf16(
    d: usize,
    g: &mut [f32],
    (tokens, x): (TokenBlock<'_>, &[bf16]),
    (w, v0, vb): (&Matrix<'_>, usize, usize),
    (w_buf, mut out): (&mut [f32], BlockGrads<'_>),
    gemm: Option<Bf16Gemm>,
) -> Result<()> {
    let c = tokens.rows();
    if c == 0 || vb == 0 {
        return Ok(());
    }
    let g = &mut g[..vb * c];
    let (Some(gemm), Matrix::Bf16(w)) = (gemm, w) else {
        round_gradient_to_bf16(g, c, &mut out);
        return accumulate_grads_widening(d, g, tokens, (w, v0, vb), w_buf, out);
    };
    if let Some(db) = out.dbias_blk.take() {
        row_sums(g, c, &mut db[..vb]);
    }
    g.par_chunks_mut(c).for_each(rows::round_to_bf16_in_place);
    // Row j of the bf16 G is the first half of f32 row j's bytes: row stride 2c.
    let g16 =
        MatRef::strided(&bytemuck::cast_slice::<f32, bf16>(g)[..(2 * vb - 1) * c + c], vb, c, 2 * c, 1)?;
    let w_blk = MatRef::row_major(&w[v0 * d..(v0 + vb) * d], vb, d)?;
    let x_blk = MatRef::row_major(&x[..c * d], c, d)?;
    let options = |mode, threads| MatmulOptions::with_accumulate(mode).threads(threads);
    if let Some(dw_blk) = out.dw_blk.take() {
        let dw = MatMut::row_major(&mut dw_blk[..vb * d], vb, d)?;
        gemm.matmul(dw, g16, x_blk, options(out.dw_mode, Threads::All))?;
    }
    let Some(dx_rows) = out.dx_rows.take() else { return Ok(()) };
    let dx = MatMut::row_major(&mut dx_rows[..c * d], c, d)?;
    match out.dx_partial.as_mut().filter(|p| vb >= SPLIT_K_MIN_ROWS && p.buf.len() >= c * d) {
        // As `accumulate_dx`: k (the block's vocabulary rows) split at ⌊vb/2⌋, the halves side by
        // side, each packing its own half of W and Gᵀ.
        Some(partial) => {
            let h = vb / 2;
            let (g1, g2) = (g16.row_range(0..h)?, g16.row_range(h..vb)?);
            let (w1, w2) = (w_blk.row_range(0..h)?, w_blk.row_range(h..vb)?);
            let part_mode = if partial.holds { Accumulate::Add } else { Accumulate::Replace };
            let part = MatMut::row_major(&mut partial.buf[..c * d], c, d)?;
            side_by_side(
                Threads::All,
                |t| Ok(gemm.matmul(dx, g1.t(), w1, options(out.dx_mode, t))?),
                |t| Ok(gemm.matmul(part, g2.t(), w2, options(part_mode, t))?),
            )?;
            partial.holds = true;
            add_partial(&mut dx_rows[..c * d], Some(partial));
        }
        None => gemm.matmul(dx, g16.t(), w_blk, options(out.dx_mode, Threads::All))?,
    }
    Ok(())
}

/// Whether backward rounds the logit gradient to bf16 before its GEMMs: bf16 inputs under
/// any precision but [`Precision::F32`](flatpeak_common::Precision::F32).
pub(crate) fn rounds_gradient(config: &Config, dtype: flatpeak_common::DType) -> bool {
    dtype != flatpeak_common::DType::F32 && config.precision != flatpeak_common::Precision::F32
}

/// Prepares a `vb×c` gradient block of bf16 inputs for f32 GEMMs that compute what bf16 GEMMs
/// would: dbias (taken out of `out`) is summed from the f32 G first, then every element of G is
/// rounded to its nearest bf16 value (kept as f32).
pub(crate) fn round_gradient_to_bf16(g: &mut [f32], c: usize, out: &mut BlockGrads<'_>) {
    if c == 0 || g.is_empty() {
        return;
    }
    if let Some(db) = out.dbias_blk.take() {
        row_sums(g, c, &mut db[..g.len() / c.max(1)]);
    }
    g.par_iter_mut().for_each(|v| *v = bf16::from_f32(*v).to_f32());
}

/// `dbias[j] += Σ_k G[j, k]`, each row summed in token order.
fn row_sums(g: &[f32], c: usize, db: &mut [f32]) {
    db.par_iter_mut().zip(g.par_chunks(c)).for_each(|(b, row)| *b += row.iter().sum::<f32>());
}
