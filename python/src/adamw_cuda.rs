//! The offloaded optimizer of CUDA parameters (feature `cuda`): one stream-adamw [`StreamAdamW`]
//! per parameter, its fp32 master parameters and moments in host memory, its step the crate's
//! bucket pipeline (D2H of gradients ‖ CPU AdamW ‖ H2D of parameters) through pinned staging
//! slots and its own copy streams. The parameter and gradient tensors are lent for the step
//! (`cuda_tensor.rs`); the step waits for its copies before returning, so torch work issued
//! afterwards sees the new parameters; the Python side waits for torch's current stream before
//! the step, so the gradients are complete.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use stream_adamw::{
    Budget, Config, Device, GradElement, OffloadedStep, ParamElement, Plan, Replicated, StateDict, StepPart,
    StepReport, StreamAdamW, bf16,
};

use crate::adamw_args::{AdamWOptions, Offloaded, OffloadedParts};
use crate::cuda_tensor::{DIn, DOut, DeviceLend, DeviceLent, LentMut};
use crate::error::refusal;
use crate::error::to_py;
use crate::tensor::{Lend, Register, TorchElement, device_of, shape_of};

/// The per-parameter optimizer of one element type (the gradient's is the parameter's, as in
/// torch).
#[derive(Debug)]
enum Inner {
    F32(StreamAdamW<f32, f32>),
    Bf16(StreamAdamW<bf16, bf16>),
}

/// The offloaded optimizer of one CUDA parameter (`flatpeak._flatpeak.CudaAdamW`).
#[pyclass(module = "flatpeak._flatpeak")]
#[derive(Debug)]
pub(crate) struct CudaAdamW {
    inner: Inner,
    ordinal: usize,
    numel: usize,
}

/// The offloaded optimizer of `config` on CUDA device `ordinal`, from the fp32 master copy.
fn offloaded<G: GradElement, P: ParamElement>(
    config: &Config,
    master: &[f32],
    ordinal: usize,
) -> stream_adamw::Result<StreamAdamW<G, P>> {
    let plan = Plan::new(config, StreamAdamW::<G, P>::shape(master.len()), Budget::Unlimited)?;
    let mut opt = StreamAdamW::new(plan, Device::Cuda(ordinal))?;
    opt.load_master(master)?;
    Ok(opt)
}

/// A CPU fp32 tensor of `numel` elements, read.
fn host_vec(name: &'static str, t: &Bound<'_, PyAny>, numel: usize) -> PyResult<Vec<f32>> {
    let mut lend = Lend::new();
    let h = lend.input::<f32>(name, t, &[Some(numel)])?;
    Ok(lend.lent()?.get(h)?.to_vec())
}

/// Copies `src` into the CPU fp32 tensor `t` of `src.len()` elements.
fn host_write(name: &'static str, t: &Bound<'_, PyAny>, src: &[f32]) -> PyResult<()> {
    let mut lend = Lend::new();
    let h = lend.output::<f32>(name, t, &[Some(src.len())])?;
    lend.lent()?.get_mut(h)?.copy_from_slice(src);
    Ok(())
}

#[pymethods]
impl CudaAdamW {
    /// The optimizer of CUDA parameter `param` (float32 or bfloat16), its fp32 master copy from
    /// the CPU fp32 tensor `master` (flattened, `param.numel()` elements), with `options` and
    /// buckets of `bucket_elems` elements.
    #[new]
    fn new(
        param: &Bound<'_, PyAny>,
        master: &Bound<'_, PyAny>,
        options: &AdamWOptions,
        bucket_elems: usize,
    ) -> PyResult<Self> {
        let Device::Cuda(ordinal) = device_of("param", param)? else {
            return Err(PyValueError::new_err("param: expected a CUDA tensor"));
        };
        let numel: usize = shape_of("param", param)?.iter().product();
        let master = host_vec("master", master, numel)?;
        let config = Config::default().bucket_elems(bucket_elems).hyperparameters(options.hyperparameters);
        let inner = match crate::tensor::dtype_name(param)?.as_str() {
            "torch.float32" => Inner::F32(offloaded(&config, &master, ordinal).map_err(to_py)?),
            "torch.bfloat16" => Inner::Bf16(offloaded(&config, &master, ordinal).map_err(to_py)?),
            other => {
                return Err(PyTypeError::new_err(format!(
                    "param: expected dtype torch.float32 or torch.bfloat16, got {other}"
                )));
            }
        };
        Ok(Self { inner, ordinal, numel })
    }

