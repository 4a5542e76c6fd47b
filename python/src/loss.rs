//! `linear_cross_entropy` on torch tensors: ring-dtp's executor over the tensors' own storage.
//!
//! Forward writes the loss and the per-row lse into tensors the Python side allocated; backward
//! writes dX, dW (and dbias) into fp32 tensors it allocated ([`ring_dtp::GradientsMut`]), so the
//! only memory the call adds is the plan's working set, fixed by `budget_bytes` before any data
//! is read. A gradient Python does not want (a frozen input, weight or bias) is passed as `None`:
//! it is neither allocated nor computed (its GEMM is skipped). The GIL is released while the
//! blocks run.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::{Mutex, OnceLock};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use ring_dtp::{
    Bf16GradientsMut, Budget, Config, DType, Device, Forward, GradOutput, GradientSelection, GradientsMut,
    Inputs, LinearCrossEntropy, Loss, Matrix, Plan, Precision, Reduction, Shape, Softcap, Want, bf16,
};

use crate::error::to_py;
use crate::tensor::TensorDevice;
#[cfg(not(feature = "cuda"))]
use crate::tensor::device_of;
use crate::tensor::{Span, TensorRef, TorchElement, check_disjoint, shape_of};

/// The default working-set budget on a CPU: 128 MiB. At N=8192, D=1024, V=32768 it gives
/// 512-token blocks over the whole vocabulary, which ran forward + backward 5% (f32) and 13%
/// (bf16) faster than the 256-token blocks of 64 MiB on a 2-core AVX-512 machine; an eighth of
/// the logits' bytes there.
pub const DEFAULT_BUDGET_BYTES: usize = 128 << 20;
/// The default working-set budget on a GPU: 256 MiB. A GPU's GEMMs need larger blocks to fill
/// its multiprocessors (on an H200, 256-token blocks over a 32K vocabulary ran at 0.79 of the
/// SGEMM rate, 1024-token blocks at 0.92: docs/gpu.md), still a fraction of the logits' bytes.
pub const DEFAULT_CUDA_BUDGET_BYTES: usize = 256 << 20;

/// The loss's options, checked once (`flatpeak._flatpeak.LossOptions`).
#[pyclass(frozen, module = "flatpeak._flatpeak")]
#[derive(Debug, Clone, Copy)]
pub struct LossOptions {
    pub(crate) config: Config,
    /// The caller's bound; `None`: the device's default ([`LossOptions::budget`]).
    budget_bytes: Option<usize>,
}

impl LossOptions {
    /// The working-set budget on `device`: the caller's, else [`DEFAULT_BUDGET_BYTES`] on a CPU
    /// and [`DEFAULT_CUDA_BUDGET_BYTES`] on a GPU.
    pub(crate) fn budget(&self, device: TensorDevice) -> Budget {
        Budget::Bytes(self.budget_bytes.unwrap_or(match device {
            TensorDevice::Cpu => DEFAULT_BUDGET_BYTES,
            TensorDevice::Cuda(_) => DEFAULT_CUDA_BUDGET_BYTES,
        }))
    }

    /// The plan of `shape` on `device` under these options.
    pub(crate) fn plan(&self, shape: Shape, device: TensorDevice) -> PyResult<Plan> {
        Plan::new(&self.config, shape, self.budget(device)).map_err(to_py)
    }
}

