//! AdamW on torch tensors: one call of stream-adamw's step ([`stream_adamw::step_parts`]) over
//! every parameter of the optimizer, the CPU ones in place on the state tensors the Python
//! optimizer keeps under torch's names (`exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`, so
//! `state_dict()` is torch's own), the CUDA ones offloaded ([`crate::adamw_cuda::CudaAdamW`]).
//! The checks, the global Σg², the skip on a non-finite gradient, the clipping and the step
//! counts are the crate's; this file finds the tensors. The GIL is released while it runs.

use flatpeak_common::Communicator;
use flatpeak_common::comm::Refusal;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use stream_adamw::cpu::StateMut;
use stream_adamw::{
    GradRef, Hyperparameters, InPlaceGroup, InPlaceGroups, InPlaceParam, OnNonFinite, Replicated,
    StepOptions, StepOutcome, StepPart, StepReport, Variant, agree, bf16, step_parts_over,
};

use crate::adamw_args::{AdamWOptions, Offloaded, OffloadedParts};
use crate::error::refusal;
use crate::tensor::{Lend, Lent, Out, Register, device_of, is_dtype, shape_of};

/// What one step did (`flatpeak._flatpeak.StepDecision`), as the crate decided it from the global
/// Σg²: whether it skipped, and what every parameter's update scaled its gradient by.
#[pyclass(frozen, name = "StepDecision", module = "flatpeak._flatpeak")]
#[derive(Debug, Clone, Copy)]
pub(crate) struct Decision {
    report: StepReport,
}

#[pymethods]
impl Decision {
    /// True when a non-finite gradient skipped the step (nothing was changed).
    #[getter]
    fn skipped(&self) -> bool {
        self.report.outcome == StepOutcome::SkippedNonFinite
    }
    /// The global gradient norm before clipping (non-finite when skipped; NaN when the step read
    /// no gradient: `on_nonfinite="ignore"` without clipping).
    #[getter]
    fn grad_norm(&self) -> f64 {
        self.report.grad_norm
    }
    /// What clipping scaled every gradient by (1 when not clipping).
    #[getter]
    fn clip_coef(&self) -> f64 {
        self.report.clip_coef
    }
    /// Seconds of the gradient statistics pass (Σg² and the non-finite check, with the group's
    /// agreement when there is one).
    #[getter]
    fn statistics_seconds(&self) -> f64 {
        self.report.times.stats.as_secs_f64()
    }
    /// Seconds of the update pass (0 when skipped).
    #[getter]
    fn update_seconds(&self) -> f64 {
        self.report.times.adam.as_secs_f64()
    }
}

/// One parameter's tensors: `(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step,
/// bf16_param)`, `step` being torch's step counter: a 0-dim float32 or float64 CPU tensor holding
/// the steps taken (a whole number ≥ 0), advanced in place when the step is applied.
/// `bf16_param` is `None` for a float32 parameter (`param`, with a float32 `grad`); for a
/// bfloat16 one it is the parameter, with its bfloat16 `grad`, and `param` its float32 master
/// copy: the step updates the master and writes it, rounded, into `bf16_param`.
#[derive(FromPyObject)]
pub(crate) struct ParamState<'py> {
    #[pyo3(item(0))]
    param: Bound<'py, PyAny>,
    #[pyo3(item(1))]
    grad: Bound<'py, PyAny>,
    #[pyo3(item(2))]
    exp_avg: Bound<'py, PyAny>,
    #[pyo3(item(3))]
    exp_avg_sq: Bound<'py, PyAny>,
    #[pyo3(item(4))]
    max_exp_avg_sq: Option<Bound<'py, PyAny>>,
    #[pyo3(item(5))]
    step: Bound<'py, PyAny>,
    #[pyo3(item(6))]
    bf16_param: Option<Bound<'py, PyAny>>,
}

/// A parameter's gradient, in its dtype.
enum Grad {
    F32(crate::tensor::In<f32>),
    Bf16(crate::tensor::In<bf16>),
}

/// torch's step counter of one parameter: a 0-dim float tensor (float64 when torch's default
/// dtype is).
enum Counter {
    F32(Out<f32>),
    F64(Out<f64>),
}

/// One parameter's tensors, registered.
struct Param {
    param: Out<f32>,
    grad: Grad,
    bf16_param: Option<Out<bf16>>,
    exp_avg: Out<f32>,
    exp_avg_sq: Out<f32>,
    max_exp_avg_sq: Option<Out<f32>>,
    counter: Counter,
}

