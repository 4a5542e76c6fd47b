//! `ring-dtp` measurements: the blocked vocabulary projection + cross-entropy against
//! materializing fp32 logits and their fp32 gradient (same GEMM library), forward + backward,
//! the ring at P = 4 (`ring_dtp_ring.rs`), and a plan-only row with the per-rank bytes of naive, Megatron vocab-parallel, Cut
//! Cross-Entropy and Ring-DTP at the paper's scale.

use std::collections::BTreeMap;
use std::time::Instant;

use flatpeak_common::{DType, PeakMeter, SplitMix64, relative_error};
use half::bf16;
use rayon::prelude::*;
use ring_dtp::cpu::{self, reference};
use ring_dtp::paper::PaperPeaks;
use ring_dtp::{Bf16Kernel, Budget, Config, GradOutput, Inputs, Loss, Matrix, Plan, Shape};

pub use super::ring_dtp_baseline::{GemmEfficiency, PROBE_N, PROBE_REPS, ROUNDS, materialized};
use super::ring_dtp_ring::{RING_WORKLOADS, RingWorkload, ring_row};
use super::{Component, ReportError, workload};
use crate::machine::{GemmProbe, MachineInfo, median};
use crate::report::{Comparison, Row};

/// Working-set budget given to the plan (the schedule must fit it).
pub const BUDGET: usize = 256 << 20;

/// One measured workload: N tokens, D, V, one rank.
#[derive(Debug, Clone, Copy)]
pub struct Workload {
    /// Tokens N.
    pub n: usize,
    /// Hidden size D.
    pub d: usize,
    /// Vocabulary V.
    pub v: usize,
    /// Input dtype.
    pub dtype: DType,
}

impl Workload {
    /// The row's label; bf16 rows name the kernel their GEMMs ran on (this CPU's) and the
    /// default precision's rounding of the logit gradient G.
    pub fn describe(&self) -> String {
        let kernel = match (self.dtype, cpu::bf16_path(Bf16Kernel::Detect)) {
            (DType::Bf16, cpu::Bf16Path::Tiles) => " (GEMMs: AMX bf16 tiles, G rounded to bf16)",
            (DType::Bf16, cpu::Bf16Path::DotProducts) => " (GEMMs: bf16 dot products, G rounded to bf16)",
            (DType::Bf16, cpu::Bf16Path::Widened) => " (GEMMs: widened to f32, G rounded to bf16)",
            _ => "",
        };
        format!("N={} D={} V={} P=1 {} fwd+bwd{kernel}", self.n, self.d, self.v, self.dtype)
    }
}

/// The measured workloads, then the plan-only paper row.
pub const WORKLOADS: [Workload; 2] = [
    Workload { n: 8192, d: 1024, v: 32768, dtype: DType::F32 },
    Workload { n: 8192, d: 1024, v: 32768, dtype: DType::Bf16 },
];

/// The paper's shape for the plan-only row.
pub const PAPER: (usize, usize, usize, usize) = (32_768, 5_120, 152_064, 8);

/// The `flatpeak report` component.
#[derive(Debug, Clone, Copy, Default)]
pub struct RingDtpComponent;

impl RingDtpComponent {
    fn paper_row(&self) -> Row {
        let (n, d, v, p) = PAPER;
        let peaks = PaperPeaks::at(n, d, v, p);
        let metrics = BTreeMap::from([
            ("naive_bytes".to_string(), peaks.naive),
            ("megatron_vocab_parallel_bytes".to_string(), peaks.megatron),
            ("cut_cross_entropy_bytes".to_string(), peaks.cut_cross_entropy),
            ("ring_dtp_bytes".to_string(), peaks.ring_dtp),
            ("megatron_reduction".to_string(), 1.0 - peaks.megatron / peaks.naive),
            ("cut_cross_entropy_reduction".to_string(), 1.0 - peaks.cut_cross_entropy / peaks.naive),
        ]);
        Row::formula(
            self.name(),
            &format!("N={n} D={d} V={v} P={p} bf16 (plan only, per rank)"),
            "materialized logits (8 B/logit)",
            (peaks.naive as u64, peaks.ring_dtp as u64),
            metrics,
        )
    }
}

