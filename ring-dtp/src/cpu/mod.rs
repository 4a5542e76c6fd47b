//! The CPU fast path: token blocks of C rows, vocabulary blocks of Vb rows; each block's logits
//! (token-major, C×Vb, so every token's reductions read contiguous memory) are one GEMM into a
//! workspace buffer reserved at launch, folded into per-token (max, sum-exp, target logit, Σz)
//! statistics, and, in backward, turned in place into the logit gradient G, from which
//! `dX_blk += G·W_blk` and `dW_blk += Gᵀ·X_blk`. On the fused full-vocabulary path without a
//! softcap the fold leaves e^(z − max) in place, so the gradient needs no second exponential.
//! Fixed block order and fixed-order reductions: bitwise reproducible run to run.

pub mod reference;

/// Vocabulary rows per dW GEMM (see `accumulate_grads`).
pub const DW_SUB_BLOCK: usize = 2048;

use flatpeak_common::Workspace;
use flatpeak_common::gemm::{Accumulate, MatMut, MatRef, MatmulOptions, matmul};
use rayon::prelude::*;

use crate::config::{LinearCrossEntropy, Reduction, Softcap};
use crate::error::{Error, Result};
use crate::inputs::{Forward, GradOutput, Gradients, Inputs, Loss, Matrix};
use crate::plan::{Plan, Schedule};

fn gemm(dst: MatMut<'_, f32>, a: MatRef<'_, f32>, b: MatRef<'_, f32>, acc: Accumulate) -> Result<()> {
    matmul(dst, a, b, MatmulOptions::with_accumulate(acc)).map_err(Error::from)
}

fn check_plan(plan: &Plan, inputs: &Inputs<'_>) -> Result<()> {
    for (what, expected, found) in
        [("n", plan.n(), inputs.n), ("d", plan.d(), inputs.d), ("v", plan.v(), inputs.v)]
    {
        if expected != found {
            return Err(Error::ShapeMismatch { what, expected, found });
        }
    }
    if plan.dtype() != inputs.x.dtype() {
        return Err(Error::DtypeMismatch { x: inputs.x.dtype(), w: plan.dtype() });
    }
    Ok(())
}

/// Per-row gradient scale c_i from the reduction and the upstream gradient (0 for ignored rows).
fn coefficients(config: &LinearCrossEntropy, inputs: &Inputs<'_>, grad: GradOutput<'_>) -> Result<Vec<f32>> {
    let valid = inputs.valid_weight(config);
    let scale = |i: usize, g: f32, denom: f64| -> f32 {
        if inputs.target(config, i).is_none() || denom == 0.0 {
            0.0
        } else {
            (g as f64 * inputs.weight(i) as f64 / denom) as f32
        }
    };
    match (config.reduction, grad) {
        (Reduction::Mean, GradOutput::Scalar(g)) => Ok((0..inputs.n).map(|i| scale(i, g, valid)).collect()),
        (Reduction::Sum, GradOutput::Scalar(g)) => Ok((0..inputs.n).map(|i| scale(i, g, 1.0)).collect()),
        (Reduction::None, GradOutput::PerToken(g)) => {
            if g.len() != inputs.n {
                return Err(Error::ShapeMismatch {
                    what: "grad_output (n)",
                    expected: inputs.n,
                    found: g.len(),
                });
            }
            Ok((0..inputs.n).map(|i| scale(i, g[i], 1.0)).collect())
        }
        (Reduction::None, _) => Err(Error::GradOutputKind { expected: "per-token for reduction none" }),
        _ => Err(Error::GradOutputKind { expected: "a scalar for reduction mean or sum" }),
    }
}

/// The scratch of one call, carved from a workspace reserved at the plan's size.
struct Scratch<'w> {
    logits: &'w mut [f32],
    xblk: &'w mut [f32],
    wblk: &'w mut [f32],
}

