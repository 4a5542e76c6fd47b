//! `ring-dtp` ring rows: P ranks on a `LocalGroup` (threads sharing this machine's cores), each
//! owning N/P tokens and V/P vocabulary rows, against the data-parallel baseline in which every
//! rank materializes its own tokens' fp32 logits and gradient against the whole vocabulary.
//! Times are the group's wall time with all P ranks running at once (total work on these
//! cores). Peaks are per rank: the ring's is the process-wide working set divided by P (its
//! buffers are reserved at launch, the same on every rank, so concurrency cannot hide any); the
//! baseline's is measured on one rank running alone, since concurrent ranks would not all reach
//! their peak at the same instant and the quotient would understate it.

use std::time::Instant;

use flatpeak_common::gemm::Threads;
use flatpeak_common::{Communicator, LocalGroup, LocalGroupOptions, PeakMeter, SplitMix64, relative_error};
use ring_dtp::cpu::reference;
use ring_dtp::{
    Config, Device, GradOutput, Gradients, Inputs, Loss, Matrix, RingKind, RingLinearCrossEntropy,
    RingOptions, RingPlan,
};

use super::ReportError;
use super::ring_dtp_baseline::{GemmEfficiency, PROBE_N, PROBE_REPS, ROUNDS, materialized};
use crate::machine::{GemmProbe, MachineInfo, median};
use crate::report::{Comparison, Row};

/// Per-rank working-set budget given to the ring plan.
pub const RING_BUDGET: usize = 32 << 20;

/// One ring workload: N tokens over P ranks, D, V, f32, the ring forced.
#[derive(Debug, Clone, Copy)]
pub struct RingWorkload {
    /// Tokens N (all ranks).
    pub n: usize,
    /// Hidden size D.
    pub d: usize,
    /// Vocabulary V.
    pub v: usize,
    /// Ranks P.
    pub p: usize,
    /// The ring.
    pub kind: RingKind,
}

impl RingWorkload {
    /// The report's workload string.
    pub fn describe(&self) -> String {
        let ring = match self.kind {
            RingKind::Weight => "weight ring",
            RingKind::Activation => "activation ring",
        };
        format!("N={} D={} V={} P={} f32 {ring} fwd+bwd", self.n, self.d, self.v, self.p)
    }
}

/// The measured ring workloads.
pub const RING_WORKLOADS: [RingWorkload; 2] = [
    RingWorkload { n: 8192, d: 1024, v: 32768, p: 4, kind: RingKind::Weight },
    RingWorkload { n: 8192, d: 1024, v: 32768, p: 4, kind: RingKind::Activation },
];

