//! `llep` measurements: PipelinedLLEP against LLEP (and standard EP) on P = 8 `LocalGroup`
//! ranks, N = 4096 tokens per rank, H = 512, I = 256, E = 64, k = 8, f32, for the LLEP
//! harness's profiles `balanced`, `50%:4` and `95%:1`: a checkpointed training step (plan,
//! forward, then recompute + backward) and a forward-only step (LLEP's own measurement); plus a
//! plan-only row at the paper's shape (P = 8, N = 65,536, k = 8, E = 128, H = 7168, I = 2048,
//! bf16) from the peak model fitted to the paper's figures (`llep::paper`).
//!
//! Every scheme runs the same executor (`llep::Executor` on the CPU) on the same inputs, each rank's expert
//! GEMMs single-threaded on its own thread ([`Threads::Single`]). After one untimed warm-up
//! step, PipelinedLLEP and LLEP run interleaved for [`ROUNDS`] rounds ([`FORWARD_ROUNDS`] for
//! the shorter forward-only rows; alternating which goes first): wall times are medians, each
//! rank's CPU time its minimum (below). Standard EP (metrics only) runs once per row, in the
//! middle round, to keep the component within its time budget.
//!
//! **What is timed.** `ms` is the group's wall time of one step: each rank waits at a barrier,
//! then plans (all-gathers counts, assigns, all-gathers row counts) and runs the step; the time
//! is from the earliest rank's start to the latest rank's end. The P ranks share this machine's
//! cores, so wall time measures total work, not balance. `makespan_ms` is what a P-device run
//! would wait for: the largest, over ranks, of the rank thread's CPU time during its step
//! (`CLOCK_THREAD_CPUTIME_ID`; time blocked waiting for peers is not CPU time). It includes the
//! rank's GEMMs, packing, scatter and its side of the message copies. Each rank's time is its
//! minimum over the rounds — its step's own work, best of the rounds as the machine probe is
//! best of five — and the makespan the largest of those minima. Eight rank threads on two
//! cores disturb each other (cache and memory contention, reschedules), and a P-device run
//! would not see that: a per-step maximum over eight ranks picks up every disturbance, and
//! in one diagnostic run even a rank's median did (one rank 18–25% above its peers in four of
//! five rounds, on identical balanced work). The same estimator
//! serves every scheme; `makespan_median_ms` (and `_llep`) keep the median-based figure.
//! `speedup_paired` and `makespan_speedup_vs_llep_paired` are the medians over rounds of
//! LLEP's wall time (makespan) ÷ PipelinedLLEP's in the same round ([`paired_ratio`]): the
//! machine's speed drifts between rounds by more than the schemes differ, and a pair shares it.
//!
//! **What `peak_bytes` counts (per rank, max over ranks).** The ranks share one process
//! allocator, so the counting allocator sees the group, not a rank. A rank's transient working
//! set is taken as (1) the rank's [`Executor`]'s workspace reservation, from which it carves
//! every buffer it uses — send, receive, output, index and metadata buffers of every pipeline
//! copy, the expert GEMM scratch, the foreign-expert slots and their gradients, the route
//! tables — and which it cannot exceed (a carve past it is an error, never growth; the tests
//! check the carves fill it exactly). PipelinedLLEP reserves its launch [`llep::Plan`]'s buffers for the pass, the
//! baselines what their plan sizes to this routing ([`Schedule::buffers`]). Plus (2) the rank's share, 1/P, of
//! everything else the group allocates during the step beyond its outputs (y, dX, d(weights),
//! dW), measured by the counting allocator around the whole group step with the workspaces
//! reserved beforehand: the plan's vectors, per-round count vectors, the `LocalGroup`
//! transport's copies of messages in flight (a real all-to-all writes straight into the receive
//! buffer that (1) already counts) and the GEMM library's per-thread packing slabs. For
//! PipelinedLLEP the ranks are symmetric, so the 1/P share is exact up to timing; for the
//! baselines the hot rank's share may be larger, which would only raise the baseline. The
//! whole-group figures are reported too (`group_peak_bytes*`).
//!
//! **Exactness.** y, dX and d(weights) of 16 tokens of rank 0 (hot under the skewed profiles)
//! and 16 of rank P−1 against the dense f64 reference; y (and in training the native experts'
//! dW_gate, dW_up, dW_down of every rank) against LLEP's over all tokens. An f32 row is `exact`
//! iff every relative error is ≤ 1e-5.
//!
//! **bf16 rows.** Every row runs in f32 and again in bf16: tokens, expert weights and dY in
//! bf16 (the f32 inputs rounded), the executors' dispatch rows and expert scratch in bf16, its
//! GEMMs on the CPU's bf16 instructions (`gemm_path_amx`, `gemm_path_avx512_bf16` or
//! `gemm_path_widened` is 1: the path that ran), outputs and gradients
//! f32, LLEP in bf16 alike. A bf16 row meets its promise iff each error against the f64
//! reference (of the rounded inputs) is ≤ 2 × the naive bf16 computation's + 1e-2
//! (`llep::cpu::reference::naive_bf16_forward`); both are reported.

