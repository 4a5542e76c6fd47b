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
    Config, Device, GradElement, ParamElement, StateDict, StepOptions, StepOutcome, StreamAdamW, bf16,
};

use crate::adamw::AdamWOptions;
use crate::cuda::{Borrowed, borrow_on, take};
use crate::tensor::{Element, TensorDevice, TensorRef, device_of, shape_of};

/// The per-parameter optimizer of one element type (the gradient's is the parameter's, as in
/// torch).
#[derive(Debug)]
enum Inner {
    F32(StreamAdamW<f32, f32>),
    Bf16(StreamAdamW<bf16, bf16>),
}

/// The offloaded optimizer of one CUDA parameter (`flatpeak._flatpeak.CudaAdamW`).
#[pyclass(unsendable, module = "flatpeak._flatpeak")]
#[derive(Debug)]
pub struct CudaAdamW {
    inner: Inner,
    ordinal: usize,
    numel: usize,
}

fn err(e: stream_adamw::Error) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// Σ g² of the gradient tensor, on the optimizer's compute stream.
fn grad_sq<G: GradElement + Element, P: ParamElement>(
    opt: &StreamAdamW<G, P>,
    grad: &Bound<'_, PyAny>,
    (ordinal, numel): (usize, usize),
) -> PyResult<f64> {
    let offload = opt.cuda_offload().ok_or_else(|| PyValueError::new_err("not a CUDA optimizer"))?;
    // SAFETY: the Python frame holds `grad` for the call; the kernel only reads it.
    let grads: Borrowed<G> =
        unsafe { borrow_on(offload.compute_stream(), ("grad", grad), &[Some(numel)], ordinal)? };
    offload.grad_sq_sum(&grads).map_err(err)
}

/// One step on the device tensors; whether it was applied (not skipped for non-finite ones).
fn step<G: GradElement + Element, P: ParamElement + Element>(
    py: Python<'_>,
    opt: &mut StreamAdamW<G, P>,
    (param, grad): (&Bound<'_, PyAny>, &Bound<'_, PyAny>),
    (ordinal, numel): (usize, usize),
) -> PyResult<bool> {
    let offload = opt.cuda_offload().ok_or_else(|| PyValueError::new_err("not a CUDA optimizer"))?;
    let stream = offload.compute_stream().clone();
    // SAFETY: the Python frame holds both tensors for the call; they are distinct tensors (a
    // parameter and its `.grad`) and only this step touches them meanwhile.
    let (grads, params): (Borrowed<G>, Borrowed<P>) = unsafe {
        (
            borrow_on(&stream, ("grad", grad), &[Some(numel)], ordinal)?,
            borrow_on(&stream, ("param", param), &[Some(numel)], ordinal)?,
        )
    };
    if grads.span().overlaps(&params.span()) {
        return Err(PyValueError::new_err("param and grad share memory"));
    }
    let mut device = CudaDevice { grads: take(grads), params: take(params) };
    let report = py.detach(|| opt.step_cuda(&mut device, StepOptions::default()));
    // The memory is the tensors': give it back whatever the step did.
    let CudaDevice { grads, params } = device;
    let _ = (grads.leak(), params.leak());
    Ok(report.map_err(err)?.outcome == StepOutcome::Applied)
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
        let config = Config::default().bucket_elems(bucket_elems);
        let hyper = options.hyperparameters();
        let dtype = param.getattr("dtype")?.str()?.to_string();
        let inner = match dtype.as_str() {
            "torch.float32" => {
                Inner::F32(StreamAdamW::new(master, hyper, &config, Device::Cuda(ordinal)).map_err(err)?)
            }
            "torch.bfloat16" => {
                Inner::Bf16(StreamAdamW::new(master, hyper, &config, Device::Cuda(ordinal)).map_err(err)?)
            }
            other => {
                return Err(PyTypeError::new_err(format!(
                    "param: expected dtype torch.float32 or torch.bfloat16, got {other}"
                )));
            }
        };
        Ok(Self { inner, ordinal, numel })
    }

    /// Σ g² over the parameter's gradient (non-finite when any element is NaN or ±∞).
    fn grad_sq_sum(&self, grad: &Bound<'_, PyAny>) -> PyResult<f64> {
        let at = (self.ordinal, self.numel);
        match &self.inner {
            Inner::F32(o) => grad_sq(o, grad, at),
            Inner::Bf16(o) => grad_sq(o, grad, at),
        }
    }

    /// One step with `options` (this step's hyperparameters); whether it was applied.
    fn step(
        &mut self,
        py: Python<'_>,
        param: &Bound<'_, PyAny>,
        grad: &Bound<'_, PyAny>,
        options: &AdamWOptions,
    ) -> PyResult<bool> {
        let at = (self.ordinal, self.numel);
        let hyper = options.hyperparameters();
        match &mut self.inner {
            Inner::F32(o) => {
                o.set_hyperparameters(hyper).map_err(err)?;
                step(py, o, (param, grad), at)
            }
            Inner::Bf16(o) => {
                o.set_hyperparameters(hyper).map_err(err)?;
                step(py, o, (param, grad), at)
            }
        }
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
        .map_err(err)
    }
}
