//! [`StreamAdamW`]: the offloaded optimizer. It owns the fp32 state (host memory) and the
//! staging slots of its plan (allocated once, at construction), and steps a device's gradients
//! into updated device parameters with the plan's schedule.

use std::marker::PhantomData;
use std::time::Instant;

use crate::config::{Hyperparameters, StepScalars, clip_coefficient};
use crate::cpu::grad_sq_sum;
use crate::element::{GradElement, ParamElement};
use crate::error::{Error, Result};
use crate::host::HostDevice;
use flatpeak_common::Budget;

use crate::plan::{Config, Plan, Schedule, Shape};
use crate::schedule::{StageTimes, Staging, run_pipelined, run_serial};
use crate::state::{OptimizerState, StateDict};

/// Per-step options.
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct StepOptions {
    /// Multiplies every gradient before clipping and the update, e.g. `1 / loss_scale` to
    /// unscale loss-scaled gradients (finite, > 0).
    pub grad_scale: f64,
}

impl Default for StepOptions {
    fn default() -> Self {
        Self { grad_scale: 1.0 }
    }
}

impl StepOptions {
    /// Unscale gradients of a loss multiplied by `loss_scale`.
    pub fn unscale(loss_scale: f64) -> Self {
        Self { grad_scale: 1.0 / loss_scale }
    }
    /// Multiply gradients by `grad_scale`.
    pub fn with_grad_scale(grad_scale: f64) -> Self {
        Self { grad_scale }
    }
}

/// Whether a step was applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepOutcome {
    /// θ, m, v, the step count and the device parameters were updated.
    Applied,
    /// A gradient was NaN or infinite: nothing at all was touched (GradScaler's `found_inf`).
    SkippedNonFinite,
}

/// What a step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// Applied or skipped.
    pub outcome: StepOutcome,
    /// The step count after this call.
    pub step: u64,
    /// Global ‖g‖₂ of the (unscaled) gradients, before clipping; non-finite when skipped.
    pub grad_norm: f64,
    /// The clip coefficient applied (1 when not clipping).
    pub clip_coef: f64,
    /// Busy time per stage.
    pub times: StageTimes,
}

/// Offloaded AdamW over N parameters with gradients of type `G` and a device parameter copy
/// of type `P`.
#[derive(Debug)]
pub struct StreamAdamW<G, P> {
    config: Hyperparameters,
    plan: Plan,
    state: OptimizerState,
    /// The CPU fallback's staging; `None` for an optimizer that stages through CUDA pinned
    /// memory (see `for_cuda`).
    staging: Option<Staging<G, P>>,
    _types: PhantomData<fn(G) -> P>,
}

impl<G: GradElement, P: ParamElement> flatpeak_common::HeapSize for StreamAdamW<G, P> {
    /// The state's 12 (or 16, AMSGrad) B/param plus the staging slots.
    fn heap_bytes(&self) -> usize {
        self.state.heap_bytes() + self.staging.as_ref().map_or(0, Staging::heap_bytes)
    }
}

impl<G: GradElement, P: ParamElement> StreamAdamW<G, P> {
    /// An optimizer for fp32 master parameters `param`, allocating the plan's staging now.
    pub fn new(param: Vec<f32>, config: Hyperparameters, options: &Config) -> Result<Self> {
        config.validate()?;
        let plan = Plan::new(options, Self::shape(param.len()), Budget::Unlimited)?;
        let staging = Some(Staging::new(&plan));
        Ok(Self {
            state: OptimizerState::new(param, config.variant),
            config,
            plan,
            staging,
            _types: PhantomData,
        })
    }

    /// The shape of an optimizer over `params` parameters of these element types.
    pub fn shape(params: usize) -> Shape {
        Shape { params, grad_dtype: G::DTYPE, param_dtype: P::DTYPE }
    }

    /// The plan (buckets, staging bytes).
    pub fn plan(&self) -> &Plan {
        &self.plan
    }
    /// The hyperparameters.
    pub fn config(&self) -> &Hyperparameters {
        &self.config
    }
    /// The state (fp32 master parameters, moments, step).
    pub fn state(&self) -> &OptimizerState {
        &self.state
    }
    /// A copy of the state.
    pub fn export_state(&self) -> StateDict {
        self.state.export()
    }
    /// Replaces the state; on error nothing changes.
    pub fn import_state(&mut self, dict: StateDict) -> Result<()> {
        self.state.import(dict, self.config.variant)
    }

