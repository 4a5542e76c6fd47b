//! One expert over one group of ≤ G received routes: SwiGLU forward, and its backward with the
//! forward recomputed, on buffers carved at launch. GEMMs through `flatpeak_common::gemm`.
//!
//! Forward: `g = X·W_gate`, `u = X·W_up`, `h = silu(g) ⊙ u`, `y = h·W_down`; row t of the
//! output buffer gains `w_t·y_t`. Backward, with `δ_t = w_t·dY_t`: `dw_t = ⟨dY_t, y_t⟩`,
//! `dW_down += hᵀ·δ`, `dh = δ·W_downᵀ`, `dg = dh ⊙ u ⊙ silu'(g)`, `du = dh ⊙ silu(g)`,
//! `dW_gate += Xᵀ·dg`, `dW_up += Xᵀ·du`, `dX_t = dg·W_gateᵀ + du·W_upᵀ`, added to row t's dX.

use flatpeak_common::gemm::{Accumulate, MatMut, MatRef, MatmulOptions, Threads, matmul};

use crate::config::Shape;
use crate::error::Result;
use crate::layer::Gradients;
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
/// `threads` is how every GEMM on it runs.
#[derive(Debug)]
pub(crate) struct Scratch<'w> {
    pub threads: Threads,
    pub x: &'w mut [f32],
    pub y: &'w mut [f32],
    pub gate: &'w mut [f32],
    pub up: &'w mut [f32],
    pub dy: &'w mut [f32],
    pub h: &'w mut [f32],
}

fn mm(
    threads: Threads,
    dst: MatMut<'_, f32>,
    a: MatRef<'_, f32>,
    b: MatRef<'_, f32>,
    acc: Accumulate,
) -> Result<()> {
    Ok(matmul(dst, a, b, MatmulOptions::with_accumulate(acc).threads(threads))?)
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
        s.threads,
        MatMut::row_major(&mut s.gate[..rows * i], rows, i)?,
        x,
        MatRef::row_major(w.gate, h, i)?,
        Accumulate::Replace,
    )?;
    mm(
        s.threads,
        MatMut::row_major(&mut s.up[..rows * i], rows, i)?,
        x,
        MatRef::row_major(w.up, h, i)?,
        Accumulate::Replace,
    )
}

/// Where forward keeps one group's pre-activations ([`Mode::SaveActivations`]): `rows × I`
/// each, route t of the group at row t.
///
/// [`Mode::SaveActivations`]: crate::Mode::SaveActivations
#[derive(Debug)]
pub(crate) struct SavedPre<'a> {
    pub gate: &'a mut [f32],
    pub up: &'a mut [f32],
}

/// The received rows and routes of one round, and the output rows forward adds to.
#[derive(Debug)]
pub(crate) struct ForwardRound<'a> {
    pub recv: &'a [f32],
    pub meta: &'a [RouteMeta],
    pub out: &'a mut [f32],
}

/// Forward of one group: `out[row_t] += w_t·FFN(recv[row_t])`; with `save`, also keeps the
/// group's `x·W_gate` and `x·W_up`.
pub(crate) fn forward(
    w: ExpertRef<'_>,
    dims: (usize, usize),
    entries: &[GroupEntry],
    round: &mut ForwardRound<'_>,
    save: Option<SavedPre<'_>>,
    s: &mut Scratch<'_>,
) -> Result<()> {
    let (h, i) = dims;
    let rows = entries.len();
    let (meta, out) = (round.meta, &mut *round.out);
    gather(s.x, round.recv, entries, h);
    project(w, dims, rows, s)?;
    if let Some(save) = save {
        save.gate.copy_from_slice(&s.gate[..rows * i]);
        save.up.copy_from_slice(&s.up[..rows * i]);
    }
    for (g, u) in s.gate[..rows * i].iter_mut().zip(&s.up[..rows * i]) {
        *g = *g * sigmoid(*g) * u;
    }
    mm(
        s.threads,
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
        s.threads,
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
        s.threads,
        MatMut::row_major(grad.down, i, h)?,
        MatRef::row_major(&s.h[..rows * i], rows, i)?.t(),
        delta,
        Accumulate::Add,
    )?;
    mm(
        s.threads,
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
    input_grads(w, grad, dims, entries, round.dx_rows, s)
}

/// The shared end of both backwards, with dg and du in the scratch's gate and up and X in its
/// x: `dW_gate += Xᵀ·dg`, `dW_up += Xᵀ·du`, `dX_t = dg·W_gateᵀ + du·W_upᵀ` added to row t.
fn input_grads(
    w: ExpertRef<'_>,
    grad: ExpertGrad<'_>,
    (h, i): (usize, usize),
    entries: &[GroupEntry],
    dx_rows: &mut [f32],
    s: &mut Scratch<'_>,
) -> Result<()> {
    let rows = entries.len();
    let x = MatRef::row_major(&s.x[..rows * h], rows, h)?;
    let dg = MatRef::row_major(&s.gate[..rows * i], rows, i)?;
    let du = MatRef::row_major(&s.up[..rows * i], rows, i)?;
    let threads = s.threads;
    mm(threads, MatMut::row_major(grad.gate, h, i)?, x.t(), dg, Accumulate::Add)?;
    mm(threads, MatMut::row_major(grad.up, h, i)?, x.t(), du, Accumulate::Add)?;
    let dx = &mut s.y[..rows * h];
    mm(
        threads,
        MatMut::row_major(dx, rows, h)?,
        dg,
        MatRef::row_major(w.gate, h, i)?.t(),
        Accumulate::Replace,
    )?;
    mm(threads, MatMut::row_major(dx, rows, h)?, du, MatRef::row_major(w.up, h, i)?.t(), Accumulate::Add)?;
    for (t, entry) in entries.iter().enumerate() {
        let r = entry.row as usize;
        let dst = &mut dx_rows[r * h..(r + 1) * h];
        for (o, v) in dst.iter_mut().zip(&s.y[t * h..(t + 1) * h]) {
            *o += v;
        }
    }
    Ok(())
}

/// One round's tensors for backward from saved activations: the saved x rows and routes, the
/// received dY rows, and the buffers it fills.
#[derive(Debug)]
pub(crate) struct SavedRound<'a> {
    pub x: &'a [f32],
    pub meta: &'a [RouteMeta],
    pub recv_dy: &'a [f32],
    pub dx_rows: &'a mut [f32],
    pub dw: &'a mut [f32],
}

