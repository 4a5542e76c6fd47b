//! `stream-adamw` measurements: the CPU AdamW kernel against the machine's copy ceiling, and
//! the offloaded step, serial against pipelined, over a simulated link (the CPU fallback's
//! copy engines are threads; see `stream_adamw::Link`).

use std::collections::BTreeMap;
use std::time::Instant;

use flatpeak_common::{DType, PeakMeter, SplitMix64, relative_error};
use half::bf16;
use stream_adamw::cpu::{ParamSink, StateMut, adamw_update, reference};
use stream_adamw::{
    Budget, Config, GradElement, HostDevice, Hyperparameters, Link, Plan, StepOptions, StepScalars,
    StepSchedule, StreamAdamW,
};

use super::{Component, ReportError, workload};
use crate::machine::{CopyProbe, MachineInfo, interleaved_ratio, median};
use crate::report::{Comparison, Row};

/// Bytes of DRAM traffic one AdamW update moves per parameter with f32 gradients: reads θ, m,
/// v, g (16 B) and writes θ, m, v (12 B).
pub const BYTES_PER_PARAM: f64 = 28.0;

/// Fresh state for the kernel measurements.
#[derive(Debug)]
pub struct KernelInputs {
    param: Vec<f32>,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    grad: Vec<f32>,
    scalars: StepScalars,
}

impl KernelInputs {
    /// Random inputs for `n` parameters.
    pub fn new(n: usize) -> Self {
        let mut rng = SplitMix64::new(n as u64);
        Self {
            param: rng.normal_f32(n, 0.0, 1.0),
            exp_avg: rng.normal_f32(n, 0.0, 0.01),
            exp_avg_sq: rng.uniform_f32(n, 0.0, 1e-4),
            grad: rng.normal_f32(n, 0.0, 0.01),
            scalars: StepScalars::new(&Hyperparameters::default(), 10, 1.0),
        }
    }

    /// One multithreaded kernel pass; returns GB/s at 28 B/param.
    pub fn kernel_gbps(&mut self) -> f64 {
        let start = Instant::now();
        let state = StateMut {
            param: &mut self.param,
            exp_avg: &mut self.exp_avg,
            exp_avg_sq: &mut self.exp_avg_sq,
            max_exp_avg_sq: &mut [],
        };
        adamw_update::<f32, f32>(state, &self.grad, ParamSink::None, &self.scalars);
        BYTES_PER_PARAM * self.grad.len() as f64 / start.elapsed().as_secs_f64() / 1e9
    }

    /// The same update as a plain single-threaded loop (the reference line); GB/s.
    pub fn plain_loop_gbps(&mut self) -> f64 {
        let s = self.scalars;
        let start = Instant::now();
        for i in 0..self.grad.len() {
            let g = self.grad[i] * s.grad_scale * s.sign;
            let theta = self.param[i] * s.decay;
            self.exp_avg[i] += s.lerp_weight * (g - self.exp_avg[i]);
            self.exp_avg_sq[i] = self.exp_avg_sq[i] * s.beta2 + s.one_minus_beta2 * g * g;
            let denom = self.exp_avg_sq[i].sqrt() * s.inv_bias_correction2_sqrt + s.eps;
            self.param[i] = theta - s.step_size * (self.exp_avg[i] / denom);
        }
        std::hint::black_box(&self.param);
        BYTES_PER_PARAM * self.grad.len() as f64 / start.elapsed().as_secs_f64() / 1e9
    }
}

/// One pipeline workload.
#[derive(Debug, Clone, Copy)]
pub struct Workload {
    /// Parameters N.
    pub params: usize,
    /// Elements per bucket N_b.
    pub bucket: usize,
    /// Simulated link bandwidth per direction, GB/s.
    pub link_gbps: f64,
    /// What the link stands for.
    pub link_name: &'static str,
    /// Gradient dtype on the link (f32 or bf16).
    pub grads: DType,
}

impl Workload {
    /// The report's workload string.
    pub fn describe(&self) -> String {
        format!(
            "params={}M buckets={}x{}M link={} GB/s ({}) grads={} params=bf16 P=1",
            self.params >> 20,
            self.params.div_ceil(self.bucket),
            self.bucket >> 20,
            self.link_gbps,
            self.link_name,
            self.grads,
        )
    }
}