impl Component for RingDtpComponent {
    fn name(&self) -> &'static str {
        "ring-dtp"
    }

    fn workloads(&self) -> Vec<String> {
        let mut w: Vec<String> = WORKLOADS.iter().map(Workload::describe).collect();
        w.extend(RING_WORKLOADS.iter().map(RingWorkload::describe));
        let (n, d, v, p) = PAPER;
        w.push(format!("N={n} D={d} V={v} P={p} bf16 (plan only, per rank)"));
        w
    }

    /// The bf16 fused row and the formula row.
    fn quick(&self) -> Vec<usize> {
        vec![1, WORKLOADS.len() + RING_WORKLOADS.len()]
    }

    fn run(&self, index: usize, machine: &MachineInfo) -> Result<Row, ReportError> {
        if index == WORKLOADS.len() + RING_WORKLOADS.len() {
            return Ok(self.paper_row());
        }
        if let Some(i) = index.checked_sub(WORKLOADS.len()) {
            let ring = *workload(self.name(), &RING_WORKLOADS, i)?;
            return ring_row(self.name(), ring, machine);
        }
        let w = *workload(self.name(), &WORKLOADS, index)?;
        let fail = |message: String| ReportError::workload(self.name(), &w.describe(), message);
        let (n, d, v) = (w.n, w.d, w.v);
        let mut rng = SplitMix64::new(11);
        let x = rng.normal_f32(n * d, 0.0, 1.0);
        let wt = rng.normal_f32(v * d, 0.0, 1.0 / (d as f32).sqrt());
        let targets: Vec<i64> = (0..n).map(|_| rng.below(v as u64) as i64).collect();
        let (xb, wb): (Vec<bf16>, Vec<bf16>) = match w.dtype {
            DType::Bf16 => (
                x.iter().map(|&a| bf16::from_f32(a)).collect(),
                wt.iter().map(|&a| bf16::from_f32(a)).collect(),
            ),
            _ => (Vec::new(), Vec::new()),
        };
        // The baseline and the oracle see the same values the blocked path reads.
        let (x, wt) = match w.dtype {
            DType::Bf16 => (xb.iter().map(|a| a.to_f32()).collect(), wb.iter().map(|a| a.to_f32()).collect()),
            _ => (x, wt),
        };
        let inputs = match w.dtype {
            DType::Bf16 => Inputs::new(Matrix::Bf16(&xb), Matrix::Bf16(&wb), &targets, d),
            _ => Inputs::new(Matrix::F32(&x), Matrix::F32(&wt), &targets, d),
        };
        let config = Config::default();
        let plan = Plan::new(
            &config,
            Shape { tokens: n, hidden: d, vocab: v, dtype: w.dtype },
            Budget::Bytes(BUDGET),
        )
        .map_err(|e| fail(e.to_string()))?;

        let (mut t_base, mut t_ours, mut probes) = (Vec::new(), Vec::new(), Vec::new());
        let (mut peak_base, mut peak_ours) = (0usize, 0usize);
        let mut results = None;
        let mut probe = GemmProbe::new(PROBE_N);
        for _ in 0..ROUNDS {
            let start = Instant::now();
            let base = PeakMeter::measure(|| match w.dtype {
                // bf16 inputs: the baseline's f32 GEMM needs f32 copies of X and W, made once
                // per call (timed and counted, as in any framework that upcasts to materialize).
                DType::Bf16 => {
                    let widen = |m: &[bf16]| -> Vec<f32> { m.par_iter().map(|a| a.to_f32()).collect() };
                    let (x32, w32) = (widen(&xb), widen(&wb));
                    materialized(&x32, &w32, &targets, (n, d, v))
                }
                _ => materialized(&x, &wt, &targets, (n, d, v)),
            })
            .map_err(|e| fail(e.to_string()))?;
            t_base.push(start.elapsed().as_secs_f64() * 1e3);
            peak_base = peak_base.max(base.peak_bytes);
            let start = Instant::now();
            let ours = PeakMeter::measure(|| cpu::forward_backward(&plan, &inputs, GradOutput::Scalar(1.0)))
                .map_err(|e| fail(e.to_string()))?;
            t_ours.push(start.elapsed().as_secs_f64() * 1e3);
            peak_ours = peak_ours.max(ours.peak_bytes);
            results = Some((base.value, ours.value.map_err(|e| fail(e.to_string()))?));
            probes.push(probe.gflops(PROBE_REPS));
        }
        drop(probe);
        let Some(((base_loss, base), (fwd, grads))) = results else {
            return Err(fail("no round ran".into()));
        };
        let flops = plan.gemms_fused() as f64 * 2.0 * (n * v * d) as f64;
        let base_flops = 3.0 * 2.0 * (n * v * d) as f64;
        let efficiency = GemmEfficiency::of_rounds((flops, &t_ours), (base_flops, &t_base), &probes, machine);
        let (ms_base, ms_ours) = (median(&mut t_base), median(&mut t_ours));

        // Exactness: 64 tokens against the f64 oracle (their lse and dX rows), and the loss and
        // dW against the materialized f32 baseline (whose G is not rounded).
        let sub = 64;
        let sub_inputs = Inputs::new(Matrix::F32(&x[..sub * d]), Matrix::F32(&wt), &targets[..sub], d);
        // bf16 inputs round G to bf16 before dX and dW (Precision::Native): the oracle models
        // that, and the bound is the one the tests hold such rows to (tests/ring_dtp.rs).
        let (rounding, bound) = match w.dtype {
            DType::Bf16 => (reference::Rounding::Bf16Gradient, 1e-3),
            _ => (reference::Rounding::Exact, 1e-5),
        };
        let oracle = reference::run_rounded(
            &sub_inputs,
            &config,
            ring_dtp::Upstream::loss(GradOutput::Scalar(1.0)),
            rounding,
        )
        .map_err(|e| fail(e.to_string()))?;
        let scale = sub as f64 / n as f64; // mean over n vs over the subset
        let want_dx: Vec<f64> = oracle.dx.iter().map(|g| g * scale).collect();
        let err_lse = relative_error(&fwd.lse[..sub], &oracle.lse);
        let err_dx = relative_error(&grads.dx[..sub * d], &want_dx);
        let err_dw = relative_error(&grads.dw, &base.dw.iter().map(|&g| g as f64).collect::<Vec<_>>());
        let Loss::Scalar(loss) = fwd.loss else { return Err(fail("mean loss expected".into())) };
        let err_loss = (loss - base_loss).abs() / base_loss.abs().max(f64::MIN_POSITIVE);
        let max_rel_err = err_lse.max(err_dx).max(err_dw).max(err_loss);

        let mut metrics = efficiency.metrics();
        metrics.extend([
            ("gemms".to_string(), plan.gemms_fused() as f64),
            ("token_block".to_string(), plan.token_block() as f64),
            ("vocab_block".to_string(), plan.vocab_block() as f64),
            ("workspace_bytes".to_string(), plan.workspace_bytes() as f64),
            ("rel_err_lse_vs_f64".to_string(), err_lse),
            ("rel_err_dx_vs_f64".to_string(), err_dx),
            ("rel_err_dw_vs_baseline".to_string(), err_dw),
            ("rel_err_loss_vs_baseline".to_string(), err_loss),
        ]);
        let comparison = Comparison {
            peak_bytes_baseline: peak_base as u64,
            peak_bytes: peak_ours as u64,
            ms_baseline: ms_base,
            ms: ms_ours,
            max_rel_err,
            exact: max_rel_err <= bound,
        };
        Ok(Row::new(self.name(), &w.describe(), "materialized logits", comparison, metrics))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn efficiency_divides_each_round_by_its_own_probe() {
        // The machine runs at 300 then 400 then 300 GFLOP/s; the schedule at 0.9 of it.
        let probes = [300.0, 400.0, 300.0];
        let flops = 1.2e12;
        let t: Vec<f64> = probes.iter().map(|p| flops / (0.9 * p * 1e9) * 1e3).collect();
        let t_base: Vec<f64> = probes.iter().map(|p| flops / (0.6 * p * 1e9) * 1e3).collect();
        let machine = MachineInfo { cpus: 2, copy_gbps: 40.0, gemm_f32_gflops: 400.0 };
        let e = GemmEfficiency::of_rounds((flops, &t), (flops, &t_base), &probes, &machine);
        assert!((e.ours - 0.9).abs() < 1e-12 && (e.baseline - 0.6).abs() < 1e-12, "{e:?}");
        assert_eq!(e.probe_gflops, 300.0);
        // Against the header's 400 GFLOP/s, the median round (at 300) reads 0.9·300/400.
        assert!((e.ours_vs_machine_line - 0.675).abs() < 1e-12, "{e:?}");
        assert_eq!(e.metrics().len(), 5);
    }
}
