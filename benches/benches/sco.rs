//! sco benches: one training step of a residual-MLP stack with plain checkpointing and with
//! selective checkpoint offload. `cargo bench -p flatpeak-bench --bench sco`; the paper-style
//! comparison at L = 32, S = 8192 is `flatpeak report --component sco`.

use criterion::{Criterion, criterion_group, criterion_main};
use flatpeak_bench::components::sco::Workload;
use flatpeak_common::SplitMix64;
use sco::Checkpointing;

fn step(c: &mut Criterion) {
    let w = Workload { layers: 16, tokens: 1024, hidden: 256, inner: 256 };
    let input = SplitMix64::new(1).normal_f32(w.tokens * w.hidden, 0.0, 1.0);
    let mut group = c.benchmark_group("sco_step_L16_S1024_H256");
    for mode in [Checkpointing::OnDevice, Checkpointing::Offload] {
        let mut stack = w.stack(mode).expect("valid stack");
        group.bench_function(format!("{mode:?}"), |b| {
            b.iter(|| stack.step(&input, |y| Ok(y.to_vec())).expect("step"))
        });
    }
    group.finish();
}

/// On a GPU host: L layers of stand-in compute (k fills of a 1 GiB buffer per layer), with and
/// without offloading a 64 MiB boundary per layer through the CUDA ring; equal times mean the
/// D2H copies hide behind compute. With k = 1 a layer's compute (≈ 0.3 ms on an H200) is far
/// shorter than its boundary's copy (≈ 1.2 ms over PCIe 5), so the step is copy-bound; k = 8
/// (≈ 2.6 ms) is still below a real layer's share: a transformer layer's forward does about
/// 12·H FLOPs per byte of its bf16 boundary, ≈ 4.7 ms per 64 MiB at H = 4096 and 700 TFLOP/s.
#[cfg(feature = "cuda")]
fn cuda_overlap(c: &mut Criterion) {
    use flatpeak_common::cuda::{KernelCache, fill_f32};
    use sco::CheckpointStore;
    use sco::cuda::CudaCheckpointOffloader;
    use sco::{Budget, Config, Plan, Shape};
    if !flatpeak_common::cuda_available() {
        eprintln!("cuda_overlap: skipped, no CUDA device");
        return;
    }
    let (layers, width) = (16usize, 16usize << 20);
    let plan =
        Plan::new(&Config::default(), Shape::of::<f32>(layers, width), Budget::Unlimited).expect("plan");
    let mut off = CudaCheckpointOffloader::<f32>::new(plan, 0).expect("device");
    let stream = off.compute_stream().clone();
    let cache = KernelCache::new(stream.context().clone()).expect("kernel cache");
    let mut work = stream.alloc_zeros::<f32>(1 << 28).expect("1 GiB");
    let mut group = c.benchmark_group("cuda_sco_forward_16x64MiB");
    for fills in [1usize, 8] {
        group.bench_function(format!("compute_only_{fills}GiB_per_layer"), |b| {
            b.iter(|| {
                for _ in 0..layers * fills {
                    fill_f32(&cache, &stream, &mut work.slice_mut(..), 1.0).expect("fill");
                }
                stream.synchronize().expect("sync");
            })
        });
        group.bench_function(format!("compute_with_offload_{fills}GiB_per_layer"), |b| {
            b.iter(|| {
                for l in 0..layers {
                    fill_f32(&cache, &stream, &mut off.slot_for(l).expect("slot"), l as f32)
                        .expect("boundary");
                    off.offload(l).expect("offload");
                    for _ in 0..fills {
                        fill_f32(&cache, &stream, &mut work.slice_mut(..), 1.0).expect("fill");
                    }
                }
                off.finish_step().expect("finish");
            })
        });
    }
    group.finish();
}

#[cfg(not(feature = "cuda"))]
fn cuda_overlap(_: &mut Criterion) {}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).warm_up_time(std::time::Duration::from_millis(500)).measurement_time(std::time::Duration::from_secs(3));
    targets = step, cuda_overlap
}
criterion_main!(benches);
