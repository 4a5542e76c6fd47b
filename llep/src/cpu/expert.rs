//! One expert over one group of ≤ G received routes: SwiGLU forward, and its backward with the
//! forward recomputed, on buffers carved at launch. GEMMs through `flatpeak_common::gemm`.
//!
//! Forward: `g = X·W_gate`, `u = X·W_up`, `h = silu(g) ⊙ u`, `y = h·W_down`; row t of the
//! output buffer gains `w_t·y_t`. Backward, with `δ_t = w_t·dY_t`: `dw_t = ⟨dY_t, y_t⟩`,
//! `dW_down += hᵀ·δ`, `dh = δ·W_downᵀ`, `dg = dh ⊙ u ⊙ silu'(g)`, `du = dh ⊙ silu(g)`,
//! `dW_gate += Xᵀ·dg`, `dW_up += Xᵀ·du`, `dX_t = dg·W_gateᵀ + du·W_upᵀ`, added to row t's dX.

use flatpeak_common::gemm::{Accumulate, MatMut, MatRef, MatmulOptions, matmul};

use crate::error::Result;
use crate::plan::{GroupEntry, RouteMeta};

/// One expert's weights: W_gate, W_up H×I and W_down I×H.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ExpertRef<'a> {
    pub gate: &'a [f32],
    pub up: &'a [f32],
    pub down: &'a [f32],
}

/// Where one expert's weight gradients accumulate.
#[derive(Debug)]
pub(crate) struct ExpertGrad<'a> {
    pub gate: &'a mut [f32],
    pub up: &'a mut [f32],
    pub down: &'a mut [f32],
}

/// The expert scratch: X and Y (G×H), gate and up (G×I); backward adds dY (G×H) and h (G×I).
#[derive(Debug)]
pub(crate) struct Scratch<'w> {
    pub x: &'w mut [f32],
    pub y: &'w mut [f32],
    pub gate: &'w mut [f32],
    pub up: &'w mut [f32],
    pub dy: &'w mut [f32],
    pub h: &'w mut [f32],
}

fn mm(dst: MatMut<'_, f32>, a: MatRef<'_, f32>, b: MatRef<'_, f32>, acc: Accumulate) -> Result<()> {
    Ok(matmul(dst, a, b, MatmulOptions::with_accumulate(acc))?)
}

fn sigmoid(g: f32) -> f32 {
    1.0 / (1.0 + (-g).exp())
}

fn gather(dst: &mut [f32], src: &[f32], entries: &[GroupEntry], width: usize) {
    for (t, entry) in entries.iter().enumerate() {
        let r = entry.row as usize;
        dst[t * width..(t + 1) * width].copy_from_slice(&src[r * width..(r + 1) * width]);
    }
}

/// `gate ← X·W_gate`, `up ← X·W_up` for the first `rows` rows of the scratch.
fn project(w: ExpertRef<'_>, (h, i): (usize, usize), rows: usize, s: &mut Scratch<'_>) -> Result<()> {
    let x = MatRef::row_major(&s.x[..rows * h], rows, h)?;
    mm(
        MatMut::row_major(&mut s.gate[..rows * i], rows, i)?,
        x,
        MatRef::row_major(w.gate, h, i)?,
        Accumulate::Replace,
    )?;
    mm(
        MatMut::row_major(&mut s.up[..rows * i], rows, i)?,
        x,
        MatRef::row_major(w.up, h, i)?,
        Accumulate::Replace,
    )
}

/// Forward of one group: `out[row_t] += w_t·FFN(recv[row_t])`.
pub(crate) fn forward(
    w: ExpertRef<'_>,
    dims: (usize, usize),
    entries: &[GroupEntry],
    recv: &[f32],
    meta: &[RouteMeta],
    out: &mut [f32],
    s: &mut Scratch<'_>,
) -> Result<()> {
    let (h, i) = dims;
    let rows = entries.len();
    gather(s.x, recv, entries, h);
    project(w, dims, rows, s)?;
    for (g, u) in s.gate[..rows * i].iter_mut().zip(&s.up[..rows * i]) {
        *g = *g * sigmoid(*g) * u;
    }
    mm(
        MatMut::row_major(&mut s.y[..rows * h], rows, h)?,
        MatRef::row_major(&s.gate[..rows * i], rows, i)?,
        MatRef::row_major(w.down, i, h)?,
        Accumulate::Replace,
    )?;
    for (t, entry) in entries.iter().enumerate() {
        let (r, weight) = (entry.row as usize, meta[entry.meta as usize].weight);
        let dst = &mut out[r * h..(r + 1) * h];
        for (o, y) in dst.iter_mut().zip(&s.y[t * h..(t + 1) * h]) {
            *o += weight * y;
        }
    }
    Ok(())
}

