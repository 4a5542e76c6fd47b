//! `sco` measurements: a stack of residual MLP blocks trained one step with plain checkpointing
//! (all boundaries on the device) and with selective checkpoint offload (a 3-slot device ring,
//! the boundaries in a host arena), interleaved round by round.

use std::collections::BTreeMap;
use std::time::Instant;

use flatpeak_common::{Link, PeakMeter, SplitMix64, relative_error};
use sco::layers::ResidualMlp;
use sco::{CheckpointedStack, Checkpointing, Config, StepOutput, hide_ratio};

use super::{Component, ReportError, workload};
use crate::machine::{MachineInfo, median};
use crate::report::{Comparison, Row};

/// A step's outputs: output, input gradient, per-layer parameter gradients.
type StepOutputs = (Vec<f32>, Vec<f32>, Vec<Vec<f32>>);

/// One stack workload.
#[derive(Debug, Clone, Copy)]
pub struct Workload {
    /// Depth L.
    pub layers: usize,
    /// Tokens S.
    pub tokens: usize,
    /// Hidden width H.
    pub hidden: usize,
    /// MLP inner width I.
    pub inner: usize,
}

impl Workload {
    /// The report's workload string.
    pub fn describe(&self) -> String {
        format!("L={} S={} H={} I={} f32 residual MLP P=1", self.layers, self.tokens, self.hidden, self.inner)
    }

    /// The stack's layers.
    pub fn layers(&self) -> Vec<ResidualMlp> {
        (0..self.layers).map(|l| ResidualMlp::new(self.tokens, self.hidden, self.inner, l as u64)).collect()
    }

    /// A stack of this shape with the given schedule.
    pub fn stack(&self, mode: Checkpointing) -> Result<CheckpointedStack<ResidualMlp>, sco::Error> {
        CheckpointedStack::new(self.layers(), mode, &Config::default(), Link::Memcpy)
    }

    /// The device working set of one step under `mode`, by the counting allocator: the live
    /// bytes a stack built over existing layers reaches during its construction and one step,
    /// less the step's outputs and, with offload, less its host arena (host memory, one
    /// allocation of `host_arena_bytes`). On the CPU fallback the "device" is host memory too;
    /// this is what a device would hold.
    pub fn device_peak(&self, mode: Checkpointing, input: &[f32]) -> Result<usize, String> {
        let layers = self.layers();
        let measured = PeakMeter::measure(|| -> Result<(StepOutputs, usize), String> {
            let mut stack = CheckpointedStack::new(layers, mode, &Config::default(), Link::Memcpy)
                .map_err(|e| e.to_string())?;
            let host_arena = match mode {
                Checkpointing::Offload => stack.plan().host_arena_bytes(),
                _ => 0,
            };
            let out = stack.step(input, loss_grad).map_err(|e| e.to_string())?;
            Ok(((out.output, out.grad_input, out.param_grads), host_arena))
        })
        .map_err(|e| e.to_string())?;
        let (_, host_arena) = measured.value?;
        Ok(measured.peak_bytes.saturating_sub(host_arena))
    }
}

/// The report's workload: the shape.
pub const WORKLOADS: [Workload; 1] = [Workload { layers: 32, tokens: 8192, hidden: 256, inner: 256 }];

/// The GPU and link the predicted hide ratio is stated for: an H200 at 600 TFLOP/s of sustained
/// bf16, PCIe Gen5 x16 at 50 GB/s per direction, a transformer layer with H = 8192 and
/// P = 12·H² at S = 8192 tokens.
pub fn predicted_hide_ratio_h200() -> f64 {
    let h = 8192.0;
    hide_ratio(50e9, 12.0 * h * h, h, 8192.0, 600e12, 2.0)
}

fn loss_grad(y: &[f32]) -> sco::Result<Vec<f32>> {
    Ok(y.iter().map(|v| v * 1e-3).collect())
}

