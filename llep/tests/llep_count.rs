//! The device work of a training step counted without a device (`llep::device::count_step`):
//! the counts the GPU schedule must keep, at the GPU bench's shape.

use flatpeak_common::{LocalGroup, LocalGroupOptions, SplitMix64};
use llep::device::{StepCounts, count_step};
use llep::{Config, DType, Device, LayerBudget, Plan, Routing, Shape, WeightLayout};

/// T=8192 H=2048 I=1024 E=64 k=8 on one rank (`python/bench/bench_cuda.py`'s MoE shape).
fn bench_shape(dtype: DType) -> Shape {
    Shape { ranks: 1, tokens: 8192, hidden: 2048, intermediate: 1024, experts: 64, top_k: 8, dtype }
}

/// The bench's configuration: torch's weight layout (`gate_up_proj`, `down_proj`), the layer
/// checkpointed, as the PyTorch binding runs it.
fn torch_config() -> Config {
    Config::default().weight_layout(WeightLayout::Linear)
}

fn step(shape: Shape, budget: LayerBudget, device: Device) -> StepCounts {
    step_with(torch_config(), shape, budget, device)
}

fn step_with(config: Config, shape: Shape, budget: LayerBudget, device: Device) -> StepCounts {
    let routes = shape.tokens * shape.top_k;
    // A router's choice: k distinct experts a token.
    let ids = SplitMix64::new(7).top_k_ids(shape.tokens, shape.experts, shape.top_k);
    let weights = vec![0.125f32; routes];
    let out = LocalGroup::run(shape.ranks, LocalGroupOptions::default(), |comm| {
        let launch = Plan::new(&config, shape, budget.of(&config, &shape, device).unwrap()).unwrap();
        Ok(count_step(comm, &launch, &Routing { ids: &ids, weights: &weights }))
    });
    out.into_iter().next().unwrap().unwrap().unwrap()
}

#[test]
fn the_bench_shape_runs_in_one_round_on_a_gpu_with_one_host_wait_per_pass() {
    for dtype in [DType::Bf16, DType::F32] {
        let shape = bench_shape(dtype);
        let c = step(shape, LayerBudget::Default, Device::Cuda(0));
        assert_eq!(c.rounds, 1, "{dtype:?}");
        let routes = (shape.tokens * shape.top_k) as f64;
        let (h, i, e) = (shape.hidden as f64, shape.intermediate as f64, shape.experts);
        // Every route's row through gate, up and down once forward; the backward recomputes
        // gate and up (not y: dw and dh come from r = dY·W_downᵀ) and runs five more products
        // of one projection's size: 8/3 of the forward's FLOPs, exactly.
        let flops =
            |d: &flatpeak_common::device_counts::DeviceCounts| d.gemms.iter().map(|g| g.flops()).sum::<f64>();
        assert_eq!(flops(&c.forward), 2.0 * routes * 3.0 * h * i);
        assert_eq!(3.0 * flops(&c.backward), 8.0 * flops(&c.forward));
        // The counts that must not grow: per round, two GEMMs per expert group forward and
        // five backward (gate and up one GEMM over `gate_up_proj`; one group per expert at
        // most), one host wait for the route metadata, and the launches of the expert groups
        // and the round's exchanges.
        assert_eq!((c.forward.gemms.len(), c.backward.gemms.len()), (2 * e, 5 * e), "{dtype:?}");
        // llep's split layout cannot read gate and up as one operand: three and eight, the same
        // FLOPs.
        let split = step_with(Config::default(), shape, LayerBudget::Default, Device::Cuda(0));
        assert_eq!((split.forward.gemms.len(), split.backward.gemms.len()), (3 * e, 8 * e), "{dtype:?}");
        assert_eq!((flops(&split.forward), flops(&split.backward)), (flops(&c.forward), flops(&c.backward)));
        assert_eq!((c.forward.host_syncs, c.backward.host_syncs), (1, 1), "{dtype:?}");
        assert!(c.forward.total_launches() <= 3 * e + 3, "{:?}", c.forward.launches);
        // Backward: nine row kernels a group (x, dY, δ and dh = w⊙r gathered; SwiGLU and its
        // backward; the dots; two scatters), the GEMMs counted above.
        assert!(c.backward.total_launches() <= 9 * e + 7, "{:?}", c.backward.launches);
        // Uploads per pass a handful, not per group: the round's lists once (rows, weights;
        // backward the metadata entries too), the send lists, and no scatter's groups (a
        // group's rows are distinct, so its scatters run directly on the lists).
        assert!(c.forward.uploads <= 6, "forward uploads: {}", c.forward.uploads);
        assert!(c.backward.uploads <= 10, "backward uploads: {}", c.backward.uploads);
        let grouped = |d: &flatpeak_common::device_counts::DeviceCounts| {
            d.launches
                .keys()
                .filter(|k| k.starts_with("llep_scatter_add_rows") && !k.contains("direct"))
                .count()
        };
        assert_eq!((grouped(&c.forward), grouped(&c.backward)), (0, 0), "{:?}", c.backward.launches);
    }
}

