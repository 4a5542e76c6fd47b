//! The round schedule (`llep::device`) on the emulated and CUDA backends against the CPU
//! executor (the same schedule on host memory): with
//! `--features cuda-emu`, on a `LocalGroup` of P ∈ {1, 2, 4} ranks with balanced, fully skewed
//! (every slot on one expert: spills, foreign weights, several rounds) and random routing (a
//! token's duplicate routes to one expert), the kernels under the SIMT emulator; with `--features cuda`, an ignored test on one GPU (P = 1).
//! Forward and backward agree within 1e-5 relative.
#![cfg(any(feature = "cuda-emu", feature = "cuda"))]

mod common;

use common::{Ids, Problem, RankRun, small_config};
use flatpeak_common::{DType, relative_error};
use llep::{Gradients, Scheme, Shape};

use llep::paper::Profile;

const TOL: f64 = 1e-5;

fn shape(p: usize) -> Shape {
    Shape { ranks: p, tokens: 16, hidden: 8, intermediate: 4, experts: 4, top_k: 2, dtype: DType::F32 }
}

/// Each rank's device (y, gradients) against its CPU run.
fn compare(what: &str, device: &[(Vec<f32>, Gradients)], cpu: &[RankRun]) {
    assert_eq!(device.len(), cpu.len(), "{what}: ranks");
    for (me, ((y, g), c)) in device.iter().zip(cpu).enumerate() {
        let pairs = [
            ("y", y, &c.y),
            ("dx", &g.dx, &c.grads.dx),
            ("d_weights", &g.d_weights, &c.grads.d_weights),
            ("d_gate", &g.d_gate, &c.grads.d_gate),
            ("d_up", &g.d_up, &c.grads.d_up),
            ("d_down", &g.d_down, &c.grads.d_down),
        ];
        for (name, got, want) in pairs {
            if want.is_empty() {
                // d_up under the Linear layout (gate_up holds it): a device buffer is never
                // empty, and nothing is accumulated into it.
                assert!(got.iter().all(|&v| v == 0.0), "{what}: rank {me} {name} written");
                continue;
            }
            assert_eq!(got.len(), want.len(), "{what}: rank {me} {name} length");
            let want: Vec<f64> = want.iter().map(|&v| v as f64).collect();
            let err = relative_error(got, &want);
            assert!(err <= TOL, "{what}: rank {me} {name} relative error {err:.3e}");
        }
    }
}

#[cfg(feature = "cuda-emu")]
mod emulated {
    use super::*;
    use flatpeak_common::{Communicator, LocalGroup, LocalGroupOptions, Workspace};
    use llep::device::{self, DeviceInputs, DeviceOps};
    use llep::emu_ops::EmuOps;
    use llep::{Config, Pass, Schedule};

    /// The host side of the device schedule's reservation (route tables, metadata staging,
    /// grouping arrays) for both passes of `plan` on rank `me`.
    fn host_workspace(plan: &Schedule, me: usize) -> Workspace {
        let bytes = [Pass::Forward, Pass::Backward].map(|p| plan.buffers(me, p).host_workspace_bytes());
        Workspace::new(bytes[0].max(bytes[1])).expect("workspace")
    }