use std::collections::BTreeMap;
use std::sync::{Mutex, OnceLock};
use std::time::Instant;

use flatpeak_common::gemm::Threads;
use flatpeak_common::{Communicator, DType, Device, LocalGroup, LocalGroupOptions, PeakMeter};
use llep::{
    Config as LlepConfig, Executor, Gradients, PairCap, Pass, RankInputs, Schedule, Scheme, Shape, SpillSplit,
};

use llep::paper::{PAPER_SHAPE, PeakModel, Profile, crate_pair_cap, model_row};

use super::llep_data::Bf16Data;
pub use super::llep_data::{Data, Phase, RankOut, SHAPE};
use super::llep_errors::errors;
use super::{Component, ReportError, workload};
use crate::machine::{MachineInfo, median};
use crate::report::{Comparison, Row};

/// The pair cap q of the measured rows: 512 rows per (source, destination) per round, so every
/// receive buffer holds P·q = 4096 rows (K = 2 rounds balanced, 4 on 50%:4, 2 on 95%:1).
pub const PAIR_CAP: usize = 512;

/// F_max: foreign-expert slots per rank (LLEP's assignment needs at most 3 here).
pub const FOREIGN_SLOTS: usize = 4;

/// The LLEP harness profiles measured.
pub const PROFILES: [&str; 3] = ["balanced", "50%:4", "95%:1"];

/// Interleaved rounds per training-step row (PipelinedLLEP and LLEP each round, standard EP
/// once, in the middle round, since it only feeds metrics).
pub const ROUNDS: usize = 5;

/// Interleaved rounds per forward-only row: its steps are ~4× shorter, so the same time buys
/// more rounds and a steadier median.
pub const FORWARD_ROUNDS: usize = 9;

/// One row of the component.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    /// A measured profile and phase at [`SHAPE`], in f32 or bf16.
    Measured {
        /// Index into [`PROFILES`].
        profile: usize,
        /// What runs.
        phase: Phase,
        /// The storage type.
        dtype: DType,
    },
    /// The plan-only row at the paper's shape (balanced, K = 10).
    PaperPlan,
}

impl Workload {
    /// Every row, in report order.
    pub fn all() -> Vec<Workload> {
        let measured = [DType::F32, DType::Bf16].into_iter().flat_map(|dtype| {
            (0..PROFILES.len()).flat_map(move |profile| {
                [Phase::TrainingStep, Phase::ForwardOnly].map(|phase| Workload::Measured {
                    profile,
                    phase,
                    dtype,
                })
            })
        });
        measured.chain([Workload::PaperPlan]).collect()
    }