#[pymethods]
impl LossOptions {
    /// Options with torch's names and conventions; `softcap=None` is off; `precision` is
    /// `"native"` (GEMMs in the inputs' dtype, a bf16 call's logit gradient rounded to bf16 as
    /// autograd of a bf16 matmul does) or `"f32"` (every GEMM in f32).
    #[new]
    #[pyo3(signature = (*, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None, budget_bytes=None, precision="native"))]
    fn new(
        ignore_index: i64,
        reduction: &str,
        label_smoothing: f64,
        z_loss: f64,
        softcap: Option<f64>,
        budget_bytes: Option<usize>,
        precision: &str,
    ) -> PyResult<Self> {
        let precision = match precision {
            "native" => Precision::Native,
            "f32" => Precision::F32,
            "tf32" => Precision::Tf32,
            other => {
                return Err(PyValueError::new_err(format!(
                    "precision: expected 'native', 'f32' or 'tf32', got {other:?}"
                )));
            }
        };
        let reduction = match reduction {
            "mean" => Reduction::Mean,
            "sum" => Reduction::Sum,
            "none" => Reduction::None,
            other => {
                return Err(PyValueError::new_err(format!(
                    "reduction: expected 'mean', 'sum' or 'none', got {other:?}"
                )));
            }
        };
        // Checked in f64, where the caller's value lives: a value just past 1 must not round
        // into the range on its cast to f32 (nor one just below it be refused after rounding up).
        if !(0.0..=1.0).contains(&label_smoothing) {
            return Err(PyValueError::new_err(format!(
                "label_smoothing: expected a value in [0, 1], got {label_smoothing}"
            )));
        }
        let softcap = softcap.map_or(Softcap::Off, |cap| Softcap::Tanh { cap: cap as f32 });
        let config = Config::default()
            .ignore_index(ignore_index)
            .reduction(reduction)
            .label_smoothing(label_smoothing as f32)
            .z_loss(z_loss as f32)
            .softcap(softcap)
            .precision(precision);
        config.validate().map_err(to_py)?;
        if budget_bytes == Some(0) {
            return Err(PyValueError::new_err("budget_bytes: expected a positive number of bytes, got 0"));
        }
        Ok(Self { config, budget_bytes })
    }

    /// Bytes of the working set the plan reserves for this shape on a CPU (`torch.float32` or
    /// `torch.bfloat16` inputs), the bound the call's added memory keeps under.
    fn workspace_bytes(&self, tokens: usize, hidden: usize, vocab: usize, bf16: bool) -> PyResult<usize> {
        let dtype = if bf16 { DType::Bf16 } else { DType::F32 };
        let shape = Shape { tokens, hidden, vocab, dtype };
        Ok(self.plan(shape, TensorDevice::Cpu)?.workspace_bytes())
    }

    /// Bytes of the `uint8` CUDA tensor the CUDA path carves its block buffers from (the plan's
    /// working set, each buffer 256-byte aligned).
    #[cfg(feature = "cuda")]
    fn cuda_workspace_bytes(
        &self,
        tokens: usize,
        hidden: usize,
        vocab: usize,
        bf16: bool,
    ) -> PyResult<usize> {
        let dtype = if bf16 { DType::Bf16 } else { DType::F32 };
        crate::cuda::workspace_bytes(self, Shape { tokens, hidden, vocab, dtype })
    }

    fn __repr__(&self) -> String {
        format!("LossOptions({:?}, budget_bytes={:?})", self.config, self.budget_bytes)
    }
}

/// X and W as one dtype, read in place.
pub(crate) enum Operands {
    F32(TensorRef<f32>, TensorRef<f32>),
    Bf16(TensorRef<bf16>, TensorRef<bf16>),
}

/// One call's checked tensors: `(input, weight, target, bias, token_weights)`.
pub(crate) struct Checked {
    pub(crate) operands: Operands,
    pub(crate) target: TensorRef<i64>,
    pub(crate) bias: Option<TensorRef<f32>>,
    pub(crate) weights: Option<TensorRef<f32>>,
    pub(crate) shape: Shape,
}

