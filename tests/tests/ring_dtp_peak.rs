//! ring-dtp memory bound, measured with the counting allocator: one forward + backward holds at
//! most the plan's workspace, `PER_TOKEN_BYTES` per token and the CPU GEMM's packing buffers
//! (outputs excluded), and that does not grow with N beyond the per-token term; the same for the
//! ring over P = 4 LocalGroup ranks against P × the ring plan's per-rank bound. A plain `main`,
//! so nothing else allocates.

use flatpeak_common::{Communicator, LocalGroup, LocalGroupOptions};
use flatpeak_common::{CountingAllocator, DType, PeakMeter, SplitMix64};
use ring_dtp::plan::{CPU_GEMM_SCRATCH_PER_THREAD, PER_TOKEN_BYTES};
use ring_dtp::{
    Budget, Config, Device, GradOutput, Inputs, Matrix, Plan, RingKind, RingLinearCrossEntropy, RingOptions,
    RingPlan, Shape, cpu,
};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// Token counts measured (the smaller, then the larger): the peak may grow between them by the
/// per-token term only. Hidden size and vocabulary are small enough that the debug-build test
/// runs in a minute or two, large enough that every budget below splits the vocabulary.
const TOKENS: [usize; 2] = [1024, 4096];
const HIDDEN: usize = 128;
const VOCAB: usize = 4096;

/// Bookkeeping besides workspace and per-token state: per-block column records and target
/// lists (≤ 20 B per token of a block) and rayon's job bookkeeping.
const SLACK: usize = 64 * 1024;

fn measure(n: usize, d: usize, v: usize, budget: usize, dtype: DType) -> (usize, Plan) {
    let mut rng = SplitMix64::new(n as u64);
    let x = rng.normal_f32(n * d, 0.0, 1.0);
    let w = rng.normal_f32(v * d, 0.0, 0.1);
    let (xb, wb): (Vec<half::bf16>, Vec<half::bf16>) = (
        x.iter().map(|&a| half::bf16::from_f32(a)).collect(),
        w.iter().map(|&a| half::bf16::from_f32(a)).collect(),
    );
    let targets: Vec<i64> =
        (0..n).map(|i| if i % 5 == 0 { -100 } else { rng.below(v as u64) as i64 }).collect();
    let config = Config::default();
    let plan = Plan::new(&config, Shape { tokens: n, hidden: d, vocab: v, dtype }, Budget::Bytes(budget))
        .expect("plan");
    let (xm, wm) = match dtype {
        DType::Bf16 => (Matrix::Bf16(&xb), Matrix::Bf16(&wb)),
        _ => (Matrix::F32(&x), Matrix::F32(&w)),
    };
    let inputs = Inputs::new(xm, wm, &targets, d);
    // Warm rayon's pool outside the measurement (a one-time cost).
    cpu::forward_backward(&plan, &inputs, GradOutput::Scalar(1.0)).expect("warm-up");
    let m = PeakMeter::measure(|| cpu::forward_backward(&plan, &inputs, GradOutput::Scalar(1.0)))
        .expect("counting allocator installed");
    assert!(m.value.is_ok());
    (m.peak_bytes, plan)
}

/// One ring forward + backward over P LocalGroup ranks: the process-wide peak (every rank, the
/// group's channels and threads), outputs excluded.
fn measure_ring(
    n: usize,
    d: usize,
    v: usize,
    p: usize,
    (budget, options): (Budget, RingOptions),
) -> (usize, RingPlan) {
    let mut rng = SplitMix64::new(n as u64 + 1);
    let x = rng.normal_f32(n * d, 0.0, 1.0);
    let w = rng.normal_f32(v * d, 0.0, 0.1);
    let targets: Vec<i64> =
        (0..n).map(|i| if i % 5 == 0 { -100 } else { rng.below(v as u64) as i64 }).collect();
    let config = Config::default();
    let plan = RingPlan::new(
        &config,
        Shape { tokens: n, hidden: d, vocab: v, dtype: DType::F32 },
        budget,
        options.ranks(p),
    )
    .expect("plan");
    let step = || {
        LocalGroup::run(p, LocalGroupOptions::default(), |comm| {
            let r = comm.rank();
            let (t, s) = (plan.tokens(r), plan.shard(r));
            let inputs = Inputs::new(
                Matrix::F32(&x[t.start * d..t.end * d]),
                Matrix::F32(&w[s.start * d..s.end * d]),
                &targets[t],
                d,
            );
            let ring = RingLinearCrossEntropy::new(plan, Device::Cpu);
            Ok(ring.and_then(|mut ring| ring.forward_backward(comm, &inputs, GradOutput::Scalar(1.0))))
        })
    };
    step();
    let m = PeakMeter::measure(step).expect("counting allocator installed");
    for r in &m.value {
        assert!(matches!(r, Ok(Ok(_))), "rank failed: {r:?}");
    }
    (m.peak_bytes, plan)
}