/// Parameters on the CPU step in place; a CUDA one in a build without the feature is refused,
/// saying how to build with it.
fn cpu_only(name: &str, tensor: &Bound<'_, PyAny>) -> PyResult<()> {
    match device_of(name, tensor)? {
        flatpeak_common::Device::Cpu => Ok(()),
        flatpeak_common::Device::Cuda(_) if !cfg!(feature = "cuda") => {
            Err(crate::tensor::cuda_not_built(name))
        }
        flatpeak_common::Device::Cuda(_) => Err(PyTypeError::new_err(format!(
            "{name}: a CUDA tensor handed to the CPU update (CUDA parameters take CudaAdamW)"
        ))),
    }
}

impl Param {
    fn new<'t, 'py>(lend: &mut Lend<'t, 'py>, p: &'t ParamState<'py>, amsgrad: bool) -> PyResult<Self> {
        cpu_only("param", &p.param)?;
        let shape: Vec<Option<usize>> = shape_of("param", &p.param)?.into_iter().map(Some).collect();
        let param = lend.output("param", &p.param, &shape)?;
        // torch's rule: the gradient has the parameter's dtype (bfloat16 with a master copy).
        let (grad, bf16_param) = match &p.bf16_param {
            None => (Grad::F32(lend.input("grad", &p.grad, &shape)?), None),
            Some(model) => {
                cpu_only("bf16_param", model)?;
                let model = lend.output("bf16_param", model, &shape)?;
                (Grad::Bf16(lend.input("grad", &p.grad, &shape)?), Some(model))
            }
        };
        let exp_avg = lend.output("exp_avg", &p.exp_avg, &shape)?;
        let exp_avg_sq = lend.output("exp_avg_sq", &p.exp_avg_sq, &shape)?;
        let max_exp_avg_sq = match (&p.max_exp_avg_sq, amsgrad) {
            (Some(m), true) => Some(lend.output("max_exp_avg_sq", m, &shape)?),
            (None, false) => None,
            (Some(_), false) => return Err(PyValueError::new_err("max_exp_avg_sq: given without amsgrad")),
            (None, true) => return Err(PyValueError::new_err("max_exp_avg_sq: amsgrad needs it")),
        };
        cpu_only("step", &p.step)?;
        let counter = if is_dtype::<f64>(&p.step)? {
            Counter::F64(lend.output("step", &p.step, &[])?)
        } else {
            Counter::F32(lend.output("step", &p.step, &[])?)
        };
        Ok(Self { param, grad, bf16_param, exp_avg, exp_avg_sq, max_exp_avg_sq, counter })
    }

    /// The crate's parameter over the lent tensors, and its step counter.
    fn lend<'l>(self, lent: &'l Lent<'_, '_>) -> PyResult<(InPlaceParam<'l>, StepCount<'l>)> {
        let counter = match self.counter {
            Counter::F32(c) => StepCount::F32(lent.get_mut(c)?),
            Counter::F64(c) => StepCount::F64(lent.get_mut(c)?),
        };
        let state = StateMut {
            param: lent.get_mut(self.param)?,
            exp_avg: lent.get_mut(self.exp_avg)?,
            exp_avg_sq: lent.get_mut(self.exp_avg_sq)?,
            max_exp_avg_sq: lent.get_mut_opt(self.max_exp_avg_sq)?.unwrap_or_default(),
        };
        let grad = match self.grad {
            Grad::F32(g) => GradRef::F32(lent.get(g)?),
            Grad::Bf16(g) => GradRef::Bf16(lent.get(g)?),
        };
        let bf16_param = lent.get_mut_opt(self.bf16_param)?;
        let step = counter.read()?;
        Ok((InPlaceParam { state, grad, bf16_param, step }, counter))
    }
}

/// A parameter's lent step counter.
enum StepCount<'l> {
    F32(&'l mut [f32]),
    F64(&'l mut [f64]),
}

impl StepCount<'_> {
    /// The steps taken; a value that is not a whole number ≥ 0 is a `ValueError`.
    fn read(&self) -> PyResult<u64> {
        let value = match self {
            Self::F32(c) => f64::from(c[0]),
            Self::F64(c) => c[0],
        };
        if value.is_finite() && value >= 0.0 && value.fract() == 0.0 && value < u64::MAX as f64 {
            Ok(value as u64)
        } else {
            Err(PyValueError::new_err(format!("step: expected a whole number of steps >= 0, got {value}")))
        }
    }

    /// Stores `step` (exact in either dtype for any realistic count).
    fn write(&mut self, step: u64) {
        match self {
            Self::F32(c) => c[0] = step as f32,
            Self::F64(c) => c[0] = step as f64,
        }
    }
}