impl Checked {
    pub(crate) fn new(args: &TensorArgs<'_>) -> PyResult<Self> {
        #[cfg(not(feature = "cuda"))]
        if let TensorDevice::Cuda(_) = device_of("input", &args.input)? {
            return Err(crate::tensor::cuda_not_built("input"));
        }
        let Shape { tokens: n, hidden: d, vocab: v, dtype } = args.shape()?;
        let (operands, dtype) = match dtype {
            DType::Bf16 => (
                Operands::Bf16(
                    TensorRef::new("input", &args.input, &[Some(n), Some(d)])?,
                    TensorRef::new("weight", &args.weight, &[Some(v), Some(d)])?,
                ),
                DType::Bf16,
            ),
            _ => (
                Operands::F32(
                    TensorRef::new("input", &args.input, &[Some(n), Some(d)])?,
                    TensorRef::new("weight", &args.weight, &[Some(v), Some(d)])?,
                ),
                DType::F32,
            ),
        };
        let target = TensorRef::new("target", &args.target, &[Some(n)])?;
        let bias = args.bias.as_ref().map(|b| TensorRef::new("bias", b, &[Some(v)])).transpose()?;
        let weights = args
            .token_weights
            .as_ref()
            .map(|w| TensorRef::new("token_weights", w, &[Some(n)]))
            .transpose()?;
        Ok(Self { operands, target, bias, weights, shape: Shape { tokens: n, hidden: d, vocab: v, dtype } })
    }

    pub(crate) fn spans(&self) -> Vec<Span> {
        let mut spans: Vec<Span> = match &self.operands {
            Operands::F32(x, w) => vec![x.into(), w.into()],
            Operands::Bf16(x, w) => vec![x.into(), w.into()],
        };
        spans.push((&self.target).into());
        spans.extend(self.bias.iter().map(Span::from));
        spans.extend(self.weights.iter().map(Span::from));
        spans
    }

    /// The crate's inputs over the tensors' storage.
    ///
    /// # Safety
    /// The tensors must outlive the returned borrow, and nothing may write them meanwhile (the
    /// outputs were checked disjoint from them).
    pub(crate) unsafe fn inputs(&self) -> Inputs<'_> {
        // SAFETY: the caller keeps the tensors alive and unwritten for the borrow; each
        // `TensorRef` was checked (CPU, contiguous, dtype, shape, alignment) in `new`.
        let (x, w) = unsafe {
            match &self.operands {
                Operands::F32(x, w) => (Matrix::F32(x.as_slice()), Matrix::F32(w.as_slice())),
                Operands::Bf16(x, w) => (Matrix::Bf16(x.as_slice()), Matrix::Bf16(w.as_slice())),
            }
        };
        // SAFETY: as above.
        let (targets, bias, weights) = unsafe {
            (self.target.as_slice(), self.bias.map(|b| b.as_slice()), self.weights.map(|w| w.as_slice()))
        };
        let mut inputs = Inputs::new(x, w, targets, self.shape.hidden);
        inputs.v = self.shape.vocab;
        inputs.bias = bias;
        inputs.weights = weights;
        inputs
    }
}

/// The tensors of one call, as Python passes them: `(input, weight, target, bias,
/// token_weights)`.
#[derive(FromPyObject)]
pub struct TensorArgs<'py> {
    #[pyo3(item(0))]
    pub(crate) input: Bound<'py, PyAny>,
    #[pyo3(item(1))]
    pub(crate) weight: Bound<'py, PyAny>,
    #[pyo3(item(2))]
    pub(crate) target: Bound<'py, PyAny>,
    #[pyo3(item(3))]
    pub(crate) bias: Option<Bound<'py, PyAny>>,
    #[pyo3(item(4))]
    pub(crate) token_weights: Option<Bound<'py, PyAny>>,
}

impl TensorArgs<'_> {
    /// N, D, V from the shapes of input `[N, D]` and weight `[V, D]`, and the dtype of input
    /// (bf16, else f32: a wrong one is named when the tensor is read).
    pub(crate) fn shape(&self) -> PyResult<Shape> {
        let x_shape = shape_of("input", &self.input)?;
        let w_shape = shape_of("weight", &self.weight)?;
        let (&[n, d], &[v, dw]) = (x_shape.as_slice(), w_shape.as_slice()) else {
            return Err(PyValueError::new_err(format!(
                "input must be [tokens, hidden] and weight [vocab, hidden]: got {x_shape:?} and {w_shape:?}"
            )));
        };
        if d != dw {
            return Err(PyValueError::new_err(format!(
                "hidden sizes differ: input is [{n}, {d}], weight is [{v}, {dw}]"
            )));
        }
        let dtype: String = self.input.getattr("dtype")?.str()?.to_string();
        let dtype = if dtype == "torch.bfloat16" { DType::Bf16 } else { DType::F32 };
        Ok(Shape { tokens: n, hidden: d, vocab: v, dtype })
    }
}

