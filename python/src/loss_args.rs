//! The loss's arguments as Python passes them, converted: its options ([`LossOptions`], defined
//! once for every loss op), the tensors of a call ([`LossArgs`]) with their shape and their host
//! registration ([`LossIns`]), a ring's choice and share, and the conversions of forward's
//! results into the caller's output tensors.

use flatpeak_common::DTypeNames;
use flatpeak_common::comm::Refusal;
use half::bf16;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use ring_dtp::ring::{RankShare, RingCall};
use ring_dtp::{
    Config, DType, Device, Forward, GradOutput, Inputs, Loss, LossBudget, Matrix, Plan, Precision, Reduction,
    RingChoice, RingKind, Shape, Softcap,
};

use crate::error::to_py;
use crate::tensor::{Host, In, Lent, Register, is_dtype, shape_of};

/// The loss's options, checked once (`flatpeak._flatpeak.LossOptions`).
#[pyclass(frozen, module = "flatpeak._flatpeak")]
#[derive(Debug, Clone, Copy)]
pub(crate) struct LossOptions {
    pub(crate) config: Config,
    pub(crate) budget: LossBudget,
}

impl LossOptions {
    /// The plan of `shape` on `device` under these options (the crate's default budget for the
    /// device unless the caller gave one).
    pub(crate) fn plan(&self, shape: Shape, device: Device) -> PyResult<Plan> {
        Plan::for_device(&self.config, shape, self.budget, device).map_err(to_py)
    }

    /// Whether the loss is per token (a per-token upstream gradient).
    pub(crate) fn per_token(&self) -> bool {
        self.config.reduction == Reduction::None
    }
}

#[pymethods]
impl LossOptions {
    /// Options with torch's names and conventions; `softcap=None` is off; `precision` is
    /// `"native"` (GEMMs in the inputs' dtype, a bf16 call's logit gradient rounded to bf16 as
    /// autograd of a bf16 matmul does), `"f32"` (every GEMM in f32) or `"tf32"` (f32 inputs on a
    /// GPU's tensor cores, not exact); `budget_bytes=None` is the crate's default for the device.
    #[new]
    #[pyo3(signature = (*, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None, budget_bytes=None, precision="native"),
        // pyo3 renders a negative default as `...`: the signature spelled out.
        text_signature = "(*, ignore_index=-100, reduction=\"mean\", label_smoothing=0.0, z_loss=0.0, softcap=None, budget_bytes=None, precision=\"native\")")]
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
        // Checked in f64, where the caller's value lives: a value just past 1 must not round into
        // the range on its cast to f32 (nor one just below it be refused after rounding up).
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
        let budget = LossBudget::checked(budget_bytes).map_err(to_py)?;
        Ok(Self { config, budget })
    }

    /// Bytes of the working set the plan reserves for this shape on a CPU (`torch.float32` or
    /// `torch.bfloat16` inputs), the bound the call's added memory keeps under.
    fn workspace_bytes(&self, tokens: usize, hidden: usize, vocab: usize, bf16: bool) -> PyResult<usize> {
        let dtype = if bf16 { DType::Bf16 } else { DType::F32 };
        Ok(self.plan(Shape { tokens, hidden, vocab, dtype }, Device::Cpu)?.workspace_bytes())
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
        // Every GPU has the same default budget: device 0 stands for any.
        let plan = self.plan(Shape { tokens, hidden, vocab, dtype }, Device::Cuda(0))?;
        Ok(ring_dtp::cuda::BlockBuffers::carved(&plan).map_err(to_py)?.bytes)
    }

    fn __repr__(&self) -> String {
        format!("LossOptions({:?}, {:?})", self.config, self.budget)
    }
}

/// The tensors of one call, as Python passes them: `(input, weight, target, bias,
/// token_weights)`.
#[derive(FromPyObject)]
pub(crate) struct LossArgs<'py> {
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

