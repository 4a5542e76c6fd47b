//! [`StreamAdamW`]: the offloaded optimizer. It owns the fp32 state (host memory) and the
//! staging slots of its plan (allocated once, at construction), and steps a device's gradients
//! into updated device parameters with the plan's schedule. One `step` on every device: the
//! backend is chosen at construction from the [`Device`], and the buffers a step is handed must
//! live there ([`StepBuffers`]; the wrong ones are `WrongDevice`).

use std::marker::PhantomData;
use std::ops::Range;
use std::time::Instant;

use flatpeak_common::Device;

use crate::config::OnFailure;
use crate::config::StepSchedule;
use crate::cpu::grad_sq_sum;
use crate::element::{GradElement, ParamElement};
use crate::error::{Error, Result};
use crate::host::HostDevice;
use crate::host_engines::{Staging, run_host};
use crate::hyperparameters::{Hyperparameters, Variant};
use crate::pipeline::{Fault, FaultPoints, StepState};
use crate::plan::{Plan, Shape};
use crate::state::{OptimizerState, StateDict};
use crate::step::{StageTimes, StepDecision, StepOptions, StepReport};

/// The device side of one step: the gradients backward produced and the parameters the next
/// forward reads, on the optimizer's device — a [`HostDevice`] for the CPU fallback, a
/// `cuda::CudaDevice` on a GPU (feature `cuda`). `&mut` of either converts into it, so
/// [`StreamAdamW::step`] takes `&mut device` whatever the device.
#[derive(Debug)]
#[non_exhaustive]
pub enum StepBuffers<'a, G: GradElement, P: ParamElement> {
    /// Host memory behind a simulated link (the CPU fallback).
    Host(&'a mut HostDevice<G, P>),
    /// Device memory of a CUDA device.
    #[cfg(feature = "cuda")]
    Cuda(&'a mut crate::cuda::CudaDevice<G, P>),
}

impl<G: GradElement, P: ParamElement> StepBuffers<'_, G, P> {
    /// The same buffers, borrowed for a shorter while (to hand them to one call and keep them).
    pub fn reborrow(&mut self) -> StepBuffers<'_, G, P> {
        match self {
            Self::Host(d) => StepBuffers::Host(d),
            #[cfg(feature = "cuda")]
            Self::Cuda(d) => StepBuffers::Cuda(d),
        }
    }

    /// Where the buffers live.
    pub fn device(&self) -> Device {
        match self {
            Self::Host(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            Self::Cuda(d) => Device::Cuda(d.grads.ordinal()),
        }
    }

    /// Elements of the gradients and of the parameters.
    fn lens(&self) -> (usize, usize) {
        match self {
            Self::Host(d) => (d.grads.len(), d.params.len()),
            #[cfg(feature = "cuda")]
            Self::Cuda(d) => (d.grads.len(), d.params.len()),
        }
    }

    /// Rewrites device parameters `range` as the narrowing of `master` (a rollback).
    fn restore_params(&mut self, range: Range<usize>, master: &[f32]) -> Result<()> {
        match self {
            Self::Host(d) => {
                P::narrow(master, &mut d.params[range]);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            Self::Cuda(d) => d.restore_params(range, master),
        }
    }
}

impl<'a, G: GradElement, P: ParamElement> From<&'a mut HostDevice<G, P>> for StepBuffers<'a, G, P> {
    fn from(device: &'a mut HostDevice<G, P>) -> Self {
        Self::Host(device)
    }
}

#[cfg(feature = "cuda")]
impl<'a, G: GradElement, P: ParamElement> From<&'a mut crate::cuda::CudaDevice<G, P>>
    for StepBuffers<'a, G, P>
{
    fn from(device: &'a mut crate::cuda::CudaDevice<G, P>) -> Self {
        Self::Cuda(device)
    }
}

/// Where the optimizer stages its copies: the CPU fallback's host slots and copy threads, or a
/// CUDA device's pinned slots and copy streams.
#[derive(Debug)]
enum Backend<G: GradElement, P: ParamElement> {
    Host(Staging<G, P>),
    #[cfg(feature = "cuda")]
    Cuda(Box<crate::cuda::CudaOffload<G, P>>),
}

