//! The oracle: a single-process dense MoE in f64, route by route, obviously correct.
//!
//! `y_i = Σ_j w_ij·FFN_{e_ij}(x_i)`, `FFN_e(x) = (silu(x·W_gate,e) ⊙ (x·W_up,e))·W_down,e`; its
//! backward from dY gives dX, dW_gate, dW_up, dW_down of all E experts, and
//! `dw_ij = ⟨dY_i, FFN_{e_ij}(x_i)⟩`. Pass a shape with `ranks: 1` holding every token and
//! [`ExpertWeights`] of all E experts.
//!
//! [`naive_bf16_forward`] and [`naive_bf16_backward`] are the same computation as a bf16
//! framework runs it, the yardstick of the bf16 layer: every tensor a GEMM or an elementwise
//! op stores (x·W_gate, x·W_up, h, y, w·dY, dh, dg, du, each route's dX) is rounded to bf16,
//! the sums and the gradients accumulate in wide precision. Their inputs are f32 slices holding
//! bf16 values.

// Index loops mirror the formulas term by term; that is the point of an oracle.
#![allow(clippy::needless_range_loop)]

use crate::config::Shape;
use crate::error::{Error, Result};
use crate::layer::{ExpertWeights, Gradients, RankInputs, check_len};

/// Gradients of the reference: [`Gradients`] in f64, over all E experts.
pub type ReferenceGrads = Gradients<f64>;

fn sigmoid(g: f64) -> f64 {
    1.0 / (1.0 + (-g).exp())
}

struct Route {
    x: Vec<f64>,
    gate: Vec<f64>,
    up: Vec<f64>,
    h: Vec<f64>,
    y: Vec<f64>,
}

/// Where the computation stores a tensor: unchanged (f64), or rounded to bf16.
type Store = fn(f64) -> f64;

fn exact(v: f64) -> f64 {
    v
}

fn to_bf16(v: f64) -> f64 {
    half::bf16::from_f64(v).to_f64()
}

fn route(shape: &Shape, w: &ExpertWeights<'_>, e: usize, x: &[f32], q: Store) -> Route {
    let (hd, id) = (shape.hidden, shape.intermediate);
    let base = e * hd * id;
    let x: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let mut gate = vec![0.0; id];
    let mut up = vec![0.0; id];
    for (a, &xa) in x.iter().enumerate() {
        for b in 0..id {
            gate[b] += xa * w.gate[base + a * id + b] as f64;
            up[b] += xa * w.up[base + a * id + b] as f64;
        }
    }
    let (gate, up): (Vec<f64>, Vec<f64>) =
        (gate.into_iter().map(q).collect(), up.into_iter().map(q).collect());
    let h: Vec<f64> = (0..id).map(|b| q(gate[b] * sigmoid(gate[b]) * up[b])).collect();
    let mut y = vec![0.0; hd];
    for (b, &hb) in h.iter().enumerate() {
        for a in 0..hd {
            y[a] += hb * w.down[base + b * hd + a] as f64;
        }
    }
    Route { x, gate, up, h, y: y.into_iter().map(q).collect() }
}

fn check(shape: &Shape, inputs: &RankInputs<'_>) -> Result<()> {
    shape.validate()?;
    if shape.ranks != 1 {
        return Err(Error::invalid_config(
            "reference ranks",
            shape.ranks as f64,
            "1 (every token and expert in one process)",
        ));
    }
    inputs.validate(shape, crate::WeightLayout::Split)
}

/// The dense forward, N×H.
pub fn forward(shape: &Shape, inputs: &RankInputs<'_>) -> Result<Vec<f64>> {
    forward_storing(shape, inputs, exact)
}

/// The dense forward as a bf16 framework runs it (see the module docs); `shape.dtype` is
/// ignored, the inputs hold bf16 values as f32.
pub fn naive_bf16_forward(shape: &Shape, inputs: &RankInputs<'_>) -> Result<Vec<f64>> {
    forward_storing(&f32_shape(shape), inputs, to_bf16)
}