impl LossArgs<'_> {
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
        let dtype = if is_dtype::<half::bf16>(&self.input)? { DType::Bf16 } else { DType::F32 };
        Ok(Shape { tokens: n, hidden: d, vocab: v, dtype })
    }
}

/// The gradient outputs as Python passes them: `(dx, dw, dbias)`, each a tensor or `None` (not
/// wanted: not computed).
#[derive(FromPyObject)]
pub(crate) struct GradArgs<'py> {
    #[pyo3(item(0))]
    pub(crate) dx: Option<Bound<'py, PyAny>>,
    #[pyo3(item(1))]
    pub(crate) dw: Option<Bound<'py, PyAny>>,
    #[pyo3(item(2))]
    pub(crate) dbias: Option<Bound<'py, PyAny>>,
}

/// The upstream gradients of backward as Python passes them: `(grad, grad_lse)`, the loss's
/// (0-dim, or `[N]` for a per-token loss) and the lse's, if any.
#[derive(FromPyObject)]
pub(crate) struct UpstreamArgs<'py> {
    #[pyo3(item(0))]
    pub(crate) grad: Bound<'py, PyAny>,
    #[pyo3(item(1))]
    pub(crate) grad_lse: Option<Bound<'py, PyAny>>,
}

/// Forward's outputs as Python passes them: `(loss, lse)`, float32 host tensors (the loss
/// 0-dim, or `[N]` for a per-token loss; the lse `[N]`).
#[derive(FromPyObject)]
pub(crate) struct ForwardOuts<'py> {
    #[pyo3(item(0))]
    pub(crate) loss: Bound<'py, PyAny>,
    #[pyo3(item(1))]
    pub(crate) lse: Bound<'py, PyAny>,
}

/// The shape of the loss output: one value, or one per token.
pub(crate) fn loss_shape(options: &LossOptions, n: usize) -> Vec<Option<usize>> {
    if options.per_token() { vec![Some(n)] } else { Vec::new() }
}

/// The loss's upstream gradient from its host values (one, or one per token).
pub(crate) fn grad_output<'a>(options: &LossOptions, values: &'a [f32]) -> GradOutput<'a> {
    if options.per_token() {
        GradOutput::PerToken(values)
    } else {
        GradOutput::Scalar(values.first().copied().unwrap_or(1.0))
    }
}

/// Writes forward's loss (one value, or one per token: the first `loss.len()`) and lse (its first
/// `lse.len()`) into the caller's outputs.
pub(crate) fn write_forward(forward: Forward, loss: &mut [f32], lse: &mut [f32]) {
    let own = lse.len();
    lse.copy_from_slice(&forward.lse[..own]);
    match forward.loss {
        Loss::Scalar(l) => loss.iter_mut().for_each(|x| *x = l as f32),
        Loss::PerToken(per_token) => loss.copy_from_slice(&per_token[..own]),
    }
}

/// X and W in their dtype, in memory `M`.
#[derive(Clone, Copy)]
pub(crate) enum Operands<M> {
    F32(In<f32, M>, In<f32, M>),
    Bf16(In<bf16, M>, In<bf16, M>),
}

/// One call's (or one rank's) tensors in memory `M` (the host's, or a CUDA device's:
/// `loss_device.rs` lends those), registered.
pub(crate) struct LossIns<M = Host> {
    pub(crate) operands: Operands<M>,
    pub(crate) target: In<i64, M>,
    pub(crate) bias: Option<In<f32, M>>,
    pub(crate) weights: Option<In<f32, M>>,
    pub(crate) shape: Shape,
}