    /// The report's workload string.
    pub fn describe(&self) -> String {
        match *self {
            Workload::Measured { profile, phase, dtype } => {
                let s = shape(dtype);
                let what = match phase {
                    Phase::TrainingStep => "fwd+bwd (checkpointed)",
                    Phase::ForwardOnly => "fwd",
                };
                format!(
                    "P={} N={}/rank H={} I={} E={} k={} {} {} {what}",
                    s.ranks,
                    s.tokens,
                    s.hidden,
                    s.intermediate,
                    s.experts,
                    s.top_k,
                    s.dtype,
                    PROFILES[profile]
                )
            }
            Workload::PaperPlan => {
                let s = PAPER_SHAPE;
                format!(
                    "P={} N={}/rank H={} I={} E={} k={} {} balanced K=10 (plan only, per rank)",
                    s.ranks, s.tokens, s.hidden, s.intermediate, s.experts, s.top_k, s.dtype
                )
            }
        }
    }
}

/// The three configurations compared; every GEMM on its rank's thread.
pub fn configs() -> [(Scheme, LlepConfig); 3] {
    let single = |c: LlepConfig| c.gemm_threads(Threads::Single);
    [
        (
            Scheme::PipelinedLlep,
            single(LlepConfig::default().pair_cap(PairCap::Rows(PAIR_CAP)).foreign_slots(FOREIGN_SLOTS)),
        ),
        (Scheme::Llep, single(LlepConfig::with_scheme(Scheme::Llep).spill_split(SpillSplit::Position))),
        (Scheme::StandardEp, single(LlepConfig::with_scheme(Scheme::StandardEp))),
    ]
}

/// [`SHAPE`] in this storage type.
pub fn shape(dtype: DType) -> Shape {
    Shape { dtype, ..SHAPE }
}

/// The f32 inputs, or for bf16 the same rounded to bf16 (the references' inputs).
fn data(dtype: DType) -> &'static Data {
    static DATA: OnceLock<Data> = OnceLock::new();
    static ROUNDED: OnceLock<Data> = OnceLock::new();
    let f32_data = DATA.get_or_init(|| Data::new(&SHAPE));
    match dtype {
        DType::Bf16 => ROUNDED.get_or_init(|| f32_data.rounded_to_bf16()),
        _ => f32_data,
    }
}

/// The bf16 tensors of the bf16 rows.
fn bf16_data() -> &'static Bf16Data {
    static DATA: OnceLock<Bf16Data> = OnceLock::new();
    DATA.get_or_init(|| Bf16Data::new(data(DType::F32)))
}

/// One rank's step on inputs of the storage type `T`.
fn rank_step<C: Communicator + ?Sized, T: llep::LayerElement>(
    layer: &mut Executor,
    comm: &C,
    (inputs, dy): (&RankInputs<'_, T>, &[T]),
    phase: Phase,
) -> llep::Result<(Schedule, Vec<f32>, Option<Gradients>)> {
    let plan = layer.schedule(comm, &inputs.routing)?;
    let y = layer.forward(comm, &plan, inputs)?;
    let grads = match phase {
        Phase::TrainingStep => Some(layer.backward(comm, &plan, inputs, dy)?),
        Phase::ForwardOnly => None,
    };
    Ok((plan, y, grads))
}

/// CPU time of the calling thread, in ms (`CLOCK_THREAD_CPUTIME_ID`).
pub fn thread_cpu_ms() -> f64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid, writable timespec for the duration of the call, and
    // CLOCK_THREAD_CPUTIME_ID is a clock every Linux kernel provides.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return f64::NAN;
    }
    ts.tv_sec as f64 * 1e3 + ts.tv_nsec as f64 / 1e6
}

/// One step of one scheme on the group: per-rank outputs, wall ms, each rank's CPU ms, and
/// the group's transient bytes beyond the workspaces and outputs.
struct Step {
    outs: Vec<RankOut>,
    wall_ms: f64,
    rank_cpu_ms: Vec<f64>,
    cpu_ms_total: f64,
    extra_bytes: usize,
}