/// Whether a gradient whose output tensor is `given` (or `None`) is computed.
pub(crate) fn want(given: bool) -> Want {
    if given { Want::Compute } else { Want::Skip }
}

/// The selection of a call's gradient outputs as Python passes them, `None` for a gradient that
/// is not wanted; a dbias without a bias is refused (there is nothing to differentiate).
pub(crate) fn selection(given: [bool; 3], has_bias: bool) -> PyResult<GradientSelection> {
    let [dx, dw, dbias] = given;
    if dbias && !has_bias {
        return Err(PyValueError::new_err("dbias: given, but the call has no bias"));
    }
    Ok(GradientSelection::ALL.dx(want(dx)).dw(want(dw)).dbias(want(dbias)))
}

/// dX and dW as the caller allocated them, each `None` when not wanted: fp32, or bf16 (the crate
/// accumulates in f32 and rounds once, holding no fp32 copy of both beside them).
enum DxDw {
    F32(Option<TensorRef<f32>>, Option<TensorRef<f32>>),
    Bf16(Option<TensorRef<bf16>>, Option<TensorRef<bf16>>),
}

/// The CPU tensors a backward writes, each `None` when its gradient is not wanted: dX and dW of
/// one dtype (fp32 or bf16), dbias fp32.
pub(crate) struct GradTensors {
    dx_dw: DxDw,
    dbias: Option<TensorRef<f32>>,
    wanted: GradientSelection,
}

/// The crate's gradient buffers over a call's tensors, of their dtype.
enum GradBuffers<'a> {
    F32(GradientsMut<'a>),
    Bf16(Bf16GradientsMut<'a>),
}

impl GradBuffers<'_> {
    /// [`LinearCrossEntropy::backward_into`] into these buffers.
    fn backward_into(
        self,
        lce: &mut LinearCrossEntropy,
        inputs: &Inputs<'_>,
        lse: &[f32],
        upstream: ring_dtp::Upstream<'_>,
    ) -> ring_dtp::Result<()> {
        match self {
            Self::F32(out) => lce.backward_into(inputs, lse, upstream, out),
            Self::Bf16(out) => lce.backward_into(inputs, lse, upstream, out),
        }
    }

    /// [`LinearCrossEntropy::forward_backward_into`] into these buffers.
    fn forward_backward_into(
        self,
        lce: &mut LinearCrossEntropy,
        inputs: &Inputs<'_>,
        grad: GradOutput<'_>,
    ) -> ring_dtp::Result<Forward> {
        match self {
            Self::F32(out) => lce.forward_backward_into(inputs, grad, out),
            Self::Bf16(out) => lce.forward_backward_into(inputs, grad, out),
        }
    }
}

