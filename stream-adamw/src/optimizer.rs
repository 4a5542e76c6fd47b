//! [`StreamAdamW`]: the offloaded optimizer. It owns the fp32 state (host memory) and the
//! staging slots of its plan (allocated once, at construction), and steps a device's gradients
//! into updated device parameters with the plan's schedule.

use std::marker::PhantomData;
use std::ops::Range;
use std::time::Instant;

use flatpeak_common::{Budget, Device};

use crate::config::{Hyperparameters, StepScalars, clip_coefficient};
use crate::cpu::grad_sq_sum;
use crate::element::{GradElement, ParamElement};
use crate::error::{Error, Result};
use crate::host::HostDevice;
use crate::pipeline::{Fault, StepState};
use crate::plan::{Config, OnFailure, Plan, Schedule, Shape};
use crate::schedule::{StageTimes, Staging, run_host};
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

/// Where the optimizer stages its copies: the CPU fallback's host slots and copy threads, or a
/// CUDA device's pinned slots and copy streams.
#[derive(Debug)]
enum Backend<G: GradElement, P: ParamElement> {
    Host(Staging<G, P>),
    #[cfg(feature = "cuda")]
    Cuda(Box<crate::cuda::CudaOffload<G, P>>),
}

impl<G: GradElement, P: ParamElement> Backend<G, P> {
    /// The host staging, or [`Error::WrongBackend`] for an optimizer on a CUDA device.
    fn host(&self) -> Result<&Staging<G, P>> {
        match self {
            Backend::Host(staging) => Ok(staging),
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => Err(Error::WrongBackend {
                expected: "step_cuda (this optimizer stages through CUDA pinned memory)",
            }),
        }
    }
}

/// Offloaded AdamW over N parameters with gradients of type `G` and a device parameter copy
/// of type `P`, on one [`Device`]: it owns its hyperparameters, its plan, the fp32 state and
/// the plan's staging, allocated once at construction.
#[derive(Debug)]
pub struct StreamAdamW<G: GradElement, P: ParamElement> {
    config: Hyperparameters,
    plan: Plan,
    state: OptimizerState,
    device: Device,
    backend: Backend<G, P>,
    /// Set when a failed step had updated some buckets: `(step, applied)`; cleared by a
    /// successful `import_state`.
    poisoned: Option<(u64, usize)>,
    /// A failure to inject into the next step (feature `testing`).
    fault: Option<Fault>,
    /// [`OnFailure::Rollback`]'s journal: each bucket's old values, saved before its update.
    journal: Option<OptimizerState>,
    _types: PhantomData<fn(G) -> P>,
}

impl<G: GradElement, P: ParamElement> flatpeak_common::HeapSize for StreamAdamW<G, P> {
    /// The state's 12 (or 16, AMSGrad) B/param plus the staging slots.
    fn heap_bytes(&self) -> usize {
        let staging = match &self.backend {
            Backend::Host(staging) => staging.heap_bytes(),
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => 0, // pinned, not heap
        };
        self.state.heap_bytes() + staging
    }
}

impl<G: GradElement, P: ParamElement> StreamAdamW<G, P> {
    /// An optimizer for fp32 master parameters `param` on `device`, allocating the plan's
    /// staging now: host slots and copy threads on the CPU fallback ([`Device::Cpu`], stepped
    /// by [`step_host`](Self::step_host)), pinned slots and copy streams on a CUDA device
    /// (feature `cuda`, stepped by `step_cuda`). A CUDA device that cannot be used is
    /// `Common(CudaUnavailable)`, saying why.
    pub fn new(param: Vec<f32>, config: Hyperparameters, options: &Config, device: Device) -> Result<Self> {
        config.validate()?;
        let plan = Plan::new(options, Self::shape(param.len()), Budget::Unlimited)?;
        let backend = match device {
            Device::Cpu => Backend::Host(Staging::new(&plan)),
            Device::Cuda(ordinal) => {
                device.ensure_available()?;
                cuda_backend(&plan, ordinal)?
            }
        };
        let journal = match options.on_failure {
            OnFailure::Poison => None,
            OnFailure::Rollback => Some(journal_like(param.len(), config.variant)?),
        };
        Ok(Self {
            journal,
            state: OptimizerState::new(param, config.variant),
            config,
            plan,
            device,
            backend,
            poisoned: None,
            fault: None,
            _types: PhantomData,
        })
    }

