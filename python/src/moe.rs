//! `moe_swiglu` on torch tensors: llep's PipelinedLLEP (or a baseline) over the caller's
//! `torch.distributed` group ([`TorchGroup`]), or in one process without a group.
//!
//! The weights are read in place in torch's layout (llep's [`WeightLayout::Linear`]):
//! `gate_up_proj` `[E_local, 2I, H]`, `down_proj` `[E_local, H, I]`. Every rank may bring its own
//! number of tokens. Before any data is exchanged, each rank checks its own tensors, the group
//! agrees on the verdicts ([`agree_on_inputs`]) and then on the shapes (one all-gather of each
//! rank's sizes): bad input on one rank raises on every rank, naming that rank and its values,
//! instead of leaving the others waiting. The plan (N = the largest rank's tokens) and its
//! executor, whose working set is reserved once, are cached in the options object.

use std::sync::Mutex;

use flatpeak_common::Communicator;
use flatpeak_common::comm::agree_on_inputs;
use half::bf16;
use llep::cpu::SavedActivations;
use llep::{
    Budget, Config, Device, Executor, ExpertWeights, LayerElement, Mode, PairCap, Plan, RankInputs, Routing,
    Schedule, Scheme, Shape, WeightLayout,
};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::error::{Refusal, to_py};
use crate::moe_call::{Backward, CallTerms, MoEArgs, Sizes, agreed_shape};
use crate::tensor::{TensorRef, TorchElement};
use crate::torch_group::{Comm, communicator, detached_in_pool};

/// The MoE layer's options, checked once, with the cached plan and executor
/// (`flatpeak._flatpeak.MoEOptions`).
#[pyclass(frozen, module = "flatpeak._flatpeak")]
#[derive(Debug)]
pub struct MoEOptions {
    pub(crate) config: Config,
    /// The caller's bound; `None`: [`DEFAULT_ROWS_BUDGET_BYTES`] above the shape's least.
    budget_bytes: Option<usize>,
    executor: Mutex<Option<Executor>>,
}

#[pymethods]
impl MoEOptions {
    /// Options under the LLEP reference code's names: `scheme` (`"pipelined"`, `"llep"` or
    /// `"standard"`), `pair_cap_rows` (q; `None`: the largest the budget holds),
    /// `budget_bytes` (`None`: 64 MiB above the least the shape runs in, one row per rank pair
    /// with its foreign expert slots), `max_tokens_factor` (α), `min_tokens_per_gemm` (m)
    /// and `imbalance_threshold` (λ), with llep's defaults; `activations` is `"recompute"`
    /// (llep's [`Mode::Checkpointed`]: forward keeps nothing, backward recomputes each round) or
    /// `"save"` ([`Mode::SaveActivations`]: a forward that needs a gradient keeps its rows and
    /// SwiGLU pre-activations for a backward without recompute).
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
        config.validate().map_err(to_py)?;
        if budget_bytes == Some(0) {
            return Err(PyValueError::new_err("budget_bytes: expected a positive number of bytes, got 0"));
        }
        Ok(Self { config, budget_bytes, executor: Mutex::new(None) })
    }

    fn __repr__(&self) -> String {
        format!("MoEOptions({:?}, budget_bytes={:?})", self.config, self.budget_bytes)
    }
}

/// What the default budget gives the rows of a round above the least a shape runs in: 64 MiB.
/// A fixed 64 MiB in all would refuse real layers, whose foreign expert slots alone exceed it
/// (3·H·I weights and their gradients per slot).
pub(crate) const DEFAULT_ROWS_BUDGET_BYTES: usize = 64 << 20;

impl MoEOptions {
    /// A digest of the options (the config and the budget), the same in every process of one
    /// build: ranks compare it before they exchange anything (FNV-1a over their `Debug` form).
    pub(crate) fn fingerprint(&self) -> u64 {
        let text = format!("{:?} {:?}", self.config, self.budget_bytes);
        text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
    }

    /// The terms of a call under these options whose backward (if it is one) runs as `backward`.
    pub(crate) fn terms(&self, backward: Backward) -> CallTerms {
        CallTerms { options: self.fingerprint(), backward }
    }

    /// The plan of one call's `shape` under these options' budget.
    pub(crate) fn plan(&self, shape: llep::Shape) -> PyResult<Plan> {
        let budget = match self.budget_bytes {
            Some(bytes) => bytes,
            None => Plan::least_workspace_bytes(&self.config, &shape)
                .map_err(to_py)?
                .saturating_add(DEFAULT_ROWS_BUDGET_BYTES),
        };
        Plan::new(&self.config, shape, Budget::Bytes(budget)).map_err(to_py)
    }
}