/// Offloaded AdamW over N parameters with gradients of type `G` and a device parameter copy
/// of type `P`, on one [`Device`]: it keeps the user's plan (and so its config), its current
/// hyperparameters, the fp32 state and the plan's staging, allocated once at construction.
#[derive(Debug)]
pub struct StreamAdamW<G: GradElement, P: ParamElement> {
    hyperparameters: Hyperparameters,
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
    /// The optimizer of `plan` on `device`: a zeroed state of `plan`'s parameters (load the
    /// model's with [`load_master`](Self::load_master) or [`import_state`](Self::import_state)),
    /// the config's hyperparameters, and the plan's staging, allocated now — host slots and
    /// copy threads on the CPU fallback ([`Device::Cpu`]), pinned slots and copy streams on a
    /// CUDA device (feature `cuda`). A CUDA device that cannot be used is
    /// `Common(CudaUnavailable)`, saying why; a `plan` of other element types than `G`, `P` is
    /// `InvalidConfig`.
    pub fn new(plan: Plan, device: Device) -> Result<Self> {
        let shape = plan.shape();
        if shape != Self::shape(shape.params) {
            return Err(Error::invalid_config(
                "plan dtypes (grad, param)",
                (shape.grad_dtype, shape.param_dtype),
                "the optimizer's element types G and P",
            ));
        }
        let config = *plan.config();
        let variant = config.hyperparameters.variant;
        let backend = match device {
            Device::Cpu => Backend::Host(Staging::new(&plan)),
            Device::Cuda(ordinal) => {
                device.ensure_available()?;
                cuda_backend(&plan, ordinal)?
            }
        };
        let journal = match config.on_failure {
            OnFailure::Poison => None,
            OnFailure::Rollback => Some(zeroed_state(shape.params, variant, "the rollback journal")?),
        };
        Ok(Self {
            journal,
            state: zeroed_state(shape.params, variant, "the optimizer state")?,
            hyperparameters: config.hyperparameters,
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

    /// The plan (buckets, staging bytes) and, through it, the config.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }
    /// The hyperparameters the next step uses.
    pub fn hyperparameters(&self) -> &Hyperparameters {
        &self.hyperparameters
    }
    /// Replaces the hyperparameters for the next steps (an LR schedule's), after checking them;
    /// the variant (Adam or AMSGrad) is the state's and cannot change. On error nothing changes.
    pub fn set_hyperparameters(&mut self, hyperparameters: Hyperparameters) -> Result<()> {
        hyperparameters.validate()?;
        if hyperparameters.variant != self.hyperparameters.variant {
            return Err(Error::StateMismatch {
                reason: format!(
                    "the variant is the state's ({:?}), not {:?}",
                    self.hyperparameters.variant, hyperparameters.variant
                ),
            });
        }
        self.hyperparameters = hyperparameters;
        Ok(())
    }
    /// The state (fp32 master parameters, moments, step).
    pub fn state(&self) -> &OptimizerState {
        &self.state
    }
    /// Sets the fp32 master parameters (the model's), leaving moments and step count as they
    /// are; a wrong length is `ShapeMismatch` and changes nothing.
    pub fn load_master(&mut self, master: &[f32]) -> Result<()> {
        let n = self.state.len();
        if master.len() != n {
            return Err(Error::ShapeMismatch { what: "master parameters", expected: n, got: master.len() });
        }
        self.state.param.copy_from_slice(master);
        Ok(())
    }
    /// A copy of the state.
    pub fn export_state(&self) -> StateDict {
        self.state.export()
    }
    /// Replaces the state; on error nothing changes. A successful import also lifts the
    /// refusal to step after a partly applied step ([`Error::Poisoned`]).
    pub fn import_state(&mut self, dict: StateDict) -> Result<()> {
        self.state.import(dict, self.hyperparameters.variant)?;
        self.poisoned = None;
        Ok(())
    }

    /// Makes the next step fail at `fault` (feature `testing`: fault injection for tests), on
    /// every backend.
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

    /// The buffers live on this optimizer's device and hold its N parameters.
    pub(crate) fn check_buffers(&self, buffers: &StepBuffers<'_, G, P>) -> Result<()> {
        if buffers.device() != self.device {
            return Err(Error::WrongDevice { executor: self.device, inputs: buffers.device() });
        }
        // The host fallback's link must be able to carry the copies (a bandwidth ≤ 0 or NaN
        // would step as if the copies took no time).
        match buffers {
            StepBuffers::Host(device) => device.link.validate()?,
            #[cfg(feature = "cuda")]
            StepBuffers::Cuda(_) => {}
        }
        let n = self.state.len();
        let (grads, params) = buffers.lens();
        for (what, found) in [("device grads", grads), ("device params", params)] {
            if found != n {
                return Err(Error::ShapeMismatch { what, expected: n, got: found });
            }
        }
        Ok(())
    }

    /// Σ g² over the buffers' gradients, in f64 (non-finite when any is NaN or ±∞): on the CPU
    /// by the fixed-order host reduction, on a GPU by the statistics kernel. What
    /// [`step`](Self::step) decides on; a framework stepping several optimizers as one adds
    /// theirs and steps each with [`step_decided`](Self::step_decided).
    pub fn grad_sq_sum<'b>(&self, buffers: impl Into<StepBuffers<'b, G, P>>) -> Result<f64> {
        let buffers = buffers.into();
        self.check_buffers(&buffers)?;
        self.backend_grad_sq(&buffers)
    }

    fn backend_grad_sq(&self, buffers: &StepBuffers<'_, G, P>) -> Result<f64> {
        match (&self.backend, buffers) {
            (Backend::Host(_), StepBuffers::Host(device)) => Ok(grad_sq_sum(&device.grads)),
            #[cfg(feature = "cuda")]
            (Backend::Cuda(offload), StepBuffers::Cuda(device)) => offload.grad_sq_sum(&device.grads),
            #[cfg(feature = "cuda")]
            _ => Err(Error::internal("the buffers' device was checked against the backend's")),
        }
    }

    /// One optimizer step: Σg² over the device gradients decides it ([`StepDecision`]: a NaN
    /// or infinity skips the step and touches nothing; global-norm clipping by the
    /// hyperparameters), then the plan's schedule of D2H copies, AdamW updates and H2D copies.
    /// `buffers` must be on the optimizer's device (`WrongDevice` otherwise).
    pub fn step<'b>(
        &mut self,
        buffers: impl Into<StepBuffers<'b, G, P>>,
        options: StepOptions,
    ) -> Result<StepReport> {
        let mut buffers = buffers.into();
        self.check_not_poisoned()?;
        self.check_buffers(&buffers)?;
        let start = Instant::now();
        let grad_sq = self.backend_grad_sq(&buffers)?;
        let stats = start.elapsed();
        let decision = StepDecision::new(grad_sq, options, self.hyperparameters.clip)?;
        let mut report = self.run_decided(&mut buffers, &decision, start)?;
        report.times.stats = stats;
        report.times.total = start.elapsed();
        Ok(report)
    }

    /// One step decided elsewhere: `decision` from the Σg² of every optimizer a framework
    /// steps as one (each one's [`grad_sq_sum`](Self::grad_sq_sum)), so one non-finite
    /// gradient skips them all. Otherwise [`step`](Self::step).
    pub fn step_decided<'b>(
        &mut self,
        buffers: impl Into<StepBuffers<'b, G, P>>,
        decision: &StepDecision,
    ) -> Result<StepReport> {
        let mut buffers = buffers.into();
        self.check_not_poisoned()?;
        self.check_buffers(&buffers)?;
        let start = Instant::now();
        let mut report = self.run_decided(&mut buffers, decision, start)?;
        report.times.total = start.elapsed();
        Ok(report)
    }