/// One param group of a step as Python passes it: `(options, params, copies)`, its
/// hyperparameters, its parameters' tensors, and how many ranks of the step's group hold those
/// parameters alike (1: this rank's own, or no group).
#[derive(FromPyObject)]
pub(crate) struct GroupArgs<'py> {
    #[pyo3(item(0))]
    options: Bound<'py, AdamWOptions>,
    #[pyo3(item(1))]
    params: Vec<ParamState<'py>>,
    #[pyo3(item(2))]
    copies: u64,
}

/// `on_nonfinite` as Python names it.
fn on_nonfinite(name: &str) -> PyResult<OnNonFinite> {
    match name {
        "skip" => Ok(OnNonFinite::Skip),
        "raise" => Ok(OnNonFinite::Raise),
        "ignore" => Ok(OnNonFinite::Ignore),
        other => Err(PyValueError::new_err(format!(
            "on_nonfinite: expected \"skip\", \"raise\" or \"ignore\", got {other:?}"
        ))),
    }
}

/// The CPU parameters of a step, lent, in classes of equal copies: each class one
/// [`Replicated`] part; `counters` are their step counters in the same order.
struct CpuParts<'l> {
    classes: Vec<(u64, Vec<InPlaceGroup<'l>>)>,
    counters: Vec<StepCount<'l>>,
}

