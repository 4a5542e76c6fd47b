//! ring-dtp memory bound, measured with the counting allocator: one forward + backward holds at
//! most the plan's workspace, `PER_TOKEN_BYTES` per token and the CPU GEMM's packing buffers
//! (outputs excluded), and that does not grow with N beyond the per-token term. A plain `main`, so nothing else allocates.

use flatpeak_common::{CountingAllocator, DType, PeakMeter, SplitMix64};
use ring_dtp::plan::PER_TOKEN_BYTES;
use ring_dtp::{GradOutput, Inputs, LinearCrossEntropy, Matrix, Plan, cpu};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

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
    let config = LinearCrossEntropy::default();
    let plan = Plan::new(&config, n, d, v, dtype, budget).expect("plan");
    let (xm, wm) = match dtype {
        DType::Bf16 => (Matrix::Bf16(&xb), Matrix::Bf16(&wb)),
        _ => (Matrix::F32(&x), Matrix::F32(&w)),
    };
    let inputs = Inputs::new(xm, wm, &targets, n, d, v);
    // Warm rayon's pool outside the measurement (a one-time cost).
    cpu::forward_backward(&config, &plan, &inputs, GradOutput::Scalar(1.0)).expect("warm-up");
    let m = PeakMeter::measure(|| cpu::forward_backward(&config, &plan, &inputs, GradOutput::Scalar(1.0)))
        .expect("counting allocator installed");
    assert!(m.value.is_ok());
    (m.peak_bytes, plan)
}

fn main() {
    let mut passed = 0;
    for (budget, dtype) in [(64usize << 20, DType::F32), (2 << 20, DType::F32), (4 << 20, DType::Bf16)] {
        let mut peaks = Vec::new();
        for n in [1024usize, 8192] {
            let (peak, plan) = measure(n, 256, 8192, budget, dtype);
            let bound =
                plan.workspace_bytes() + plan.per_token_bytes() + plan.cpu_gemm_scratch_bytes() + SLACK;
            assert!(peak <= bound, "N={n} {dtype} {:?}: peak {peak} > bound {bound}", plan.schedule());
            assert!(plan.workspace_bytes() <= budget);
            println!(
                "test ring_dtp_peak_N{n}_{dtype}_{:?} ... ok (peak {peak} B ≤ workspace {} + {} per-token + slack)",
                plan.schedule(),
                plan.workspace_bytes(),
                plan.per_token_bytes()
            );
            peaks.push(peak);
            passed += 1;
        }
        let growth = peaks[1].saturating_sub(peaks[0]);
        assert!(
            growth <= PER_TOKEN_BYTES * (8192 - 1024) + SLACK,
            "peak grew by {growth} B from N=1024 to 8192"
        );
    }
    println!("test result: ok. {passed} passed; 0 failed; 0 ignored; 0 measured; 0 filtered out");
}