/// The report's workloads. The PCIe rows show the pipeline where copies are cheap next to Adam
/// (there the memcpy of the CPU fallback's copy engines, ~10 GB/s on one core, is slower than
/// the declared link, so `link_effective_gbps` says what the copies really ran at). The last
/// row is the paper's regime: copies take about as long as Adam (a ≈ h ≈ 1.9·c), where the
/// serial schedule pays a + c + h per bucket and the pipeline only max(a, c, h); its 1.1 GB/s
/// link keeps the copy engines' own CPU time (they are threads here, DMA engines on a GPU) from
/// starving Adam on a 2-core machine.
pub const WORKLOADS: [Workload; 3] = [
    Workload {
        params: 16 << 20,
        bucket: 1 << 20,
        link_gbps: 25.0,
        link_name: "PCIe Gen4 x16",
        grads: DType::F32,
    },
    Workload {
        params: 64 << 20,
        bucket: 2 << 20,
        link_gbps: 25.0,
        link_name: "PCIe Gen4 x16",
        grads: DType::F32,
    },
    Workload {
        params: 64 << 20,
        bucket: 1 << 20,
        link_gbps: 1.1,
        link_name: "copies ≈ 1.9× Adam",
        grads: DType::Bf16,
    },
];

/// Serial and pipelined timings of one workload, and what they imply.
#[derive(Debug, Clone, Copy)]
pub struct PipelineMeasurement {
    /// Median serial schedule time (statistics pass excluded), ms.
    pub serial_ms: f64,
    /// Median pipelined schedule time (statistics pass excluded), ms.
    pub pipelined_ms: f64,
    /// Per-bucket D2H, Adam and H2D times from the serial run, ms.
    pub a_c_h_ms: (f64, f64, f64),
    /// Median statistics-pass time (device-side work on a GPU), ms.
    pub stats_ms: f64,
    /// Transient peak of building each optimizer: state + staging, bytes (serial, pipelined).
    pub staging_bytes: (u64, u64),
    /// Pipelined result bitwise equal to serial after all steps.
    pub bitwise_equal: bool,
    /// Norm-wise relative error of the pipelined step 1 against the f64 reference.
    pub max_rel_err: f64,
}

/// Runs `rounds` interleaved serial/pipelined steps of `w`.
pub fn measure_pipeline(w: &Workload, rounds: usize) -> Result<PipelineMeasurement, stream_adamw::Error> {
    match w.grads {
        DType::Bf16 => measure_pipeline_typed(w, rounds, half::bf16::from_f32),
        _ => measure_pipeline_typed(w, rounds, |x| x),
    }
}

fn measure_pipeline_typed<G: GradElement>(
    w: &Workload,
    rounds: usize,
    convert: impl Fn(f32) -> G,
) -> Result<PipelineMeasurement, stream_adamw::Error> {
    let n = w.params;
    let master = SplitMix64::new(3).normal_f32(n, 0.0, 1.0);
    let grads: Vec<G> = SplitMix64::new(4).normal_f32(n, 0.0, 0.01).into_iter().map(convert).collect();
    let link = Link::Simulated { gbps: w.link_gbps };
    let options = Config::default().bucket_elems(w.bucket);
    let config = Hyperparameters::default();
    let build = |schedule| {
        PeakMeter::measure(|| {
            let config = options.schedule(schedule).hyperparameters(config);
            let plan = Plan::new(&config, StreamAdamW::<G, bf16>::shape(n), Budget::Unlimited)?;
            let mut opt = StreamAdamW::<G, bf16>::new(plan, stream_adamw::Device::Cpu)?;
            opt.load_master(&master)?;
            Ok::<_, stream_adamw::Error>(opt)
        })
    };
    let (serial, pipelined) = (build(StepSchedule::Serial)?, build(StepSchedule::Pipelined)?);
    // Staging is what the schedule adds beyond the 12 B/param state both hold.
    let state_bytes = 12 * n as u64;
    let staging_bytes =
        (serial.output_bytes as u64 - state_bytes, pipelined.output_bytes as u64 - state_bytes);
    let (mut serial, mut pipelined) = (serial.value?, pipelined.value?);
    let mut dev_s = HostDevice::new(grads.clone(), vec![bf16::ZERO; n], link);
    let mut dev_p = HostDevice::new(grads.clone(), vec![bf16::ZERO; n], link);

    serial.step(&mut dev_s, StepOptions::default())?;
    pipelined.step(&mut dev_p, StepOptions::default())?;
    let mut reference = reference::State::new(&master);
    let mut wide = vec![0f32; n];
    let g64: Vec<f64> = G::widen(&grads, &mut wide).iter().map(|&x| x as f64).collect();
    drop(wide);
    reference::step(&mut reference, &g64, &config, 1.0);
    let state = pipelined.export_state();
    let max_rel_err = [
        relative_error(&state.param, &reference.param),
        relative_error(&state.exp_avg, &reference.exp_avg),
        relative_error(&state.exp_avg_sq, &reference.exp_avg_sq),
    ]
    .into_iter()
    .fold(0.0, f64::max);
    drop((reference, g64, state));

    let (mut ts, mut tp, mut stats) = (Vec::new(), Vec::new(), Vec::new());
    let (mut a, mut c, mut h) = (Vec::new(), Vec::new(), Vec::new());
    let buckets = n.div_ceil(w.bucket) as f64;
    for _ in 0..rounds.max(1) {
        let s = serial.step(&mut dev_s, StepOptions::default())?.times;
        let p = pipelined.step(&mut dev_p, StepOptions::default())?.times;
        ts.push((s.total - s.stats).as_secs_f64() * 1e3);
        tp.push((p.total - p.stats).as_secs_f64() * 1e3);
        stats.push(p.stats.as_secs_f64() * 1e3);
        a.push(s.d2h.as_secs_f64() * 1e3 / buckets);
        c.push(s.adam.as_secs_f64() * 1e3 / buckets);
        h.push(s.h2d.as_secs_f64() * 1e3 / buckets);
    }
    let bitwise_equal = serial.export_state() == pipelined.export_state() && dev_s.params == dev_p.params;
    Ok(PipelineMeasurement {
        serial_ms: median(&mut ts),
        pipelined_ms: median(&mut tp),
        a_c_h_ms: (median(&mut a), median(&mut c), median(&mut h)),
        stats_ms: median(&mut stats),
        staging_bytes,
        bitwise_equal,
        max_rel_err,
    })
}