/// The checked tensors of one call, read in place.
struct Tensors<T> {
    x: TensorRef<T>,
    ids: TensorRef<i64>,
    weights: TensorRef<f32>,
    gate_up: TensorRef<T>,
    down: TensorRef<T>,
}

impl<T: TorchElement> Tensors<T> {
    fn new(args: &MoEArgs<'_>, s: Sizes) -> PyResult<Self> {
        let (t, h, i, m, k) = (s.tokens, s.hidden, s.intermediate, s.local_experts, s.top_k);
        Ok(Self {
            x: TensorRef::new("hidden_states", &args.x, &[Some(t), Some(h)])?,
            ids: TensorRef::new("topk_ids", &args.ids, &[Some(t), Some(k)])?,
            weights: TensorRef::new("topk_weights", &args.weights, &[Some(t), Some(k)])?,
            gate_up: TensorRef::new("gate_up_proj", &args.gate_up, &[Some(m), Some(2 * i), Some(h)])?,
            down: TensorRef::new("down_proj", &args.down, &[Some(m), Some(h), Some(i)])?,
        })
    }

    /// # Safety
    /// The tensors must outlive the borrow and not be written meanwhile.
    unsafe fn inputs(&self) -> RankInputs<'_, T> {
        // SAFETY: the caller keeps every tensor alive and unwritten for the borrow; each was
        // checked (CPU, contiguous, dtype, shape, alignment) in `new`.
        unsafe {
            RankInputs {
                x: self.x.as_slice(),
                routing: Routing { ids: self.ids.as_slice(), weights: self.weights.as_slice() },
                experts: ExpertWeights::linear(self.gate_up.as_slice(), self.down.as_slice()),
            }
        }
    }
}

/// What a forward reports: `(rounds, recv_high_water_rows, recv_high_water_bytes,
/// workspace_bytes, saved_bytes)`.
pub(crate) type ForwardStats = (usize, usize, usize, usize, usize);

/// The checks every rank agrees on, then the agreed shape.
fn prepare<T: TorchElement>(
    py: Python<'_>,
    comm: &dyn Communicator,
    args: &MoEArgs<'_>,
    num_experts: Option<usize>,
    terms: CallTerms,
) -> PyResult<(Tensors<T>, Shape)> {
    let local = Sizes::of(args).and_then(|s| Tensors::<T>::new(args, s).map(|t| (t, s)));
    let local = local.map_err(|e| Refusal::from_py(py, e));
    let (tensors, sizes) = agree_on_inputs(comm, local).map_err(Refusal::into_py)?;
    let shape = agreed_shape(comm, sizes, num_experts, false, terms).map_err(Refusal::into_py)?;
    Ok((tensors, shape))
}

/// The cached executor of `plan` in `cached` (a new one, its working set reserved once, when
/// the plan changed).
pub(crate) fn executor_for(
    cached: &mut Option<Executor>,
    plan: Plan,
    device: Device,
) -> llep::Result<&mut Executor> {
    if cached.as_ref().is_none_or(|e| e.plan() != &plan || e.device() != device) {
        *cached = None; // the old working set goes before the new one is reserved
        *cached = Some(Executor::new(plan, device)?);
    }
    cached.as_mut().ok_or(llep::Error::Internal { invariant: "an executor was cached just above" })
}

/// Locks `options`' executor; called with the GIL released (a thread waiting for the lock must
/// not hold the GIL that the thread inside needs for its collectives).
pub(crate) fn locked(options: &MoEOptions) -> std::sync::MutexGuard<'_, Option<Executor>> {
    options.executor.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// What a forward keeps for its backward.
#[derive(Debug, Clone, Copy)]
enum Keep {
    /// Nothing: its backward recomputes, or no backward follows.
    Nothing,
    /// Its received rows, routes and SwiGLU pre-activations, in this `uint8` tensor of
    /// [`moe_saved_bytes`] ([`SavedActivations::from_raw`]).
    Activations(TensorRef<u8>),
}