    /// Writes the state into CPU fp32 tensors (`max_exp_avg_sq` only with AMSGrad); returns the
    /// step count.
    #[pyo3(signature = (master, exp_avg, exp_avg_sq, max_exp_avg_sq=None))]
    fn export_into(
        &self,
        master: &Bound<'_, PyAny>,
        exp_avg: &Bound<'_, PyAny>,
        exp_avg_sq: &Bound<'_, PyAny>,
        max_exp_avg_sq: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let dict = match &self.inner {
            Inner::F32(o) => o.export_state(),
            Inner::Bf16(o) => o.export_state(),
        };
        host_write("master", master, &dict.param)?;
        host_write("exp_avg", exp_avg, &dict.exp_avg)?;
        host_write("exp_avg_sq", exp_avg_sq, &dict.exp_avg_sq)?;
        match (max_exp_avg_sq, &dict.max_exp_avg_sq) {
            (Some(t), Some(m)) => host_write("max_exp_avg_sq", t, m)?,
            (None, None) => {}
            _ => return Err(PyValueError::new_err("max_exp_avg_sq: expected exactly with amsgrad")),
        }
        Ok(dict.step)
    }

    /// Replaces the state from CPU fp32 tensors; on error nothing changes.
    #[pyo3(signature = (step, master, exp_avg, exp_avg_sq, max_exp_avg_sq=None))]
    fn import_from(
        &mut self,
        step: u64,
        master: &Bound<'_, PyAny>,
        exp_avg: &Bound<'_, PyAny>,
        exp_avg_sq: &Bound<'_, PyAny>,
        max_exp_avg_sq: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let n = self.numel;
        let dict = StateDict {
            step,
            param: host_vec("master", master, n)?,
            exp_avg: host_vec("exp_avg", exp_avg, n)?,
            exp_avg_sq: host_vec("exp_avg_sq", exp_avg_sq, n)?,
            max_exp_avg_sq: max_exp_avg_sq.map(|t| host_vec("max_exp_avg_sq", t, n)).transpose()?,
        };
        match &mut self.inner {
            Inner::F32(o) => o.import_state(dict),
            Inner::Bf16(o) => o.import_state(dict),
        }
        .map_err(to_py)
    }
}