fn run_step(
    config: &LlepConfig,
    ids: &[i64],
    phase: Phase,
    executors: &[Mutex<Executor>],
) -> Result<Step, String> {
    let (d, dtype) = (data(DType::F32), config_dtype(executors));
    let b = (dtype == DType::Bf16).then(bf16_data);
    let measured = PeakMeter::measure(|| {
        LocalGroup::run(SHAPE.ranks, LocalGroupOptions::default(), |comm| {
            let me = comm.rank();
            let inputs = d.inputs(&SHAPE, me, ids);
            let inputs_bf16 = b.map(|b| (b.inputs(&SHAPE, me, ids, &d.weights[me]), b.dy(me)));
            let mut layer = executors[me].lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            comm.barrier()?;
            let (t0, c0) = (Instant::now(), thread_cpu_ms());
            debug_assert_eq!(layer.plan().config(), config);
            let ran = match &inputs_bf16 {
                Some((x, dy)) => rank_step(&mut layer, comm, (x, dy), phase),
                None => rank_step(&mut layer, comm, (&inputs, d.dy(me)), phase),
            };
            Ok(ran.map(|(plan, y, grads)| RankOut {
                y,
                grads,
                span: (t0, Instant::now()),
                cpu_ms: thread_cpu_ms() - c0,
                plan,
            }))
        })
    })
    .map_err(|e| e.to_string())?;
    let mut outs = Vec::with_capacity(SHAPE.ranks);
    for r in measured.value {
        outs.push(r.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?);
    }
    let start = outs.iter().map(|o| o.span.0).min().ok_or("no rank ran")?;
    let end = outs.iter().map(|o| o.span.1).max().ok_or("no rank ran")?;
    Ok(Step {
        wall_ms: (end - start).as_secs_f64() * 1e3,
        rank_cpu_ms: outs.iter().map(|o| o.cpu_ms).collect(),
        cpu_ms_total: outs.iter().map(|o| o.cpu_ms).sum(),
        extra_bytes: measured.peak_bytes,
        outs,
    })
}

/// The storage type the executors were planned for.
fn config_dtype(executors: &[Mutex<Executor>]) -> DType {
    executors.first().and_then(|e| e.lock().ok().map(|e| e.plan().shape().dtype)).unwrap_or(DType::F32)
}

/// Each rank's CPU executor for `config` at `shape`, its workspace reserved for this routing
/// (pages touched): PipelinedLLEP's launch size for the pass, the baselines' plan for this
/// routing.
fn executors(
    config: &LlepConfig,
    shape: Shape,
    ids: &[i64],
    pass: Pass,
) -> Result<Vec<Mutex<Executor>>, String> {
    let views: Vec<&[i64]> = (0..SHAPE.ranks).map(|_| ids).collect();
    let bytes: Vec<usize> = match config.scheme {
        Scheme::PipelinedLlep => {
            let b = llep::Plan::new(config, shape, llep::Budget::Unlimited)
                .map(|plan| plan.buffers(pass))
                .map_err(|e| e.to_string())?
                .workspace_bytes();
            vec![b; SHAPE.ranks]
        }
        _ => {
            let plan = llep::Plan::new(config, shape, llep::Budget::Unlimited).map_err(|e| e.to_string())?;
            let plan = Schedule::from_top_k(&plan, &views).map_err(|e| e.to_string())?;
            (0..SHAPE.ranks).map(|d| plan.buffers(d, pass).workspace_bytes()).collect()
        }
    };
    let plan = llep::Plan::new(config, shape, llep::Budget::Unlimited).map_err(|e| e.to_string())?;
    let mut out = Vec::with_capacity(bytes.len());
    for b in bytes {
        // The reservation is written once when made (`Workspace::new`): its pages are touched.
        let layer = Executor::with_workspace_bytes(plan, Device::Cpu, b).map_err(|e| e.to_string())?;
        out.push(Mutex::new(layer));
    }
    Ok(out)
}