    /// Runs the plan's schedule for `decision` on checked buffers; settles a failure.
    fn run_decided(
        &mut self,
        buffers: &mut StepBuffers<'_, G, P>,
        decision: &StepDecision,
        start: Instant,
    ) -> Result<StepReport> {
        let mut times = StageTimes::default();
        if decision.skips() {
            times.total = start.elapsed();
            return Ok(decision.report(self.state.step, times));
        }
        let step = StepDecision::next_step(self.state.step)?;
        let scalars = decision.scalars(&self.hyperparameters, step);
        let (mut applied, faults) = (0, FaultPoints::new(&self.plan, self.fault.take()));
        let step_state =
            StepState { state: &mut self.state, applied: &mut applied, journal: self.journal.as_mut() };
        let ran = match (&mut self.backend, &mut *buffers) {
            (Backend::Host(staging), StepBuffers::Host(device)) => {
                run_host(&self.plan, &faults, step_state, staging, device, &scalars, &mut times)
            }
            #[cfg(feature = "cuda")]
            (Backend::Cuda(offload), StepBuffers::Cuda(device)) => {
                offload.run(&self.plan, &faults, step_state, device, &scalars, &mut times)
            }
            #[cfg(feature = "cuda")]
            _ => Err(Error::internal("the buffers' device was checked against the backend's")),
        };
        self.settle(ran, applied, |range, master| buffers.restore_params(range, master))?;
        self.state.step = step;
        Ok(decision.report(step, times))
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
            StepSchedule::Serial => std::iter::once(0..self.plan.n_params()).collect(),
            StepSchedule::Pipelined => (0..applied).map(|k| self.plan.bucket(k)).collect(),
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
}

/// A zeroed state for `n` parameters of `variant` (12 B/param, 16 with AMSGrad), reserved
/// fallibly: a refusal is `HostAlloc` naming `what`.
fn zeroed_state(n: usize, variant: Variant, what: &'static str) -> Result<OptimizerState> {
    let buffers = if variant == Variant::AmsGrad { 4 } else { 3 };
    let refused = || flatpeak_common::Error::HostAlloc { what, bytes: n.saturating_mul(4 * buffers) };
    let zeros = |len: usize| -> Result<Vec<f32>> {
        let mut v = Vec::new();
        v.try_reserve_exact(len).map_err(|_| refused())?;
        // Every step streams the whole state: huge pages, asked for before the first touch.
        flatpeak_common::advise_huge_pages(v.spare_capacity_mut());
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