/// Backward of one group from its saved pre-activations `g = x·W_gate`, `u = x·W_up` (route t
/// at row t of `pre`), without recompute: `h = silu(g) ⊙ u`, `r = dY·W_downᵀ`,
/// `dw_t = ⟨r_t, h_t⟩` (= ⟨dY_t, y_t⟩ since `y = h·W_down`), `dW_down += hᵀ·(w ⊙ dY)`,
/// `dh_t = w_t·r_t`, then as [`backward`]. Six GEMMs instead of nine.
pub(crate) fn backward_saved(
    w: ExpertRef<'_>,
    grad: ExpertGrad<'_>,
    dims: (usize, usize),
    entries: &[GroupEntry],
    pre: (&[f32], &[f32]),
    round: &mut SavedRound<'_>,
    s: &mut Scratch<'_>,
) -> Result<()> {
    let (h, i) = dims;
    let rows = entries.len();
    let (g_saved, u_saved) = (&pre.0[..rows * i], &pre.1[..rows * i]);
    gather(s.x, round.x, entries, h);
    gather(s.dy, round.recv_dy, entries, h);
    for ((hv, g), u) in s.h[..rows * i].iter_mut().zip(g_saved).zip(u_saved) {
        *hv = g * sigmoid(*g) * u;
    }
    mm(
        s.threads,
        MatMut::row_major(&mut s.gate[..rows * i], rows, i)?,
        MatRef::row_major(&s.dy[..rows * h], rows, h)?,
        MatRef::row_major(w.down, i, h)?.t(),
        Accumulate::Replace,
    )?;
    for (t, entry) in entries.iter().enumerate() {
        let m = entry.meta as usize;
        let (r, hv) = (&s.gate[t * i..(t + 1) * i], &s.h[t * i..(t + 1) * i]);
        // f64 dot product, as in the recomputing backward.
        let dot: f64 = r.iter().zip(hv).map(|(a, b)| *a as f64 * *b as f64).sum();
        round.dw[m] = dot as f32;
        let weight = round.meta[m].weight;
        s.dy[t * h..(t + 1) * h].iter_mut().for_each(|v| *v *= weight);
    }
    mm(
        s.threads,
        MatMut::row_major(grad.down, i, h)?,
        MatRef::row_major(&s.h[..rows * i], rows, i)?.t(),
        MatRef::row_major(&s.dy[..rows * h], rows, h)?,
        Accumulate::Add,
    )?;
    for (t, entry) in entries.iter().enumerate() {
        let weight = round.meta[entry.meta as usize].weight;
        let span = t * i..(t + 1) * i;
        let gate = s.gate[span.clone()].iter_mut().zip(&g_saved[span.clone()]);
        for ((dg, g), (du, u)) in gate.zip(s.up[span.clone()].iter_mut().zip(&u_saved[span])) {
            let dh = weight * *dg;
            let sg = sigmoid(*g);
            *dg = dh * u * sg * (1.0 + g * (1.0 - sg));
            *du = dh * g * sg;
        }
    }
    input_grads(w, grad, dims, entries, round.dx_rows, s)
}

/// `len` zeros written now. `vec![0.0; len]` asks the allocator for zeroed memory, whose fresh
/// pages are first mapped to the shared zero page and then copied on the first write of an
/// accumulation (`+=`): a second fault and a TLB shoot-down across the group's threads per
/// page. Writing the zeros makes the first touch a plain write fault.
pub(super) fn zeros(len: usize) -> Vec<f32> {
    let mut v = Vec::with_capacity(len);
    v.resize(len, 0.0);
    v
}

/// dX, d(weights) and the native experts' weight gradients, zeroed.
pub(super) fn zero_gradients(s: &Shape) -> Gradients {
    let native = s.local_experts() * s.hidden * s.intermediate;
    Gradients {
        dx: zeros(s.tokens * s.hidden),
        d_weights: zeros(s.tokens * s.top_k),
        d_gate: zeros(native),
        d_up: zeros(native),
        d_down: zeros(native),
    }
}

/// Where local expert `slot`'s weight gradients accumulate: the returned native gradients, or
/// the foreign slot's fp32 buffer (sent home at the end).
pub(super) fn expert_grad<'g>(
    s: &Shape,
    slot: usize,
    g: &'g mut Gradients,
    foreign_grad: &'g mut [f32],
) -> ExpertGrad<'g> {
    let hi = s.hidden * s.intermediate;
    let m = s.local_experts();
    if slot < m {
        let r = slot * hi..(slot + 1) * hi;
        ExpertGrad { gate: &mut g.d_gate[r.clone()], up: &mut g.d_up[r.clone()], down: &mut g.d_down[r] }
    } else {
        let f = &mut foreign_grad[(slot - m) * 3 * hi..][..3 * hi];
        let (gate, rest) = f.split_at_mut(hi);
        let (up, down) = rest.split_at_mut(hi);
        ExpertGrad { gate, up, down }
    }
}