/// Medians, makespans and peaks of one scheme over the rounds, and its last outputs.
struct Summary {
    ms: f64,
    /// Each round's wall ms, in round order (for paired ratios).
    round_wall_ms: Vec<f64>,
    /// Each round's makespan (max over ranks of that round's CPU ms), in round order.
    round_makespan_ms: Vec<f64>,
    makespan_ms: f64,
    makespan_median_ms: f64,
    cpu_ms_total: f64,
    rank_peak: usize,
    group_peak: usize,
    last: Vec<RankOut>,
}

fn summarize(steps: Vec<Step>, executors: &[Mutex<Executor>]) -> Result<Summary, String> {
    let high: Vec<usize> =
        executors.iter().map(|w| w.lock().map(|w| w.workspace_bytes()).unwrap_or(usize::MAX)).collect();
    let extra = steps.iter().map(|s| s.extra_bytes).max().unwrap_or(0);
    let round_wall_ms: Vec<f64> = steps.iter().map(|s| s.wall_ms).collect();
    let round_makespan_ms: Vec<f64> =
        steps.iter().map(|s| s.rank_cpu_ms.iter().copied().fold(0.0, f64::max)).collect();
    let mut wall = round_wall_ms.clone();
    let per_rank = |r: usize| steps.iter().map(|s| s.rank_cpu_ms[r]).collect::<Vec<f64>>();
    let makespan_ms =
        (0..SHAPE.ranks).map(|r| per_rank(r).into_iter().fold(f64::INFINITY, f64::min)).fold(0.0, f64::max);
    let makespan_median_ms = (0..SHAPE.ranks).map(|r| median(&mut per_rank(r))).fold(0.0, f64::max);
    let mut total: Vec<f64> = steps.iter().map(|s| s.cpu_ms_total).collect();
    let last = steps.into_iter().last().ok_or("no round ran")?.outs;
    Ok(Summary {
        ms: median(&mut wall),
        round_wall_ms,
        round_makespan_ms,
        makespan_ms,
        makespan_median_ms,
        cpu_ms_total: median(&mut total),
        rank_peak: high.iter().copied().max().unwrap_or(0) + extra.div_ceil(SHAPE.ranks),
        group_peak: high.iter().sum::<usize>() + extra,
        last,
    })
}

/// Median over rounds of `baseline[i] / ours[i]`: the two ran back to back in round i (in
/// alternating order), so a drift of this VM's speed between rounds (up to 15% for the same
/// step here) cancels within each pair.
pub fn paired_ratio(baseline: &[f64], ours: &[f64]) -> f64 {
    let mut r: Vec<f64> = baseline.iter().zip(ours).map(|(b, o)| b / o).collect();
    median(&mut r)
}

/// The `flatpeak report` component.
#[derive(Debug, Clone, Copy, Default)]
pub struct LlepComponent;