impl<M: Copy> LossIns<M> {
    /// The tensors of `args` (input `[N, D]`, weight `[V, D]`, target `[N]`, bias `[V]`,
    /// token_weights `[N]`), registered with `lend` in its memory.
    pub(crate) fn new<'t, 'py, R: Register<'t, 'py, Memory = M>>(
        lend: &mut R,
        args: &'t LossArgs<'py>,
    ) -> PyResult<Self> {
        let shape = args.shape()?;
        let Shape { tokens: n, hidden: d, vocab: v, dtype } = shape;
        let (x, w) = ([Some(n), Some(d)], [Some(v), Some(d)]);
        let operands = match dtype {
            DType::Bf16 => {
                Operands::Bf16(lend.input("input", &args.input, &x)?, lend.input("weight", &args.weight, &w)?)
            }
            _ => {
                Operands::F32(lend.input("input", &args.input, &x)?, lend.input("weight", &args.weight, &w)?)
            }
        };
        Ok(Self {
            operands,
            target: lend.input("target", &args.target, &[Some(n)])?,
            bias: lend.input_opt("bias", args.bias.as_ref(), &[Some(v)])?,
            weights: lend.input_opt("token_weights", args.token_weights.as_ref(), &[Some(n)])?,
            shape,
        })
    }
}

impl LossIns {
    /// The crate's host inputs over the lent tensors.
    pub(crate) fn inputs<'l>(&self, lent: &'l Lent<'_, '_>) -> PyResult<Inputs<'l>> {
        let (x, w) = match self.operands {
            Operands::F32(x, w) => (Matrix::F32(lent.get(x)?), Matrix::F32(lent.get(w)?)),
            Operands::Bf16(x, w) => (Matrix::Bf16(lent.get(x)?), Matrix::Bf16(lent.get(w)?)),
        };
        let mut inputs = Inputs::new(x, w, lent.get(self.target)?, self.shape.hidden);
        inputs.v = self.shape.vocab;
        (inputs.bias, inputs.weights) = (lent.get_opt(self.bias)?, lent.get_opt(self.weights)?);
        Ok(inputs)
    }
}

/// The ring named by the Python argument (`None`: the plan's choice).
pub(crate) fn ring_choice(ring: Option<&str>) -> PyResult<RingChoice> {
    match ring {
        None => Ok(RingChoice::Auto),
        Some("weight") => Ok(RingChoice::Force(RingKind::Weight)),
        Some("activation") => Ok(RingChoice::Force(RingKind::Activation)),
        Some(other) => Err(PyValueError::new_err(format!(
            "ring: expected 'weight', 'activation' or None, got {other:?}"
        ))),
    }
}

/// The call's options as every rank passes them.
fn ring_call(options: &LossOptions, ring: RingChoice) -> RingCall {
    RingCall::default().config(options.config).budget(options.budget).ring(ring).names(DTypeNames::Torch)
}

/// This rank's share of a call from its tensors' shape.
fn share(shape: Shape, device: Device, bias: bool) -> RankShare {
    RankShare {
        tokens: shape.tokens,
        hidden: shape.hidden,
        shard: shape.vocab,
        dtype: shape.dtype,
        device,
        bias,
    }
}

/// This rank's part of a ring call from its own checks' outcome (`mine`: the ring it names and
/// its tensors, or the refusal): the call and its share to agree on, or the refusal with the
/// plan's ring (the group refuses the call, naming this rank).
pub(crate) fn ring_part<M>(
    options: &LossOptions,
    device: Device,
    mine: Result<(RingChoice, &LossIns<M>), &Refusal>,
) -> (RingCall, Result<RankShare, Refusal>) {
    match mine {
        Ok((choice, ins)) => (ring_call(options, choice), Ok(share(ins.shape, device, ins.bias.is_some()))),
        Err(refused) => (ring_call(options, RingChoice::Auto), Err(refused.clone())),
    }
}

/// A gradient output the rings always compute (they compute every gradient).
pub(crate) fn required<'a, 'py>(
    name: &str,
    t: &'a Option<Bound<'py, PyAny>>,
) -> PyResult<&'a Bound<'py, PyAny>> {
    t.as_ref().ok_or_else(|| {
        PyValueError::new_err(format!("{name}: the rings compute every gradient: pass its tensor"))
    })
}
