//! What the `llep` measurements (report rows and benches) run: the measured shape, seeded inputs
//! (every rank's tokens, dY and routing weights, and all E experts' weights, independent of the
//! routing profile), the phases measured and a rank's outcome of one step.

use std::time::Instant;

use flatpeak_common::{DType, HeapSize, SplitMix64};
use llep::{ExpertWeights, Gradients, RankInputs, Routing, Schedule, Shape, bf16};

/// Seeded inputs of every rank: tokens, dY, routing weights and all E experts' weights.
#[derive(Debug)]
pub struct Data {
    pub(super) x: Vec<Vec<f32>>,
    pub(super) dy: Vec<Vec<f32>>,
    pub(super) weights: Vec<Vec<f32>>,
    pub(super) gate: Vec<f32>,
    pub(super) up: Vec<f32>,
    pub(super) down: Vec<f32>,
}

impl Data {
    /// The inputs at `shape` (seeded, routing-independent).
    pub fn new(shape: &Shape) -> Self {
        let (p, n, h, i, e, k) =
            (shape.ranks, shape.tokens, shape.hidden, shape.intermediate, shape.experts, shape.top_k);
        let mut rng = SplitMix64::new(0x11E9);
        let x = (0..p).map(|_| rng.normal_f32(n * h, 0.0, 1.0)).collect();
        let dy = (0..p).map(|_| rng.normal_f32(n * h, 0.0, 1.0)).collect();
        let weights = (0..p).map(|s| llep::paper::routing_weights(n, k, 77 + s as u64)).collect();
        let gate = rng.normal_f32(e * h * i, 0.0, 1.0 / (h as f32).sqrt());
        let up = rng.normal_f32(e * h * i, 0.0, 1.0 / (h as f32).sqrt());
        let down = rng.normal_f32(e * i * h, 0.0, 1.0 / (i as f32).sqrt());
        Self { x, dy, weights, gate, up, down }
    }

    /// Rank s's inputs with these ids.
    pub fn inputs<'a>(&'a self, shape: &Shape, s: usize, ids: &'a [i64]) -> RankInputs<'a> {
        let len = shape.local_experts() * shape.hidden * shape.intermediate;
        RankInputs {
            x: &self.x[s],
            routing: Routing { ids, weights: &self.weights[s] },
            experts: ExpertWeights {
                gate: &self.gate[s * len..(s + 1) * len],
                up: &self.up[s * len..(s + 1) * len],
                down: &self.down[s * len..(s + 1) * len],
            },
        }
    }

    /// rank s's dY.
    pub fn dy(&self, s: usize) -> &[f32] {
        &self.dy[s]
    }
}

impl Data {
    /// These inputs with every tensor but the routing weights rounded to bf16 (kept as f32):
    /// the references' inputs of the bf16 rows.
    pub fn rounded_to_bf16(&self) -> Data {
        let round = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect::<Vec<f32>>();
        Data {
            x: self.x.iter().map(|v| round(v)).collect(),
            dy: self.dy.iter().map(|v| round(v)).collect(),
            weights: self.weights.clone(),
            gate: round(&self.gate),
            up: round(&self.up),
            down: round(&self.down),
        }
    }
}

/// The bf16 copies of [`Data`]'s tokens, dY and expert weights (routing weights stay f32).
#[derive(Debug)]
pub struct Bf16Data {
    x: Vec<Vec<bf16>>,
    dy: Vec<Vec<bf16>>,
    gate: Vec<bf16>,
    up: Vec<bf16>,
    down: Vec<bf16>,
}

impl Bf16Data {
    /// `data` rounded to bf16.
    pub fn new(data: &Data) -> Self {
        let narrow = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<bf16>>();
        Self {
            x: data.x.iter().map(|v| narrow(v)).collect(),
            dy: data.dy.iter().map(|v| narrow(v)).collect(),
            gate: narrow(&data.gate),
            up: narrow(&data.up),
            down: narrow(&data.down),
        }
    }

    /// Rank s's bf16 inputs with these ids and `weights` (f32 routing weights).
    pub fn inputs<'a>(
        &'a self,
        shape: &Shape,
        s: usize,
        ids: &'a [i64],
        weights: &'a [f32],
    ) -> RankInputs<'a, bf16> {
        let len = shape.local_experts() * shape.hidden * shape.intermediate;
        RankInputs {
            x: &self.x[s],
            routing: Routing { ids, weights },
            experts: ExpertWeights {
                gate: &self.gate[s * len..(s + 1) * len],
                up: &self.up[s * len..(s + 1) * len],
                down: &self.down[s * len..(s + 1) * len],
            },
        }
    }

    /// Rank s's dY in bf16.
    pub fn dy(&self, s: usize) -> &[bf16] {
        &self.dy[s]
    }
}

/// The measured shape: P = 8 ranks, N = 4096 tokens per rank, H = 512, I = 256, E = 64, k = 8
/// (f32; the bf16 rows run it with `dtype: Bf16`).
pub const SHAPE: Shape = Shape {
    ranks: 8,
    tokens: 4096,
    hidden: 512,
    intermediate: 256,
    experts: 64,
    top_k: 8,
    dtype: DType::F32,
};

/// What one measured row runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Checkpointed training step: plan, forward, then recompute + backward.
    TrainingStep,
    /// Schedule and forward only (what LLEP's harness measures).
    ForwardOnly,
}

/// One rank's outcome of one step.
#[derive(Debug)]
pub struct RankOut {
    /// The layer's output.
    pub y: Vec<f32>,
    /// The gradients (training step only).
    pub grads: Option<Gradients>,
    /// Wall clock at the step's start (after the barrier) and end.
    pub span: (Instant, Instant),
    /// The rank thread's CPU time during the step, ms.
    pub cpu_ms: f64,
    /// The rank's plan.
    pub plan: Schedule,
}

impl HeapSize for RankOut {
    /// The step's outputs only (the plan is the step's own transient state).
    fn heap_bytes(&self) -> usize {
        self.y.heap_bytes() + self.grads.as_ref().map_or(0, HeapSize::heap_bytes)
    }
}
