//! The optimizer's arguments as Python passes them, converted: a param group's hyperparameters
//! ([`AdamWOptions`], defined once for the CPU and the offloaded parameters) and an offloaded
//! parameter of a step ([`Offloaded`]).

use flatpeak_common::comm::Refusal;
use pyo3::prelude::*;
use stream_adamw::{GradClip, Hyperparameters, Objective, StepPart, Variant};

use crate::error::to_py;

/// One param group's hyperparameters, checked (`flatpeak._flatpeak.AdamWOptions`).
#[pyclass(frozen, module = "flatpeak._flatpeak")]
#[derive(Debug, Clone, Copy)]
pub(crate) struct AdamWOptions {
    pub(crate) hyperparameters: Hyperparameters,
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

/// An offloaded parameter of a step, as Python passes it: `(optimizer, param, grad, options,
/// copies)`, its `CudaAdamW`, its CUDA tensors, its group's options for this step and how many
/// ranks of the step's group hold it alike.
/// Without the `cuda` build only `param` is read: to refuse it, naming its device.
#[derive(FromPyObject)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) struct Offloaded<'py> {
    #[pyo3(item(0))]
    pub(crate) optimizer: Bound<'py, PyAny>,
    #[pyo3(item(1))]
    pub(crate) param: Bound<'py, PyAny>,
    #[pyo3(item(2))]
    pub(crate) grad: Bound<'py, PyAny>,
    #[pyo3(item(3))]
    pub(crate) options: Bound<'py, AdamWOptions>,
    #[pyo3(item(4))]
    pub(crate) copies: u64,
}

/// The work of a step given this rank's offloaded parts, or why it has none (the refusal still
/// enters the step's agreement).
pub(crate) type OffloadedParts<'a, 'p> = Result<&'a mut [&'p mut dyn StepPart], Refusal>;
