//! `moe_swiglu`'s arguments as Python passes them, converted: its options ([`MoEOptions`]), the
//! tensors of a call ([`MoEArgs`]), its outputs and the sizes they give ([`sizes`]), the call's
//! agreement on either device ([`agree`], [`refuse`]), and what a forward reports back
//! ([`ForwardStats`]).

use flatpeak_common::comm::Refusal;
use llep::{
    AgreedCall, Backward, CallOptions, CallStats, Config, DType, LayerBudget, Mode, PairCap, RankCall,
    RankSizes, Scheme, WeightLayout,
};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;

use crate::error::{refusal, to_py};
use crate::tensor::{dtype_name, shape_of};
use crate::torch_group::{Comm, detached};

/// The MoE layer's options, checked once (`flatpeak._flatpeak.MoEOptions`).
#[pyclass(frozen, module = "flatpeak._flatpeak")]
#[derive(Debug, Clone, Copy)]
pub(crate) struct MoEOptions {
    pub(crate) config: Config,
    pub(crate) budget: LayerBudget,
}

#[pymethods]
impl MoEOptions {
    /// Options under the LLEP reference code's names: `scheme` (`"pipelined"`, `"llep"` or
    /// `"standard"`), `pair_cap_rows` (q; `None`: the largest the budget holds), `budget_bytes`
    /// (`None`: the crate's default for the device, `LayerBudget::Default`),
    /// `max_tokens_factor` (α), `min_tokens_per_gemm` (m) and `imbalance_threshold` (λ), with
    /// llep's defaults; `activations` is `"recompute"` (forward keeps nothing, backward recomputes
    /// each round) or `"save"` (a forward that needs a gradient keeps its rows and SwiGLU
    /// pre-activations for a backward without recompute).
    #[new]
    #[pyo3(signature = (*, scheme="pipelined", pair_cap_rows=None, budget_bytes=None, max_tokens_factor=None, min_tokens_per_gemm=None, imbalance_threshold=None, activations="recompute"))]
    fn new(
        scheme: &str,
        pair_cap_rows: Option<usize>,
        budget_bytes: Option<usize>,
        max_tokens_factor: Option<f64>,
        min_tokens_per_gemm: Option<usize>,
        imbalance_threshold: Option<f64>,
        activations: &str,
    ) -> PyResult<Self> {
        let scheme = match scheme {
            "pipelined" => Scheme::PipelinedLlep,
            "llep" => Scheme::Llep,
            "standard" => Scheme::StandardEp,
            other => {
                return Err(PyValueError::new_err(format!(
                    "scheme: expected 'pipelined', 'llep' or 'standard', got {other:?}"
                )));
            }
        };
        let mode = match activations {
            "recompute" => Mode::Checkpointed,
            "save" => Mode::SaveActivations,
            other => {
                return Err(PyValueError::new_err(format!(
                    "activations: expected 'recompute' or 'save', got {other:?}"
                )));
            }
        };
        let defaults = Config::default();
        let config = Config::with_scheme(scheme)
            .mode(mode)
            .pair_cap(pair_cap_rows.map_or(PairCap::FitBudget, PairCap::Rows))
            .alpha(max_tokens_factor.unwrap_or(defaults.alpha))
            .min_chunk(min_tokens_per_gemm.unwrap_or(defaults.min_chunk))
            .imbalance_threshold(imbalance_threshold.unwrap_or(defaults.imbalance_threshold))
            .weight_layout(WeightLayout::Linear);
        let budget = budget_bytes.map_or(LayerBudget::Default, LayerBudget::Bytes);
        llep::Layer::new(config, budget).map_err(to_py)?;
        Ok(Self { config, budget })
    }

    fn __repr__(&self) -> String {
        format!("MoEOptions({:?}, {:?})", self.config, self.budget)
    }
}

impl MoEOptions {
    /// The layer of these options (checked when they were made).
    pub(crate) fn layer(&self) -> PyResult<llep::Layer> {
        llep::Layer::new(self.config, self.budget).map_err(to_py)
    }

    /// Whether a forward keeps its activations.
    pub(crate) fn saves(&self) -> bool {
        self.config.mode == Mode::SaveActivations
    }
}

/// The tensors of one call: `(hidden_states [T, H], topk_ids [T, k], topk_weights [T, k],
/// gate_up_proj [M, 2I, H], down_proj [M, H, I])`.
#[derive(FromPyObject)]
pub(crate) struct MoEArgs<'py> {
    #[pyo3(item(0))]
    pub(crate) x: Bound<'py, PyAny>,
    #[pyo3(item(1))]
    pub(crate) ids: Bound<'py, PyAny>,
    #[pyo3(item(2))]
    pub(crate) weights: Bound<'py, PyAny>,
    #[pyo3(item(3))]
    pub(crate) gate_up: Bound<'py, PyAny>,
    #[pyo3(item(4))]
    pub(crate) down: Bound<'py, PyAny>,
}

/// Forward's outputs as Python passes them: `(y_out [T, H] float32, counts_out [E] int64 on the
/// host, saved_out uint8 or None)`.
#[derive(FromPyObject)]
pub(crate) struct MoEOuts<'py> {
    #[pyo3(item(0))]
    pub(crate) y: Bound<'py, PyAny>,
    #[pyo3(item(1))]
    pub(crate) counts: Bound<'py, PyAny>,
    #[pyo3(item(2))]
    pub(crate) saved: Option<Bound<'py, PyAny>>,
}