/// The dense backward as a bf16 framework runs it (see the module docs).
pub fn naive_bf16_backward(shape: &Shape, inputs: &RankInputs<'_>, dy: &[f32]) -> Result<ReferenceGrads> {
    backward_storing(&f32_shape(shape), inputs, dy, to_bf16)
}

fn f32_shape(shape: &Shape) -> Shape {
    Shape { dtype: flatpeak_common::DType::F32, ..*shape }
}

fn forward_storing(shape: &Shape, inputs: &RankInputs<'_>, q: Store) -> Result<Vec<f64>> {
    check(shape, inputs)?;
    let (n, hd, k) = (shape.tokens, shape.hidden, shape.top_k);
    let mut y = vec![0.0; n * hd];
    for i in 0..n {
        for j in 0..k {
            let e = inputs.routing.ids[i * k + j] as usize;
            let w = inputs.routing.weights[i * k + j] as f64;
            let r = route(shape, &inputs.experts, e, &inputs.x[i * hd..(i + 1) * hd], q);
            for a in 0..hd {
                y[i * hd + a] += w * r.y[a];
            }
        }
    }
    Ok(y)
}

/// The dense backward from dY (N×H).
pub fn backward(shape: &Shape, inputs: &RankInputs<'_>, dy: &[f32]) -> Result<ReferenceGrads> {
    backward_storing(shape, inputs, dy, exact)
}

fn backward_storing(shape: &Shape, inputs: &RankInputs<'_>, dy: &[f32], q: Store) -> Result<ReferenceGrads> {
    check(shape, inputs)?;
    let (n, hd, id, k, e_all) = (shape.tokens, shape.hidden, shape.intermediate, shape.top_k, shape.experts);
    check_len("dY (N·H)", n * hd, dy.len())?;
    let mut g = ReferenceGrads {
        dx: vec![0.0; n * hd],
        d_weights: vec![0.0; n * k],
        d_gate: vec![0.0; e_all * hd * id],
        d_up: vec![0.0; e_all * hd * id],
        d_down: vec![0.0; e_all * hd * id],
    };
    let w = &inputs.experts;
    for i in 0..n {
        let dyi: Vec<f64> = dy[i * hd..(i + 1) * hd].iter().map(|&v| v as f64).collect();
        for j in 0..k {
            let e = inputs.routing.ids[i * k + j] as usize;
            let weight = inputs.routing.weights[i * k + j] as f64;
            let r = route(shape, w, e, &inputs.x[i * hd..(i + 1) * hd], q);
            g.d_weights[i * k + j] = dyi.iter().zip(&r.y).map(|(a, b)| a * b).sum();
            let delta: Vec<f64> = dyi.iter().map(|v| q(weight * v)).collect();
            let base = e * hd * id;
            let mut dh = vec![0.0; id];
            for b in 0..id {
                for a in 0..hd {
                    g.d_down[base + b * hd + a] += r.h[b] * delta[a];
                    dh[b] += delta[a] * w.down[base + b * hd + a] as f64;
                }
            }
            let mut dx = vec![0.0; hd];
            for b in 0..id {
                let (s, dh) = (sigmoid(r.gate[b]), q(dh[b]));
                let dg = q(dh * r.up[b] * s * (1.0 + r.gate[b] * (1.0 - s)));
                let du = q(dh * r.gate[b] * s);
                for a in 0..hd {
                    g.d_gate[base + a * id + b] += r.x[a] * dg;
                    g.d_up[base + a * id + b] += r.x[a] * du;
                    dx[a] += dg * w.gate[base + a * id + b] as f64 + du * w.up[base + a * id + b] as f64;
                }
            }
            for a in 0..hd {
                g.dx[i * hd + a] += q(dx[a]);
            }
        }
    }
    Ok(g)
}
