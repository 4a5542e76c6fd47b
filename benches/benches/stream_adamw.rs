//! stream-adamw benches: the CPU AdamW kernel at 16M and 64M parameters (throughput counted at
//! 28 B/param), a plain single-threaded loop beside it, and one offloaded step serial vs
//! pipelined. `cargo bench -p flatpeak-bench --bench stream_adamw`; the paper-style comparison
//! with interleaved ceilings is `flatpeak report --component stream-adamw`.

use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};
use flatpeak_bench::components::stream_adamw::{BYTES_PER_PARAM, KernelInputs};
use flatpeak_common::SplitMix64;
use half::bf16;
use stream_adamw::{Budget, Config, HostDevice, Link, Plan, StepOptions, StepSchedule, StreamAdamW};

fn kernel(c: &mut Criterion) {
    let mut group = c.benchmark_group("stream_adamw_kernel");
    for n in [16usize << 20, 64 << 20] {
        let mut inputs = KernelInputs::new(n);
        group.throughput(Throughput::Bytes((BYTES_PER_PARAM * n as f64) as u64));
        group.bench_function(format!("adamw_update_{}M", n >> 20), |b| b.iter(|| inputs.kernel_gbps()));
        if n == 16 << 20 {
            group.bench_function("plain_loop_1_thread_16M", |b| b.iter(|| inputs.plain_loop_gbps()));
        }
    }
    group.finish();
}

fn offloaded_step(c: &mut Criterion) {
    let n = 16usize << 20;
    let master = SplitMix64::new(1).normal_f32(n, 0.0, 1.0);
    let grads = SplitMix64::new(2).normal_f32(n, 0.0, 0.01);
    let mut group = c.benchmark_group("stream_adamw_step_16M_link25");
    for schedule in [StepSchedule::Serial, StepSchedule::Pipelined] {
        let options = Config::default().bucket_elems(1 << 20).schedule(schedule);
        let plan = Plan::new(&options, StreamAdamW::<f32, bf16>::shape(n), Budget::Unlimited)
            .expect("valid options");
        let mut opt =
            StreamAdamW::<f32, bf16>::new(plan, stream_adamw::Device::Cpu).expect("a CPU optimizer");
        opt.load_master(&master).expect("n parameters");
        let mut device = HostDevice::new(grads.clone(), vec![bf16::ZERO; n], Link::Simulated { gbps: 25.0 });
        group.bench_function(format!("{schedule:?}"), |b| {
            b.iter_batched(|| (), |()| opt.step(&mut device, StepOptions::default()), BatchSize::SmallInput)
        });
    }
    group.finish();
}

/// On a GPU host: the offloaded step over real PCIe, serial vs pipelined, and the per-bucket
/// D2H, Adam and H2D times a, c, h of the serial run (printed once).
#[cfg(feature = "cuda")]
fn cuda_offloaded_step(c: &mut Criterion) {
    use stream_adamw::cuda::CudaDevice;
    if !flatpeak_common::cuda_available() {
        eprintln!("cuda_offloaded_step: skipped, no CUDA device");
        return;
    }
    let n = 64usize << 20;
    let bucket = 4usize << 20;
    let master = SplitMix64::new(1).normal_f32(n, 0.0, 1.0);
    let grads: Vec<bf16> =
        SplitMix64::new(2).normal_f32(n, 0.0, 0.01).into_iter().map(bf16::from_f32).collect();
    let mut group = c.benchmark_group("cuda_stream_adamw_step_64M_bf16");
    for schedule in [StepSchedule::Serial, StepSchedule::Pipelined] {
        let options = Config::default().bucket_elems(bucket).schedule(schedule);
        let on = stream_adamw::Device::Cuda(0);
        let plan = Plan::new(&options, StreamAdamW::<bf16, bf16>::shape(n), Budget::Unlimited)
            .expect("valid options");
        let mut opt = StreamAdamW::<bf16, bf16>::new(plan, on).expect("device");
        opt.load_master(&master).expect("n parameters");
        let stream = flatpeak_common::cuda::context(0).expect("device").default_stream();
        let mut device = CudaDevice {
            grads: stream.clone_htod(&grads).expect("upload"),
            params: stream.alloc_zeros::<bf16>(n).expect("alloc"),
        };
        // The first step touches the host state for the first time (page faults): time a warm one.
        opt.step(&mut device, StepOptions::default()).expect("cold step");
        let report = opt.step(&mut device, StepOptions::default()).expect("step");
        if schedule == StepSchedule::Serial {
            let b = n.div_ceil(bucket) as f64;
            let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3 / b;
            eprintln!(
                "cuda serial step (warm), per {}M bucket: a = {:.3} ms, c = {:.3} ms, h = {:.3} ms, ideal speedup {:.2}",
                bucket >> 20,
                ms(report.times.d2h),
                ms(report.times.adam),
                ms(report.times.h2d),
                stream_adamw::ideal_speedup(
                    ms(report.times.d2h),
                    ms(report.times.adam),
                    ms(report.times.h2d)
                ),
            );
        }
        group.bench_function(format!("{schedule:?}"), |b| {
            b.iter(|| opt.step(&mut device, StepOptions::default()).expect("step"))
        });
    }
    group.finish();
}

#[cfg(not(feature = "cuda"))]
fn cuda_offloaded_step(_: &mut Criterion) {}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).warm_up_time(std::time::Duration::from_millis(500)).measurement_time(std::time::Duration::from_secs(3));
    targets = kernel, offloaded_step, cuda_offloaded_step
}
criterion_main!(benches);
