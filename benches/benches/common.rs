//! Benches of the foundation: the CPU GEMM behind every primitive's CPU path, LocalGroup's ring
//! and collectives (the fabric of the CPU fallback), and, with `--features cuda` on a GPU host,
//! the device fill kernel. `cargo bench -p flatpeak-bench --bench common`.

use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use flatpeak_common::gemm::{MatMut, MatRef, MatmulOptions, matmul};
use flatpeak_common::{Communicator, CommunicatorExt, LocalGroup, LocalGroupOptions, ReduceOp, SplitMix64};

fn cpu_gemm(c: &mut Criterion) {
    let mut group = c.benchmark_group("cpu_gemm_f32");
    for n in [256usize, 1024] {
        let mut rng = SplitMix64::new(n as u64);
        let (a, b) = (rng.uniform_f32(n * n, -1.0, 1.0), rng.uniform_f32(n * n, -1.0, 1.0));
        let mut out = vec![0f32; n * n];
        group.throughput(Throughput::Elements(2 * (n * n * n) as u64)); // FLOPs
        group.bench_function(format!("{n}^3"), |bench| {
            bench.iter(|| {
                let views = (
                    MatMut::row_major(&mut out, n, n),
                    MatRef::row_major(&a, n, n),
                    MatRef::row_major(&b, n, n),
                );
                if let (Ok(d), Ok(l), Ok(r)) = views {
                    matmul(d, l, r, MatmulOptions::default()).expect("square shapes agree");
                }
                black_box(&out);
            })
        });
    }
    group.finish();
}

fn local_group(c: &mut Criterion) {
    let mut group = c.benchmark_group("local_group");
    let elems = 1 << 18; // 1 MiB of f32 per rank
    for p in [2usize, 4] {
        group.throughput(Throughput::Bytes((4 * elems * p) as u64));
        group.bench_function(format!("ring_shift_1MiB_P{p}"), |bench| {
            bench.iter(|| {
                LocalGroup::run(p, LocalGroupOptions::default(), |comm| {
                    let (block, mut incoming) = (vec![comm.rank() as f32; elems], vec![0f32; elems]);
                    comm.ring_shift(&block, &mut incoming)?;
                    Ok(incoming[0])
                })
            })
        });
        group.bench_function(format!("all_reduce_sum_1MiB_P{p}"), |bench| {
            bench.iter(|| {
                LocalGroup::run(p, LocalGroupOptions::default(), |comm| {
                    let mut buf = vec![1f32; elems];
                    comm.all_reduce_f32(&mut buf, ReduceOp::Sum)?;
                    Ok(buf[0])
                })
            })
        });
    }
    group.finish();
}

#[cfg(feature = "cuda")]
fn cuda_fill(c: &mut Criterion) {
    use flatpeak_common::cuda::{KernelCache, context, fill_f32};
    let Ok(ctx) = context(0) else {
        eprintln!("cuda_fill: skipped, no CUDA device");
        return;
    };
    let stream = ctx.default_stream();
    let cache = KernelCache::new(ctx).expect("kernel cache");
    let n = 1 << 28; // 1 GiB of f32
    let mut buf = stream.alloc_zeros::<f32>(n).expect("1 GiB on the device");
    let mut group = c.benchmark_group("cuda");
    group.throughput(Throughput::Bytes(4 * n as u64));
    group.bench_function("fill_f32_1GiB", |bench| {
        bench.iter(|| {
            fill_f32(&cache, &stream, &mut buf.slice_mut(..), 1.0).expect("launch");
            stream.synchronize().expect("sync");
        })
    });
    group.finish();
}

#[cfg(not(feature = "cuda"))]
fn cuda_fill(_: &mut Criterion) {}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).warm_up_time(std::time::Duration::from_millis(300)).measurement_time(std::time::Duration::from_secs(2));
    targets = cpu_gemm, local_group, cuda_fill
}
criterion_main!(benches);