fn bitwise_equal(a: &StepOutput, b: &StepOutput) -> bool {
    let same = |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
    same(&a.output, &b.output)
        && same(&a.grad_input, &b.grad_input)
        && a.param_grads.iter().zip(&b.param_grads).all(|(x, y)| same(x, y))
}

/// The `flatpeak report` component.
#[derive(Debug, Clone, Copy, Default)]
pub struct ScoComponent;

impl Component for ScoComponent {
    fn name(&self) -> &'static str {
        "sco"
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
        let mut plain = w.stack(Checkpointing::OnDevice).map_err(|e| fail(e.to_string()))?;
        let mut offload = w.stack(Checkpointing::Offload).map_err(|e| fail(e.to_string()))?;
        let plan = offload.plan();
        let input = SplitMix64::new(5).normal_f32(w.tokens * w.hidden, 0.0, 1.0);

        let (mut t_plain, mut t_sco) = (Vec::new(), Vec::new());
        let (mut last_plain, mut last_sco) = (None, None);
        for _ in 0..4 {
            let start = Instant::now();
            last_plain = Some(plain.step(&input, loss_grad).map_err(|e| fail(e.to_string()))?);
            t_plain.push(start.elapsed().as_secs_f64() * 1e3);
            let start = Instant::now();
            last_sco = Some(offload.step(&input, loss_grad).map_err(|e| fail(e.to_string()))?);
            t_sco.push(start.elapsed().as_secs_f64() * 1e3);
        }
        let (Some(p), Some(s)) = (last_plain, last_sco) else {
            return Err(fail("no step ran".into()));
        };
        // Drop the first (warm-up) round.
        let (ms_plain, ms_sco) = (median(&mut t_plain[1..]), median(&mut t_sco[1..]));

        // This machine's own hide ratio: one layer's forward against one boundary's copy.
        let layer = ResidualMlp::new(w.tokens, w.hidden, w.inner, 99);
        let mut y = vec![0f32; w.tokens * w.hidden];
        let start = Instant::now();
        sco::Layer::forward(&layer, &input, &mut y).map_err(|e| fail(e.to_string()))?;
        let forward_s = start.elapsed().as_secs_f64();
        let start = Instant::now();
        Link::Memcpy.copy(&input, &mut y);
        let copy_s = start.elapsed().as_secs_f64();

        let exact = bitwise_equal(&p, &s);
        drop((plain, offload));
        let peak_plain = w.device_peak(Checkpointing::OnDevice, &input).map_err(fail)?;
        let peak_sco = w.device_peak(Checkpointing::Offload, &input).map_err(fail)?;
        let metrics = BTreeMap::from([
            ("boundaries_resident".to_string(), (s.boundary_high_water_bytes / plan.boundary_bytes()) as f64),
            (
                "boundaries_resident_plain".to_string(),
                (p.boundary_high_water_bytes / plan.boundary_bytes()) as f64,
            ),
            ("host_arena_bytes".to_string(), plan.host_arena_bytes() as f64),
            ("boundary_bytes".to_string(), plan.boundary_bytes() as f64),
            ("boundary_high_water_bytes".to_string(), s.boundary_high_water_bytes as f64),
            ("boundary_high_water_bytes_plain".to_string(), p.boundary_high_water_bytes as f64),
            ("plan_reduction".to_string(), 1.0 - plan.slots() as f64 / plan.layers() as f64),
            ("hide_ratio_measured_cpu".to_string(), forward_s / copy_s),
            ("hide_ratio_predicted_h200_pcie5".to_string(), predicted_hide_ratio_h200()),
        ]);
        let comparison = Comparison {
            peak_bytes_baseline: peak_plain as u64,
            peak_bytes: peak_sco as u64,
            ms_baseline: ms_plain,
            ms: ms_sco,
            max_rel_err: relative_error(
                &s.grad_input,
                &p.grad_input.iter().map(|&x| x as f64).collect::<Vec<_>>(),
            ),
            exact,
        };
        Ok(Row::new(
            self.name(),
            &w.describe(),
            "plain checkpointing (boundaries on device)",
            comparison,
            metrics,
        ))
    }
}