/// Runs one ring row.
pub fn ring_row(name: &str, w: RingWorkload, machine: &MachineInfo) -> Result<Row, ReportError> {
    let fail = |message: String| ReportError::workload(name, &w.describe(), message);
    let (n, d, v, p) = (w.n, w.d, w.v, w.p);
    let mut rng = SplitMix64::new(13);
    let x = rng.normal_f32(n * d, 0.0, 1.0);
    let wt = rng.normal_f32(v * d, 0.0, 1.0 / (d as f32).sqrt());
    let targets: Vec<i64> = (0..n).map(|_| rng.below(v as u64) as i64).collect();
    let config = Config::default();
    // The P ranks are threads sharing this machine's cores: each rank's GEMMs stay on its own
    // thread (P GEMMs each splitting its tiles over every core would only contend for them).
    let options = RingOptions::default().ring(w.kind).gemm_threads(Threads::Single);
    let plan = RingPlan::new(
        &config,
        ring_dtp::Shape { tokens: n, hidden: d, vocab: v, dtype: flatpeak_common::DType::F32 },
        ring_dtp::Budget::Bytes(RING_BUDGET),
        options.ranks(p),
    )
    .map_err(|e| fail(e.to_string()))?;
    let group = LocalGroupOptions::default();

    // Every rank: its tokens against the whole W, materialized (mean over its own tokens).
    let baseline = || {
        LocalGroup::run(p, group, |comm| {
            let t = plan.tokens(comm.rank());
            Ok(materialized(&x[t.start * d..t.end * d], &wt, &targets[t.clone()], (t.len(), d, v)))
        })
    };
    let ringed = || {
        LocalGroup::run(p, group, |comm| {
            let (t, s) = (plan.tokens(comm.rank()), plan.shard(comm.rank()));
            let inputs = Inputs::new(
                Matrix::F32(&x[t.start * d..t.end * d]),
                Matrix::F32(&wt[s.start * d..s.end * d]),
                &targets[t],
                d,
            );
            let ring = RingLinearCrossEntropy::new(plan, Device::Cpu);
            Ok(ring.and_then(|mut ring| ring.forward_backward(comm, &inputs, GradOutput::Scalar(1.0))))
        })
    };
    let t0 = plan.tokens(0);
    let alone = PeakMeter::measure(|| {
        materialized(&x[t0.start * d..t0.end * d], &wt, &targets[t0.clone()], (t0.len(), d, v)).1
    })
    .map_err(|e| fail(e.to_string()))?;
    let peak_base = alone.peak_bytes;
    drop(alone);
    let (mut t_base, mut t_ring, mut probes) = (Vec::new(), Vec::new(), Vec::new());
    let mut peak_ring = 0usize;
    let mut results = None;
    let mut probe = GemmProbe::new(PROBE_N);
    for _ in 0..ROUNDS {
        let start = Instant::now();
        let base = baseline();
        t_base.push(start.elapsed().as_secs_f64() * 1e3);
        let start = Instant::now();
        let ours = PeakMeter::measure(ringed).map_err(|e| fail(e.to_string()))?;
        t_ring.push(start.elapsed().as_secs_f64() * 1e3);
        peak_ring = peak_ring.max(ours.peak_bytes);
        let base: Vec<(f64, Gradients)> =
            base.into_iter().collect::<Result<_, _>>().map_err(|e| fail(e.to_string()))?;
        let mut ring_out = Vec::with_capacity(p);
        for r in ours.value {
            ring_out.push(r.map_err(|e| fail(e.to_string()))?.map_err(|e| fail(e.to_string()))?);
        }
        results = Some((base, ring_out));
        probes.push(probe.gflops(PROBE_REPS));
    }
    drop(probe);
    let Some((base, ring_out)) = results else { return Err(fail("no round ran".into())) };
    let flops = plan.gemm_flops_per_rank() * p as f64;
    let base_flops = 3.0 * 2.0 * (n * v * d) as f64;
    let efficiency = GemmEfficiency::of_rounds((flops, &t_ring), (base_flops, &t_base), &probes, machine);
    let (ms_base, ms_ring) = (median(&mut t_base), median(&mut t_ring));

    // Exactness. Every target is valid, so the global mean (its loss and gradient) is the
    // per-rank means' times n_r/N: the loss and dW summed over the ranks, dX row by row.
    let mut dx_ring = Vec::with_capacity(n * d);
    let mut dw_ring = Vec::with_capacity(v * d);
    for (_, g) in &ring_out {
        dx_ring.extend_from_slice(&g.dx);
        dw_ring.extend_from_slice(&g.dw);
    }
    let mut dx_base = Vec::with_capacity(n * d);
    let mut dw_base = vec![0f64; v * d];
    let mut loss_base = 0f64;
    for (r, (loss, g)) in base.iter().enumerate() {
        let share = plan.tokens(r).len() as f64 / n as f64;
        loss_base += loss * share;
        dx_base.extend(g.dx.iter().map(|&a| a as f64 * share));
        dw_base.iter_mut().zip(&g.dw).for_each(|(acc, &a)| *acc += a as f64 * share);
    }
    let err_dx = relative_error(&dx_ring, &dx_base);
    let err_dw = relative_error(&dw_ring, &dw_base);
    // The lse of rank 0's first 64 tokens against the f64 oracle over the whole vocabulary.
    let sub = 64.min(plan.tokens(0).len());
    let sub_inputs = Inputs::new(Matrix::F32(&x[..sub * d]), Matrix::F32(&wt), &targets[..sub], d);
    let oracle = reference::run(&sub_inputs, &config, GradOutput::Scalar(1.0), None)
        .map_err(|e| fail(e.to_string()))?;
    let err_lse = relative_error(&ring_out[0].0.lse[..sub], &oracle.lse);
    let Loss::Scalar(loss) = ring_out[0].0.loss else { return Err(fail("mean loss expected".into())) };
    let err_loss = (loss - loss_base).abs() / loss_base.abs().max(f64::MIN_POSITIVE);
    let max_rel_err = err_lse.max(err_dx).max(err_dw).max(err_loss);

    let mut metrics = efficiency.metrics();
    metrics.extend([
        ("gemms".to_string(), plan.gemms() as f64),
        ("ranks".to_string(), p as f64),
        ("token_block".to_string(), plan.token_block() as f64),
        ("vocab_block".to_string(), plan.vocab_block() as f64),
        ("plan_bound_bytes_per_rank".to_string(), plan.bound_bytes() as f64),
        ("rel_err_lse_vs_f64".to_string(), err_lse),
        ("rel_err_dx_vs_baseline".to_string(), err_dx),
        ("rel_err_dw_vs_baseline".to_string(), err_dw),
        ("rel_err_loss_vs_baseline".to_string(), err_loss),
    ]);
    let comparison = Comparison {
        peak_bytes_baseline: peak_base as u64,
        peak_bytes: (peak_ring / p) as u64,
        ms_baseline: ms_base,
        ms: ms_ring,
        max_rel_err,
        exact: max_rel_err <= 1e-5,
    };
    Ok(Row::new(name, &w.describe(), "materialized logits per data-parallel rank", comparison, metrics))
}
