//! ring-dtp benches: forward + backward of the blocked single-device path against materialized
//! logits (f32, and bf16 inputs), and the weight and activation rings on P = 4 LocalGroup ranks,
//! at a reduced shape (N = 2048, D = 256, V = 8192). `cargo bench -p flatpeak-bench --bench
//! ring_dtp`; the paper-style comparison at N = 8192, D = 1024, V = 32768 is
//! `flatpeak report --component ring-dtp`.

use criterion::{Criterion, criterion_group, criterion_main};
use flatpeak_bench::components::ring_dtp::materialized;
use flatpeak_common::{Communicator, DType, LocalGroup, LocalGroupOptions, SplitMix64};
use half::bf16;
use rayon::prelude::*;
use ring_dtp::{
    Budget, Config, Device, GradOutput, Inputs, Matrix, Plan, RingKind, RingLinearCrossEntropy, RingOptions,
    RingPlan, Shape, cpu,
};

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
    let config = Config::default();
    let inputs = Inputs::new(Matrix::F32(&x), Matrix::F32(&w), &targets, D);
    let mut group = c.benchmark_group("ring_dtp_N2048_D256_V8192_P1_f32");
    group.sample_size(10);
    group.bench_function("materialized", |b| b.iter(|| materialized(&x, &w, &targets, (N, D, V))));
    for (name, budget) in [("fused_full_vocab", 64usize << 20), ("vocab_blocked", 1 << 20)] {
        let plan = Plan::new(
            &config,
            Shape { tokens: N, hidden: D, vocab: V, dtype: DType::F32 },
            Budget::Bytes(budget),
        )
        .expect("plan");
        group.bench_function(name, |b| {
            b.iter(|| cpu::forward_backward(&plan, &inputs, GradOutput::Scalar(1.0)).expect("runs"))
        });
    }
    group.finish();

    // bf16 inputs: the baseline widens X and W to f32 once per call (as the report's row does),
    // the blocked path widens per block.
    let (xb, wb): (Vec<bf16>, Vec<bf16>) =
        (x.iter().map(|&a| bf16::from_f32(a)).collect(), w.iter().map(|&a| bf16::from_f32(a)).collect());
    let inputs = Inputs::new(Matrix::Bf16(&xb), Matrix::Bf16(&wb), &targets, D);
    let mut group = c.benchmark_group("ring_dtp_N2048_D256_V8192_P1_bf16");
    group.sample_size(10);
    group.bench_function("materialized", |b| {
        b.iter(|| {
            let widen = |m: &[bf16]| -> Vec<f32> { m.par_iter().map(|a| a.to_f32()).collect() };
            materialized(&widen(&xb), &widen(&wb), &targets, (N, D, V))
        })
    });
    let plan = Plan::new(
        &config,
        Shape { tokens: N, hidden: D, vocab: V, dtype: DType::Bf16 },
        Budget::Bytes(64 << 20),
    )
    .expect("plan");
    group.bench_function("fused_full_vocab", |b| {
        b.iter(|| cpu::forward_backward(&plan, &inputs, GradOutput::Scalar(1.0)).expect("runs"))
    });
    group.finish();
}

fn rings(c: &mut Criterion) {
    let (x, w, targets) = data();
    let config = Config::default();
    let p = 4;
    let mut group = c.benchmark_group("ring_dtp_N2048_D256_V8192_P4_f32");
    group.sample_size(10);
    for kind in [RingKind::Weight, RingKind::Activation] {
        let (budget, options) = (Budget::Bytes(4 << 20), RingOptions::default().ring(kind));
        let plan = RingPlan::new(
            &config,
            Shape { tokens: N, hidden: D, vocab: V, dtype: DType::F32 },
            budget,
            options.ranks(p),
        )
        .expect("plan");
        group.bench_function(format!("{kind:?}"), |b| {
            b.iter(|| {
                LocalGroup::run(p, LocalGroupOptions::default(), |comm| {
                    let (t, s) = (plan.tokens(comm.rank()), plan.shard(comm.rank()));
                    let inputs = Inputs::new(
                        Matrix::F32(&x[t.start * D..t.end * D]),
                        Matrix::F32(&w[s.start * D..s.end * D]),
                        &targets[t],
                        D,
                    );
                    let ring = RingLinearCrossEntropy::new(plan, Device::Cpu);
                    Ok(ring
                        .and_then(|mut ring| ring.forward_backward(comm, &inputs, GradOutput::Scalar(1.0))))
                })
            })
        });
    }
    group.finish();
}

