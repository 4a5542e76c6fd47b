//! Measured working set: PipelinedLLEP's transient heap (every rank's workspace, route tables,
//! plan and in-flight messages, measured by the counting allocator) for balanced routing and
//! for every route on one expert; against standard EP, whose peak grows with the skew.
//!
//! One test in this binary: the counters are process-wide.

mod common;

use common::{Ids, Problem, launch_bytes, small_config};
use flatpeak_common::{
    Communicator, CountingAllocator, DType, Device, LocalGroup, LocalGroupOptions, PeakMeter,
};
use llep::{Config, Executor, Pass, Scheme, Shape};

use llep::paper::Profile;

#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

/// Runs plan + forward + backward on every rank on a CPU executor (its workspace reserved at
/// the launch plan's bytes, a baseline's at its routing's); returns the measured transient peak
/// (outputs excluded) and each rank's reservation.
fn measure(problem: &Problem, config: &Config) -> (usize, Vec<usize>) {
    let m = PeakMeter::measure(|| {
        LocalGroup::run(problem.shape.ranks, LocalGroupOptions::default(), |comm| {
            let me = comm.rank();
            let inputs = problem.inputs(me);
            let run = || -> llep::Result<(Vec<f32>, llep::Gradients, usize)> {
                let launch = llep::Plan::new(config, problem.shape, llep::Budget::Unlimited)?;
                let mut layer = Executor::new(launch, Device::Cpu)?;
                let plan = layer.schedule(comm, &inputs.routing)?;
                // A baseline's reservation follows the routing: made before the step, as
                // PipelinedLLEP's is at launch.
                layer.reserve(plan.buffers(me, Pass::Backward).workspace_bytes()).expect("reserve");
                let y = layer.forward(comm, &plan, &inputs)?;
                let g = layer.backward(comm, &plan, &inputs, &problem.dy[me])?;
                Ok((y, g, layer.workspace_bytes()))
            };
            run().map_err(|e| flatpeak_common::Error::ShapeMismatch {
                what: "llep run",
                expected: 0,
                got: e.to_string().len(),
            })
        })
    })
    .unwrap();
    let reserved = m.value.iter().map(|r| r.as_ref().unwrap().2).collect();
    (m.peak_bytes, reserved)
}

/// The CPU GEMM's own scratch of one thread: `gemm` keeps a thread-local slab the size of the
/// L2 cache on every thread that runs a kernel, plus per-call packing. Measured on a fresh
/// thread running the expert GEMM shapes at G rows; routing-independent.
fn gemm_scratch_per_thread(shape: &Shape, g: usize) -> usize {
    use flatpeak_common::gemm::{Accumulate, MatMut, MatRef, MatmulOptions, Threads, matmul};
    let (h, i) = (shape.hidden, shape.intermediate);
    let (x, w) = (vec![0.5f32; g * h], vec![0.25f32; h * i]);
    let (mut out, mut dw) = (vec![0f32; g * h], vec![0f32; h * i]);
    let m = PeakMeter::measure(|| {
        std::thread::scope(|scope| {
            scope
                .spawn(|| -> flatpeak_common::Result<()> {
                    let add = MatmulOptions::with_accumulate(Accumulate::Add).threads(Threads::Single);
                    let (xr, wr) = (MatRef::row_major(&x, g, h)?, MatRef::row_major(&w, h, i)?);
                    matmul(MatMut::row_major(&mut out[..g * i], g, i)?, xr, wr, add)?;
                    matmul(
                        MatMut::row_major(&mut out, g, h)?,
                        MatRef::row_major(&x[..g * i], g, i)?,
                        wr.t(),
                        add,
                    )?;
                    matmul(
                        MatMut::row_major(&mut dw, h, i)?,
                        xr.t(),
                        MatRef::row_major(&out[..g * i], g, i)?,
                        add,
                    )
                })
                .join()
                .unwrap()
                .unwrap()
        })
    })
    .unwrap();
    m.peak_bytes
}

#[test]
fn working_set_is_fixed_under_skew() {
    let shape = Shape {
        ranks: 4,
        tokens: 96,
        hidden: 64,
        intermediate: 32,
        experts: 16,
        top_k: 4,
        dtype: DType::F32,
    };
    let balanced = Problem::new(shape, Ids::Profile(Profile::Balanced), 1);
    let skewed = Problem::new(shape, Ids::Profile(Profile::Hot { ratio: 1.0, experts: 1 }), 1);
    let ours = small_config(Scheme::PipelinedLlep).foreign_slots(3);
    let launch = launch_bytes(&ours, &shape);

    let (peak_bal, res_bal) = measure(&balanced, &ours);
    let (peak_skew, res_skew) = measure(&skewed, &ours);
    assert!(res_bal.iter().chain(&res_skew).all(|&b| b == launch), "{res_bal:?} {res_skew:?} vs {launch}");

    // Besides the P reservations: route tables are inside them; what is left is the plan's
    // O(P·E + P²) vectors, the LocalGroup's threads and channels and the messages in flight
    // (at most two rounds' rows per pair), and the GEMM's packing buffers.
    let b = llep::Plan::new(&ours, shape, llep::Budget::Unlimited)
        .map(|plan| plan.buffers(Pass::Backward))
        .unwrap();
    let in_flight = 2 * shape.ranks * b.send_rows() * (2 * shape.hidden * 4 + 12 * shape.top_k);
    let scratch =
        (shape.ranks + rayon::current_num_threads()) * gemm_scratch_per_thread(&shape, b.expert_rows());
    let slack = in_flight + scratch + (256 << 10);
    let fixed = shape.ranks * launch;
    println!(
        "PipelinedLLEP peak: balanced {peak_bal} B, all-on-one-expert {peak_skew} B, reservations {fixed} B"
    );
    for peak in [peak_bal, peak_skew] {
        assert!(peak >= fixed && peak <= fixed + slack, "peak {peak} outside [{fixed}, {}]", fixed + slack);
    }
    assert!(peak_bal.abs_diff(peak_skew) <= slack, "{peak_bal} vs {peak_skew}");

    // Standard EP sizes its buffers to what arrives: the hot rank's reservation grows with the
    // skew (the measured peaks also carry the GEMM's per-thread slabs, which swamp them here).
    let ep = Config::with_scheme(Scheme::StandardEp);
    let (ep_bal, ep_res_bal) = measure(&balanced, &ep);
    let (ep_skew, ep_res_skew) = measure(&skewed, &ep);
    println!(
        "standard EP peak: balanced {ep_bal} B {ep_res_bal:?}, all-on-one-expert {ep_skew} B {ep_res_skew:?}"
    );
    let (hot_bal, hot_skew) = (ep_res_bal.iter().max().unwrap(), ep_res_skew.iter().max().unwrap());
    assert!(*hot_skew > 2 * hot_bal && *hot_skew > 2 * launch, "EP {hot_bal} → {hot_skew}, ours {launch}");
}
