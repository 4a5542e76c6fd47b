//! The bf16 layer on the CPU: tokens, expert weights, dY, the dispatch rows and the expert
//! scratch in bf16, GEMMs with f32 accumulation, on every CPU kernel: the fastest this CPU has
//! ([`Bf16Kernel::Detect`]: AMX tiles or AVX512-BF16), the dot products
//! ([`Bf16Kernel::Avx512Bf16`], in the proptest) and the widening fallback
//! ([`Bf16Kernel::Widened`]).
//!
//! Exactness, bf16: each output and gradient is compared with the f64 reference of the same
//! (bf16-valued) inputs, and must be within twice the error of the naive bf16 computation
//! ([`reference::naive_bf16_forward`]: every stored tensor rounded to bf16) plus 1e-2,
//! norm-wise relative. Memory: the bf16 plan's workspace is what the executor carves, and it is
//! below the f32 plan's.

mod common;

use common::{Ids, Problem, small_config};
use flatpeak_common::{Communicator, DType, Device, LocalGroup, LocalGroupOptions, relative_error};
use llep::cpu::reference;
use llep::paper::Profile;
use llep::{
    Bf16Kernel, Config, Executor, ExpertWeights, Gradients, Mode, Pass, RankInputs, Routing, Scheme, Shape,
    bf16, cpu,
};
use proptest::prelude::*;

/// A problem whose tensors hold bf16 values, and its bf16 copies.
struct Bf16Problem {
    /// Every f32 tensor rounded to bf16 (the references' inputs).
    wide: Problem,
    x: Vec<Vec<bf16>>,
    dy: Vec<Vec<bf16>>,
    gate: Vec<bf16>,
    up: Vec<bf16>,
    down: Vec<bf16>,
}

fn narrow(v: &[f32]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f32(x)).collect()
}

fn widen(v: &[bf16]) -> Vec<f32> {
    v.iter().map(|x| x.to_f32()).collect()
}

impl Bf16Problem {
    fn new(shape: Shape, ids: Ids, seed: u64) -> Self {
        let mut wide = Problem::new(Shape { dtype: DType::F32, ..shape }, ids, seed);
        let (x, dy): (Vec<_>, Vec<_>) =
            (wide.x.iter().map(|v| narrow(v)).collect(), wide.dy.iter().map(|v| narrow(v)).collect());
        let (gate, up, down) = (narrow(&wide.gate), narrow(&wide.up), narrow(&wide.down));
        wide.x = x.iter().map(|v| widen(v)).collect();
        wide.dy = dy.iter().map(|v| widen(v)).collect();
        (wide.gate, wide.up, wide.down) = (widen(&gate), widen(&up), widen(&down));
        Self { wide, x, dy, gate, up, down }
    }

    fn shape(&self) -> Shape {
        Shape { dtype: DType::Bf16, ..self.wide.shape }
    }

    fn inputs(&self, s: usize) -> RankInputs<'_, bf16> {
        let sh = self.wide.shape;
        let len = sh.local_experts() * sh.hidden * sh.intermediate;
        RankInputs {
            x: &self.x[s],
            routing: Routing { ids: &self.wide.ids[s], weights: &self.wide.weights[s] },
            experts: ExpertWeights {
                gate: &self.gate[s * len..(s + 1) * len],
                up: &self.up[s * len..(s + 1) * len],
                down: &self.down[s * len..(s + 1) * len],
            },
        }
    }
}

/// One rank's bf16 forward and backward: y, the gradients, the bytes the executor carved at
/// most and the plan's backward workspace.
struct Bf16Run {
    y: Vec<f32>,
    grads: Gradients,
    high_water: usize,
    planned: usize,
}

