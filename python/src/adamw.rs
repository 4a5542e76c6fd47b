//! AdamW on torch tensors: stream-adamw's SIMD CPU update, in place on the parameter and on the
//! state tensors the Python optimizer keeps under torch's names (`exp_avg`, `exp_avg_sq`,
//! `max_exp_avg_sq`), so `state_dict()` is torch's own.
//!
//! The step is the crate's [`stream_adamw::step_in_place`] logic — the checks, the global Σg²,
//! the skip on a non-finite gradient and the step counts — with torch's `AdamW` update (see the
//! `stream-adamw` crate for the exact order of operations). This file only finds the tensors.
//! The GIL is released while it runs.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use stream_adamw::cpu::{StateMut, grad_sq_sums};
use stream_adamw::{
    GradClip, GradRef, Hyperparameters, InPlaceGroup, InPlaceParam, Objective, StepDecision, StepOptions,
    Variant, apply_in_place, bf16, global_clip, in_place_grad_sq,
};

use crate::error::to_py;
use crate::tensor::{Span, TensorDevice, TensorRef, check_disjoint, device_of, shape_of};

/// One param group's hyperparameters, checked (`flatpeak._flatpeak.AdamWOptions`).
#[pyclass(frozen, module = "flatpeak._flatpeak")]
#[derive(Debug, Clone, Copy)]
pub struct AdamWOptions {
    hyperparameters: Hyperparameters,
}

impl AdamWOptions {
    /// The checked hyperparameters.
    pub(crate) fn hyperparameters(&self) -> Hyperparameters {
        self.hyperparameters
    }
}

#[pymethods]
impl AdamWOptions {
    /// torch.optim.AdamW's hyperparameters, and the global-norm clipping of
    /// `torch.nn.utils.clip_grad_norm_(params, max_norm)` (`None`: none).
    #[new]
    #[pyo3(signature = (*, lr, betas, eps, weight_decay, amsgrad, maximize, max_norm=None))]
    fn new(
        lr: f64,
        betas: (f64, f64),
        eps: f64,
        weight_decay: f64,
        amsgrad: bool,
        maximize: bool,
        max_norm: Option<f64>,
    ) -> PyResult<Self> {
        let hyperparameters = Hyperparameters::default()
            .lr(lr)
            .betas(betas.0, betas.1)
            .eps(eps)
            .weight_decay(weight_decay)
            .variant(if amsgrad { Variant::AmsGrad } else { Variant::Adam })
            .objective(if maximize { Objective::Maximize } else { Objective::Minimize })
            .clip(max_norm.map_or(GradClip::None, |max_norm| GradClip::GlobalNorm { max_norm }));
        hyperparameters.validate().map_err(to_py)?;
        Ok(Self { hyperparameters })
    }
}

/// The decision of one step (`flatpeak._flatpeak.StepDecision`), made by the crate from the
/// global Σg²: whether it skips, and what every parameter's update scales its gradient by.
#[pyclass(frozen, module = "flatpeak._flatpeak")]
#[derive(Debug, Clone, Copy)]
pub struct Decision {
    decision: StepDecision,
}

#[cfg(feature = "cuda")]
impl Decision {
    /// The crate's decision.
    pub(crate) fn get(&self) -> &StepDecision {
        &self.decision
    }
}

#[pymethods]
impl Decision {
    /// True when a non-finite gradient skips the step (nothing is changed).
    #[getter]
    fn skipped(&self) -> bool {
        self.decision.skips()
    }
    /// The global gradient norm before clipping (non-finite when skipped).
    #[getter]
    fn grad_norm(&self) -> f64 {
        self.decision.grad_norm()
    }
    /// What clipping scaled every gradient by (1 when not clipping).
    #[getter]
    fn clip_coef(&self) -> f64 {
        self.decision.clip_coef()
    }
}

/// One parameter's tensors: `(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step,
/// bf16_param)`, `step` being torch's step counter: a 0-dim float32 or float64 CPU tensor
/// holding the steps taken (a whole number ≥ 0), advanced in place when the step is applied.
/// `bf16_param` is `None` for a float32 parameter (`param`, with a float32 `grad`); for a
/// bfloat16 one it is the parameter, with its bfloat16 `grad`, and `param` its float32 master
/// copy: the step updates the master and writes it, rounded, into `bf16_param`.
#[derive(FromPyObject)]
pub struct ParamState<'py> {
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
enum CheckedGrad {
    F32(TensorRef<f32>),
    Bf16(TensorRef<bf16>),
}

impl CheckedGrad {
    /// # Safety
    /// As [`TensorRef::as_slice`]: the caller holds the tensor for the call and nothing writes it.
    unsafe fn as_grad(&self) -> GradRef<'_> {
        // SAFETY: the caller's contract.
        unsafe {
            match self {
                Self::F32(g) => GradRef::F32(g.as_slice()),
                Self::Bf16(g) => GradRef::Bf16(g.as_slice()),
            }
        }
    }

    fn span(&self) -> Span {
        match self {
            Self::F32(g) => g.into(),
            Self::Bf16(g) => g.into(),
        }
    }
}

