//! The offloaded optimizer for CUDA parameters (feature `cuda`): one stream-adamw
//! [`StreamAdamW`] per parameter, its fp32 master parameters and moments in host memory, its
//! step the crate's bucket pipeline (D2H of gradients ‖ CPU AdamW ‖ H2D of parameters) through
//! pinned staging slots and its own copy streams. The parameter and gradient tensors are read
//! and written in place (borrowed for the step on the optimizer's compute stream and leaked
//! back, never freed by cudarc). The step waits for its copies before returning, so torch work
//! issued afterwards sees the new parameters; the Python side waits for torch's current stream
//! before the step, so the gradients are complete.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use stream_adamw::cuda::CudaDevice;
use stream_adamw::{
    Budget, Config, Device, GradElement, ParamElement, Plan, StateDict, StepOutcome, StreamAdamW, bf16,
};

use crate::adamw::{AdamWOptions, Decision};
use crate::cuda::{Borrowed, borrow_on, take};
use crate::error::to_py;
use crate::tensor::{TensorDevice, TensorRef, TorchElement, device_of, shape_of};

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
pub struct CudaAdamW {
    inner: Inner,
    ordinal: usize,
    numel: usize,
}

/// Runs `f` on the parameter and gradient tensors as the optimizer's device buffers, borrowed
/// on the device's default stream (the optimizer's compute stream) and handed back after.
fn with_device<G: GradElement + TorchElement, P: ParamElement + TorchElement, R>(
    (param, grad): (&Bound<'_, PyAny>, &Bound<'_, PyAny>),
    (ordinal, numel): (usize, usize),
    f: impl FnOnce(&mut CudaDevice<G, P>) -> stream_adamw::Result<R>,
) -> PyResult<R> {
    // The parameter keeps its shape (any, of the optimizer's `numel` elements); its gradient has
    // the same shape, as torch requires of `.grad`.
    let sizes = shape_of("param", param)?;
    if sizes.iter().product::<usize>() != numel {
        return Err(PyValueError::new_err(format!(
            "param: expected {numel} elements (the parameter this optimizer was made for), got shape {sizes:?}"
        )));
    }
    let shape: Vec<Option<usize>> = sizes.into_iter().map(Some).collect();
    let stream = flatpeak_common::cuda::context(ordinal).map_err(to_py)?.default_stream();
    // SAFETY: the Python frame holds both tensors for the call; they are distinct tensors (a
    // parameter and its `.grad`, checked not to overlap below) and only this call touches them
    // meanwhile.
    let (grads, params): (Borrowed<G>, Borrowed<P>) = unsafe {
        (
            borrow_on(&stream, ("grad", grad), &shape, ordinal)?,
            borrow_on(&stream, ("param", param), &shape, ordinal)?,
        )
    };
    if grads.span().overlaps(&params.span()) {
        return Err(PyValueError::new_err("param and grad share memory"));
    }
    let mut device = CudaDevice { grads: take(grads), params: take(params) };
    let result = f(&mut device);
    // The memory is the tensors': give it back whatever the call did.
    let CudaDevice { grads, params } = device;
    let _ = (grads.leak(), params.leak());
    result.map_err(to_py)
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
    let r = TensorRef::<f32>::new(name, t, &[Some(numel)])?;
    // SAFETY: a checked CPU fp32 tensor held by the Python frame, only read.
    Ok(unsafe { r.as_slice() }.to_vec())
}

/// Copies `src` into the CPU fp32 tensor `t` of `src.len()` elements.
fn host_write(name: &'static str, t: &Bound<'_, PyAny>, src: &[f32]) -> PyResult<()> {
    let r = TensorRef::<f32>::new(name, t, &[Some(src.len())])?;
    // SAFETY: a checked CPU fp32 tensor held by the Python frame, written by nobody else.
    unsafe { r.as_mut_slice() }.copy_from_slice(src);
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
        let TensorDevice::Cuda(ordinal) = device_of("param", param)? else {
            return Err(PyValueError::new_err("param: expected a CUDA tensor"));
        };
        let numel: usize = shape_of("param", param)?.iter().product();
        let master = host_vec("master", master, numel)?;
        let config = Config::default().bucket_elems(bucket_elems).hyperparameters(options.hyperparameters());
        let dtype = param.getattr("dtype")?.str()?.to_string();
        let inner = match dtype.as_str() {
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

    /// Σ g² over the parameter's gradient (non-finite when any element is NaN or ±∞), by the
    /// optimizer's statistics kernel.
    fn grad_sq_sum(&self, param: &Bound<'_, PyAny>, grad: &Bound<'_, PyAny>) -> PyResult<f64> {
        let at = (self.ordinal, self.numel);
        match &self.inner {
            Inner::F32(o) => with_device((param, grad), at, |d| o.grad_sq_sum(d)),
            Inner::Bf16(o) => with_device((param, grad), at, |d| o.grad_sq_sum(d)),
        }
    }

    /// One step with `options` (this step's hyperparameters), as `decision` (the step's, over
    /// every parameter) says; whether it was applied.
    fn step(
        &mut self,
        py: Python<'_>,
        param: &Bound<'_, PyAny>,
        grad: &Bound<'_, PyAny>,
        options: &AdamWOptions,
        decision: &Decision,
    ) -> PyResult<bool> {
        let at = (self.ordinal, self.numel);
        let (hyper, decision) = (options.hyperparameters(), *decision.get());
        let report = match &mut self.inner {
            Inner::F32(o) => {
                o.set_hyperparameters(hyper).map_err(to_py)?;
                with_device((param, grad), at, |d| py.detach(|| o.step_decided(d, &decision)))?
            }
            Inner::Bf16(o) => {
                o.set_hyperparameters(hyper).map_err(to_py)?;
                with_device((param, grad), at, |d| py.detach(|| o.step_decided(d, &decision)))?
            }
        };
        Ok(report.outcome == StepOutcome::Applied)
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