/// The gradient outputs as Python passes them: `(dx, dw, dbias)`, each a tensor or `None`.
pub(crate) type GradArgs<'py> =
    (Option<Bound<'py, PyAny>>, Option<Bound<'py, PyAny>>, Option<Bound<'py, PyAny>>);

impl GradTensors {
    /// Checks each given tensor against the call's shape (dX `[N, D]`, dW `[V, D]`, dbias `[V]`)
    /// and dX and dW against one dtype, fp32 or bf16 (the first given decides; the other is
    /// named if it differs).
    fn new(grads_out: &GradArgs<'_>, checked: &Checked) -> PyResult<Self> {
        let Shape { tokens: n, hidden: d, vocab: v, .. } = checked.shape;
        fn tensor<T: TorchElement>(
            name: &'static str,
            t: &Option<Bound<'_, PyAny>>,
            shape: &[Option<usize>],
        ) -> PyResult<Option<TensorRef<T>>> {
            t.as_ref().map(|t| TensorRef::<T>::new(name, t, shape)).transpose()
        }
        let (dx_shape, dw_shape) = ([Some(n), Some(d)], [Some(v), Some(d)]);
        let first_given = grads_out.0.as_ref().or(grads_out.1.as_ref());
        // Anything but a bf16 tensor is read as fp32, whose check names what is wrong with it.
        let bf16_given = first_given
            .and_then(|t| t.getattr("dtype").ok()?.str().ok())
            .is_some_and(|dtype| dtype == "torch.bfloat16");
        let dx_dw = if bf16_given {
            DxDw::Bf16(tensor("dx", &grads_out.0, &dx_shape)?, tensor("dw", &grads_out.1, &dw_shape)?)
        } else {
            DxDw::F32(tensor("dx", &grads_out.0, &dx_shape)?, tensor("dw", &grads_out.1, &dw_shape)?)
        };
        let dbias = tensor("dbias", &grads_out.2, &[Some(v)])?;
        let given = [grads_out.0.is_some(), grads_out.1.is_some(), dbias.is_some()];
        let wanted = selection(given, checked.bias.is_some())?;
        Ok(Self { dx_dw, dbias, wanted })
    }

    fn spans(&self) -> Vec<Span> {
        let mut spans: Vec<Span> = match &self.dx_dw {
            DxDw::F32(dx, dw) => [dx, dw].into_iter().flatten().map(Span::from).collect(),
            DxDw::Bf16(dx, dw) => [dx, dw].into_iter().flatten().map(Span::from).collect(),
        };
        spans.extend(self.dbias.iter().map(Span::from));
        spans
    }

    /// The crate's gradient buffers over the tensors' storage (empty for a skipped one).
    ///
    /// # Safety
    /// The tensors must outlive the returned borrow and [`check_disjoint`] must have passed for
    /// them against every other tensor of the call.
    unsafe fn as_mut(&self) -> GradBuffers<'_> {
        // SAFETY: the caller's contract: each tensor is alive and no other borrow overlaps it.
        let dbias = self.dbias.map(|t| unsafe { t.as_mut_slice() });
        match self.dx_dw {
            DxDw::F32(dx, dw) => {
                // SAFETY: the caller's contract: dX and dW are alive for the borrow and
                // `check_disjoint` proved them disjoint from every other tensor of the call.
                let slice =
                    |t: Option<TensorRef<f32>>| t.map_or(&mut [][..], |t| unsafe { t.as_mut_slice() });
                GradBuffers::F32(GradientsMut::new(slice(dx), slice(dw), dbias).selecting(self.wanted))
            }
            DxDw::Bf16(dx, dw) => {
                // SAFETY: the caller's contract: the bf16 dX and dW are alive for the borrow and
                // `check_disjoint` proved them disjoint from every other tensor of the call.
                let slice =
                    |t: Option<TensorRef<bf16>>| t.map_or(&mut [][..], |t| unsafe { t.as_mut_slice() });
                GradBuffers::Bf16(Bf16GradientsMut::new(slice(dx), slice(dw), dbias).selecting(self.wanted))
            }
        }
    }
}

/// Executors of the CPU path kept between calls, by (options, plan): each one's working set is
/// reserved once and reused by every later call of the same shape and options (forward and
/// then backward of one step included). At most this many are kept; a new one past it clears
/// the rest first.
pub(crate) const CACHED_CPU_EXECUTORS: usize = 16;

type CpuCache = Mutex<HashMap<String, LinearCrossEntropy>>;

fn cpu_cache() -> &'static CpuCache {
    static CACHE: OnceLock<CpuCache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Runs `f` (with the GIL released) on the cached CPU executor of `options`' plan for `shape`,
