//! llep benches: one checkpointed training step (plan, forward, recompute + backward) and one
//! forward of PipelinedLLEP, LLEP and standard EP on P = 4 LocalGroup ranks at a reduced shape
//! (N = 512 tokens per rank, H = 128, I = 64, E = 16, k = 4, f32), for the report's three
//! profiles: balanced, 50%:4 and 95%:1 routing.
//! `cargo bench -p flatpeak-bench --bench llep`; the paper-style comparison at P = 8,
//! N = 4096, H = 512, I = 256, E = 64, k = 8 is `flatpeak report --component llep`.
//!
//! With `--features cuda` and a device, `cuda/llep_*` times the device executor on one GPU
//! (P = 1, NCCL all-to-all to itself) at the report's per-rank shape: PipelinedLLEP in 4 rounds
//! with three buffer copies (round j+1's dispatch and round j−1's combine beside round j's
//! experts), two (the dispatch only) and one (rounds in sequence), against LLEP's single round.

use criterion::{Criterion, criterion_group, criterion_main};
use flatpeak_bench::components::llep::Data;
use flatpeak_common::gemm::Threads;
use flatpeak_common::{Communicator, DType, Device, LocalGroup, LocalGroupOptions};
use llep::{Config as LlepConfig, Executor, PairCap, Pass, Scheme, Shape};

use llep::paper::Profile;

const SHAPE: Shape =
    Shape { ranks: 4, tokens: 512, hidden: 128, intermediate: 64, experts: 16, top_k: 4, dtype: DType::F32 };