    /// Plans on every rank (host), then runs the device forward and backward on the emulator
    /// (with `saving`, the saving forward and the backward from its store).
    fn run_device(
        problem: &Problem,
        config: &Config,
        saving: bool,
    ) -> Vec<(Vec<f32>, Gradients, usize, usize)> {
        LocalGroup::run(problem.shape.ranks, LocalGroupOptions::default(), |comm| {
            Ok((|| -> llep::Result<_> {
                let me = comm.rank();
                let inputs = problem.inputs(me);
                let plan = llep::cpu::schedule(
                    comm,
                    &llep::Plan::new(config, problem.shape, llep::Budget::Unlimited).expect("plan"),
                    &inputs.routing,
                )?;
                let ops = EmuOps::new(comm);
                let w = &inputs.experts;
                let (x, gate, up, down) =
                    (ops.upload(inputs.x)?, ops.upload(w.gate)?, ops.upload(w.up)?, ops.upload(w.down)?);
                let dev = DeviceInputs { x: &x, routing: inputs.routing, gate: &gate, up: &up, down: &down };
                let dy = ops.upload(&problem.dy[me])?;
                let (y, grads, _) = common::device_pass(&ops, (&plan, me, problem.shape), &dev, &dy, saving)?;
                Ok((y, grads, plan.rounds(), plan.assignment().transfers().len()))
            })())
        })
        .into_iter()
        .map(|r| r.map_err(llep::Error::from).and_then(|inner| inner).unwrap())
        .collect()
    }

    #[test]
    fn device_schedule_matches_cpu_executor() {
        let profiles = [
            ("balanced", Ids::Profile(Profile::Balanced)),
            ("hot 100% on 1", Ids::Profile(Profile::Hot { ratio: 1.0, experts: 1 })),
            ("random (duplicate routes)", Ids::Random),
        ];
        // Two buffer copies: round j+1's dispatch is issued before round j's experts run; three:
        // round j−1's scatter also waits until after them. One: rounds one after another.
        for (p, depth) in [(1, 2), (2, 2), (4, 2), (2, 1), (4, 1), (2, 3), (4, 3)] {
            for (seed, (name, ids)) in profiles.iter().enumerate() {
                let what = format!("P={p} depth {depth} {name}");
                let problem = Problem::new(shape(p), *ids, (p * 10 + seed) as u64);
                let config = small_config(Scheme::PipelinedLlep).pipeline_depth(depth);
                let cpu: Vec<RankRun> =
                    common::run(&problem, &config).into_iter().map(|r| r.unwrap()).collect();
                let device = run_device(&problem, &config, false);
                let (rounds, transfers) = (device[0].2, device[0].3);
                assert_eq!(rounds, cpu[0].plan.rounds(), "{what}: rounds");
                if matches!(ids, Ids::Profile(Profile::Hot { .. })) {
                    // The skewed case exercises several rounds and (P > 1) spills with foreign
                    // weights travelling to helpers and their gradients back.
                    assert!(
                        rounds > 1 && (p == 1 || transfers > 0),
                        "{what}: {transfers} transfers, {rounds} rounds"
                    );
                }
                let results: Vec<_> = device.into_iter().map(|(y, g, _, _)| (y, g)).collect();
                compare(&what, &results, &cpu);
            }
        }
    }

    /// Weights in torch's layout on the device schedule (the kernels and the GEMMs reading them
    /// transposed, spilled experts' weights and gradients travelling in that layout), both modes.
    #[test]
    fn torch_weight_layout_on_the_device_matches_the_cpu_executor() {
        for (seed, ids) in
            [Ids::Profile(Profile::Hot { ratio: 1.0, experts: 1 }), Ids::Random].into_iter().enumerate()
        {
            let problem = Problem::new(shape(4), ids, 70 + seed as u64).in_linear_layout();
            for mode in [llep::Mode::Checkpointed, llep::Mode::SaveActivations] {
                let what = format!("linear {ids:?} {mode:?}");
                let config =
                    small_config(Scheme::PipelinedLlep).weight_layout(llep::WeightLayout::Linear).mode(mode);
                let saving = mode == llep::Mode::SaveActivations;
                let cpu: Vec<RankRun> = if saving {
                    common::run_saved(&problem, &config)
                } else {
                    common::run(&problem, &config)
                }
                .into_iter()
                .map(|r| r.unwrap())
                .collect();
                let device: Vec<_> =
                    run_device(&problem, &config, saving).into_iter().map(|(y, g, _, _)| (y, g)).collect();
                compare(&what, &device, &cpu);
            }
        }
    }

