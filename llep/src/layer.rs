//! One rank's tensors of a layer call: tokens, routing, native expert weights; and the
//! gradients backward returns. All row-major f32.

use flatpeak_common::HeapSize;

use crate::assign::expert_index;
use crate::config::Shape;
use crate::error::{Error, Result};

/// One rank's routing: N×k expert ids and routing weights.
#[derive(Debug, Clone, Copy)]
pub struct Routing<'a> {
    /// Expert id of slot j of token i at `i·k + j`, in 0..E (duplicates allowed).
    pub ids: &'a [i64],
    /// Routing weight w_ij at `i·k + j`, finite.
    pub weights: &'a [f32],
}

impl Routing<'_> {
    /// Checks lengths, every id in 0..E and every weight finite.
    pub fn validate(&self, shape: &Shape) -> Result<()> {
        let (n, k) = (shape.tokens, shape.top_k);
        check_len("top-k ids (N·k)", n * k, self.ids.len())?;
        check_len("routing weights (N·k)", n * k, self.weights.len())?;
        for (r, (&id, &w)) in self.ids.iter().zip(self.weights).enumerate() {
            expert_index(shape, id, r / k, r % k)?;
            if !w.is_finite() {
                return Err(Error::NonFiniteWeight { token: r / k, slot: r % k, value: w });
            }
        }
        Ok(())
    }
}

/// The SwiGLU weights of one rank's M = E/P native experts, expert-major:
/// W_gate and W_up `[M][H][I]`, W_down `[M][I][H]`.
#[derive(Debug, Clone, Copy)]
pub struct ExpertWeights<'a> {
    /// W_gate, M·H·I.
    pub gate: &'a [f32],
    /// W_up, M·H·I.
    pub up: &'a [f32],
    /// W_down, M·I·H.
    pub down: &'a [f32],
}

impl ExpertWeights<'_> {
    /// Checks the three lengths against M·H·I.
    pub fn validate(&self, shape: &Shape) -> Result<()> {
        let len = shape.local_experts() * shape.hidden * shape.intermediate;
        check_len("W_gate (M·H·I)", len, self.gate.len())?;
        check_len("W_up (M·H·I)", len, self.up.len())?;
        check_len("W_down (M·I·H)", len, self.down.len())
    }
}

/// Everything one rank brings to a layer call.
#[derive(Debug, Clone, Copy)]
pub struct RankInputs<'a> {
    /// Tokens x, N×H.
    pub x: &'a [f32],
    /// Top-k ids and weights.
    pub routing: Routing<'a>,
    /// The rank's native experts.
    pub experts: ExpertWeights<'a>,
}

impl RankInputs<'_> {
    /// Checks every length, id and weight.
    pub fn validate(&self, shape: &Shape) -> Result<()> {
        check_len("x (N·H)", shape.tokens * shape.hidden, self.x.len())?;
        self.routing.validate(shape)?;
        self.experts.validate(shape)
    }
}

/// What backward returns on one rank: gradients of its inputs and of its native experts
/// (foreign contributions already returned and added).
#[derive(Debug, Clone, PartialEq)]
pub struct Gradients {
    /// dL/dx, N×H.
    pub dx: Vec<f32>,
    /// dL/dw_ij = ⟨dY_i, FFN_{e_ij}(x_i)⟩, N×k: what an upstream router trains on.
    pub d_weights: Vec<f32>,
    /// dL/dW_gate of the native experts, M·H·I.
    pub d_gate: Vec<f32>,
    /// dL/dW_up, M·H·I.
    pub d_up: Vec<f32>,
    /// dL/dW_down, M·I·H.
    pub d_down: Vec<f32>,
}

impl HeapSize for Gradients {
    fn heap_bytes(&self) -> usize {
        self.dx.heap_bytes()
            + self.d_weights.heap_bytes()
            + self.d_gate.heap_bytes()
            + self.d_up.heap_bytes()
            + self.d_down.heap_bytes()
    }
}

pub(crate) fn check_len(what: &'static str, expected: usize, found: usize) -> Result<()> {
    if expected == found { Ok(()) } else { Err(Error::ShapeMismatch { what, expected, got: found }) }
}