/// torch's step counter of one parameter: a 0-dim float tensor (float64 when torch's default
/// dtype is), read and advanced in place.
enum StepCounter {
    F32(TensorRef<f32>),
    F64(TensorRef<f64>),
}

impl StepCounter {
    fn new(tensor: &Bound<'_, PyAny>) -> PyResult<Self> {
        cpu_only("step", tensor)?;
        match TensorRef::<f32>::new("step", tensor, &[]) {
            Ok(t) => Ok(Self::F32(t)),
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyTypeError>(tensor.py()) => {
                TensorRef::<f64>::new("step", tensor, &[]).map(Self::F64).map_err(|_| e)
            }
            Err(e) => Err(e),
        }
    }

    /// The steps taken; a value that is not a whole number ≥ 0 is a `ValueError`.
    fn read(&self) -> PyResult<u64> {
        // SAFETY: the counter is a checked 0-dim tensor (one element) the caller holds for the
        // call; it is read here, before any write, with the GIL held.
        let value = unsafe {
            match self {
                Self::F32(t) => t.as_slice()[0] as f64,
                Self::F64(t) => t.as_slice()[0],
            }
        };
        if value.is_finite() && value >= 0.0 && value.fract() == 0.0 && value < u64::MAX as f64 {
            Ok(value as u64)
        } else {
            Err(PyValueError::new_err(format!("step: expected a whole number of steps >= 0, got {value}")))
        }
    }

    /// Stores `step` (exact in either dtype for any realistic count).
    ///
    /// # Safety
    /// `check_disjoint` must have proved the counter overlaps no other tensor of the call, and
    /// the caller must hold it for the call.
    unsafe fn write(&self, step: u64) {
        // SAFETY: the caller's contract: the one element is exclusively this call's to write.
        unsafe {
            match self {
                Self::F32(t) => t.as_mut_slice()[0] = step as f32,
                Self::F64(t) => t.as_mut_slice()[0] = step as f64,
            }
        }
    }

    fn span(&self) -> Span {
        match self {
            Self::F32(t) => t.into(),
            Self::F64(t) => t.into(),
        }
    }
}

/// A parameter's checked tensors.
struct Checked {
    param: TensorRef<f32>,
    grad: CheckedGrad,
    bf16_param: Option<TensorRef<bf16>>,
    exp_avg: TensorRef<f32>,
    exp_avg_sq: TensorRef<f32>,
    max_exp_avg_sq: Option<TensorRef<f32>>,
    counter: StepCounter,
    step: u64,
}

/// Parameters on the CPU run here. A CUDA one takes the offloaded path (`CudaAdamW`, feature
/// `cuda`); without the feature it is refused, saying how to build with it.
fn cpu_only(name: &str, tensor: &Bound<'_, PyAny>) -> PyResult<()> {
    match device_of(name, tensor)? {
        TensorDevice::Cpu => Ok(()),
        #[cfg(not(feature = "cuda"))]
        TensorDevice::Cuda(_) => Err(crate::tensor::cuda_not_built(name)),
        #[cfg(feature = "cuda")]
        TensorDevice::Cuda(_) => Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "{name}: a CUDA tensor handed to the CPU update (CUDA parameters take CudaAdamW)"
        ))),
    }
}

/// Any tensor's shape, as an expected shape: the other tensors of a parameter must match it.
fn expected_shape(name: &str, tensor: &Bound<'_, PyAny>) -> PyResult<Vec<Option<usize>>> {
    Ok(shape_of(name, tensor)?.into_iter().map(Some).collect())
}

impl Checked {
    fn new(p: &ParamState<'_>, amsgrad: bool) -> PyResult<Self> {
        cpu_only("param", &p.param)?;
        let shape = expected_shape("param", &p.param)?;
        let param = TensorRef::new("param", &p.param, &shape)?;
        // torch's rule: the gradient has the parameter's dtype (bfloat16 with a master copy).
        let (grad, bf16_param) = match &p.bf16_param {
            None => (CheckedGrad::F32(TensorRef::new("grad", &p.grad, &shape)?), None),
            Some(model) => {
                cpu_only("bf16_param", model)?;
                let model = TensorRef::new("bf16_param", model, &shape)?;
                (CheckedGrad::Bf16(TensorRef::new("grad", &p.grad, &shape)?), Some(model))
            }
        };
        let exp_avg = TensorRef::new("exp_avg", &p.exp_avg, &shape)?;
        let exp_avg_sq = TensorRef::new("exp_avg_sq", &p.exp_avg_sq, &shape)?;
        let max_exp_avg_sq = match (&p.max_exp_avg_sq, amsgrad) {
            (Some(m), true) => Some(TensorRef::new("max_exp_avg_sq", m, &shape)?),
            (None, false) => None,
            (Some(_), false) => return Err(PyValueError::new_err("max_exp_avg_sq: given without amsgrad")),
            (None, true) => return Err(PyValueError::new_err("max_exp_avg_sq: amsgrad needs it")),
        };
        let counter = StepCounter::new(&p.step)?;
        let step = counter.read()?;
        Ok(Self { param, grad, bf16_param, exp_avg, exp_avg_sq, max_exp_avg_sq, counter, step })
    }
}