/// One offloaded parameter's lent buffers, by its dtype.
enum Buffers<'l> {
    F32(LentMut<'l, stream_adamw::cuda::CudaDevice<f32, f32>>),
    Bf16(LentMut<'l, stream_adamw::cuda::CudaDevice<bf16, bf16>>),
}

/// Lends one parameter and its gradient (their shape the parameter's: torch's rule for `.grad`).
fn lend_pair<'t, 'py, T: TorchElement + flatpeak_common::cuda::cudarc::driver::DeviceRepr>(
    lend: &mut DeviceLend<'t, 'py>,
    part: &'t Offloaded<'py>,
    numel: usize,
) -> PyResult<Pair<T>> {
    let sizes = shape_of("param", &part.param)?;
    if sizes.iter().product::<usize>() != numel {
        return Err(PyValueError::new_err(format!(
            "param: expected {numel} elements (the parameter this optimizer was made for), got shape {sizes:?}"
        )));
    }
    let shape: Vec<Option<usize>> = sizes.into_iter().map(Some).collect();
    Ok(Pair {
        grad: lend.input("grad", &part.grad, &shape)?,
        param: lend.output("param", &part.param, &shape)?,
    })
}

/// Runs `step` with the GIL released on the parts of the `offloaded` parameters: each optimizer's
/// hyperparameters set to its group's, each parameter and gradient lent on its device. When one
/// cannot be, `step` runs on that refusal (it still enters its group's agreement) and the Python
/// error is returned.
pub(crate) fn step_with(
    py: Python<'_>,
    offloaded: Vec<Offloaded<'_>>,
    step: impl for<'a, 'p> FnOnce(OffloadedParts<'a, 'p>) -> stream_adamw::Result<StepReport> + Send,
) -> PyResult<StepReport> {
    let mut optimizers: Vec<PyRefMut<'_, CudaAdamW>> = Vec::with_capacity(offloaded.len());
    let mut lends: Vec<DeviceLent<'_, '_>> = Vec::with_capacity(offloaded.len());
    let mut buffers = Vec::with_capacity(offloaded.len());
    let prepared = prepare(py, &offloaded, &mut optimizers, &mut lends).and_then(|handles| {
        for (lent, pair) in lends.iter().zip(handles) {
            buffers.push(match pair {
                Pairs::F32(p) => Buffers::F32(lent.adamw_device(p.grad, p.param)?),
                Pairs::Bf16(p) => Buffers::Bf16(lent.adamw_device(p.grad, p.param)?),
            });
        }
        optimizers
            .iter_mut()
            .zip(buffers.iter_mut())
            .zip(&offloaded)
            .map(|((opt, b), o)| match (&mut opt.inner, b) {
                (Inner::F32(opt), Buffers::F32(d)) => Ok(Part::F32(Replicated {
                    part: OffloadedStep { optimizer: opt, buffers: (&mut **d).into() },
                    copies: o.copies,
                })),
                (Inner::Bf16(opt), Buffers::Bf16(d)) => Ok(Part::Bf16(Replicated {
                    part: OffloadedStep { optimizer: opt, buffers: (&mut **d).into() },
                    copies: o.copies,
                })),
                _ => Err(to_py(stream_adamw::Error::internal(
                    "an offloaded parameter lent in its optimizer's dtype",
                ))),
            })
            .collect::<PyResult<Vec<Part<'_, '_>>>>()
    });
    match prepared {
        Ok(mut parts) => py
            .detach(move || {
                let mut dyns: Vec<&mut dyn StepPart> = parts.iter_mut().map(Part::as_dyn).collect();
                step(Ok(&mut dyns))
            })
            .map_err(to_py),
        Err(e) => {
            let refused = refusal(py, e.clone_ref(py));
            let _ = py.detach(move || step(Err(refused)));
            Err(e)
        }
    }
}

/// Sets each offloaded optimizer's hyperparameters and registers its parameter and gradient.
fn prepare<'t, 'py>(
    py: Python<'py>,
    offloaded: &'t [Offloaded<'py>],
    optimizers: &mut Vec<PyRefMut<'py, CudaAdamW>>,
    lends: &mut Vec<DeviceLent<'t, 'py>>,
) -> PyResult<Vec<Pairs>> {
    let mut handles = Vec::with_capacity(offloaded.len());
    for part in offloaded {
        let mut opt: PyRefMut<'py, CudaAdamW> = part.optimizer.extract().map_err(PyErr::from)?;
        let hyper = part.options.get().hyperparameters;
        match &mut opt.inner {
            Inner::F32(o) => o.set_hyperparameters(hyper),
            Inner::Bf16(o) => o.set_hyperparameters(hyper),
        }
        .map_err(to_py)?;
        let mut lend = DeviceLend::new(py, opt.ordinal)?;
        handles.push(match opt.inner {
            Inner::F32(_) => Pairs::F32(lend_pair::<f32>(&mut lend, part, opt.numel)?),
            Inner::Bf16(_) => Pairs::Bf16(lend_pair::<bf16>(&mut lend, part, opt.numel)?),
        });
        lends.push(lend.lent()?);
        optimizers.push(opt);
    }
    Ok(handles)
}

/// A parameter's registered gradient and parameter.
struct Pair<T> {
    grad: DIn<T>,
    param: DOut<T>,
}

/// A parameter's registered tensors, by dtype.
enum Pairs {
    F32(Pair<f32>),
    Bf16(Pair<bf16>),
}

/// One offloaded parameter's step part, by dtype.
enum Part<'o, 'b> {
    F32(Replicated<OffloadedStep<'o, 'b, f32, f32>>),
    Bf16(Replicated<OffloadedStep<'o, 'b, bf16, bf16>>),
}

impl Part<'_, '_> {
    fn as_dyn(&mut self) -> &mut dyn StepPart {
        match self {
            Part::F32(p) => p,
            Part::Bf16(p) => p,
        }
    }
}