/// The `flatpeak report` component.
#[derive(Debug, Clone, Copy, Default)]
pub struct StreamAdamWComponent;

impl Component for StreamAdamWComponent {
    fn name(&self) -> &'static str {
        "stream-adamw"
    }

    fn workloads(&self) -> Vec<String> {
        WORKLOADS.iter().map(Workload::describe).collect()
    }

    fn quick(&self) -> Vec<usize> {
        vec![0]
    }

    fn run(&self, index: usize, _machine: &MachineInfo) -> Result<Row, ReportError> {
        let w = *workload(self.name(), &WORKLOADS, index)?;
        let fail = |message: String| ReportError::workload(self.name(), &w.describe(), message);
        let m = measure_pipeline(&w, 5).map_err(|e| fail(e.to_string()))?;

        // Kernel throughput against the copy ceiling, interleaved round by round.
        let mut kernel = KernelInputs::new(w.params);
        let mut probe = CopyProbe::new(1 << 30);
        kernel.kernel_gbps(); // fault in and warm
        let mut gbps = Vec::new();
        let fraction = interleaved_ratio(
            7,
            || {
                let g = kernel.kernel_gbps();
                gbps.push(g);
                g
            },
            || probe.gbps(),
        );
        drop(probe);
        let plain = kernel.plain_loop_gbps();

        let (a, c, h) = m.a_c_h_ms;
        let ideal = stream_adamw::ideal_speedup(a, c, h);
        let speedup = m.serial_ms / m.pipelined_ms;
        let kernel_gbps = median(&mut gbps);
        let metrics = BTreeMap::from([
            ("gbps".to_string(), kernel_gbps),
            ("gparams_per_s".to_string(), kernel_gbps / BYTES_PER_PARAM),
            ("gbps_plain_loop_1_thread".to_string(), plain),
            ("bandwidth_fraction".to_string(), fraction),
            ("ideal_speedup".to_string(), ideal),
            ("pipeline_efficiency".to_string(), speedup / ideal),
            // Per bucket: the copies and the CPU update, and whether the update bounds the
            // pipeline (above 1: it is the slowest stage, the step's time is buckets × it).
            ("d2h_ms_per_bucket".to_string(), a),
            ("adam_ms_per_bucket".to_string(), c),
            ("h2d_ms_per_bucket".to_string(), h),
            ("adam_over_slowest_copy".to_string(), c / a.max(h)),
            ("stats_ms".to_string(), m.stats_ms),
            ("link_gbps".to_string(), w.link_gbps),
            ("link_effective_gbps".to_string(), (w.bucket * w.grads.size_in_bytes()) as f64 / a / 1e6),
        ]);
        let comparison = Comparison {
            peak_bytes_baseline: m.staging_bytes.0,
            peak_bytes: m.staging_bytes.1,
            ms_baseline: m.serial_ms,
            ms: m.pipelined_ms,
            max_rel_err: m.max_rel_err,
            exact: m.bitwise_equal && m.max_rel_err <= 1e-6,
        };
        Ok(Row::new(self.name(), &w.describe(), "serial offload step", comparison, metrics))
    }
}
