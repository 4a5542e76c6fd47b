//! The fused op's transient memory against candle's materialized path, measured with the
//! counting allocator: one forward + backward at N = 4096, D = 512, V = 32768 (f32). The
//! gradients dX and dW are outputs under both and are not counted; everything else is (logits,
//! softmax, their gradients and candle's intermediate gradients on one side; the plan's working
//! set, per-token state and the copied targets on the other).
//!
//! Asserts: the fused peak ≤ 15% of the materialized one, and ≤ ring-dtp's bound for the plan
//! (working set + per-token state + GEMM packing) plus this crate's per-token copies plus what
//! candle's autograd adds around any op's backward: the op's gradients (`(N·D + V·D)·4` B, which
//! ring-dtp writes once) are added into a `zeros_like` tensor of the same size (candle's
//! `GradStore::or_insert` then `add`), so both are transient beside the accumulated output.

use candle_core::{Device, Tensor, Var};
use flatpeak_candle::{LossOptions, linear_cross_entropy};
use flatpeak_common::{CountingAllocator, HeapSize, PeakMeter, SplitMix64};
use ring_dtp::{DType, Plan, Shape};

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

const N: usize = 4096;
const D: usize = 512;
const V: usize = 32768;

/// Bytes per token this crate adds to ring-dtp's: targets as i64 (8), the saved lse (4), the
/// loss or its upstream gradient on the host (4 + 4).
const CRATE_PER_TOKEN_BYTES: usize = 20;
/// Candle's bookkeeping for a handful of tensors and the graph walk.
const SLACK: usize = 256 << 10;

/// The gradients a training step keeps: outputs, not working set.
struct Grads(Vec<Tensor>);

impl HeapSize for Grads {
    fn heap_bytes(&self) -> usize {
        self.0.iter().map(|t| t.elem_count() * t.dtype().size_in_bytes()).sum()
    }
}

fn main() {
    let mut rng = SplitMix64::new(2026);
    let x = Var::from_vec(rng.normal_f32(N * D, 0.0, 1.0), (N, D), &Device::Cpu).unwrap();
    let w = Var::from_vec(rng.normal_f32(V * D, 0.0, 0.05), (V, D), &Device::Cpu).unwrap();
    let targets: Vec<u32> = (0..N).map(|_| rng.below(V as u64) as u32).collect();
    let targets = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
    let options = LossOptions::default();

    let grads_of = |loss: Tensor| {
        let mut store = loss.backward().unwrap();
        Grads(vec![store.remove(x.as_tensor()).unwrap(), store.remove(w.as_tensor()).unwrap()])
    };
    let fused = PeakMeter::measure(|| {
        grads_of(linear_cross_entropy(x.as_tensor(), w.as_tensor(), &targets, &options).unwrap())
    })
    .unwrap();
    let materialized = PeakMeter::measure(|| {
        let logits = x.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap();
        grads_of(candle_nn::loss::cross_entropy(&logits, &targets).unwrap())
    })
    .unwrap();

    let plan = Plan::new(
        &options.config,
        Shape { tokens: N, hidden: D, vocab: V, dtype: DType::F32 },
        options.budget.of(ring_dtp::Device::Cpu),
    )
    .unwrap();
    let bound = plan.workspace_bytes()
        + plan.per_token_bytes()
        + plan.row_scratch_bytes()
        + plan.cpu_gemm_scratch_bytes()
        + N * CRATE_PER_TOKEN_BYTES
        + 2 * (N * D + V * D) * 4
        + SLACK;
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let ratio = fused.peak_bytes as f64 / materialized.peak_bytes as f64;
    println!(
        "candle_peak N={N} D={D} V={V} f32: fused {:.1} MiB (bound {:.1} MiB), candle materialized {:.1} MiB, ratio {:.1}%",
        mib(fused.peak_bytes),
        mib(bound),
        mib(materialized.peak_bytes),
        100.0 * ratio
    );
    assert!(fused.peak_bytes <= bound, "fused peak {} B > bound {bound} B", fused.peak_bytes);
    assert!(
        ratio <= 0.15,
        "fused peak is {:.1}% of candle's materialized path (target ≤ 15%)",
        100.0 * ratio
    );
}