    /// Gradient statistics and the step's scalars, or `None` when the step must be skipped.
    fn prepare(&mut self, grad_sq: f64, options: StepOptions) -> Result<(Option<StepScalars>, f64, f64)> {
        let scale = options.grad_scale;
        if !(scale.is_finite() && scale > 0.0) {
            return Err(Error::invalid_config("grad_scale", scale, "a finite value > 0"));
        }
        let norm = grad_sq.sqrt() * scale;
        if !norm.is_finite() {
            return Ok((None, norm, 1.0));
        }
        let step = self.state.step.checked_add(1).ok_or(Error::StepOverflow { step: self.state.step })?;
        let clip_coef = clip_coefficient(self.config.clip, norm);
        self.state.step = step;
        Ok((Some(StepScalars::new(&self.config, step, clip_coef * scale)), norm, clip_coef))
    }

    /// One optimizer step on the CPU fallback's device: statistics over the device gradients,
    /// then the plan's schedule of D2H copies, AdamW updates and H2D copies. Non-finite
    /// gradients skip the step and touch nothing.
    pub fn step_host(&mut self, device: &mut HostDevice<G, P>, options: StepOptions) -> Result<StepReport> {
        self.check_lengths(device.grads.len(), device.params.len())?;
        let wrong_backend =
            Error::WrongBackend { expected: "step_cuda (this optimizer stages through CUDA pinned memory)" };
        if self.staging.is_none() {
            return Err(wrong_backend);
        }
        let start = Instant::now();
        let mut times = StageTimes::default();
        let grad_sq = grad_sq_sum(&device.grads);
        times.stats = start.elapsed();
        let (scalars, grad_norm, clip_coef) = self.prepare(grad_sq, options)?;
        let Some(scalars) = scalars else {
            return Ok(self.skipped(grad_norm, times, start));
        };
        let staging = self.staging.as_ref().ok_or(wrong_backend)?;
        match self.plan.schedule() {
            Schedule::Serial => run_serial(&mut self.state, staging, device, &scalars, &mut times),
            Schedule::Pipelined => {
                run_pipelined(&self.plan, &mut self.state, staging, device, &scalars, &mut times)?
            }
        }
        times.total = start.elapsed();
        Ok(StepReport { outcome: StepOutcome::Applied, step: self.state.step, grad_norm, clip_coef, times })
    }

    fn check_lengths(&self, grads: usize, params: usize) -> Result<()> {
        let n = self.state.len();
        for (what, found) in [("device grads", grads), ("device params", params)] {
            if found != n {
                return Err(Error::ShapeMismatch { what, expected: n, got: found });
            }
        }
        Ok(())
    }

    fn skipped(&self, grad_norm: f64, mut times: StageTimes, start: Instant) -> StepReport {
        times.total = start.elapsed();
        StepReport {
            outcome: StepOutcome::SkippedNonFinite,
            step: self.state.step,
            grad_norm,
            clip_coef: 1.0,
            times,
        }
    }
}

#[cfg(feature = "cuda")]
impl<G: GradElement, P: ParamElement> StreamAdamW<G, P> {
    /// An optimizer whose staging is CUDA pinned memory on device `ordinal`, with the streams
    /// and events of its schedule. Fails with a typed error when CUDA or the device is missing.
    pub fn for_cuda(
        param: Vec<f32>,
        config: Hyperparameters,
        options: &Config,
        ordinal: usize,
    ) -> Result<(Self, crate::cuda::CudaOffload<G, P>)> {
        config.validate()?;
        let plan = Plan::new(options, Self::shape(param.len()), Budget::Unlimited)?;
        let offload = crate::cuda::CudaOffload::new(&plan, ordinal)?;
        let state = OptimizerState::new(param, config.variant);
        Ok((Self { config, plan, state, staging: None, _types: PhantomData }, offload))
    }

    /// One optimizer step on a CUDA device: the statistics kernel over the device gradients,
    /// then the plan's schedule through `offload`'s pinned slots and copy streams. Non-finite
    /// gradients skip the step and touch nothing.
    pub fn step_cuda(
        &mut self,
        offload: &mut crate::cuda::CudaOffload<G, P>,
        device: &mut crate::cuda::CudaDevice<G, P>,
        options: StepOptions,
    ) -> Result<StepReport> {
        self.check_lengths(device.grads.len(), device.params.len())?;
        let start = Instant::now();
        let mut times = StageTimes::default();
        let grad_sq = offload.grad_sq_sum(&device.grads)?;
        times.stats = start.elapsed();
        let (scalars, grad_norm, clip_coef) = self.prepare(grad_sq, options)?;
        let Some(scalars) = scalars else {
            return Ok(self.skipped(grad_norm, times, start));
        };
        offload.run(&self.plan, &mut self.state, device, &scalars, &mut times)?;
        times.total = start.elapsed();
        Ok(StepReport { outcome: StepOutcome::Applied, step: self.state.step, grad_norm, clip_coef, times })
    }
}
