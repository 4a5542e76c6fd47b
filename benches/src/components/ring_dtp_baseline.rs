//! What the `ring-dtp` rows (one device and the rings) measure against: the materialized
//! baseline (fp32 logits and their gradient, the same GEMM library) and the GEMM efficiency of a
//! schedule and its baseline, each round's time over that round's GEMM-rate probe.

use std::collections::BTreeMap;

use flatpeak_common::gemm::{MatMut, MatRef, MatmulOptions, matmul};
use rayon::prelude::*;
use ring_dtp::Gradients;

use crate::machine::{MachineInfo, median};

fn gemm(dst: MatMut<'_, f32>, a: MatRef<'_, f32>, b: MatRef<'_, f32>) {
    matmul(dst, a, b, MatmulOptions::default()).expect("baseline shapes agree");
}

/// The baseline: fp32 logits N×V and their fp32 gradient N×V, mean cross-entropy, then
/// dX = G·W and dW = Gᵀ·X (the same GEMM library as the blocked path).
pub fn materialized(
    x: &[f32],
    w: &[f32],
    targets: &[i64],
    (n, d, v): (usize, usize, usize),
) -> (f64, Gradients) {
    let mut logits = vec![0f32; n * v];
    gemm(
        MatMut::row_major(&mut logits, n, v).expect("shape"),
        MatRef::row_major(x, n, d).expect("shape"),
        MatRef::row_major(w, v, d).expect("shape").t(),
    );
    let valid = targets.iter().filter(|&&t| t >= 0).count().max(1) as f64;
    let mut grad = vec![0f32; n * v];
    let losses: Vec<f64> = grad
        .par_chunks_mut(v)
        .zip(logits.par_chunks(v))
        .zip(targets.par_iter())
        .map(|((g, z), &t)| {
            let m = z.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let s: f64 = z.iter().map(|&zj| ((zj - m).exp()) as f64).sum();
            let lse = m as f64 + s.ln();
            if t < 0 {
                return 0.0;
            }
            let c = (1.0 / valid) as f32;
            for (gj, &zj) in g.iter_mut().zip(z) {
                *gj = c * ((zj as f64 - lse).exp() as f32);
            }
            g[t as usize] -= c;
            lse - z[t as usize] as f64
        })
        .collect();
    drop(logits);
    let mut dx = vec![0f32; n * d];
    let mut dw = vec![0f32; v * d];
    let g = MatRef::row_major(&grad, n, v).expect("shape");
    gemm(MatMut::row_major(&mut dx, n, d).expect("shape"), g, MatRef::row_major(w, v, d).expect("shape"));
    gemm(MatMut::row_major(&mut dw, v, d).expect("shape"), g.t(), MatRef::row_major(x, n, d).expect("shape"));
    (losses.iter().sum::<f64>() / valid, Gradients { dx, dw, dbias: None })
}

/// Edge of the GEMM-rate probe run after each round (the `flatpeak machine` product).
pub const PROBE_N: usize = 2048;
/// Products per probe; the best is kept, as `flatpeak machine` does.
pub const PROBE_REPS: usize = 3;
/// Measured rounds per row (baseline, then the schedule, then the probe): five, so the median
/// of the per-round efficiencies rides out one or two disturbed rounds on a shared machine.
pub const ROUNDS: usize = 5;

/// `gemm_efficiency` of a schedule and of its baseline: GEMM FLOPs ÷ time ÷ the machine's f32
/// GEMM rate. The rate is probed after every round (this VM's drifts by ±10% over minutes,
/// more than the effects measured), each round's times are divided by that round's probe, and
/// the median over rounds is reported; the quotient by the header's once-per-run figure is
/// kept beside it (`*_vs_machine_line`).
#[derive(Debug, Clone, PartialEq)]
pub struct GemmEfficiency {
    /// Median over rounds of the schedule's rate ÷ that round's probe.
    pub ours: f64,
    /// The same for the baseline.
    pub baseline: f64,
    /// Median of the probes (GFLOP/s).
    pub probe_gflops: f64,
    /// The schedule's median rate ÷ the report header's GEMM rate.
    pub ours_vs_machine_line: f64,
    /// The baseline's median rate ÷ the report header's GEMM rate.
    pub baseline_vs_machine_line: f64,
}

impl GemmEfficiency {
    /// From each round's times (ms) of the schedule and the baseline with their GEMM FLOPs, and
    /// the probe (GFLOP/s) measured after each round.
    pub fn of_rounds(
        (flops, t_ours): (f64, &[f64]),
        (base_flops, t_base): (f64, &[f64]),
        probes: &[f64],
        machine: &MachineInfo,
    ) -> Self {
        let rate = |f: f64, ms: f64| f / (ms / 1e3) / 1e9;
        let per_round = |f: f64, t: &[f64]| -> f64 {
            let mut r: Vec<f64> = t.iter().zip(probes).map(|(&ms, &p)| rate(f, ms) / p).collect();
            median(&mut r)
        };
        let (mut t_ours, mut t_base) = (t_ours.to_vec(), t_base.to_vec());
        Self {
            ours: per_round(flops, &t_ours),
            baseline: per_round(base_flops, &t_base),
            probe_gflops: median(&mut probes.to_vec()),
            ours_vs_machine_line: rate(flops, median(&mut t_ours)) / machine.gemm_f32_gflops,
            baseline_vs_machine_line: rate(base_flops, median(&mut t_base)) / machine.gemm_f32_gflops,
        }
    }

    /// The report metrics.
    pub fn metrics(&self) -> BTreeMap<String, f64> {
        BTreeMap::from([
            ("gemm_efficiency".to_string(), self.ours),
            ("gemm_efficiency_baseline".to_string(), self.baseline),
            ("gemm_probe_gflops".to_string(), self.probe_gflops),
            ("gemm_efficiency_vs_machine_line".to_string(), self.ours_vs_machine_line),
            ("gemm_efficiency_baseline_vs_machine_line".to_string(), self.baseline_vs_machine_line),
        ])
    }
}