/// made (its workspace reserved) at the first call of that plan.
fn with_executor<R: Send>(
    py: Python<'_>,
    options: &LossOptions,
    shape: Shape,
    f: impl FnOnce(&mut LinearCrossEntropy) -> ring_dtp::Result<R> + Send,
) -> PyResult<R> {
    let budget = options.budget(TensorDevice::Cpu);
    let plan = Plan::new(&options.config, shape, budget).map_err(to_py)?;
    let key = format!("{:?}/{budget:?}/{plan:?}", options.config);
    // The cache's lock is taken with the GIL released: a thread waiting for it must not hold
    // the GIL that the thread inside needs to return.
    py.detach(|| {
        let mut executors = cpu_cache().lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if executors.len() >= CACHED_CPU_EXECUTORS && !executors.contains_key(&key) {
            executors.clear(); // the old working sets go before a new one is reserved
        }
        let lce = match executors.entry(key) {
            Entry::Occupied(cached) => cached.into_mut(),
            Entry::Vacant(slot) => slot.insert(LinearCrossEntropy::new(plan, Device::Cpu)?),
        };
        f(lce)
    })
    .map_err(to_py)
}

/// How many CPU executors (each with its reserved working set) are cached.
#[pyfunction]
pub fn cached_loss_executors(py: Python<'_>) -> usize {
    py.detach(|| cpu_cache().lock().unwrap_or_else(|poisoned| poisoned.into_inner()).len())
}

/// Drops every cached CPU executor and its working set.
#[pyfunction]
pub fn clear_loss_executors(py: Python<'_>) {
    py.detach(|| cpu_cache().lock().unwrap_or_else(|poisoned| poisoned.into_inner()).clear());
}

/// Forward: writes the loss (a 0-dim fp32 tensor for mean and sum, `[N]` for none) and the
/// per-row lse (`[N]` fp32) into `loss_out` and `lse_out`.
#[pyfunction]
pub fn lce_forward(
    py: Python<'_>,
    options: &LossOptions,
    args: TensorArgs<'_>,
    outputs: (Bound<'_, PyAny>, Bound<'_, PyAny>),
) -> PyResult<()> {
    let (loss_out, lse_out) = outputs;
    let checked = Checked::new(&args)?;
    let n = checked.shape.tokens;
    let loss_shape: &[Option<usize>] =
        if options.config.reduction == Reduction::None { &[Some(n)] } else { &[] };
    let loss_out = TensorRef::<f32>::new("loss_out", &loss_out, loss_shape)?;
    let lse_out = TensorRef::<f32>::new("lse_out", &lse_out, &[Some(n)])?;
    check_disjoint(&[(&loss_out).into(), (&lse_out).into()], &checked.spans())?;
    let forward = with_executor(py, options, checked.shape, |lce| {
        // SAFETY: the caller's frame holds every tensor for this call; the outputs were checked
        // disjoint from the inputs, so nothing writes what `inputs` reads.
        let inputs = unsafe { checked.inputs() };
        lce.forward(&inputs)
    })?;
    write_forward(forward, (&loss_out, &lse_out));
    Ok(())
}

/// Forward and backward in one pass, for a loss that is the last op before `.backward()`:
/// writes the loss and lse as [`lce_forward`] does and dX, dW (and dbias) for an upstream
/// gradient of 1 into the fp32 `grads_out`, as [`lce_backward`] does (each `None` when not
/// wanted: not computed). On the full-vocabulary
/// schedule each block's logits serve both passes: 3 GEMMs per block instead of 4. Mean and
/// sum only (a per-token upstream gradient is not known before backward).
#[pyfunction]
pub fn lce_forward_backward(
    py: Python<'_>,
    options: &LossOptions,
    args: TensorArgs<'_>,
    outputs: (Bound<'_, PyAny>, Bound<'_, PyAny>),
    grads_out: GradArgs<'_>,
) -> PyResult<()> {
    check_fused(options)?;
    let checked = Checked::new(&args)?;
    let n = checked.shape.tokens;
    let loss_out = TensorRef::<f32>::new("loss_out", &outputs.0, &[])?;
    let lse_out = TensorRef::<f32>::new("lse_out", &outputs.1, &[Some(n)])?;
    let grads = GradTensors::new(&grads_out, &checked)?;
    let mut out_spans = vec![(&loss_out).into(), (&lse_out).into()];
    out_spans.extend(grads.spans());
    check_disjoint(&out_spans, &checked.spans())?;
    let forward = with_executor(py, options, checked.shape, |lce| {
        // SAFETY: every tensor is held by the caller's frame for this call; the outputs were
        // checked disjoint from each other and from every input, so the `&mut` are exclusive.
        let (inputs, out) = unsafe { (checked.inputs(), grads.as_mut()) };
        out.forward_backward_into(lce, &inputs, GradOutput::Scalar(1.0))
    })?;
    write_forward(forward, (&loss_out, &lse_out));
    Ok(())
}