fn run(problem: &Bf16Problem, config: &Config) -> Vec<Bf16Run> {
    LocalGroup::run(problem.shape().ranks, LocalGroupOptions::default(), |comm| {
        Ok((|| -> llep::Result<Bf16Run> {
            let me = comm.rank();
            let inputs = problem.inputs(me);
            let launch = llep::Plan::new(config, problem.shape(), llep::Budget::Unlimited)?;
            let mut layer = Executor::new(launch, Device::Cpu)?;
            let plan = layer.schedule(comm, &inputs.routing)?;
            let planned = plan.buffers(me, Pass::Backward).workspace_bytes();
            let (y, grads) = if config.mode == Mode::SaveActivations {
                let mut saved = cpu::SavedActivations::new(&plan, me)?;
                let y = layer.forward_saving(comm, &plan, &inputs, &mut saved)?;
                (y, layer.backward_saved(comm, &plan, &inputs, &problem.dy[me], &mut saved)?)
            } else {
                let y = layer.forward(comm, &plan, &inputs)?;
                (y, layer.backward(comm, &plan, &inputs, &problem.dy[me])?)
            };
            Ok(Bf16Run { y, grads, high_water: layer.high_water(), planned })
        })())
    })
    .into_iter()
    .map(|r| r.expect("rank ran").expect("bf16 layer ran"))
    .collect()
}

/// Checks every output of `runs` against the f64 reference, within twice the naive bf16
/// computation's error + 1e-2; returns the errors (name, layer, naive).
fn check_exactness(problem: &Bf16Problem, runs: &[Bf16Run]) -> Vec<(&'static str, f64, f64)> {
    let p = &problem.wide;
    let (x, ids, w, dy) = (p.x.concat(), p.ids.concat(), p.weights.concat(), p.dy.concat());
    let inputs = RankInputs {
        x: &x,
        routing: Routing { ids: &ids, weights: &w },
        experts: ExpertWeights { gate: &p.gate, up: &p.up, down: &p.down },
    };
    let shape = p.global_shape();
    let (y_ref, g_ref) =
        (reference::forward(&shape, &inputs).unwrap(), reference::backward(&shape, &inputs, &dy).unwrap());
    let (y_naive, g_naive) = (
        reference::naive_bf16_forward(&shape, &inputs).unwrap(),
        reference::naive_bf16_backward(&shape, &inputs, &dy).unwrap(),
    );
    let narrow64 = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
    let cat =
        |f: fn(&Bf16Run) -> &Vec<f32>| runs.iter().flat_map(|r| f(r).iter().copied()).collect::<Vec<f32>>();
    let checks = [
        ("y", cat(|r| &r.y), narrow64(&y_naive), &y_ref),
        ("dx", cat(|r| &r.grads.dx), narrow64(&g_naive.dx), &g_ref.dx),
        ("d_weights", cat(|r| &r.grads.d_weights), narrow64(&g_naive.d_weights), &g_ref.d_weights),
        ("d_gate", cat(|r| &r.grads.d_gate), narrow64(&g_naive.d_gate), &g_ref.d_gate),
        ("d_up", cat(|r| &r.grads.d_up), narrow64(&g_naive.d_up), &g_ref.d_up),
        ("d_down", cat(|r| &r.grads.d_down), narrow64(&g_naive.d_down), &g_ref.d_down),
    ];
    checks
        .into_iter()
        .map(|(name, got, naive, want)| {
            let (err, naive_err) = (relative_error(&got, want), relative_error(&naive, want));
            assert!(
                err <= 2.0 * naive_err + 1e-2,
                "{name}: bf16 layer error {err:.3e} > 2 × naive bf16 error {naive_err:.3e} + 1e-2"
            );
            (name, err, naive_err)
        })
        .collect()
}

fn shape(
    ranks: usize,
    tokens: usize,
    (hidden, intermediate): (usize, usize),
    experts: usize,
    top_k: usize,
) -> Shape {
    Shape { ranks, tokens, hidden, intermediate, experts, top_k, dtype: DType::Bf16 }
}

