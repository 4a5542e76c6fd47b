//! ring-dtp benches: forward + backward of the blocked single-device path against materialized
//! logits, and the weight and activation rings on P = 4 LocalGroup ranks, at a reduced shape
//! (N = 2048, D = 256, V = 8192). `cargo bench -p flatpeak-bench --bench ring_dtp`; the paper-style
//! comparison at N = 8192, D = 1024, V = 32768 is `flatpeak report --component ring-dtp`.

use criterion::{Criterion, criterion_group, criterion_main};
use flatpeak_bench::components::ring_dtp::materialized;
use flatpeak_common::{Communicator, DType, LocalGroup, LocalGroupOptions, SplitMix64};
use ring_dtp::ring::{self, RankInputs};
use ring_dtp::{GradOutput, Inputs, LinearCrossEntropy, Matrix, Plan, RingKind, RingOptions, RingPlan, cpu};

const N: usize = 2048;
const D: usize = 256;
const V: usize = 8192;

fn data() -> (Vec<f32>, Vec<f32>, Vec<i64>) {
    let mut rng = SplitMix64::new(3);
    let x = rng.normal_f32(N * D, 0.0, 1.0);
    let w = rng.normal_f32(V * D, 0.0, 1.0 / (D as f32).sqrt());
    let targets = (0..N).map(|_| rng.below(V as u64) as i64).collect();
    (x, w, targets)
}

fn single_device(c: &mut Criterion) {
    let (x, w, targets) = data();
    let config = LinearCrossEntropy::default();
    let inputs = Inputs::new(Matrix::F32(&x), Matrix::F32(&w), &targets, N, D, V);
    let mut group = c.benchmark_group("ring_dtp_N2048_D256_V8192_P1_f32");
    group.sample_size(10);
    group.bench_function("materialized", |b| b.iter(|| materialized(&x, &w, &targets, (N, D, V))));
    for (name, budget) in [("fused_full_vocab", 64usize << 20), ("vocab_blocked", 1 << 20)] {
        let plan = Plan::new(&config, N, D, V, DType::F32, budget).expect("plan");
        group.bench_function(name, |b| {
            b.iter(|| cpu::forward_backward(&config, &plan, &inputs, GradOutput::Scalar(1.0)).expect("runs"))
        });
    }
    group.finish();
}

fn rings(c: &mut Criterion) {
    let (x, w, targets) = data();
    let config = LinearCrossEntropy::default();
    let p = 4;
    let mut group = c.benchmark_group("ring_dtp_N2048_D256_V8192_P4_f32");
    group.sample_size(10);
    for kind in [RingKind::Weight, RingKind::Activation] {
        let options = RingOptions::with_budget(4 << 20).ring(kind);
        let plan = RingPlan::new(&config, (N, D, V), p, DType::F32, options).expect("plan");
        group.bench_function(format!("{kind:?}"), |b| {
            b.iter(|| {
                LocalGroup::run(p, LocalGroupOptions::default(), |comm| {
                    let (t, s) = (plan.tokens(comm.rank()), plan.shard(comm.rank()));
                    let inputs = RankInputs::new(
                        Matrix::F32(&x[t.start * D..t.end * D]),
                        Matrix::F32(&w[s.start * D..s.end * D]),
                        &targets[t],
                    );
                    Ok(ring::forward_backward(comm, &config, &plan, &inputs, GradOutput::Scalar(1.0)))
                })
            })
        });
    }
    group.finish();
}

/// On a GPU host: forward + backward at N = 8192, D = 1024, V = 32768 (f32) through the device
/// schedule: vocabulary blocks within an 8 MiB budget against 1024-token blocks over the whole
/// vocabulary (a 128 MiB logits block), same kernels and cuBLAS: what blocking costs on a GPU.
#[cfg(feature = "cuda")]
fn cuda_blocked_vs_one_block(c: &mut Criterion) {
    use ring_dtp::cuda::{CudaLinearCrossEntropy, DeviceInputs, DeviceMatrix};
    if !flatpeak_common::cuda_available() {
        eprintln!("cuda_blocked_vs_one_block: skipped, no CUDA device");
        return;
    }
    let (n, d, v) = (8192usize, 1024usize, 32768usize);
    let mut rng = SplitMix64::new(5);
    let x = rng.normal_f32(n * d, 0.0, 1.0);
    let w = rng.normal_f32(v * d, 0.0, 1.0 / (d as f32).sqrt());
    let targets: Vec<i64> = (0..n).map(|_| rng.below(v as u64) as i64).collect();
    let config = LinearCrossEntropy::default();
    let mut group = c.benchmark_group("cuda/ring_dtp_N8192_D1024_V32768_f32");
    group.sample_size(10);
    for (name, budget) in [("blocked_8MiB", 8usize << 20), ("full_vocab_128MiB", 160 << 20)] {
        let plan = Plan::new(&config, n, d, v, DType::F32, budget).expect("plan");
        let mut lce = CudaLinearCrossEntropy::new(config, plan, 0).expect("device");
        let s = lce.stream().clone();
        let (xd, wd, td) =
            (s.clone_htod(&x).expect("x"), s.clone_htod(&w).expect("w"), s.clone_htod(&targets).expect("t"));
        let inputs = DeviceInputs {
            x: DeviceMatrix::F32(&xd),
            w: DeviceMatrix::F32(&wd),
            bias: None,
            targets: &td,
            weights: None,
            n,
            d,
            v,
        };
        group.bench_function(name, |b| {
            b.iter(|| {
                let f = lce.forward(&inputs).expect("forward");
                let g = lce.backward(&inputs, &f, GradOutput::Scalar(1.0), None).expect("backward");
                s.synchronize().expect("sync");
                g
            })
        });
    }
    group.finish();
}

#[cfg(not(feature = "cuda"))]
fn cuda_blocked_vs_one_block(_: &mut Criterion) {}

criterion_group!(benches, single_device, rings, cuda_blocked_vs_one_block);
criterion_main!(benches);