/// What a device executor allocates per pass is what the plan says it does: `Plan::device_bytes`
/// (the pass's device regions and its f32 outputs) against every buffer the counted schedule
/// reserves beside the inputs.
#[test]
fn each_pass_allocates_the_device_bytes_its_plan_states() {
    for dtype in [DType::Bf16, DType::F32] {
        let shape = bench_shape(dtype);
        let config = torch_config();
        let launch =
            Plan::new(&config, shape, LayerBudget::Default.of(&config, &shape, Device::Cuda(0)).unwrap())
                .unwrap();
        let c = step(shape, LayerBudget::Default, Device::Cuda(0));
        assert_eq!(
            c.forward.allocated_bytes,
            launch.pass_device_bytes(llep::Pass::Forward) as u64,
            "{dtype:?}"
        );
        assert_eq!(
            c.backward.allocated_bytes,
            launch.pass_device_bytes(llep::Pass::Backward) as u64,
            "{dtype:?}"
        );
        // Carved from one lent buffer, every pass fits the plan's arena with room for the
        // binding's own (an empty weight slot), and within a few KiB of the bytes it holds.
        for (pass, counted) in [(llep::Pass::Forward, &c.forward), (llep::Pass::Backward, &c.backward)] {
            let arena = launch.buffers(pass).device_arena_bytes() as u64;
            assert!(counted.arena_bytes + 256 <= arena, "{pass:?}: {} of {arena}", counted.arena_bytes);
            assert!(counted.allocations < launch.buffers(pass).device_buffers_bound(), "{pass:?}");
            assert!(arena - counted.allocated_bytes < 64 << 10, "{pass:?}");
        }
        assert!(launch.device_arena_bytes() as u64 >= c.forward.arena_bytes.max(c.backward.arena_bytes));
        // The GPU's default budget bounds the buffers; the outputs are the layer's own.
        let outputs = 4
            * (shape.tokens * (shape.hidden + shape.top_k)
                + 3 * shape.experts * shape.hidden * shape.intermediate);
        assert!(
            launch.device_bytes() <= llep::DEFAULT_CUDA_ROWS_BUDGET_BYTES + outputs + (64 << 20),
            "{}",
            launch.device_bytes()
        );
    }
}

#[test]
fn the_cpu_budget_takes_more_rounds_each_with_its_own_host_wait() {
    let shape = bench_shape(DType::Bf16);
    let gpu = step(shape, LayerBudget::Default, Device::Cuda(0));
    let cpu = step(shape, LayerBudget::Default, Device::Cpu);
    assert!(cpu.rounds > 1, "{}", cpu.rounds);
    assert_eq!((cpu.forward.host_syncs, cpu.backward.host_syncs), (cpu.rounds, cpu.rounds));
    // The same work in more, smaller GEMMs.
    let flops = |c: &StepCounts| c.forward.gemms.iter().map(|g| g.flops()).sum::<f64>();
    assert_eq!(flops(&cpu), flops(&gpu));
    assert!(cpu.forward.gemms.len() > gpu.forward.gemms.len());
}