#[test]
fn every_scheme_and_mode_is_within_twice_the_naive_bf16_error() {
    let s = shape(4, 48, (64, 32), 8, 2);
    let problem = Bf16Problem::new(s, Ids::Profile(Profile::Hot { ratio: 0.9, experts: 1 }), 7);
    for kernel in [Bf16Kernel::Detect, Bf16Kernel::Widened] {
        for scheme in [Scheme::PipelinedLlep, Scheme::Llep, Scheme::StandardEp] {
            for mode in [Mode::Checkpointed, Mode::SaveActivations] {
                let config = small_config(scheme).mode(mode).bf16_kernel(kernel);
                let runs = run(&problem, &config);
                let errors = check_exactness(&problem, &runs);
                // The naive computation's own error is bf16's (≈ 2⁻⁸ relative), not zero: the
                // test compares against something that can fail.
                assert!(
                    errors.iter().all(|&(_, _, naive)| naive > 1e-4),
                    "{kernel:?} {scheme:?} {mode:?}: {errors:?}"
                );
            }
        }
    }
}

#[test]
fn the_bf16_workspace_is_what_the_executor_carves_and_less_than_f32s() {
    let s = shape(2, 64, (64, 48), 4, 2);
    let problem = Bf16Problem::new(s, Ids::Random, 3);
    let config = small_config(Scheme::PipelinedLlep);
    for r in run(&problem, &config) {
        assert!(r.high_water <= r.planned, "carved {} > planned {}", r.high_water, r.planned);
    }
    let bytes = |dtype| {
        llep::Plan::new(&config, Shape { dtype, ..s }, llep::Budget::Unlimited)
            .unwrap()
            .buffers(Pass::Backward)
            .workspace_bytes()
    };
    let (b16, b32) = (bytes(DType::Bf16), bytes(DType::F32));
    assert!(b16 < b32 * 3 / 4, "bf16 workspace {b16} B against f32's {b32} B");
}