impl<'w> Scratch<'w> {
    fn carve(ws: &'w Workspace, plan: &Plan) -> Result<Self> {
        let (c, vb, d) = (plan.token_block(), plan.vocab_block(), plan.d());
        let w_upcast = if plan.dtype() == flatpeak_common::DType::F32 { 0 } else { vb * d };
        Ok(Self { logits: ws.take(vb * c)?, xblk: ws.take(c * d)?, wblk: ws.take(w_upcast)? })
    }
}

/// W rows `v0..v1` as f32: a slice of W itself, or upcast into `buf`.
fn w_rows<'a>(w: &Matrix<'a>, v0: usize, v1: usize, d: usize, buf: &'a mut [f32]) -> &'a [f32] {
    match w {
        Matrix::F32(m) => &m[v0 * d..v1 * d],
        Matrix::Bf16(_) => {
            w.rows_f32(v0..v1, d, buf);
            &buf[..(v1 - v0) * d]
        }
    }
}

/// `logits (c×vb) = X_blk·W_blkᵀ`, then bias and softcap, in place.
fn form_logits(
    config: &LinearCrossEntropy,
    inputs: &Inputs<'_>,
    w_blk: &[f32],
    xblk: &[f32],
    (v0, vb, c): (usize, usize, usize),
    logits: &mut [f32],
) -> Result<()> {
    let d = inputs.d;
    let logits = &mut logits[..vb * c];
    gemm(
        MatMut::row_major(logits, c, vb)?,
        MatRef::row_major(&xblk[..c * d], c, d)?,
        MatRef::row_major(w_blk, vb, d)?.t(),
        Accumulate::Replace,
    )?;
    let bias = inputs.bias.map(|b| &b[v0..v0 + vb]);
    let softcap = config.softcap;
    if bias.is_some() || softcap != Softcap::Off {
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
    Ok(())
}

/// Per-token running statistics of the fold.
struct Stats {
    max: Vec<f32>,
    sum: Vec<f64>,
    target_logit: Vec<f32>,
    logit_sum: Vec<f64>,
}

impl Stats {
    fn new(n: usize) -> Self {
        Self {
            max: vec![f32::NEG_INFINITY; n],
            sum: vec![0.0; n],
            target_logit: vec![0.0; n],
            logit_sum: vec![0.0; n],
        }
    }
}

/// Folds a logits block (tokens `t0..t0+c` × vocabulary rows `v0..v0+vb`) into the statistics,
/// one parallel task per token row: M' = max(M, row max), S' = S·e^(M−M') + Σ e^(z−M'), Σz for
/// smoothing, the target logit. With `keep_exp`, the row is left holding e^(z − M').
fn fold(
    config: &LinearCrossEntropy,
    inputs: &Inputs<'_>,
    logits: &mut [f32],
    (v0, vb, t0, c): (usize, usize, usize, usize),
    keep_exp: bool,
    stats: &mut Stats,
) {
    let smoothing = config.label_smoothing != 0.0;
    let rows = logits[..vb * c].par_chunks_mut(vb);
    let per_token = stats.max[t0..t0 + c]
        .par_iter_mut()
        .zip(stats.sum[t0..t0 + c].par_iter_mut())
        .zip(stats.target_logit[t0..t0 + c].par_iter_mut())
        .zip(stats.logit_sum[t0..t0 + c].par_iter_mut());
    rows.zip(per_token).enumerate().for_each(|(k, (row, (((m_run, s_run), zt), zsum)))| {
        if let Some(y) = inputs.target(config, t0 + k).filter(|y| (v0..v0 + vb).contains(y)) {
            *zt = row[y - v0];
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
struct ColumnGrad {
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
    inv_sum: f32,
}

fn column_grads(
    config: &LinearCrossEntropy,
    v: usize,
    coef: &[f32],
    lse: &[f32],
    dlse: Option<&[f32]>,
    t0: usize,
    out: &mut Vec<ColumnGrad>,
) {
    out.clear();
    let (alpha, lambda) = (config.label_smoothing, config.z_loss);
    out.extend((0..coef.len()).map(|k| {
        let (c, l) = (coef[k], lse[k]);
        let extra = dlse.map_or(0.0, |g| g[t0 + k]);
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
fn gradient(
    config: &LinearCrossEntropy,
    inputs: &Inputs<'_>,
    logits: &mut [f32],
    (v0, vb, t0, c): (usize, usize, usize, usize),
    cols: &[ColumnGrad],
    holds_exp: bool,
) {
    let softcap = config.softcap;
    logits[..vb * c].par_chunks_mut(vb).zip(cols.par_iter()).enumerate().for_each(|(k, (row, col))| {
        let target = inputs.target(config, t0 + k).filter(|y| (v0..v0 + vb).contains(y)).map(|y| y - v0);
        let prob = |z: f32| if holds_exp { z * col.inv_sum } else { (z - col.lse).exp() };
        // The target entry, with its one-hot term subtracted first (see ColumnGrad).
        let at_target = target.map(|j| {
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
struct BlockGrads<'a> {
    dx_rows: &'a mut [f32],
    dw_blk: &'a mut [f32],
    dbias_blk: Option<&'a mut [f32]>,
}

/// `dX[rows] += G·W_blk`, `dW[blk] += Gᵀ·X_blk` and `dbias[blk] += Gᵀ·1`.
fn accumulate_grads(
    d: usize,
    g: &[f32],
    w_blk: &[f32],
    xblk: &[f32],
    (vb, c): (usize, usize),
    out: BlockGrads<'_>,
) -> Result<()> {
    let BlockGrads { dx_rows, dw_blk, dbias_blk } = out;
    let g_all = &g[..vb * c];
    let g = MatRef::row_major(g_all, c, vb)?;
    gemm(MatMut::row_major(dx_rows, c, d)?, g, MatRef::row_major(w_blk, vb, d)?, Accumulate::Add)?;
    // dW in vocabulary sub-blocks: the CPU GEMM copies a transposed left operand whole, so
    // this bounds that copy to C·DW_SUB_BLOCK floats instead of a second logits block.
    let x = MatRef::row_major(&xblk[..c * d], c, d)?;
    for j0 in (0..vb).step_by(DW_SUB_BLOCK) {
        let j1 = (j0 + DW_SUB_BLOCK).min(vb);
        let g_sub = MatRef::strided(&g_all[j0..], c, j1 - j0, vb, 1)?;
        gemm(MatMut::row_major(&mut dw_blk[j0 * d..j1 * d], j1 - j0, d)?, g_sub.t(), x, Accumulate::Add)?;
    }
    if let Some(db) = dbias_blk {
        let ones = vec![1f32; c];
        gemm(MatMut::row_major(db, 1, vb)?, MatRef::row_major(&ones, 1, c)?, g, Accumulate::Add)?;
    }
    Ok(())
}

/// Which passes one call runs.
enum Pass<'a> {
    /// Fold only.
    Forward,
    /// Gradient from a saved lse (recompute logits).
    Backward { coef: &'a [f32], lse: &'a [f32], dlse: Option<&'a [f32]> },
    /// Fold, then gradient from the same logits (full-vocabulary schedule only).
    Fused { coef: &'a [f32] },
}

fn run(
    config: &LinearCrossEntropy,
    plan: &Plan,
    inputs: &Inputs<'_>,
    pass: Pass<'_>,
) -> Result<(Option<Stats>, Option<Gradients>)> {
    let (n, d, v) = (inputs.n, inputs.d, inputs.v);
    let (cb, vbmax) = (plan.token_block(), plan.vocab_block());
    let ws = Workspace::new(plan.workspace_bytes());
    let Scratch { logits, xblk, wblk } = Scratch::carve(&ws, plan)?;
    let folding = matches!(pass, Pass::Forward | Pass::Fused { .. });
    // Fused over the whole vocabulary without a softcap: the fold leaves e^(z − max) in place
    // and the gradient reuses it (one exponential per logit instead of two).
    let keep_exp = matches!(pass, Pass::Fused { .. })
        && plan.schedule() == Schedule::FullVocab
        && config.softcap == Softcap::Off;
    let mut stats = folding.then(|| Stats::new(n));
    let mut grads = (!matches!(pass, Pass::Forward)).then(|| Gradients {
        dx: vec![0.0; n * d],
        dw: vec![0.0; v * d],
        dbias: inputs.bias.map(|_| vec![0.0; v]),
    });
    let mut cols = Vec::with_capacity(cb);
    let mut w_upcast_done = false;
    let mut lse_block = vec![0f32; cb];
    for t0 in (0..n).step_by(cb.max(1)) {
        let c = cb.min(n - t0);
        inputs.x.rows_f32(t0..t0 + c, d, xblk);
        for v0 in (0..v).step_by(vbmax.max(1)) {
            let vb = vbmax.min(v - v0);
            // A bf16 W is upcast per vocabulary block, or once per call when one block is all of W.
            let w_blk: &[f32] = match (&inputs.w, vb == v) {
                (Matrix::Bf16(_), true) => {
                    if !w_upcast_done {
                        inputs.w.rows_f32(0..v, d, wblk);
                        w_upcast_done = true;
                    }
                    &wblk[..v * d]
                }
                _ => w_rows(&inputs.w, v0, v0 + vb, d, wblk),
            };
            form_logits(config, inputs, w_blk, xblk, (v0, vb, c), logits)?;
            if let Some(st) = stats.as_mut() {
                fold(config, inputs, logits, (v0, vb, t0, c), keep_exp, st);
            }
            let (coef, lse, dlse) = match pass {
                Pass::Forward => continue,
                Pass::Backward { coef, lse, dlse } => (coef, &lse[t0..t0 + c], dlse),
                Pass::Fused { coef } => {
                    let st = stats.as_ref().ok_or(Error::InvalidOption {
                        name: "pass",
                        value: 0.0,
                        expected: "fold stats",
                    })?;
                    for (k, l) in lse_block[..c].iter_mut().enumerate() {
                        *l = (st.max[t0 + k] as f64 + st.sum[t0 + k].ln()) as f32;
                    }
                    (coef, &lse_block[..c], None)
                }
            };
            column_grads(config, v, &coef[t0..t0 + c], lse, dlse, t0, &mut cols);
            if keep_exp {
                let st = stats.as_ref().ok_or(Error::InvalidOption {
                    name: "pass",
                    value: 0.0,
                    expected: "fold stats",
                })?;
                for (k, col) in cols.iter_mut().enumerate() {
                    col.inv_sum = (1.0 / st.sum[t0 + k]) as f32;
                }
            }
            let Some(g) = grads.as_mut() else { continue };
            gradient(config, inputs, logits, (v0, vb, t0, c), &cols, keep_exp);
            let out = BlockGrads {
                dx_rows: &mut g.dx[t0 * d..(t0 + c) * d],
                dw_blk: &mut g.dw[v0 * d..(v0 + vb) * d],
                dbias_blk: g.dbias.as_mut().map(|b| &mut b[v0..v0 + vb]),
            };
            accumulate_grads(d, logits, w_blk, xblk, (vb, c), out)?;
        }
    }
    Ok((stats, grads))
}

fn finish_forward(config: &LinearCrossEntropy, inputs: &Inputs<'_>, stats: &Stats) -> Forward {
    let (alpha, lambda, v) = (config.label_smoothing as f64, config.z_loss as f64, inputs.v as f64);
    let lse: Vec<f32> = (0..inputs.n).map(|t| (stats.max[t] as f64 + stats.sum[t].ln()) as f32).collect();
    let per_token: Vec<f32> = (0..inputs.n)
        .map(|t| match inputs.target(config, t) {
            None => 0.0,
            Some(_) => {
                let l = stats.max[t] as f64 + stats.sum[t].ln();
                let ce = l - (1.0 - alpha) * stats.target_logit[t] as f64 - alpha / v * stats.logit_sum[t];
                (inputs.weight(t) as f64 * (ce + lambda * l * l)) as f32
            }
        })
        .collect();
    let loss = match config.reduction {
        Reduction::None => Loss::PerToken(per_token),
        Reduction::Sum => Loss::Scalar(per_token.iter().map(|&x| x as f64).sum()),
        Reduction::Mean => {
            let denom = inputs.valid_weight(config);
            let total: f64 = per_token.iter().map(|&x| x as f64).sum();
            Loss::Scalar(if denom > 0.0 { total / denom } else { 0.0 })
        }
    };
    Forward { loss, lse }
}

/// The loss and per-row lse, one GEMM per block.
pub fn forward(config: &LinearCrossEntropy, plan: &Plan, inputs: &Inputs<'_>) -> Result<Forward> {
    inputs.validate(config)?;
    check_plan(plan, inputs)?;
    let (stats, _) = run(config, plan, inputs, Pass::Forward)?;
    let stats = stats.ok_or(Error::InvalidOption { name: "pass", value: 0.0, expected: "fold stats" })?;
    Ok(finish_forward(config, inputs, &stats))
}

/// dX, dW (and dbias) from forward's lse, recomputing each block's logits (so forward +
/// backward cost 4 GEMMs). `dlse` is an optional upstream gradient of the lse output.
pub fn backward(
    config: &LinearCrossEntropy,
    plan: &Plan,
    inputs: &Inputs<'_>,
    forward: &Forward,
    grad: GradOutput<'_>,
    dlse: Option<&[f32]>,
) -> Result<Gradients> {
    inputs.validate(config)?;
    check_plan(plan, inputs)?;
    if forward.lse.len() != inputs.n {
        return Err(Error::ShapeMismatch { what: "lse (n)", expected: inputs.n, found: forward.lse.len() });
    }
    if let Some(g) = dlse.filter(|g| g.len() != inputs.n) {
        return Err(Error::ShapeMismatch { what: "dlse (n)", expected: inputs.n, found: g.len() });
    }
    let coef = coefficients(config, inputs, grad)?;
    let (_, grads) = run(config, plan, inputs, Pass::Backward { coef: &coef, lse: &forward.lse, dlse })?;
    grads.ok_or(Error::InvalidOption { name: "pass", value: 0.0, expected: "gradients" })
}

/// Forward and backward in one pass when the loss is the last op (its upstream gradient is
/// known): on the full-vocabulary schedule each block's logits serve both (3 GEMMs); on the
/// blocked schedule it runs `forward` then `backward`.
pub fn forward_backward(
    config: &LinearCrossEntropy,
    plan: &Plan,
    inputs: &Inputs<'_>,
    grad: GradOutput<'_>,
) -> Result<(Forward, Gradients)> {
    inputs.validate(config)?;
    check_plan(plan, inputs)?;
    let coef = coefficients(config, inputs, grad)?;
    if plan.schedule() == Schedule::VocabBlocked {
        let fwd = forward(config, plan, inputs)?;
        let grads = backward(config, plan, inputs, &fwd, grad, None)?;
        return Ok((fwd, grads));
    }
    let (stats, grads) = run(config, plan, inputs, Pass::Fused { coef: &coef })?;
    let stats = stats.ok_or(Error::InvalidOption { name: "pass", value: 0.0, expected: "fold stats" })?;
    let grads = grads.ok_or(Error::InvalidOption { name: "pass", value: 0.0, expected: "gradients" })?;
    Ok((finish_forward(config, inputs, &stats), grads))
}