impl<'l> CpuParts<'l> {
    fn new(registered: Vec<(Hyperparameters, u64, Vec<Param>)>, lent: &'l Lent<'_, '_>) -> PyResult<Self> {
        let mut classes: Vec<(u64, Vec<InPlaceGroup<'l>>)> = Vec::new();
        let mut by_class: Vec<Vec<StepCount<'l>>> = Vec::new();
        for (hyperparameters, copies, params) in registered {
            let class = match classes.iter().position(|(c, _)| *c == copies) {
                Some(i) => i,
                None => {
                    classes.push((copies, Vec::new()));
                    by_class.push(Vec::new());
                    classes.len() - 1
                }
            };
            let mut group = InPlaceGroup { hyperparameters, params: Vec::new() };
            for p in params {
                let (param, counter) = p.lend(lent)?;
                group.params.push(param);
                by_class[class].push(counter);
            }
            classes[class].1.push(group);
        }
        Ok(Self { classes, counters: by_class.into_iter().flatten().collect() })
    }

    /// Writes each parameter's step count into its torch counter (after an applied step).
    fn write_counters(&mut self) {
        let steps =
            self.classes.iter().flat_map(|(_, groups)| groups).flat_map(|g| &g.params).map(|p| p.step);
        for (counter, step) in self.counters.iter_mut().zip(steps) {
            counter.write(step);
        }
    }
}

/// One AdamW step of every parameter: `groups` the CPU parameters by param group, `offloaded`
/// the CUDA parameters with their offloaded optimizers (the `cuda` build). Every tensor of every
/// parameter is checked before any is written, so a bad one leaves all parameters and state
/// untouched; one decision for all of them (a non-finite gradient anywhere skips the step, or
/// raises under `on_nonfinite="raise"`; the clipping's norm is over all of them). With `group`
/// (a process group), the decision is agreed by its ranks ([`stream_adamw::step_parts_over`]):
/// each element counted once (by its part's copies), the same decision on every rank, and a
/// rank's bad input an error on every rank. `threads`: the CPU passes' threads (torch's OpenMP team
/// when the process has one, else a pool of ours: [`crate::pool`]; rayon's global pool when `None`). `refused`: an exception the caller raised preparing this rank's step: it enters the
/// group's agreement (the other ranks raise too) and is raised here. Returns the decision.
#[pyfunction]
#[pyo3(signature = (groups, offloaded=Vec::new(), *, group=None, on_nonfinite="skip", threads=None, refused=None))]
pub(crate) fn adamw_step(
    py: Python<'_>,
    groups: Vec<GroupArgs<'_>>,
    offloaded: Vec<Offloaded<'_>>,
    group: Option<Bound<'_, PyAny>>,
    on_nonfinite: &str,
    threads: Option<usize>,
    refused: Option<Bound<'_, PyAny>>,
) -> PyResult<Decision> {
    let policy = self::on_nonfinite(on_nonfinite)?;
    let workers = threads.map(crate::pool::Workers::new).transpose()?;
    let comm = crate::torch_group::communicator(py, group)?
        .ok_or_else(|| PyRuntimeError::new_err("a step's communicator is made for it"))?;
    if let Some(exception) = refused {
        let e = PyErr::from_value(exception);
        let refused = refusal(py, e.clone_ref(py));
        let _ = py.detach(move || step(comm.as_ref(), Err(refused), policy));
        return Err(e);
    }
    let mut lend = Lend::new();
    let registered = register(&mut lend, &groups);
    let lent = lend.lent();
    let cpu = match (registered, &lent) {
        (Ok(registered), Ok(lent)) => CpuParts::new(registered, lent),
        (Err(e), _) => Err(e),
        (Ok(_), Err(e)) => Err(e.clone_ref(py)),
    }
    .map_err(|e| refusal(py, e));
    let report = step_offloaded(py, offloaded, move |offloaded| {
        let run = move || {
            let mut cpu = cpu;
            let local = match (&mut cpu, offloaded) {
                (Ok(cpu), Ok(offloaded)) => Ok((cpu, offloaded)),
                (Err(r), _) => Err(r.clone()),
                (_, Err(r)) => Err(r),
            };
            let report = step(comm.as_ref(), local, policy)?;
            if let (Ok(cpu), StepOutcome::Applied) = (&mut cpu, report.outcome) {
                cpu.write_counters();
            }
            Ok(report)
        };
        match &workers {
            Some(workers) => workers.install(run),
            None => run(),
        }
    })?;
    Ok(Decision { report })
}

/// The step of this rank's parts, agreed over `comm` (a group of one without a process group),
/// or, when this rank's own input was refused, that refusal entered in the agreement (so the
/// group's other ranks raise too) and returned.
fn step(
    comm: &dyn Communicator,
    local: Result<(&mut CpuParts<'_>, &mut [&mut dyn StepPart]), Refusal>,
    policy: OnNonFinite,
) -> stream_adamw::Result<StepReport> {
    let (cpu, offloaded) = match local {
        Ok(parts) => parts,
        Err(refusal) => {
            let agreed =
                agree::<_, stream_adamw::Error>(comm, Err(refusal.into()), StepOptions::default(), policy);
            return Err(agreed.err().unwrap_or_else(|| {
                stream_adamw::Error::internal("an agreement over a refused input refuses")
            }));
        }
    };
    let mut classes: Vec<Replicated<InPlaceGroups<'_, '_>>> = cpu
        .classes
        .iter_mut()
        .map(|(copies, groups)| Replicated { part: InPlaceGroups(groups), copies: *copies })
        .collect();
    let mut parts: Vec<&mut dyn StepPart> = classes.iter_mut().map(|c| c as &mut dyn StepPart).collect();
    parts.extend(offloaded.iter_mut().map(|p| &mut **p as &mut dyn StepPart));
    step_parts_over(comm, &mut parts, StepOptions::default(), policy)
}

/// Registers every CPU parameter's tensors: `(hyperparameters, copies, params)` by group.
fn register<'t, 'py>(
    lend: &mut Lend<'t, 'py>,
    groups: &'t [GroupArgs<'py>],
) -> PyResult<Vec<(Hyperparameters, u64, Vec<Param>)>> {
    groups
        .iter()
        .map(|g| {
            let hyperparameters = g.options.get().hyperparameters;
            let amsgrad = hyperparameters.variant == Variant::AmsGrad;
            let params =
                g.params.iter().map(|p| Param::new(lend, p, amsgrad)).collect::<PyResult<Vec<_>>>()?;
            Ok((hyperparameters, g.copies, params))
        })
        .collect()
}

/// Runs `step` (with the GIL released) on the parts of the offloaded parameters; when they
/// cannot be lent, on that refusal (the step still enters its group's agreement) and returns the
/// Python error.
#[cfg(feature = "cuda")]
fn step_offloaded(
    py: Python<'_>,
    offloaded: Vec<Offloaded<'_>>,
    step: impl for<'a, 'p> FnOnce(OffloadedParts<'a, 'p>) -> stream_adamw::Result<StepReport> + Send,
) -> PyResult<StepReport> {
    crate::adamw_cuda::step_with(py, offloaded, step)
}

/// Runs `step` (with the GIL released): no parameter is offloaded without the `cuda` build, so
/// one given is refused, naming its device.
#[cfg(not(feature = "cuda"))]
fn step_offloaded(
    py: Python<'_>,
    offloaded: Vec<Offloaded<'_>>,
    step: impl for<'a, 'p> FnOnce(OffloadedParts<'a, 'p>) -> stream_adamw::Result<StepReport> + Send,
) -> PyResult<StepReport> {
    if let Some(Err(e)) = offloaded.first().map(|first| cpu_only("param", &first.param)) {
        let refused = refusal(py, e.clone_ref(py));
        let _ = py.detach(|| step(Err(refused)));
        return Err(e);
    }
    py.detach(|| step(Ok(&mut []))).map_err(crate::error::to_py)
}