fn configs() -> [(&'static str, LlepConfig); 3] {
    let single = |c: LlepConfig| c.gemm_threads(Threads::Single).min_chunk(64);
    [
        ("pipelined_llep", single(LlepConfig::default().pair_cap(PairCap::Rows(64)))),
        ("llep", single(LlepConfig::with_scheme(Scheme::Llep))),
        ("standard_ep", single(LlepConfig::with_scheme(Scheme::StandardEp))),
    ]
}

/// One step on every rank; executors (and their workspaces) made inside (PipelinedLLEP: its
/// launch size for the pass; the baselines: their routing's).
fn step(data: &Data, ids: &[i64], config: &LlepConfig, train: bool) {
    let out = LocalGroup::run(SHAPE.ranks, LocalGroupOptions::default(), |comm| {
        let me = comm.rank();
        let inputs = data.inputs(&SHAPE, me, ids);
        let run = || -> llep::Result<usize> {
            let launch = llep::Plan::new(config, SHAPE, llep::Budget::Unlimited).expect("plan");
            let plan = llep::cpu::schedule(comm, &launch, &inputs.routing)?;
            let pass = if train { Pass::Backward } else { Pass::Forward };
            let bytes = plan.buffers(me, pass).workspace_bytes();
            let mut layer = Executor::with_workspace_bytes(launch, Device::Cpu, bytes)?;
            let y = layer.forward(comm, &plan, &inputs)?;
            if train {
                let g = layer.backward(comm, &plan, &inputs, data.dy(me))?;
                return Ok(y.len() + g.dx.len());
            }
            Ok(y.len())
        };
        Ok(run())
    });
    for r in out {
        r.expect("group ran").expect("step ran");
    }
}

fn steps(c: &mut Criterion) {
    let data = Data::new(&SHAPE);
    for spec in ["balanced", "50%:4", "95%:1"] {
        let ids = spec.parse::<Profile>().expect("profile").ids(&Shape { ranks: 1, ..SHAPE }).expect("ids");
        let mut group =
            c.benchmark_group(format!("llep_P4_N512_H128_I64_E16_k4_f32_{}", spec.replace(['%', ':'], "_")));
        group.sample_size(10);
        for (name, config) in configs() {
            group.bench_function(format!("{name}_train"), |b| b.iter(|| step(&data, &ids, &config, true)));
            group.bench_function(format!("{name}_fwd"), |b| b.iter(|| step(&data, &ids, &config, false)));
        }
        group.finish();
    }
}

#[cfg(feature = "cuda")]
fn cuda_steps(c: &mut Criterion) {
    use flatpeak_common::nccl::{NcclComm, nccl_available};
    use llep::Schedule;
    use llep::cuda::CudaOps;
    use llep::device::{DeviceInputs, DeviceOps};
    if !flatpeak_common::cuda_available() || !nccl_available() {
        eprintln!("cuda_steps: skipped, no CUDA device or no NCCL");
        return;
    }
    // The report's per-rank shape, on one rank.
    let shape = Shape { ranks: 1, ..flatpeak_bench::components::llep::SHAPE };
    let ctx = flatpeak_common::cuda::context(0).expect("device");
    let comm = NcclComm::for_devices(vec![ctx.default_stream()]).expect("NCCL").remove(0);
    let ops = CudaOps::new(&comm).expect("CUDA ops");
    let data = Data::new(&shape);
    let pipelined = LlepConfig::default().pair_cap(PairCap::Rows(1024)).min_chunk(64);
    let configs = [
        ("pipelined_llep_3_copies", pipelined.pipeline_depth(3)),
        ("pipelined_llep_2_copies", pipelined),
        ("pipelined_llep_1_copy", pipelined.pipeline_depth(1)),
        ("llep", LlepConfig::with_scheme(Scheme::Llep).min_chunk(64)),
    ];
    // Each dtype's layer on its own buffers: f32 (SGEMM) and bf16 (GemmEx on tensor cores,
    // the `_bf16` kernels), the same routing and values (bf16: rounded once on upload).
    for (spec, dtype) in ["balanced", "95%:1"].into_iter().flat_map(|s| [(s, DType::F32), (s, DType::Bf16)]) {
        let ids = spec.parse::<Profile>().expect("profile").ids(&shape).expect("ids");
        let inputs = data.inputs(&shape, 0, &ids);
        let up = |v: &[f32]| match dtype {
            DType::Bf16 => ops.upload_bf16(&v.iter().map(|&x| half::bf16::from_f32(x)).collect::<Vec<_>>()),
            _ => ops.upload(v),
        };
        let up = |v: &[f32]| up(v).expect("upload");
        let w = &inputs.experts;
        let (x, gate, w_up, down, dy) = (up(inputs.x), up(w.gate), up(w.up), up(w.down), up(data.dy(0)));
        let dev = DeviceInputs { x: &x, routing: inputs.routing, gate: &gate, up: &w_up, down: &down };
        let mut group = c.benchmark_group(format!(
            "cuda/llep_P1_N4096_H512_I256_E64_k8_{dtype}_{}",
            spec.replace(['%', ':'], "_")
        ));
        group.sample_size(10);
        let shape = Shape { dtype, ..shape };
        for (name, config) in &configs {
            let launch = llep::Plan::new(config, shape, llep::Budget::Unlimited).expect("plan");
            let mut layer = llep::Executor::new(launch, flatpeak_common::Device::Cuda(0)).expect("executor");
            let plan = Schedule::from_top_k(&launch, &[&ids]).expect("plan");
            eprintln!("cuda/llep {dtype} {spec} {name}: {} rounds", plan.rounds());
            group.bench_function(format!("{name}_train"), |b| {
                b.iter(|| {
                    let y = layer.forward(&ops, &plan, &dev).expect("forward");
                    let g = layer.backward(&ops, &plan, &dev, &dy).expect("backward");
                    ops.synchronize().expect("sync");
                    (y, g)
                })
            });
        }
        group.finish();
    }
    ops.synchronize().expect("sync");
}

#[cfg(not(feature = "cuda"))]
fn cuda_steps(_: &mut Criterion) {}

criterion_group!(benches, steps, cuda_steps);
criterion_main!(benches);