fn ring_bounds() -> usize {
    let (p, d, v) = (4, HIDDEN, VOCAB);
    let mut passed = 0;
    for kind in [RingKind::Weight, RingKind::Activation] {
        let options = (Budget::Bytes(4 << 20), RingOptions::default().ring(kind));
        let mut peaks = Vec::new();
        for n in TOKENS {
            let (peak, plan) = measure_ring(n, d, v, p, options);
            // Per rank: the plan's bound, its tokens' statistics and gradient scales, the CPU
            // GEMM's rank-thread buffers; once: the rayon pool's buffers, the group's channels.
            let per_rank = plan.bound_bytes() + plan.per_token_bytes() + plan.cpu_gemm_scratch_bytes();
            let bound = p * (per_rank + SLACK) + rayon::current_num_threads() * CPU_GEMM_SCRATCH_PER_THREAD;
            assert!(plan.bound_bytes() <= 4 << 20);
            assert!(peak <= bound, "N={n} P={p} {kind:?}: peak {peak} > bound {bound}");
            println!(
                "test ring_dtp_ring_peak_N{n}_P{p}_{kind:?} ... ok (peak {peak} B ≤ {p} × (plan bound {} + {} per-token + GEMM {}) + pool)",
                plan.bound_bytes(),
                plan.per_token_bytes(),
                plan.cpu_gemm_scratch_bytes()
            );
            peaks.push((peak, plan.bound_bytes()));
            passed += 1;
        }
        // The plan's bound grows with N only until the budget caps it (its chunks never exceed
        // a rank's tokens), so the peak may grow by P × that growth plus per-token state.
        // Which threads pack GEMM operands (each caches its own buffers) depends on how the
        // ranks' GEMMs meet on the shared pool, so that part may differ between two runs by up
        // to a rank's packing buffers each; everything else is per-token state.
        let growth = peaks[1].0.saturating_sub(peaks[0].0);
        let plan_growth = p * peaks[1].1.saturating_sub(peaks[0].1);
        assert!(
            growth
                <= plan_growth
                    + PER_TOKEN_BYTES * (TOKENS[1] - TOKENS[0])
                    + p * (SLACK + CPU_GEMM_SCRATCH_PER_THREAD),
            "{kind:?}: peak grew by {growth} B from N={} to {}",
            TOKENS[0],
            TOKENS[1]
        );
    }
    passed
}

fn main() {
    let mut passed = ring_bounds();
    for (budget, dtype) in
        [(64usize << 20, DType::F32), (2 << 20, DType::F32), (4 << 20, DType::Bf16), (64 << 20, DType::Bf16)]
    {
        let mut peaks = Vec::new();
        for n in TOKENS {
            let (peak, plan) = measure(n, HIDDEN, VOCAB, budget, dtype);
            let bound = plan.workspace_bytes()
                + plan.per_token_bytes()
                + plan.row_scratch_bytes()
                + plan.cpu_gemm_scratch_bytes()
                + SLACK;
            assert!(peak <= bound, "N={n} {dtype} {:?}: peak {peak} > bound {bound}", plan.schedule());
            assert!(plan.workspace_bytes() <= budget);
            println!(
                "test ring_dtp_peak_N{n}_{dtype}_{:?} ... ok (peak {peak} B ≤ workspace {} + {} per-token + slack)",
                plan.schedule(),
                plan.workspace_bytes(),
                plan.per_token_bytes()
            );
            peaks.push((peak, plan.workspace_bytes()));
            passed += 1;
        }
        // The workspace grows with N only until the budget caps it; past that, per-token state.
        let growth = peaks[1].0.saturating_sub(peaks[0].0);
        let plan_growth = peaks[1].1.saturating_sub(peaks[0].1);
        assert!(
            growth <= plan_growth + PER_TOKEN_BYTES * (TOKENS[1] - TOKENS[0]) + SLACK,
            "peak grew by {growth} B from N={} to {}",
            TOKENS[0],
            TOKENS[1]
        );
    }
    println!("test result: ok. {passed} passed; 0 failed; 0 ignored; 0 measured; 0 filtered out");
}