#[test]
fn bf16_tensors_on_an_f32_plan_are_a_typed_error() {
    let s = shape(1, 8, (8, 4), 2, 1);
    let problem = Bf16Problem::new(s, Ids::Random, 1);
    let out = LocalGroup::run(1, LocalGroupOptions::default(), |comm| {
        Ok((|| -> llep::Result<()> {
            let f32_shape = Shape { dtype: DType::F32, ..s };
            let launch = llep::Plan::new(&Config::default(), f32_shape, llep::Budget::Unlimited)?;
            let mut layer = Executor::new(launch, Device::Cpu)?;
            let inputs = problem.inputs(comm.rank());
            let plan = layer.schedule(comm, &inputs.routing)?;
            layer.forward(comm, &plan, &inputs).map(|_| ())
        })())
    });
    match &out[0] {
        Ok(Err(llep::Error::DtypeMismatch { expected: DType::F32, found: DType::Bf16, .. })) => {}
        other => panic!("expected DtypeMismatch, got {other:?}"),
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Edge shapes: odd H and I (the bf16 GEMM packs pairs of k), k up to 3, one rank or four,
    /// random routing with duplicates, every scheme, every CPU kernel.
    #[test]
    fn random_shapes_are_within_twice_the_naive_bf16_error(
        ranks in prop_oneof![Just(1usize), Just(2), Just(4)],
        tokens in 1usize..24,
        hidden in 1usize..40,
        intermediate in 1usize..24,
        top_k in 1usize..4,
        scheme in prop_oneof![Just(Scheme::PipelinedLlep), Just(Scheme::Llep), Just(Scheme::StandardEp)],
        kernel in prop_oneof![Just(Bf16Kernel::Detect), Just(Bf16Kernel::Avx512Bf16), Just(Bf16Kernel::Widened)],
        seed in any::<u64>(),
    ) {
        let s = shape(ranks, tokens, (hidden, intermediate), 4 * ranks, top_k);
        let problem = Bf16Problem::new(s, Ids::Random, seed);
        check_exactness(&problem, &run(&problem, &small_config(scheme).bf16_kernel(kernel)));
    }
}

/// The bf16 layer on the emulated device (`--features cuda-emu`): the device round schedule
/// with the `_bf16` instantiations of `kernels/llep.cu` under the SIMT emulator (both thread
/// schedules; a race is an error) and bf16 GEMMs with f32 accumulation, against the f64
/// reference (the same bound as the CPU) and against the CPU executor's bf16 run.
#[cfg(feature = "cuda-emu")]
mod emulated {
    use super::*;
    use llep::device::DeviceInputs;
    use llep::emu_ops::EmuOps;

    /// Every rank's device forward and backward (with `SaveActivations`, the saving forward
    /// and the backward from its store, kept in bf16), downloaded.
    fn run_emulated(problem: &Bf16Problem, config: &Config) -> Vec<Bf16Run> {
        LocalGroup::run(problem.shape().ranks, LocalGroupOptions::default(), |comm| {
            Ok((|| -> llep::Result<Bf16Run> {
                let me = comm.rank();
                let inputs = problem.inputs(me);
                let launch = llep::Plan::new(config, problem.shape(), llep::Budget::Unlimited)?;
                let plan = cpu::schedule(comm, &launch, &inputs.routing)?;
                let ops = EmuOps::new(comm);
                let w = &inputs.experts;
                let (x, gate, up, down) = (
                    ops.upload_bf16(inputs.x)?,
                    ops.upload_bf16(w.gate)?,
                    ops.upload_bf16(w.up)?,
                    ops.upload_bf16(w.down)?,
                );
                let dev = DeviceInputs { x: &x, routing: inputs.routing, gate: &gate, up: &up, down: &down };
                let dy = ops.upload_bf16(&problem.dy[me])?;
                let saving = config.mode == Mode::SaveActivations;
                let (y, grads, high_water) =
                    common::device_pass(&ops, (&plan, me, problem.shape()), &dev, &dy, saving)?;
                Ok(Bf16Run { y, grads, high_water, planned: 0 })
            })())
        })
        .into_iter()
        .map(|r| r.expect("rank ran").expect("emulated bf16 layer ran"))
        .collect()
    }

    /// Norm-wise relative distance between the emulated and the CPU runs, per output.
    fn distance_to_cpu(emulated: &[Bf16Run], cpu: &[Bf16Run]) -> f64 {
        let pairs = emulated.iter().zip(cpu).flat_map(|(e, c)| {
            [
                (&e.y, &c.y),
                (&e.grads.dx, &c.grads.dx),
                (&e.grads.d_weights, &c.grads.d_weights),
                (&e.grads.d_gate, &c.grads.d_gate),
                (&e.grads.d_up, &c.grads.d_up),
                (&e.grads.d_down, &c.grads.d_down),
            ]
        });
        pairs
            .map(|(got, want)| {
                let want: Vec<f64> = want.iter().map(|&v| v as f64).collect();
                relative_error(got, &want)
            })
            .fold(0.0, f64::max)
    }

    #[test]
    fn the_emulated_bf16_layer_is_within_twice_the_naive_bf16_error_and_matches_the_cpu() {
        let cases = [
            (1, Ids::Random, 1),
            (2, Ids::Profile(Profile::Hot { ratio: 1.0, experts: 1 }), 1),
            (4, Ids::Profile(Profile::Hot { ratio: 0.9, experts: 1 }), 2),
            (4, Ids::Random, 3),
        ];
        for (i, (ranks, ids, depth)) in cases.into_iter().enumerate() {
            let problem = Bf16Problem::new(shape(ranks, 24, (24, 12), 4 * ranks, 2), ids, 40 + i as u64);
            for mode in [Mode::Checkpointed, Mode::SaveActivations] {
                let config = small_config(Scheme::PipelinedLlep).pipeline_depth(depth).mode(mode);
                let emulated = run_emulated(&problem, &config);
                let errors = check_exactness(&problem, &emulated);
                assert!(errors.iter().all(|&(_, _, naive)| naive > 1e-4), "{errors:?}");
                // The same arithmetic as the CPU executor: every store rounded once, f32 sums,
                // the same GEMM; only the dot products' f64 partials are summed in another
                // order (measured: bitwise equal here; the f32 device test's 1e-5 allows for it).
                let d = distance_to_cpu(&emulated, &run(&problem, &config));
                assert!(d <= 1e-5, "P={ranks} {ids:?} {mode:?}: emulated vs CPU distance {d:.3e}");
            }
        }
    }
}

/// The bf16 layer on one GPU (`--features cuda`, ignored elsewhere): the `_bf16` NVRTC kernels
/// and cuBLAS `GemmEx` on the bf16 buffers in place (tensor cores, f32 accumulation), against
/// the f64 reference (the same bound as the CPU) and the CPU executor's bf16 run.
#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use flatpeak_common::nccl::NcclComm;
    use llep::Schedule;
    use llep::cuda::CudaOps;
    use llep::device::{DeviceInputs, DeviceOps};

    #[test]
    #[ignore = "needs a CUDA device with NVRTC and NCCL"]
    fn the_gpu_bf16_layer_is_within_twice_the_naive_bf16_error_and_near_the_cpu() {
        let ctx = flatpeak_common::cuda::context(0).expect("a CUDA device");
        let comm = NcclComm::for_devices(vec![ctx.default_stream()]).expect("NCCL").remove(0);
        let ops = CudaOps::new(&comm).expect("CUDA ops");
        let larger = shape(1, 2048, (256, 128), 16, 4);
        let larger_config = Config::with_scheme(Scheme::PipelinedLlep)
            .min_chunk(64)
            .pair_cap(llep::PairCap::Rows(512))
            .foreign_slots(2);
        let cases = [
            (shape(1, 24, (24, 12), 4, 2), small_config(Scheme::PipelinedLlep)),
            (larger, larger_config),
            (larger, larger_config.pipeline_depth(3)),
        ];
        for (seed, ((s, config), profile)) in cases
            .into_iter()
            .flat_map(|case| [Profile::Balanced, Profile::Hot { ratio: 1.0, experts: 1 }].map(|p| (case, p)))
            .enumerate()
        {
            let problem = Bf16Problem::new(s, Ids::Profile(profile), 60 + seed as u64);
            let inputs = problem.inputs(0);
            let launch = llep::Plan::new(&config, problem.shape(), llep::Budget::Unlimited).expect("plan");
            let mut layer = Executor::new(launch, Device::Cuda(0)).expect("a CUDA executor");
            let plan = Schedule::from_top_k(&launch, &[inputs.routing.ids]).unwrap();
            let w = &inputs.experts;
            let up = |v: &[bf16]| ops.upload_bf16(v).unwrap();
            let (x, gate, w_up, down, dy) =
                (up(inputs.x), up(w.gate), up(w.up), up(w.down), up(&problem.dy[0]));
            let dev = DeviceInputs { x: &x, routing: inputs.routing, gate: &gate, up: &w_up, down: &down };
            let y = layer.forward(&ops, &plan, &dev).unwrap();
            let y = ops.download(&y, s.tokens * s.hidden).unwrap();
            let grads = layer.backward(&ops, &plan, &dev, &dy).unwrap().download(&ops).unwrap();
            let gpu = [Bf16Run { y, grads, high_water: 0, planned: 0 }];
            let errors = check_exactness(&problem, &gpu);
            assert!(errors.iter().all(|&(_, _, naive)| naive > 1e-4), "{errors:?}");
            // Tensor cores sum in another order than the CPU's GEMM: a bf16 store may round one
            // step apart, so the two runs agree to bf16's resolution, not bitwise.
            let cpu = run(&problem, &config);
            for (name, got, want) in [("y", &gpu[0].y, &cpu[0].y), ("dx", &gpu[0].grads.dx, &cpu[0].grads.dx)]
            {
                let want: Vec<f64> = want.iter().map(|&v| v as f64).collect();
                let d = relative_error(got, &want);
                assert!(d <= 1e-2, "{} tokens {profile:?} {name}: GPU vs CPU {d:.3e}", s.tokens);
            }
        }
        ops.synchronize().expect("synchronize before the communicator drops");
    }
}