/// `tensor` (argument `name`) as a saved-activation store: a contiguous CPU `uint8` tensor whose
/// data starts on a 64-byte line (as a fresh `torch.empty` does).
fn store_tensor(name: &'static str, tensor: &Bound<'_, PyAny>) -> PyResult<TensorRef<u8>> {
    let bytes = TensorRef::<u8>::new(name, tensor, &[None])?;
    // SAFETY: only the address is read.
    let address = unsafe { bytes.as_slice() }.as_ptr() as usize;
    if bytes.len() > 0 && !address.is_multiple_of(64) {
        return Err(PyValueError::new_err(format!(
            "{name}: data pointer {address:#x} is not on a 64-byte line (pass a fresh torch.empty(..., dtype=torch.uint8), not a slice of one)"
        )));
    }
    Ok(bytes)
}

/// The store over `bytes` (a `uint8` tensor the Python frame holds for the call, read or
/// written by nothing else meanwhile).
fn store_over(
    schedule: &Schedule,
    rank: usize,
    bytes: TensorRef<u8>,
) -> llep::Result<SavedActivations<'static>> {
    // SAFETY: the caller's frame keeps the tensor alive and untouched for the call (the store
    // lives inside it, and is dropped before the call returns); a tensor's bytes are initialised.
    let slice = unsafe { bytes.as_mut_slice() };
    SavedActivations::over(schedule, rank, slice)
}