    /// Saved activations on the device schedule: the saving forward and the backward from its
    /// store (copies in and out of the store, six GEMMs per group) against the CPU executor's.
    #[test]
    fn saved_activations_on_the_device_match_the_cpu_executor() {
        for (p, depth) in [(1, 2), (2, 1), (4, 2), (4, 3)] {
            for (seed, ids) in
                [Ids::Profile(Profile::Hot { ratio: 1.0, experts: 1 }), Ids::Random].into_iter().enumerate()
            {
                let what = format!("saved P={p} depth {depth} {ids:?}");
                let problem = Problem::new(shape(p), ids, (p * 10 + seed + 5) as u64);
                let config = small_config(Scheme::PipelinedLlep)
                    .pipeline_depth(depth)
                    .mode(llep::Mode::SaveActivations);
                let cpu: Vec<RankRun> =
                    common::run_saved(&problem, &config).into_iter().map(|r| r.unwrap()).collect();
                let device: Vec<_> =
                    run_device(&problem, &config, true).into_iter().map(|(y, g, _, _)| (y, g)).collect();
                compare(&what, &device, &cpu);
            }
        }
    }

    /// The emulated device runs f32 and bf16 (the bf16 layer: `tests/llep_bf16.rs`): f16 is a
    /// typed error naming the device and what it runs, and f32 buffers handed to a bf16 plan are
    /// a dtype mismatch, not a reinterpretation.
    #[test]
    fn a_dtype_the_emulated_device_does_not_run_is_a_typed_error() {
        let bf16_shape = Shape { dtype: DType::Bf16, ..shape(1) };
        let problem = Problem::new(shape(1), Ids::Random, 4);
        let out = LocalGroup::run(1, LocalGroupOptions::default(), |comm| {
            let ops = EmuOps::new(comm);
            let alloc = ops.alloc(8, DType::F16).map(|_| ());
            let inputs = problem.inputs(0);
            let plan = llep::cpu::schedule(
                comm,
                &llep::Plan::new(&small_config(Scheme::PipelinedLlep), bf16_shape, llep::Budget::Unlimited)
                    .expect("plan"),
                &inputs.routing,
            )
            .unwrap();
            let w = &inputs.experts;
            let up = |v: &[f32]| ops.upload(v).unwrap();
            let (x, gate, upw, down) = (up(inputs.x), up(w.gate), up(w.up), up(w.down));
            let dev = DeviceInputs { x: &x, routing: inputs.routing, gate: &gate, up: &upw, down: &down };
            let forward = device::forward(&ops, &host_workspace(&plan, 0), &plan, &dev, None).map(|_| ());
            Ok((alloc, forward))
        });
        let (alloc, forward) = out.into_iter().next().unwrap().unwrap();
        assert!(
            matches!(&alloc, Err(llep::Error::UnsupportedDtype { dtype: DType::F16, backend, .. }) if backend.contains("emulated")),
            "{alloc:?}"
        );
        assert!(
            matches!(
                forward,
                Err(llep::Error::DtypeMismatch { expected: DType::Bf16, found: DType::F32, .. })
            ),
            "{forward:?}"
        );
    }