/// Σ g² over every gradient, in f64 (non-finite when any element is NaN or ±∞). Each tensor
/// must be a contiguous fp32 CPU tensor.
#[pyfunction]
pub fn grad_sq_sum_all(py: Python<'_>, grads: Vec<Bound<'_, PyAny>>) -> PyResult<f64> {
    let mut checked = Vec::with_capacity(grads.len());
    for g in &grads {
        cpu_only("grad", g)?;
        checked.push(TensorRef::<f32>::new("grad", g, &expected_shape("grad", g)?)?);
    }
    // SAFETY: each tensor is held by the caller's list for the call and only read.
    let slices: Vec<&[f32]> = checked.iter().map(|g| unsafe { g.as_slice() }).collect();
    Ok(py.detach(|| grad_sq_sums(&slices).into_iter().sum()))
}

/// One AdamW step of every CPU parameter of every group, in place (each parameter's step
/// counter advanced with it): `groups` is a list of `(options, params)`, and `other_grad_sq` the Σg² of the gradients stepped with them
/// elsewhere (the offloaded CUDA parameters), so one non-finite gradient skips them all. Every
/// tensor of every group is checked before any is written, so a bad one leaves all parameters
/// and state untouched. The groups' global-norm clipping (one for all of them) scales every
/// gradient, these and the offloaded ones, by the coefficient of the norm over all of them.
/// Returns the crate's decision (skipped, or applied with that coefficient), which the offloaded
/// parameters then take.
#[pyfunction]
#[pyo3(signature = (groups, other_grad_sq=0.0))]
pub fn adamw_step(
    py: Python<'_>,
    groups: Vec<(Bound<'_, AdamWOptions>, Vec<ParamState<'_>>)>,
    other_grad_sq: f64,
) -> PyResult<Decision> {
    let mut checked = Vec::with_capacity(groups.len());
    for (options, params) in &groups {
        let hyperparameters = options.get().hyperparameters();
        let amsgrad = hyperparameters.variant == Variant::AmsGrad;
        let params = params.iter().map(|p| Checked::new(p, amsgrad)).collect::<PyResult<Vec<_>>>()?;
        checked.push((hyperparameters, params));
    }
    // Every written tensor of every parameter overlaps no other tensor of the step.
    let (mut outputs, mut inputs): (Vec<Span>, Vec<Span>) = (Vec::new(), Vec::new());
    for p in checked.iter().flat_map(|(_, params)| params) {
        outputs.extend([Span::from(&p.param), (&p.exp_avg).into(), (&p.exp_avg_sq).into()]);
        outputs.extend(p.max_exp_avg_sq.iter().map(Span::from));
        outputs.extend(p.bf16_param.iter().map(Span::from));
        outputs.push(p.counter.span());
        inputs.push(p.grad.span());
    }
    check_disjoint(&outputs, &inputs)?;
    let decision = py.detach(|| -> stream_adamw::Result<StepDecision> {
        let mut in_place: Vec<InPlaceGroup<'_>> = Vec::with_capacity(checked.len());
        for (hyperparameters, params) in &checked {
            let mut group = InPlaceGroup { hyperparameters: *hyperparameters, params: Vec::new() };
            for p in params {
                // SAFETY: the caller holds every tensor for the call; `check_disjoint` above
                // proved every written tensor of every parameter disjoint from every other
                // tensor of the step (written or read), so these `&mut` slices are exclusive.
                let (state, grad, bf16_param) = unsafe {
                    let max_exp_avg_sq = p.max_exp_avg_sq.as_ref().map_or(&mut [][..], |m| m.as_mut_slice());
                    let state = StateMut {
                        param: p.param.as_mut_slice(),
                        exp_avg: p.exp_avg.as_mut_slice(),
                        exp_avg_sq: p.exp_avg_sq.as_mut_slice(),
                        max_exp_avg_sq,
                    };
                    (state, p.grad.as_grad(), p.bf16_param.as_ref().map(|m| m.as_mut_slice()))
                };
                group.params.push(InPlaceParam { state, grad, bf16_param, step: p.step });
            }
            in_place.push(group);
        }
        let clip = global_clip(&in_place)?;
        let grad_sq = in_place_grad_sq(&in_place) + other_grad_sq;
        let decision = StepDecision::new(grad_sq, StepOptions::default(), clip)?;
        apply_in_place(&mut in_place, &decision)?;
        if !decision.skips() {
            let taken = in_place.iter().flat_map(|g| &g.params).map(|p| p.step);
            for (p, step) in checked.iter().flat_map(|(_, params)| params).zip(taken) {
                // SAFETY: `check_disjoint` proved each counter disjoint from every other tensor
                // of the call, and the caller holds them all for the call.
                unsafe { p.counter.write(step) };
            }
        }
        Ok(decision)
    });
    Ok(Decision { decision: decision.map_err(to_py)? })
}