/// The fused call (forward with backward) takes a reduced loss: its upstream gradient is one
/// number, applied in backward; a per-token one is known only there.
pub(crate) fn check_fused(options: &LossOptions) -> PyResult<()> {
    if options.config.reduction == Reduction::None {
        return Err(PyValueError::new_err(
            "reduction: the fused call takes 'mean' or 'sum' (a per-token upstream gradient is known only in backward)",
        ));
    }
    Ok(())
}

/// Writes forward's loss (one value, or one per token) and lse into the checked CPU fp32
/// tensors `loss_out` and `lse_out` (their shapes checked against the reduction and N).
pub(crate) fn write_forward(forward: Forward, (loss_out, lse_out): (&TensorRef<f32>, &TensorRef<f32>)) {
    // SAFETY: the callers checked both as fp32 CPU tensors of the loss's and lse's shapes, alive
    // in the Python frame and disjoint from each other and from every tensor of the call.
    let (loss, lse) = unsafe { (loss_out.as_mut_slice(), lse_out.as_mut_slice()) };
    lse.copy_from_slice(&forward.lse);
    match forward.loss {
        Loss::Scalar(l) => loss[0] = l as f32,
        Loss::PerToken(per_token) => loss.copy_from_slice(&per_token),
    }
}

/// Backward from forward's `lse`: `grad_loss` is the upstream gradient of the loss (0-dim for
/// mean and sum, `[N]` for none) and `grad_lse` that of the lse output, if any; dX, dW (and
/// dbias) are written into the fp32 tensors `grads_out`, each `None` when its gradient is not
/// wanted (then it is not computed: a frozen weight costs no dW GEMM).
#[pyfunction]
#[pyo3(signature = (options, args, lse, upstream, grads_out))]
pub fn lce_backward(
    py: Python<'_>,
    options: &LossOptions,
    args: TensorArgs<'_>,
    lse: Bound<'_, PyAny>,
    upstream: (Bound<'_, PyAny>, Option<Bound<'_, PyAny>>),
    grads_out: GradArgs<'_>,
) -> PyResult<()> {
    let checked = Checked::new(&args)?;
    let n = checked.shape.tokens;
    let lse = TensorRef::<f32>::new("lse", &lse, &[Some(n)])?;
    let per_token = options.config.reduction == Reduction::None;
    let grad_shape: &[Option<usize>] = if per_token { &[Some(n)] } else { &[] };
    let grad_loss = TensorRef::<f32>::new("grad_output", &upstream.0, grad_shape)?;
    let grad_lse =
        upstream.1.as_ref().map(|g| TensorRef::<f32>::new("grad_lse", g, &[Some(n)])).transpose()?;
    let grads = GradTensors::new(&grads_out, &checked)?;
    let mut inputs_spans = checked.spans();
    inputs_spans.extend([(&lse).into(), (&grad_loss).into()]);
    inputs_spans.extend(grad_lse.iter().map(Span::from));
    check_disjoint(&grads.spans(), &inputs_spans)?;
    with_executor(py, options, checked.shape, |lce| {
        // SAFETY: every tensor is held by the caller's frame for this call; the outputs were
        // checked disjoint from each other and from every input, so the `&mut` are exclusive.
        let (inputs, lse, grad_loss, grad_lse, out) = unsafe {
            let out = grads.as_mut();
            (checked.inputs(), lse.as_slice(), grad_loss.as_slice(), grad_lse.map(|g| g.as_slice()), out)
        };
        let grad = if per_token { GradOutput::PerToken(grad_loss) } else { GradOutput::Scalar(grad_loss[0]) };
        out.backward_into(lce, &inputs, lse, ring_dtp::Upstream::loss(grad).with_dlse(grad_lse))
    })
}
