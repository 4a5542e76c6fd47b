//! One rank's tensors of a layer call: tokens, routing, native expert weights; and the
//! gradients backward returns. All row-major. Tokens, expert weights and dY are of the layer's
//! storage type ([`LayerElement`]: f32 or bf16, the plan's [`Shape::dtype`]); routing weights, the
//! output and every gradient are f32.

use flatpeak_common::{DType, HeapSize};
use half::bf16;

use crate::assign::expert_index;
use crate::config::{Shape, WeightLayout};
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

/// The storage type of a layer's tokens, expert weights and dY: `f32`, or `bf16` (GEMMs in
/// bf16 with f32 accumulation, the dispatch rows and the expert scratch in bf16, the output and
/// the gradients f32). Sealed.
pub trait LayerElement: bytemuck::Pod + Send + Sync + std::fmt::Debug + sealed::Sealed {
    /// The [`DType`] a plan's [`Shape::dtype`] names for it.
    const DTYPE: DType;
}

impl LayerElement for f32 {
    const DTYPE: DType = DType::F32;
}

impl LayerElement for bf16 {
    const DTYPE: DType = DType::Bf16;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
}

/// The SwiGLU weights of one rank's M = E/P native experts, expert-major, of the storage type
/// `T`, in the config's [`WeightLayout`]: by default W_gate and W_up `[M][H][I]`, W_down
/// `[M][I][H]`; under [`WeightLayout::Linear`] `gate` holds torch's gate_up `[M][2I][H]`, `up`
/// is empty and `down` is `[M][H][I]` ([`ExpertWeights::linear`]).
#[derive(Debug, Clone, Copy)]
pub struct ExpertWeights<'a, T = f32> {
    /// W_gate, M·H·I.
    pub gate: &'a [T],
    /// W_up, M·H·I.
    pub up: &'a [T],
    /// W_down, M·I·H.
    pub down: &'a [T],
}

impl<'a, T> ExpertWeights<'a, T> {
    /// Weights in [`WeightLayout::Linear`]: torch's gate_up `[M][2I][H]` and down `[M][H][I]`.
    pub fn linear(gate_up: &'a [T], down: &'a [T]) -> Self {
        Self { gate: gate_up, up: &[], down }
    }

    /// Checks the three lengths against what `layout` stores for M experts.
    pub fn validate(&self, shape: &Shape, layout: WeightLayout) -> Result<()> {
        let [gate, up, down] = layout.native_lens(shape);
        match layout {
            WeightLayout::Split => {
                check_len("W_gate (M·H·I)", gate, self.gate.len())?;
                check_len("W_up (M·H·I)", up, self.up.len())?;
            }
            WeightLayout::Linear => {
                check_len("gate_up (M·2I·H)", gate, self.gate.len())?;
                check_len("W_up (empty: gate_up holds it)", up, self.up.len())?;
            }
        }
        check_len("W_down (M·I·H)", down, self.down.len())
    }
}

/// Everything one rank brings to a layer call, tokens and weights of the storage type `T`.
#[derive(Debug, Clone, Copy)]
pub struct RankInputs<'a, T = f32> {
    /// Tokens x, N×H.
    pub x: &'a [T],
    /// Top-k ids and weights.
    pub routing: Routing<'a>,
    /// The rank's native experts.
    pub experts: ExpertWeights<'a, T>,
}

impl<T: LayerElement> RankInputs<'_, T> {
    /// Checks the storage type against the shape's, then every length (the expert weights in
    /// `layout`), id and weight.
    pub fn validate(&self, shape: &Shape, layout: WeightLayout) -> Result<()> {
        if T::DTYPE != shape.dtype {
            return Err(Error::DtypeMismatch {
                what: "tokens and weights",
                expected: shape.dtype,
                found: T::DTYPE,
            });
        }
        check_len("x (N·H)", shape.tokens * shape.hidden, self.x.len())?;
        self.routing.validate(shape)?;
        self.experts.validate(shape, layout)
    }
}

/// What backward returns on one rank: gradients of its inputs and of its native experts
/// (foreign contributions already returned and added), in f32. The reference's, in f64 over all
/// E experts, are [`ReferenceGrads`](crate::cpu::reference::ReferenceGrads) (`T = f64`).
#[derive(Debug, Clone, PartialEq)]
pub struct Gradients<T = f32> {
    /// dL/dx, N×H.
    pub dx: Vec<T>,
    /// dL/dw_ij = ⟨dY_i, FFN_{e_ij}(x_i)⟩, N×k: what an upstream router trains on.
    pub d_weights: Vec<T>,
    /// dL/dW_gate of the native experts, M·H·I (the reference's: all E, E·H·I).
    pub d_gate: Vec<T>,
    /// dL/dW_up, M·H·I (E·H·I).
    pub d_up: Vec<T>,
    /// dL/dW_down, M·I·H (E·I·H).
    pub d_down: Vec<T>,
}

impl<T: HeapSize> HeapSize for Gradients<T> {
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