    /// The device it steps.
    pub fn device(&self) -> Device {
        self.device
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
    /// Replaces the hyperparameters for the next steps (an LR schedule's), after checking them;
    /// the variant (Adam or AMSGrad) is the state's and cannot change. On error nothing changes.
    pub fn set_hyperparameters(&mut self, config: Hyperparameters) -> Result<()> {
        config.validate()?;
        if config.variant != self.config.variant {
            return Err(Error::StateMismatch {
                reason: format!(
                    "the variant is the state's ({:?}), not {:?}",
                    self.config.variant, config.variant
                ),
            });
        }
        self.config = config;
        Ok(())
    }
    /// The state (fp32 master parameters, moments, step).
    pub fn state(&self) -> &OptimizerState {
        &self.state
    }
    /// A copy of the state.
    pub fn export_state(&self) -> StateDict {
        self.state.export()
    }
    /// Replaces the state; on error nothing changes. A successful import also lifts the
    /// refusal to step after a partly applied step ([`Error::Poisoned`]).
    pub fn import_state(&mut self, dict: StateDict) -> Result<()> {
        self.state.import(dict, self.config.variant)?;
        self.poisoned = None;
        Ok(())
    }

    /// Makes the next step fail at `fault` (feature `testing`: fault injection for tests).
    #[cfg(feature = "testing")]
    pub fn inject_fault(&mut self, fault: Fault) {
        self.fault = Some(fault);
    }

    /// Whether a failed step left the state partly updated ([`Error::Poisoned`] until a
    /// consistent state is imported).
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.is_some()
    }

    /// [`Error::Poisoned`] when a failed step left the state partly updated.
    fn check_not_poisoned(&self) -> Result<()> {
        match self.poisoned {
            Some((step, applied)) => Err(Error::Poisoned { step, applied, buckets: self.plan.n_buckets() }),
            None => Ok(()),
        }
    }

    /// The outcome of a step's pipeline. On an error after some buckets' update ran: with a
    /// journal, the state of those buckets is restored and their master parameters, narrowed,
    /// are handed to `restore_params` to rewrite on the device; without one, the optimizer is
    /// poisoned. The error is returned either way (with no bucket applied nothing changed).
    fn settle(
        &mut self,
        ran: Result<()>,
        applied: usize,
        mut restore_params: impl FnMut(Range<usize>, &[f32]) -> Result<()>,
    ) -> Result<()> {
        let Err(error) = ran else { return Ok(()) };
        if applied == 0 {
            return Err(error);
        }
        let Some(journal) = self.journal.as_ref() else {
            self.poisoned = Some((self.state.step, applied));
            return Err(error);
        };
        let ranges: Vec<Range<usize>> = match self.plan.schedule() {
            Schedule::Serial => std::iter::once(0..self.plan.n_params()).collect(),
            Schedule::Pipelined => (0..applied).map(|k| self.plan.bucket(k)).collect(),
        };
        for range in ranges {
            self.state.copy_range_from(journal, range.clone());
            if let Err(restore) = restore_params(range.clone(), &self.state.param[range]) {
                // The master state is whole again but the device copy is not: say so.
                self.poisoned = Some((self.state.step, applied));
                return Err(restore);
            }
        }
        Err(error)
    }

    /// Gradient statistics and the step's scalars with its step number, or `None` when the step
    /// must be skipped. Changes nothing: the step number is committed only once the step ran.
    fn prepare(&self, grad_sq: f64, options: StepOptions) -> Result<(Option<NextStep>, f64, f64)> {
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
        Ok((Some((StepScalars::new(&self.config, step, clip_coef * scale), step)), norm, clip_coef))
    }