/// Backward's upstream as Python passes it: `(grad_output [T, H] in the input's dtype, saved)`,
/// `saved` the `uint8` store of a saving forward of these inputs, or `None` to recompute.
#[derive(FromPyObject)]
pub(crate) struct MoEUpstream<'py> {
    #[pyo3(item(0))]
    pub(crate) grad: Bound<'py, PyAny>,
    #[pyo3(item(1))]
    pub(crate) saved: Option<Bound<'py, PyAny>>,
}

/// The gradient outputs of a backward as Python passes them (float32): `(dx [T, H],
/// d_topk_weights [T, k], d_gate_up_proj [M, 2I, H], d_down_proj [M, H, I])`.
#[derive(FromPyObject)]
pub(crate) struct MoEGrads<'py> {
    #[pyo3(item(0))]
    pub(crate) dx: Bound<'py, PyAny>,
    #[pyo3(item(1))]
    pub(crate) d_weights: Bound<'py, PyAny>,
    #[pyo3(item(2))]
    pub(crate) d_gate_up: Bound<'py, PyAny>,
    #[pyo3(item(3))]
    pub(crate) d_down: Bound<'py, PyAny>,
}

/// A call as its entry receives it: the options, the group (`None`: one process) and E (`None`:
/// E_local × the group's size).
pub(crate) struct MoEEntry<'a, 'py> {
    pub(crate) options: &'a MoEOptions,
    pub(crate) group: Option<Bound<'py, PyAny>>,
    pub(crate) num_experts: Option<usize>,
}

/// Agrees on the call (`local`: this rank's part, or the refusal of its own checks) with the GIL
/// released: the layer's agreement, whatever the device.
pub(crate) fn agree<'r>(
    py: Python<'_>,
    comm: &mut Comm,
    options: &MoEOptions,
    local: Result<RankCall<'r>, Refusal>,
    call: CallOptions,
) -> PyResult<AgreedCall<'r>> {
    let layer = options.layer()?;
    detached(py, comm, move |comm| layer.agree(comm, local, call))?.map_err(to_py)
}

/// The error of a rank whose own checks refused its part, agreed on by the group (its own error
/// here, `PeerInput` on the others).
pub(crate) fn refuse(
    py: Python<'_>,
    comm: &mut Comm,
    options: &MoEOptions,
    refused: PyErr,
    call: CallOptions,
) -> PyErr {
    match agree(py, comm, options, Err(refusal(py, refused)), call) {
        Err(e) => e,
        Ok(_) => to_py(llep::Error::internal("a refused call agreed on as a success")),
    }
}

/// The sizes a rank's tensors give, and their storage type.
pub(crate) fn sizes(args: &MoEArgs<'_>) -> PyResult<(RankSizes, DType)> {
    let x = shape_of("hidden_states", &args.x)?;
    let ids = shape_of("topk_ids", &args.ids)?;
    let gate_up = shape_of("gate_up_proj", &args.gate_up)?;
    let (&[t, h], &[ti, k], &[m, two_i, hg]) = (x.as_slice(), ids.as_slice(), gate_up.as_slice()) else {
        return Err(PyValueError::new_err(format!(
            "expected hidden_states [T, H], topk_ids [T, k] and gate_up_proj [E_local, 2I, H]: got {x:?}, {ids:?} and {gate_up:?}"
        )));
    };
    if ti != t || hg != h || two_i % 2 != 0 {
        return Err(PyValueError::new_err(format!(
            "topk_ids must be [{t}, k] and gate_up_proj [E_local, 2I, {h}] for hidden_states [{t}, {h}]: got {ids:?} and {gate_up:?}"
        )));
    }
    let dtype = match dtype_name(&args.x)?.as_str() {
        "torch.bfloat16" => DType::Bf16,
        "torch.float32" => DType::F32,
        other => {
            return Err(PyTypeError::new_err(format!(
                "hidden_states: expected dtype torch.float32 or torch.bfloat16, got {other}"
            )));
        }
    };
    let sizes = RankSizes { tokens: t, hidden: h, intermediate: two_i / 2, local_experts: m, top_k: k };
    Ok((sizes, dtype))
}

/// The options of a call with `num_experts` (`None`: E_local × the group's size) whose backward
/// (if it is one) runs `backward`.
pub(crate) fn call_options(num_experts: Option<usize>, backward: Backward) -> CallOptions {
    CallOptions::default().experts(num_experts).backward(backward).names(flatpeak_common::DTypeNames::Torch)
}

/// What a forward reports: `(rounds, recv_high_water_rows, recv_high_water_bytes,
/// workspace_bytes, saved_bytes, device_bytes)`.
pub(crate) type ForwardStats = (usize, usize, usize, usize, usize, usize);

/// The report of a forward that did `stats` and kept `saved` bytes.
pub(crate) fn forward_stats(stats: &CallStats, saved: usize) -> ForwardStats {
    let s = stats;
    (s.rounds, s.recv_high_water_rows, s.recv_high_water_bytes, s.workspace_bytes, saved, s.device_bytes)
}

/// Writes the routes per expert into the host counts tensor's elements.
pub(crate) fn write_counts(stats: &CallStats, counts: &mut [i64]) {
    for (c, &routes) in counts.iter_mut().zip(&stats.expert_routes) {
        *c = routes as i64;
    }
}