    #[test]
    fn short_device_input_is_a_typed_error() {
        let problem = Problem::new(shape(1), Ids::Random, 3);
        let config = small_config(Scheme::PipelinedLlep);
        let out = LocalGroup::run(1, LocalGroupOptions::default(), |comm| {
            let inputs = problem.inputs(0);
            let plan = llep::cpu::schedule(
                comm,
                &llep::Plan::new(&config, problem.shape, llep::Budget::Unlimited).expect("plan"),
                &inputs.routing,
            )
            .unwrap();
            let ops = EmuOps::new(comm);
            let w = &inputs.experts;
            let (x, gate, up, down) = (
                ops.upload(&inputs.x[1..]).unwrap(),
                ops.upload(w.gate).unwrap(),
                ops.upload(w.up).unwrap(),
                ops.upload(w.down).unwrap(),
            );
            let dev = DeviceInputs { x: &x, routing: inputs.routing, gate: &gate, up: &up, down: &down };
            Ok(device::forward(&ops, &host_workspace(&plan, 0), &plan, &dev, None).map(|_| ()))
        });
        let n = problem.shape.tokens * problem.shape.hidden;
        assert!(
            matches!(out[0], Ok(Err(llep::Error::ShapeMismatch { what: "x (N·H)", expected, got: found }))
                if expected == n && found == n - 1),
            "{:?}",
            out[0]
        );
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use flatpeak_common::Device;
    use flatpeak_common::nccl::NcclComm;
    use llep::cuda::CudaOps;
    use llep::device::{DeviceInputs, DeviceOps};
    use llep::{Config, Executor, Schedule};

    /// One GPU (P = 1): the device schedule with NVRTC kernels, cuBLAS and NCCL against the CPU
    /// executor, balanced and skewed, on the tiny shape and on one whose rounds (4 of 512
    /// rows × H = 256, either profile) are long enough for round j+1's all-to-alls on NCCL's stream
    /// to run beside round j's kernels on the compute stream (with two and three buffer copies). Needs a CUDA device, NVRTC and
    /// NCCL.
    #[test]
    #[ignore = "needs a CUDA device with NVRTC and NCCL"]
    fn gpu_schedule_matches_cpu_executor() {
        let ctx = flatpeak_common::cuda::context(0).expect("a CUDA device");
        let comm = NcclComm::for_devices(vec![ctx.default_stream()]).expect("NCCL").remove(0);
        let ops = CudaOps::new(&comm).expect("CUDA ops");
        let larger =
            Shape { tokens: 2048, hidden: 256, intermediate: 128, experts: 16, top_k: 4, ..shape(1) };
        let larger_config = Config::with_scheme(Scheme::PipelinedLlep)
            .min_chunk(64)
            .pair_cap(llep::PairCap::Rows(512))
            .foreign_slots(2);
        let cases = [
            (shape(1), small_config(Scheme::PipelinedLlep)),
            (larger, larger_config),
            (larger, larger_config.pipeline_depth(3)),
        ];
        for (seed, ((shape, config), profile)) in cases
            .into_iter()
            .flat_map(|case| [Profile::Balanced, Profile::Hot { ratio: 1.0, experts: 1 }].map(|p| (case, p)))
            .enumerate()
        {
            let what = format!("GPU P=1 {} tokens {profile:?}", shape.tokens);
            let problem = Problem::new(shape, Ids::Profile(profile), 40 + seed as u64);
            let cpu: Vec<RankRun> = common::run(&problem, &config).into_iter().map(|r| r.unwrap()).collect();
            let inputs = problem.inputs(0);
            let launch = llep::Plan::new(&config, problem.shape, llep::Budget::Unlimited).expect("plan");
            let mut layer = Executor::new(launch, Device::Cuda(0)).expect("a CUDA executor");
            let plan = Schedule::from_top_k(&launch, &[inputs.routing.ids]).unwrap();
            let w = &inputs.experts;
            let up = |v: &[f32]| ops.upload(v).unwrap();
            let (x, gate, w_up, down, dy) =
                (up(inputs.x), up(w.gate), up(w.up), up(w.down), up(&problem.dy[0]));
            let dev = DeviceInputs { x: &x, routing: inputs.routing, gate: &gate, up: &w_up, down: &down };
            let y = layer.forward(&ops, &plan, &dev).unwrap();
            let y = ops.download(&y, problem.shape.tokens * problem.shape.hidden).unwrap();
            let grads = layer.backward(&ops, &plan, &dev, &dy).unwrap().download(&ops).unwrap();
            compare(&what, &[(y, grads)], &cpu);
        }
        ops.synchronize().expect("synchronize before the communicator drops");
    }
}