impl LlepComponent {
    fn measured_row(&self, profile: usize, phase: Phase, dtype: DType) -> Result<Row, String> {
        let spec: Profile = PROFILES[profile].parse().map_err(|e: llep::Error| e.to_string())?;
        let ids = spec.ids(&Shape { ranks: 1, ..SHAPE }).map_err(|e| e.to_string())?;
        let pass = match phase {
            Phase::TrainingStep => Pass::Backward,
            Phase::ForwardOnly => Pass::Forward,
        };
        let configs = configs();
        let mut summaries = Vec::with_capacity(configs.len());
        let mut steps: Vec<Vec<Step>> = configs.iter().map(|_| Vec::new()).collect();
        let spaces: Vec<Vec<Mutex<Executor>>> =
            configs.iter().map(|(_, c)| executors(c, shape(dtype), &ids, pass)).collect::<Result<_, _>>()?;
        // One untimed step first: the allocator's mmap threshold adapts after the first large
        // free, so whichever scheme ran first would otherwise pay extra page faults.
        run_step(&configs[0].1, &ids, phase, &spaces[0])?;
        let rounds = match phase {
            Phase::TrainingStep => ROUNDS,
            Phase::ForwardOnly => FORWARD_ROUNDS,
        };
        for round in 0..rounds {
            // PipelinedLLEP and LLEP swap order every round; standard EP (metrics only) runs
            // once, in the middle round.
            let order: [usize; 3] = if round % 2 == 0 { [0, 1, 2] } else { [1, 0, 2] };
            for c in order {
                if configs[c].0 != Scheme::StandardEp || round == rounds / 2 {
                    let step = run_step(&configs[c].1, &ids, phase, &spaces[c]);
                    steps[c].push(step.map_err(|e| format!("{:?}: {e}", configs[c].0))?);
                }
            }
        }
        for (runs, ws) in steps.into_iter().zip(&spaces) {
            summaries.push(summarize(runs, ws)?);
        }
        drop(spaces);
        let [ours, llep, ep] =
            <[Summary; 3]>::try_from(summaries).map_err(|_| "three schemes".to_string())?;
        let (errs, within) = errors(data(dtype), &ids, (&ours.last, &llep.last), phase, dtype)?;
        let max_rel_err = errs.iter().filter(|e| !e.0.starts_with("naive")).map(|e| e.1).fold(0.0, f64::max);
        let plan = &ours.last[0].plan;
        let mut metrics: BTreeMap<String, f64> = errs.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        metrics.extend([
            ("peak_bytes_ep".to_string(), ep.rank_peak as f64),
            ("ms_ep".to_string(), ep.ms),
            ("makespan_ms".to_string(), ours.makespan_ms),
            ("makespan_ms_llep".to_string(), llep.makespan_ms),
            ("makespan_ms_ep".to_string(), ep.makespan_ms),
            ("makespan_median_ms".to_string(), ours.makespan_median_ms),
            ("makespan_median_ms_llep".to_string(), llep.makespan_median_ms),
            ("cpu_ms_all_ranks".to_string(), ours.cpu_ms_total),
            ("cpu_ms_all_ranks_llep".to_string(), llep.cpu_ms_total),
            ("cpu_ms_all_ranks_ep".to_string(), ep.cpu_ms_total),
            ("makespan_speedup_vs_llep".to_string(), llep.makespan_ms / ours.makespan_ms),
            ("makespan_speedup_vs_ep".to_string(), ep.makespan_ms / ours.makespan_ms),
            ("speedup_paired".to_string(), paired_ratio(&llep.round_wall_ms, &ours.round_wall_ms)),
            (
                "makespan_speedup_vs_llep_paired".to_string(),
                paired_ratio(&llep.round_makespan_ms, &ours.round_makespan_ms),
            ),
            ("rounds".to_string(), plan.rounds() as f64),
            ("pair_cap".to_string(), plan.pair_cap() as f64),
            ("max_rows_per_round".to_string(), plan.max_rows_per_round() as f64),
            ("foreign_experts".to_string(), plan.assignment().max_foreign() as f64),
            ("foreign_experts_llep".to_string(), llep.last[0].plan.assignment().max_foreign() as f64),
            ("workspace_bytes_per_rank".to_string(), plan.buffers(0, pass).workspace_bytes() as f64),
            ("group_peak_bytes".to_string(), ours.group_peak as f64),
            ("group_peak_bytes_llep".to_string(), llep.group_peak as f64),
            ("group_peak_bytes_ep".to_string(), ep.group_peak as f64),
        ]);
        let comparison = Comparison {
            peak_bytes_baseline: llep.rank_peak as u64,
            peak_bytes: ours.rank_peak as u64,
            ms_baseline: llep.ms,
            ms: ours.ms,
            max_rel_err,
            exact: within,
        };
        if dtype == DType::Bf16 {
            // Which kernel the bf16 GEMMs ran on: one of these is 1.
            let path = flatpeak_common::gemm_bf16::Bf16Kernel::Detect.path_name();
            for name in ["amx", "avx512-bf16", "widened"] {
                let ran = if path == name { 1.0 } else { 0.0 };
                metrics.insert(format!("gemm_path_{}", name.replace('-', "_")), ran);
            }
        }
        let w = Workload::Measured { profile, phase, dtype };
        Ok(Row::new(self.name(), &w.describe(), "LLEP", comparison, metrics))
    }