    /// One optimizer step on the CPU fallback's device: statistics over the device gradients,
    /// then the plan's schedule of D2H copies, AdamW updates and H2D copies. Non-finite
    /// gradients skip the step and touch nothing.
    pub fn step_host(&mut self, device: &mut HostDevice<G, P>, options: StepOptions) -> Result<StepReport> {
        self.check_not_poisoned()?;
        self.check_lengths(device.grads.len(), device.params.len())?;
        device.link.validate()?;
        self.backend.host()?;
        let start = Instant::now();
        let mut times = StageTimes::default();
        let grad_sq = grad_sq_sum(&device.grads);
        times.stats = start.elapsed();
        let (scalars, grad_norm, clip_coef) = self.prepare(grad_sq, options)?;
        let Some((scalars, step)) = scalars else {
            return Ok(self.skipped(grad_norm, times, start));
        };
        let staging = self.backend.host()?;
        let (mut applied, fault) = (0, self.fault.take());
        let step_state =
            StepState { state: &mut self.state, applied: &mut applied, journal: self.journal.as_mut() };
        let ran = run_host((&self.plan, fault), step_state, staging, device, &scalars, &mut times);
        let params = &mut device.params;
        self.settle(ran, applied, |range, master| {
            P::narrow(master, &mut params[range]);
            Ok(())
        })?;
        self.state.step = step;
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

/// A zeroed journal for `n` parameters of `variant`, the state's size, reserved fallibly.
fn journal_like(n: usize, variant: crate::config::Variant) -> Result<OptimizerState> {
    let buffers = if variant == crate::config::Variant::AmsGrad { 4 } else { 3 };
    let refused = || flatpeak_common::Error::HostAlloc {
        what: "the rollback journal",
        bytes: n.saturating_mul(4 * buffers),
    };
    let zeros = |len: usize| -> Result<Vec<f32>> {
        let mut v = Vec::new();
        v.try_reserve_exact(len).map_err(|_| refused())?;
        v.resize(len, 0.0);
        Ok(v)
    };
    let max_len = if buffers == 4 { n } else { 0 };
    Ok(OptimizerState {
        param: zeros(n)?,
        exp_avg: zeros(n)?,
        exp_avg_sq: zeros(n)?,
        max_exp_avg_sq: zeros(max_len)?,
        step: 0,
    })
}

/// The scalars of the step about to run, and its number (committed once it ran).
type NextStep = (StepScalars, u64);

#[cfg(feature = "cuda")]
fn cuda_backend<G: GradElement, P: ParamElement>(plan: &Plan, ordinal: usize) -> Result<Backend<G, P>> {
    Ok(Backend::Cuda(Box::new(crate::cuda::CudaOffload::new(plan, ordinal)?)))
}

#[cfg(not(feature = "cuda"))]
fn cuda_backend<G: GradElement, P: ParamElement>(_plan: &Plan, ordinal: usize) -> Result<Backend<G, P>> {
    // `ensure_available` already failed without the feature; this keeps the reason explicit.
    Err(Error::Common(flatpeak_common::Error::CudaUnavailable {
        reason: format!("cuda:{ordinal} requested, but stream-adamw was built without the `cuda` feature"),
    }))
}

#[cfg(feature = "cuda")]
impl<G: GradElement, P: ParamElement> StreamAdamW<G, P> {
    /// The streams, events and pinned staging of an optimizer on a CUDA device (`None` on the
    /// CPU fallback): its context allocates the device buffers [`step_cuda`](Self::step_cuda)
    /// reads and writes.
    pub fn cuda_offload(&self) -> Option<&crate::cuda::CudaOffload<G, P>> {
        match &self.backend {
            Backend::Cuda(offload) => Some(offload),
            Backend::Host(_) => None,
        }
    }

    /// One optimizer step on a CUDA device: the statistics kernel over the device gradients,
    /// then the plan's schedule through `offload`'s pinned slots and copy streams. Non-finite
    /// gradients skip the step and touch nothing.
    pub fn step_cuda(
        &mut self,
        device: &mut crate::cuda::CudaDevice<G, P>,
        options: StepOptions,
    ) -> Result<StepReport> {
        self.check_not_poisoned()?;
        self.check_lengths(device.grads.len(), device.params.len())?;
        let wrong_backend =
            || Error::WrongBackend { expected: "step_host (this optimizer stages on the host)" };
        let Backend::Cuda(offload) = &self.backend else { return Err(wrong_backend()) };
        let start = Instant::now();
        let mut times = StageTimes::default();
        let grad_sq = offload.grad_sq_sum(&device.grads)?;
        times.stats = start.elapsed();
        let (scalars, grad_norm, clip_coef) = self.prepare(grad_sq, options)?;
        let Some((scalars, step)) = scalars else {
            return Ok(self.skipped(grad_norm, times, start));
        };
        let Backend::Cuda(offload) = &mut self.backend else { return Err(wrong_backend()) };
        let mut applied = 0;
        let step_state =
            StepState { state: &mut self.state, applied: &mut applied, journal: self.journal.as_mut() };
        let ran = offload.run(&self.plan, step_state, device, &scalars, &mut times);
        let stream = offload.compute_stream().clone();
        self.settle(ran, applied, |range, master| {
            let mut narrowed = vec![P::zeroed(); range.len()];
            P::narrow(master, &mut narrowed);
            stream
                .memcpy_htod(&narrowed, &mut device.params.slice_mut(range))
                .map_err(flatpeak_common::cuda::cuda_error("cuMemcpyHtoD (rollback)"))?;
            stream
                .synchronize()
                .map_err(flatpeak_common::cuda::cuda_error("cuStreamSynchronize (rollback)"))?;
            Ok(())
        })?;
        self.state.step = step;
        times.total = start.elapsed();
        Ok(StepReport { outcome: StepOutcome::Applied, step: self.state.step, grad_norm, clip_coef, times })
    }
}
