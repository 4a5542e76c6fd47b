//! Seeded inputs of the `llep` measurements (report rows and benches): every rank's tokens, dY
//! and routing weights, and all E experts' weights, independent of the routing profile.

use flatpeak_common::SplitMix64;
use llep::{ExpertWeights, RankInputs, Routing, Shape};

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