/// On a GPU host, at N = 8192, D = 1024, V = 32768: cuBLAS SGEMM and the bf16 tensor-core GEMM
/// (`gemm_bf16`) at 8192³ (the device's two GEMM ceilings), then forward + backward through the
/// device schedule at several block shapes — all 8192 tokens over the whole vocabulary (the
/// materialized-logits shape, gradient in place), 1024 and 256 tokens over the whole vocabulary
/// (fused: 3 GEMMs; also 1024 called as forward then backward: 4 GEMMs), vocabulary blocks
/// within an 8 MiB budget (4 GEMMs); bf16 inputs under the default precision (tensor cores) and
/// under `Precision::F32` (widened, SGEMM); f32 inputs under `Precision::Tf32` (tensor cores,
/// not exact: its ratio to the SGEMM probe shows what TF32 buys). Throughput is in GEMM FLOPs per second, so an f32
/// row's ratio to the SGEMM probe, and a `bf16_native` row's to the bf16 probe, is its
/// `gemm_efficiency` on this device; each row prints its plan's block bytes.
#[cfg(feature = "cuda")]
fn cuda_blocked_vs_one_block(c: &mut Criterion) {
    use criterion::Throughput;
    use flatpeak_common::cuda::SquareOperands;
    use flatpeak_common::cuda::cudarc::cublas::CudaBlas;
    use ring_dtp::Precision;
    use ring_dtp::cuda::{DeviceInputs, DeviceMatrix};
    if !flatpeak_common::cuda_available() {
        eprintln!("cuda_blocked_vs_one_block: skipped, no CUDA device");
        return;
    }
    let probe = 8192usize;
    {
        let ctx = flatpeak_common::cuda::context(0).expect("device");
        let s = ctx.default_stream();
        let blas = CudaBlas::new(s.clone()).expect("cublas");
        let host = SplitMix64::new(9).normal_f32(probe * probe, 0.0, 1.0);
        let a = s.clone_htod(&host).expect("a");
        let mut out = s.alloc_zeros::<f32>(probe * probe).expect("c");
        let mut group = c.benchmark_group("cuda/sgemm_probe");
        group.sample_size(10).throughput(Throughput::Elements(2 * (probe as u64).pow(3)));
        group.bench_function("sgemm_8192", |b| {
            b.iter(|| {
                flatpeak_common::cuda::sgemm_square(&blas, probe, SquareOperands { a: &a, b: &a }, &mut out)
                    .expect("sgemm");
                s.synchronize().expect("sync");
            })
        });
        group.finish();
        // The bf16 ceiling: bf16 operands on the tensor cores, f32 accumulation and output.
        let a16 = s.clone_htod(&host.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>()).expect("a bf16");
        let mut group = c.benchmark_group("cuda/gemm_bf16_probe");
        group.sample_size(10).throughput(Throughput::Elements(2 * (probe as u64).pow(3)));
        group.bench_function("gemm_bf16_8192", |b| {
            b.iter(|| {
                // SAFETY: `blas` was created on `s`, and every buffer is on `s`'s context.
                unsafe {
                    flatpeak_common::cuda::gemm_bf16_square(
                        &blas,
                        &s,
                        probe,
                        SquareOperands { a: &a16, b: &a16 },
                        &mut out,
                    )
                }
                .expect("gemm bf16");
                s.synchronize().expect("sync");
            })
        });
        group.finish();
    }
    let (n, d, v) = (8192usize, 1024usize, 32768usize);
    let mut rng = SplitMix64::new(5);
    let x = rng.normal_f32(n * d, 0.0, 1.0);
    let w = rng.normal_f32(v * d, 0.0, 1.0 / (d as f32).sqrt());
    let (xh, wh): (Vec<bf16>, Vec<bf16>) =
        (x.iter().map(|&a| bf16::from_f32(a)).collect(), w.iter().map(|&a| bf16::from_f32(a)).collect());
    let targets: Vec<i64> = (0..n).map(|_| rng.below(v as u64) as i64).collect();
    let config = Config::default();
    let gemm_flops = 2 * (n * d * v) as u64;
    let mut group = c.benchmark_group("cuda/ring_dtp_N8192_D1024_V32768");
    group.sample_size(10);
    #[derive(Clone, Copy, PartialEq)]
    enum Call {
        Separate,
        Fused,
    }
    let blocks = |c: usize, vb: usize, dtype| {
        Plan::with_blocks(&config, Shape { tokens: n, hidden: d, vocab: v, dtype }, (c, vb)).expect("plan")
    };
    // bf16 with every GEMM in f32 (operands widened, G kept f32): the exact path's cost.
    let f32_gemms = config.precision(Precision::F32);
    let widened = |c: usize| {
        Plan::with_blocks(&f32_gemms, Shape { tokens: n, hidden: d, vocab: v, dtype: DType::Bf16 }, (c, v))
            .expect("plan")
    };
    let tf32 = |c: usize| {
        let tf32 = config.precision(Precision::Tf32);
        Plan::with_blocks(&tf32, Shape { tokens: n, hidden: d, vocab: v, dtype: DType::F32 }, (c, v))
            .expect("plan")
    };
    let budget = |bytes: usize| {
        Plan::new(&config, Shape { tokens: n, hidden: d, vocab: v, dtype: DType::F32 }, Budget::Bytes(bytes))
            .expect("plan")
    };
    for (name, plan, call) in [
        ("f32_materialized_8192_tokens_fused", blocks(n, v, DType::F32), Call::Fused),
        ("f32_1024_tokens_fused", blocks(1024, v, DType::F32), Call::Fused),
        ("f32_1024_tokens_separate", blocks(1024, v, DType::F32), Call::Separate),
        ("f32_256_tokens_fused", blocks(256, v, DType::F32), Call::Fused),
        ("f32_budget_8MiB_separate", budget(8 << 20), Call::Separate),
        ("bf16_native_materialized_8192_tokens_fused", blocks(n, v, DType::Bf16), Call::Fused),
        ("bf16_native_1024_tokens_fused", blocks(1024, v, DType::Bf16), Call::Fused),
        ("bf16_native_1024_tokens_separate", blocks(1024, v, DType::Bf16), Call::Separate),
        ("bf16_f32gemms_1024_tokens_fused", widened(1024), Call::Fused),
        ("f32_tf32_1024_tokens_fused", tf32(1024), Call::Fused),
    ] {
        let mut lce = ring_dtp::LinearCrossEntropy::new(plan, Device::Cuda(0)).expect("device");
        let s = lce.stream().expect("a CUDA executor").clone();
        let td = s.clone_htod(&targets).expect("t");
        let (xf, wf, xb, wb);
        let (xm, wm) = if plan.dtype() == DType::F32 {
            (xf, wf) = (s.clone_htod(&x).expect("x"), s.clone_htod(&w).expect("w"));
            (DeviceMatrix::F32(&xf), DeviceMatrix::F32(&wf))
        } else {
            (xb, wb) = (s.clone_htod(&xh).expect("x"), s.clone_htod(&wh).expect("w"));
            (DeviceMatrix::Bf16(&xb), DeviceMatrix::Bf16(&wb))
        };
        let inputs = DeviceInputs::on_device(xm, wm, &td, d);
        assert_eq!((inputs.n, inputs.v), (n, v));
        let gemms = if call == Call::Fused { plan.gemms_fused() as u64 } else { 4 };
        eprintln!(
            "{name}: {} tokens x {} vocabulary rows, {gemms} GEMMs, blocks {:.1} MiB",
            plan.token_block(),
            plan.vocab_block(),
            plan.workspace_bytes() as f64 / (1 << 20) as f64
        );
        group.throughput(Throughput::Elements(gemms * gemm_flops));
        group.bench_function(name, |b| {
            b.iter(|| {
                let g = match call {
                    Call::Separate => {
                        let f = lce.forward(&inputs).expect("forward");
                        lce.backward(&inputs, &f, GradOutput::Scalar(1.0).into()).expect("backward")
                    }
                    Call::Fused => lce.forward_backward(&inputs, GradOutput::Scalar(1.0)).expect("fused").1,
                };
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