/// The received tensors of one round that backward reads, and the buffers it fills.
#[derive(Debug)]
pub(crate) struct BackwardRound<'a> {
    pub recv_x: &'a [f32],
    pub recv_dy: &'a [f32],
    pub meta: &'a [RouteMeta],
    pub dx_rows: &'a mut [f32],
    pub dw: &'a mut [f32],
}

/// Backward of one group, recomputing its forward.
pub(crate) fn backward(
    w: ExpertRef<'_>,
    grad: ExpertGrad<'_>,
    dims: (usize, usize),
    entries: &[GroupEntry],
    round: &mut BackwardRound<'_>,
    s: &mut Scratch<'_>,
) -> Result<()> {
    let (h, i) = dims;
    let rows = entries.len();
    gather(s.x, round.recv_x, entries, h);
    gather(s.dy, round.recv_dy, entries, h);
    project(w, dims, rows, s)?;
    for ((hv, g), u) in s.h[..rows * i].iter_mut().zip(&s.gate[..rows * i]).zip(&s.up[..rows * i]) {
        *hv = g * sigmoid(*g) * u;
    }
    mm(
        MatMut::row_major(&mut s.y[..rows * h], rows, h)?,
        MatRef::row_major(&s.h[..rows * i], rows, i)?,
        MatRef::row_major(w.down, i, h)?,
        Accumulate::Replace,
    )?;
    for (t, entry) in entries.iter().enumerate() {
        let m = entry.meta as usize;
        let dy = &mut s.dy[t * h..(t + 1) * h];
        // f64 dot product: one per route, cheap, and exact enough to compare against f64.
        let dot: f64 = dy.iter().zip(&s.y[t * h..(t + 1) * h]).map(|(a, b)| *a as f64 * *b as f64).sum();
        round.dw[m] = dot as f32;
        let weight = round.meta[m].weight;
        dy.iter_mut().for_each(|v| *v *= weight);
    }
    let delta = MatRef::row_major(&s.dy[..rows * h], rows, h)?;
    mm(
        MatMut::row_major(grad.down, i, h)?,
        MatRef::row_major(&s.h[..rows * i], rows, i)?.t(),
        delta,
        Accumulate::Add,
    )?;
    mm(
        MatMut::row_major(&mut s.h[..rows * i], rows, i)?,
        delta,
        MatRef::row_major(w.down, i, h)?.t(),
        Accumulate::Replace,
    )?;
    for ((dh, g), u) in
        s.h[..rows * i].iter().zip(s.gate[..rows * i].iter_mut()).zip(s.up[..rows * i].iter_mut())
    {
        let sg = sigmoid(*g);
        let silu = *g * sg;
        let dsilu = sg * (1.0 + *g * (1.0 - sg));
        let (dg, du) = (dh * *u * dsilu, dh * silu);
        *g = dg;
        *u = du;
    }
    let x = MatRef::row_major(&s.x[..rows * h], rows, h)?;
    let dg = MatRef::row_major(&s.gate[..rows * i], rows, i)?;
    let du = MatRef::row_major(&s.up[..rows * i], rows, i)?;
    mm(MatMut::row_major(grad.gate, h, i)?, x.t(), dg, Accumulate::Add)?;
    mm(MatMut::row_major(grad.up, h, i)?, x.t(), du, Accumulate::Add)?;
    let dx = &mut s.y[..rows * h];
    mm(MatMut::row_major(dx, rows, h)?, dg, MatRef::row_major(w.gate, h, i)?.t(), Accumulate::Replace)?;
    mm(MatMut::row_major(dx, rows, h)?, du, MatRef::row_major(w.up, h, i)?.t(), Accumulate::Add)?;
    for (t, entry) in entries.iter().enumerate() {
        let r = entry.row as usize;
        let dst = &mut round.dx_rows[r * h..(r + 1) * h];
        for (o, v) in dst.iter_mut().zip(&s.y[t * h..(t + 1) * h]) {
            *o += v;
        }
    }
    Ok(())
}
