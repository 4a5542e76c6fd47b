//! `flatpeak run stream-adamw`: one `torch.optim.AdamW` step through the offloaded pipeline.
//!
//! Inputs: `param` \[n\] F32 (the fp32 master parameters), `grad` \[n\] F32 or BF16; optional
//! state `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq` (AMSGrad) \[n\] F32 and `step` \[\] I64 (steps
//! taken so far; all absent: a fresh state). Outputs: `param`, `exp_avg`, `exp_avg_sq` (and
//! `max_exp_avg_sq`) \[n\] F32, `step` \[\] I64, `grad_norm` \[\] F64 (‖g‖₂ before clipping) and
//! `skipped` \[\] I64 (1 when a non-finite gradient skipped the step).

use half::bf16;
use serde::Deserialize;
use stream_adamw::{
    Budget, Config, GradClip, GradElement, HostDevice, Hyperparameters, Link, Objective, Plan, StateDict,
    StepOptions, StepOutcome, StepSchedule, StreamAdamW, Variant,
};

use super::{Dim, Floats, Outputs, RunError, TensorFile};

/// `"adam"` or `"amsgrad"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum VariantName {
    /// Plain Adam.
    #[default]
    Adam,
    /// AMSGrad.
    Amsgrad,
}

/// `"pipelined"` or `"serial"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleName {
    /// OffloadStreamAdamW's bucket pipeline.
    #[default]
    Pipelined,
    /// The serial offload.
    Serial,
}

/// The config file of `flatpeak run stream-adamw` (torch's defaults; every field optional).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StreamHyperparameters {
    /// Learning rate.
    pub lr: f64,
    /// β1.
    pub beta1: f64,
    /// β2.
    pub beta2: f64,
    /// ε.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Adam or AMSGrad.
    pub variant: VariantName,
    /// torch's `maximize`.
    pub maximize: bool,
    /// Global-norm clipping bound (`null`: none).
    pub max_grad_norm: Option<f64>,
    /// Multiplies every gradient first (e.g. 1/loss_scale).
    pub grad_scale: f64,
    /// Pipelined or serial.
    pub schedule: ScheduleName,
    /// Elements per bucket (a multiple of 64).
    pub bucket_elems: usize,
    /// Staging slots per direction.
    pub slots: usize,
}

impl Default for StreamHyperparameters {
    fn default() -> Self {
        let torch = Hyperparameters::default();
        let pipeline = Config::default();
        Self {
            lr: torch.lr,
            beta1: torch.beta1,
            beta2: torch.beta2,
            eps: torch.eps,
            weight_decay: torch.weight_decay,
            variant: VariantName::Adam,
            maximize: false,
            max_grad_norm: None,
            grad_scale: 1.0,
            schedule: ScheduleName::Pipelined,
            bucket_elems: pipeline.bucket_elems,
            slots: pipeline.slots,
        }
    }
}

/// Runs one step on the tensors of `t`.
pub fn run(t: &TensorFile, cfg: &StreamHyperparameters) -> Result<Outputs, RunError> {
    let (param, ps) = t.f32("param", &[Dim::Any])?;
    let n = ps[0];
    let (grad, _) = t.floats("grad", &[Dim::Is(n)])?;
    match grad {
        Floats::F32(g) => step(t, cfg, param, g),
        Floats::Bf16(g) => step::<bf16>(t, cfg, param, g),
    }
}

fn step<G: GradElement>(
    t: &TensorFile,
    cfg: &StreamHyperparameters,
    param: Vec<f32>,
    grad: Vec<G>,
) -> Result<Outputs, RunError> {
    let n = param.len();
    let mut config = Hyperparameters::default().lr(cfg.lr);
    config.beta1 = cfg.beta1;
    config.beta2 = cfg.beta2;
    config.eps = cfg.eps;
    config.weight_decay = cfg.weight_decay;
    config.variant = match cfg.variant {
        VariantName::Adam => Variant::Adam,
        VariantName::Amsgrad => Variant::AmsGrad,
    };
    config.objective = if cfg.maximize { Objective::Maximize } else { Objective::Minimize };
    config.clip = cfg.max_grad_norm.map_or(GradClip::None, |max_norm| GradClip::GlobalNorm { max_norm });
    let schedule = match cfg.schedule {
        ScheduleName::Pipelined => StepSchedule::Pipelined,
        ScheduleName::Serial => StepSchedule::Serial,
    };
    let options = Config::default()
        .schedule(schedule)
        .bucket_elems(cfg.bucket_elems)
        .slots(cfg.slots)
        .hyperparameters(config);
    let plan = Plan::new(&options, StreamAdamW::<G, f32>::shape(n), Budget::Unlimited)?;
    let mut opt = StreamAdamW::<G, f32>::new(plan, stream_adamw::Device::Cpu)?;
    opt.load_master(&param)?;
    let exp_avg = t.optional_f32("exp_avg", &[Dim::Is(n)])?;
    let exp_avg_sq = t.optional_f32("exp_avg_sq", &[Dim::Is(n)])?;
    let max_exp_avg_sq = t.optional_f32("max_exp_avg_sq", &[Dim::Is(n)])?;
    let steps = if t.has("step") { Some(t.i64("step", &[])?.0[0]) } else { None };
    if exp_avg.is_some() || exp_avg_sq.is_some() || steps.is_some() {
        let dict = StateDict {
            step: u64::try_from(steps.unwrap_or(0)).map_err(|_| RunError::WrongShape {
                name: "step".into(),
                expected: "a count ≥ 0".into(),
                found: vec![],
            })?,
            param: param.clone(),
            exp_avg: exp_avg.unwrap_or_else(|| vec![0.0; n]),
            exp_avg_sq: exp_avg_sq.unwrap_or_else(|| vec![0.0; n]),
            max_exp_avg_sq: match (cfg.variant, max_exp_avg_sq) {
                (VariantName::Amsgrad, None) => Some(vec![0.0; n]),
                (_, max) => max,
            },
        };
        opt.import_state(dict)?;
    }
    let mut device = HostDevice::new(grad, param, Link::Memcpy);
    let report = opt.step(&mut device, StepOptions::with_grad_scale(cfg.grad_scale))?;
    let state = opt.export_state();
    let mut out = Outputs::default();
    out.f32("param", &[n], &state.param);
    out.f32("exp_avg", &[n], &state.exp_avg);
    out.f32("exp_avg_sq", &[n], &state.exp_avg_sq);
    if let Some(m) = &state.max_exp_avg_sq {
        out.f32("max_exp_avg_sq", &[n], m);
    }
    out.i64("step", &[], &[state.step as i64]);
    out.f64("grad_norm", &[], &[report.grad_norm]);
    out.i64("skipped", &[], &[i64::from(report.outcome == StepOutcome::SkippedNonFinite)]);
    Ok(out)
}