/// Runs `f` on the cached executor of `plan` (made for the CPU at first use) with the call's
/// schedule, computed from `tensors`' routing with the group, inside the rayon pool with the
/// GIL released (the executor's lock taken first, on this thread).
fn on_schedule<T: TorchElement + LayerElement, R: Send>(
    py: Python<'_>,
    options: &MoEOptions,
    comm: &mut Comm,
    tensors: &Tensors<T>,
    plan: Plan,
    f: impl FnOnce(&mut Executor, &dyn Communicator, &Schedule, &RankInputs<'_, T>) -> llep::Result<R> + Send,
) -> PyResult<R> {
    detached_in_pool(
        py,
        comm,
        || locked(options),
        |comm, cached| -> llep::Result<R> {
            let executor = executor_for(cached, plan, Device::Cpu)?;
            // SAFETY: the Python frame holds every tensor of the call for its length; nothing
            // writes the inputs meanwhile.
            let inputs = unsafe { tensors.inputs() };
            let schedule = executor.schedule(comm, &inputs.routing)?;
            f(executor, comm, &schedule, &inputs)
        },
    )?
    .map_err(to_py)
}

/// Where a forward writes: y, the per-expert counts and, when it saves, the store.
struct ForwardOutputs<'a, 'py> {
    y: &'a Bound<'py, PyAny>,
    counts: &'a Bound<'py, PyAny>,
    saved: Option<&'a Bound<'py, PyAny>>,
}

/// What a backward reads besides the call's inputs: dY and, from a saving forward, its store.
struct BackwardUpstream<'a, 'py> {
    dy: &'a Bound<'py, PyAny>,
    saved: Option<&'a Bound<'py, PyAny>>,
}

fn forward_typed<T: TorchElement + LayerElement>(
    py: Python<'_>,
    options: &MoEOptions,
    comm: &mut Comm,
    args: &MoEArgs<'_>,
    num_experts: Option<usize>,
    outputs: ForwardOutputs<'_, '_>,
) -> PyResult<ForwardStats> {
    let ForwardOutputs { y: y_out, counts: counts_out, saved: saved_out } = outputs;
    let group = comm.as_deref().ok_or_else(|| PyRuntimeError::new_err("the communicator is in use"))?;
    let terms = options.terms(Backward::Recomputing);
    let (tensors, shape) = prepare::<T>(py, group, args, num_experts, terms)?;
    let n = tensors.ids.len() / shape.top_k.max(1);
    let y_out = TensorRef::<f32>::new("y_out", y_out, &[Some(n), Some(shape.hidden)])?;
    let counts_out = TensorRef::<i64>::new("counts_out", counts_out, &[Some(shape.experts)])?;
    let keep = match saved_out {
        None => Keep::Nothing,
        Some(t) => Keep::Activations(store_tensor("saved_out", t)?),
    };
    let plan = options.plan(shape)?;
    let (y, kept, counts, (rounds, rows), workspace) =
        on_schedule(py, options, comm, &tensors, plan, |executor, comm, schedule, inputs| {
            let (y, kept) = match keep {
                Keep::Nothing => (executor.forward(comm, schedule, inputs)?, 0),
                Keep::Activations(bytes) => {
                    let mut saved = store_over(schedule, comm.rank(), bytes)?;
                    (executor.forward_saving(comm, schedule, inputs, &mut saved)?, saved.bytes())
                }
            };
            let counts: Vec<i64> =
                (0..shape.experts).map(|e| schedule.assignment().counts().load(e) as i64).collect();
            let rounds = (schedule.rounds(), received_rows_high_water(schedule, comm.rank()));
            Ok((y, kept, counts, rounds, executor.workspace_bytes()))
        })?;
    // SAFETY: both outputs were made by the caller for this call and are read by nothing else.
    let (y_dst, counts_dst) = unsafe { (y_out.as_mut_slice(), counts_out.as_mut_slice()) };
    y_dst.copy_from_slice(&y);
    counts_dst.copy_from_slice(&counts);
    Ok((rounds, rows, rows * shape.hidden * shape.elem_bytes(), workspace, kept))
}

/// Bytes of the `uint8` tensor a saving forward of these inputs keeps its activations in
/// (options made with `activations="save"`): this rank's received rows, routes and
/// pre-activations under the routing, agreed with the group as a forward agrees.
#[pyfunction]
#[pyo3(signature = (options, group, args, num_experts))]
pub fn moe_saved_bytes(
    py: Python<'_>,
    options: &MoEOptions,
    group: Option<Bound<'_, PyAny>>,
    args: MoEArgs<'_>,
    num_experts: Option<usize>,
) -> PyResult<usize> {
    let mut comm = Some(communicator(py, group)?);
    let is_bf16 = args.x.getattr("dtype")?.str()? == "torch.bfloat16";
    if is_bf16 {
        saved_bytes_typed::<bf16>(py, options, &mut comm, &args, num_experts)
    } else {
        saved_bytes_typed::<f32>(py, options, &mut comm, &args, num_experts)
    }
}

fn saved_bytes_typed<T: TorchElement + LayerElement>(
    py: Python<'_>,
    options: &MoEOptions,
    comm: &mut Comm,
    args: &MoEArgs<'_>,
    num_experts: Option<usize>,
) -> PyResult<usize> {
    let group = comm.as_deref().ok_or_else(|| PyRuntimeError::new_err("the communicator is in use"))?;
    let terms = options.terms(Backward::Recomputing);
    let (tensors, shape) = prepare::<T>(py, group, args, num_experts, terms)?;
    let plan = options.plan(shape)?;
    on_schedule(py, options, comm, &tensors, plan, |_, comm, schedule, _| match schedule.config().mode {
        Mode::SaveActivations => Ok(SavedActivations::bytes_for(schedule, comm.rank())),
        Mode::Checkpointed => Err(llep::Error::invalid_config(
            "mode",
            Mode::Checkpointed,
            "Mode::SaveActivations (options made with activations='save')",
        )),
    })
}

/// The most rows rank `me` receives in one round.
pub(crate) fn received_rows_high_water(schedule: &Schedule, me: usize) -> usize {
    let p = schedule.shape().ranks;
    (0..schedule.rounds())
        .map(|j| (0..p).map(|s| schedule.round_pair_rows(s, me, j)).sum())
        .max()
        .unwrap_or(0)
}

/// Forward: writes `y` (`[T, H]` float32) into `y_out` and the global routes per expert
/// (`[E]` int64) into `counts_out`; returns `(rounds, recv_high_water_rows,
/// recv_high_water_bytes, workspace_bytes, saved_bytes)`. With a `saved_out` tensor (`uint8`,
/// at least [`moe_saved_bytes`]; options made with `activations="save"`) it keeps there what
/// [`moe_backward`] reads instead of recomputing.
#[pyfunction]
#[pyo3(signature = (options, group, args, num_experts, outputs))]
pub fn moe_forward(
    py: Python<'_>,
    options: &MoEOptions,
    group: Option<Bound<'_, PyAny>>,
    args: MoEArgs<'_>,
    num_experts: Option<usize>,
    outputs: (Bound<'_, PyAny>, Bound<'_, PyAny>, Option<Bound<'_, PyAny>>),
) -> PyResult<ForwardStats> {
    let (y_out, counts_out, saved_out) = outputs;
    if saved_out.is_some() && options.config.mode == Mode::Checkpointed {
        return Err(PyValueError::new_err(
            "saved_out: these options recompute in backward; keeping activations needs options made with \
             activations='save'",
        ));
    }
    let mut comm = Some(communicator(py, group)?);
    let is_bf16 = args.x.getattr("dtype")?.str()? == "torch.bfloat16";
    let outputs = ForwardOutputs { y: &y_out, counts: &counts_out, saved: saved_out.as_ref() };
    if is_bf16 {
        forward_typed::<bf16>(py, options, &mut comm, &args, num_experts, outputs)
    } else {
        forward_typed::<f32>(py, options, &mut comm, &args, num_experts, outputs)
    }
}

fn backward_typed<T: TorchElement + LayerElement>(
    py: Python<'_>,
    options: &MoEOptions,
    comm: &mut Comm,
    args: &MoEArgs<'_>,
    num_experts: Option<usize>,
    upstream: BackwardUpstream<'_, '_>,
    grads_out: [&Bound<'_, PyAny>; 4],
) -> PyResult<()> {
    let BackwardUpstream { dy, saved } = upstream;
    let group = comm.as_deref().ok_or_else(|| PyRuntimeError::new_err("the communicator is in use"))?;
    let saved = saved.map(|t| store_tensor("saved", t)).transpose()?;
    let from = if saved.is_some() { Backward::FromSaved } else { Backward::Recomputing };
    let (tensors, shape) = prepare::<T>(py, group, args, num_experts, options.terms(from))?;
    let (h, i, m, k) = (shape.hidden, shape.intermediate, shape.local_experts(), shape.top_k);
    let n = tensors.ids.len() / k.max(1);
    let dy = TensorRef::<T>::new("grad_output", dy, &[Some(n), Some(h)])?;
    let [dx, dw, dgu, dd] = grads_out;
    let dx = TensorRef::<f32>::new("dx", dx, &[Some(n), Some(h)])?;
    let dw = TensorRef::<f32>::new("d_topk_weights", dw, &[Some(n), Some(k)])?;
    let dgu = TensorRef::<f32>::new("d_gate_up_proj", dgu, &[Some(m), Some(2 * i), Some(h)])?;
    let dd = TensorRef::<f32>::new("d_down_proj", dd, &[Some(m), Some(h), Some(i)])?;
    let plan = options.plan(shape)?;
    // SAFETY: the Python frame holds grad_output for this call; nothing writes it.
    let dy = unsafe { dy.as_slice() };
    let grads =
        on_schedule(py, options, comm, &tensors, plan, |executor, comm, schedule, inputs| match saved {
            Some(bytes) => {
                let mut store = store_over(schedule, comm.rank(), bytes)?;
                executor.backward_saved(comm, schedule, inputs, dy, &mut store)
            }
            None => executor.backward(comm, schedule, inputs, dy),
        })?;
    // SAFETY: the gradient tensors were made by the caller for this call, each read by nothing
    // else; their shapes match the gradients' lengths (n·H, n·k, M·2I·H, M·H·I).
    unsafe {
        dx.as_mut_slice().copy_from_slice(&grads.dx);
        dw.as_mut_slice().copy_from_slice(&grads.d_weights);
        dgu.as_mut_slice().copy_from_slice(&grads.d_gate);
        dd.as_mut_slice().copy_from_slice(&grads.d_down);
    }
    Ok(())
}

/// Backward from `upstream = (grad_output, saved)`: `grad_output` `[T, H]` in the input's
/// dtype; `saved`, the `uint8` tensor a saving forward of these inputs kept its activations in
/// (read, not changed: it serves another backward too), or `None` to recompute each round.
/// Writes dX, d(topk_weights), d(gate_up_proj) and d(down_proj) into the float32 tensors
/// `grads_out`.
#[pyfunction]
#[pyo3(signature = (options, group, args, num_experts, upstream, grads_out))]
pub fn moe_backward(
    py: Python<'_>,
    options: &MoEOptions,
    group: Option<Bound<'_, PyAny>>,
    args: MoEArgs<'_>,
    num_experts: Option<usize>,
    upstream: (Bound<'_, PyAny>, Option<Bound<'_, PyAny>>),
    grads_out: (Bound<'_, PyAny>, Bound<'_, PyAny>, Bound<'_, PyAny>, Bound<'_, PyAny>),
) -> PyResult<()> {
    let (grad_output, saved) = (&upstream.0, upstream.1.as_ref());
    let mut comm = Some(communicator(py, group)?);
    let is_bf16 = args.x.getattr("dtype")?.str()? == "torch.bfloat16";
    let grads = [&grads_out.0, &grads_out.1, &grads_out.2, &grads_out.3];
    let upstream = BackwardUpstream { dy: grad_output, saved };
    if is_bf16 {
        backward_typed::<bf16>(py, options, &mut comm, &args, num_experts, upstream, grads)
    } else {
        backward_typed::<f32>(py, options, &mut comm, &args, num_experts, upstream, grads)
    }
}