    fn paper_row(&self) -> Result<Row, String> {
        let config = LlepConfig::default();
        let q = crate_pair_cap(&PAPER_SHAPE, Profile::Balanced, 10, &config).map_err(|e| e.to_string())?;
        let row = model_row(&PAPER_SHAPE, Profile::Balanced, 10, q, &config, &PeakModel::paper_fit())
            .map_err(|e| e.to_string())?;
        const GIB: f64 = (1u64 << 30) as f64;
        let metrics = BTreeMap::from([
            ("peak_bytes_ep".to_string(), row.ep_gib * GIB),
            ("peak_bytes_llep".to_string(), row.llep_gib * GIB),
            ("peak_bytes_paper_pipelined".to_string(), row.paper_pipelined_gib * GIB),
            ("peak_bytes_crate_formula".to_string(), row.crate_formula_gib * GIB),
            ("paper_reduction".to_string(), row.paper_reduction()),
            ("rounds".to_string(), row.crate_rounds as f64),
            ("pair_cap".to_string(), row.pair_cap as f64),
            ("foreign_experts_llep".to_string(), row.llep_foreign_experts as f64),
            ("send_ratio_strided".to_string(), row.strided.worst_send_ratio),
            ("send_ratio_contiguous".to_string(), row.contiguous.worst_send_ratio),
            ("max_chunk_recv_strided".to_string(), row.strided.max_chunk_recv as f64),
            ("max_chunk_recv_contiguous".to_string(), row.contiguous.max_chunk_recv as f64),
        ]);
        let peaks = ((row.llep_gib * GIB) as u64, (row.crate_buffers_gib * GIB) as u64);
        let baseline = "LLEP (peak model fitted to the paper's figures)";
        Ok(Row::formula(self.name(), &Workload::PaperPlan.describe(), baseline, peaks, metrics))
    }
}

impl Component for LlepComponent {
    fn name(&self) -> &'static str {
        "llep"
    }

    fn workloads(&self) -> Vec<String> {
        Workload::all().iter().map(Workload::describe).collect()
    }

    /// The balanced forward (the same executor and rounds as the training step, a quarter of
    /// its time) and the formula row.
    fn quick(&self) -> Vec<usize> {
        let all = Workload::all();
        let balanced_step = Workload::Measured { profile: 0, phase: Phase::ForwardOnly, dtype: DType::F32 };
        all.iter()
            .enumerate()
            .filter(|(_, w)| matches!(w, Workload::PaperPlan) || **w == balanced_step)
            .map(|(i, _)| i)
            .collect()
    }

    fn run(&self, index: usize, _machine: &MachineInfo) -> Result<Row, ReportError> {
        let all = Workload::all();
        let w = *workload(self.name(), &all, index)?;
        let outcome = match w {
            Workload::Measured { profile, phase, dtype } => self.measured_row(profile, phase, dtype),
            Workload::PaperPlan => self.paper_row(),
        };
        outcome.map_err(|message| ReportError::workload(self.name(), &w.describe(), message))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paired_ratio_cancels_a_drift_between_rounds() {
        // The machine slows by 15% from round to round; ours is 5% faster in every round.
        let llep = [1000.0, 1150.0, 1322.5];
        let ours: Vec<f64> = llep.iter().map(|t| t / 1.05).collect();
        assert!((paired_ratio(&llep, &ours) - 1.05).abs() < 1e-12);
        // Ratios of medians can land on the wrong side when the pairing is lost.
        let mut shifted = [ours[1], ours[2], ours[2] * 1.15];
        assert!(median(&mut [1000.0, 1150.0, 1322.5]) / median(&mut shifted) < 1.0);
    }
}
