//! `flatpeak run llep`: one MoE layer over P ranks (threads of this process), forward and, when
//! `dy` is given, the checkpointed backward.
//!
//! Inputs, stacked over ranks: `x` [P, N, H] F32 or BF16, `ids` [P, N, k] I64 (expert ids),
//! `weights` [P, N, k] F32 (routing weights), the experts `gate` and `up` [E, H, I] and `down`
//! [E, I, H] (rank r owns experts r·E/P … (r+1)·E/P − 1), and optionally `dy` [P, N, H]; the
//! experts and dy in the dtype of x. BF16 runs the bf16 layer (dispatch rows and expert scratch
//! in bf16, GEMMs with f32 accumulation). Outputs: `y` [P, N, H]; with `dy` also `dx`
//! [P, N, H], `d_weights` [P, N, k] and the expert gradients `d_gate`, `d_up` [E, H, I] and
//! `d_down` [E, I, H], all F32.

use flatpeak_common::{Communicator, Error as CommonError, LocalGroup, LocalGroupOptions};
use llep::{
    Config as LlepConfig, ExpertWeights, LayerElement, PairCap, Pass, RankInputs, Routing, Scheme, Shape,
    bf16,
};
use serde::Deserialize;

use super::tensors::Floats;
use super::{Dim, Outputs, RunError, TensorFile};

/// `"pipelined"` (PipelinedLLEP), `"llep"` or `"standard_ep"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SchemeName {
    /// PipelinedLLEP.
    #[default]
    Pipelined,
    /// LLEP, one dispatch.
    Llep,
    /// Standard expert parallelism.
    StandardEp,
}

/// The config file of `flatpeak run llep` (the paper's settings by default).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LlepRunConfig {
    /// The dispatch scheme.
    pub scheme: SchemeName,
    /// α: capacity factor of the least-loaded assignment.
    pub alpha: f64,
    /// m: smallest spilled chunk.
    pub min_chunk: usize,
    /// λ: imbalance below which plain EP runs.
    pub imbalance_threshold: f64,
    /// q rows per (source, destination) per round; `null`: the largest that `budget_bytes` holds.
    pub pair_cap_rows: Option<usize>,
    /// Bytes of one rank's workspace (both passes' buffers, every pipeline copy); `null`, the
    /// default: llep's default, the least the shape runs in + 64 MiB (`llep::LayerBudget`).
    pub budget_bytes: Option<usize>,
    /// F_max foreign expert slots per rank.
    pub foreign_slots: usize,
}

impl Default for LlepRunConfig {
    fn default() -> Self {
        Self {
            scheme: SchemeName::Pipelined,
            alpha: 1.0,
            min_chunk: 1024,
            imbalance_threshold: 1.3,
            pair_cap_rows: None,
            budget_bytes: None,
            foreign_slots: 4,
        }
    }
}

impl LlepRunConfig {
    fn to_config(&self) -> LlepConfig {
        let scheme = match self.scheme {
            SchemeName::Pipelined => Scheme::PipelinedLlep,
            SchemeName::Llep => Scheme::Llep,
            SchemeName::StandardEp => Scheme::StandardEp,
        };
        let cap = self.pair_cap_rows.map_or(PairCap::FitBudget, PairCap::Rows);
        LlepConfig::with_scheme(scheme)
            .alpha(self.alpha)
            .min_chunk(self.min_chunk)
            .imbalance_threshold(self.imbalance_threshold)
            .pair_cap(cap)
            .foreign_slots(self.foreign_slots)
    }
}

/// One rank's results: y, and the gradients when `dy` was given.
type RankResult = (Vec<f32>, Option<llep::Gradients>);

/// Every rank's result, or the error of the rank that failed first. A rank whose peer failed
/// sees only the consequence — `PeerLost` or a timeout from its next collective — so an error
/// of any other kind, on whichever rank, is the cause; consequences are reported only when
/// nothing else failed.
fn first_failure<R>(results: Vec<flatpeak_common::Result<llep::Result<R>>>) -> Result<Vec<R>, RunError> {
    let consequence = |e: &RunError| {
        matches!(
            e,
            RunError::Common(CommonError::PeerLost { .. } | CommonError::Timeout { .. })
                | RunError::Llep(llep::Error::Common(
                    CommonError::PeerLost { .. } | CommonError::Timeout { .. }
                ))
        )
    };
    let (mut ok, mut errors) = (Vec::with_capacity(results.len()), Vec::new());
    for result in results {
        match result.map_err(RunError::from).and_then(|r| r.map_err(RunError::from)) {
            Ok(r) => ok.push(r),
            Err(e) => errors.push(e),
        }
    }
    match errors.iter().position(|e| !consequence(e)) {
        Some(cause) => Err(errors.swap_remove(cause)),
        None => errors.into_iter().next().map_or(Ok(ok), Err),
    }
}

/// The elements of a tensor read as F32 or BF16, if they are of type T.
trait FromFloats: LayerElement {
    /// The safetensors name of the dtype.
    const NAME: &'static str;
    fn of(f: &Floats) -> Option<&[Self]>;
}

impl FromFloats for f32 {
    const NAME: &'static str = "F32";
    fn of(f: &Floats) -> Option<&[f32]> {
        if let Floats::F32(v) = f { Some(v) } else { None }
    }
}

impl FromFloats for bf16 {
    const NAME: &'static str = "BF16";
    fn of(f: &Floats) -> Option<&[bf16]> {
        if let Floats::Bf16(v) = f { Some(v) } else { None }
    }
}

/// `f`'s elements as T (the dtype of x), or [`RunError::WrongDtype`] naming tensor `name`.
fn as_dtype_of_x<'a, T: FromFloats>(name: &str, f: &'a Floats) -> Result<&'a [T], RunError> {
    T::of(f).ok_or_else(|| RunError::WrongDtype {
        name: name.into(),
        expected: format!("{} (the dtype of x)", T::NAME),
        found: match f {
            Floats::F32(_) => "F32".into(),
            Floats::Bf16(_) => "BF16".into(),
        },
    })
}

/// The tensors of one call, read once: x and the experts (and dy) as read, ids and routing
/// weights.
struct Tensors {
    dims: (usize, usize, usize, usize, usize, usize),
    x: Floats,
    ids: Vec<i64>,
    weights: Vec<f32>,
    experts: [Floats; 3],
    dy: Option<Floats>,
}

/// Runs the layer on the tensors of `t`.
pub fn run(t: &TensorFile, cfg: &LlepRunConfig) -> Result<Outputs, RunError> {
    let (x, xs) = t.floats("x", &[Dim::Any, Dim::Any, Dim::Any])?;
    let (p, n, h) = (xs[0], xs[1], xs[2]);
    let (ids, is) = t.i64("ids", &[Dim::Is(p), Dim::Is(n), Dim::Any])?;
    let k = is[2];
    let (weights, _) = t.f32("weights", &[Dim::Is(p), Dim::Is(n), Dim::Is(k)])?;
    let (gate, gs) = t.floats("gate", &[Dim::Any, Dim::Is(h), Dim::Any])?;
    let (e, i) = (gs[0], gs[2]);
    let (up, _) = t.floats("up", &[Dim::Is(e), Dim::Is(h), Dim::Is(i)])?;
    let (down, _) = t.floats("down", &[Dim::Is(e), Dim::Is(i), Dim::Is(h)])?;
    let dy = if t.has("dy") { Some(t.floats("dy", &[Dim::Is(p), Dim::Is(n), Dim::Is(h)])?.0) } else { None };
    let is_bf16 = matches!(x, Floats::Bf16(_));
    let tensors = Tensors { dims: (p, n, h, i, e, k), x, ids, weights, experts: [gate, up, down], dy };
    if is_bf16 { run_typed::<bf16>(&tensors, cfg) } else { run_typed::<f32>(&tensors, cfg) }
}

/// The layer in storage type T (the dtype of x).
fn run_typed<T: FromFloats>(t: &Tensors, cfg: &LlepRunConfig) -> Result<Outputs, RunError> {
    let (p, n, h, i, e, k) = t.dims;
    let x = as_dtype_of_x::<T>("x", &t.x)?;
    let [gate, up, down] = &t.experts;
    let (gate, up, down) =
        (as_dtype_of_x::<T>("gate", gate)?, as_dtype_of_x::<T>("up", up)?, as_dtype_of_x::<T>("down", down)?);
    let dy = t.dy.as_ref().map(|d| as_dtype_of_x::<T>("dy", d)).transpose()?;
    let (ids, weights) = (&t.ids, &t.weights);
    let shape =
        Shape { ranks: p, tokens: n, hidden: h, intermediate: i, experts: e, top_k: k, dtype: T::DTYPE };
    shape.validate()?;
    let config = cfg.to_config();
    let m = shape.local_experts();
    let expert_len = m * h * i;

    let results = LocalGroup::run(p, LocalGroupOptions::default(), |comm| {
        let r = comm.rank();
        let rows = r * n * h..(r + 1) * n * h;
        let routes = r * n * k..(r + 1) * n * k;
        let experts = r * expert_len..(r + 1) * expert_len;
        let inputs = RankInputs {
            x: &x[rows.clone()],
            routing: Routing { ids: &ids[routes.clone()], weights: &weights[routes] },
            experts: ExpertWeights {
                gate: &gate[experts.clone()],
                up: &up[experts.clone()],
                down: &down[experts],
            },
        };
        let layer = || -> llep::Result<RankResult> {
            let budget = cfg.budget_bytes.map_or(llep::LayerBudget::Default, llep::LayerBudget::Bytes);
            let device = llep::Device::Cpu;
            let launch = llep::Plan::new(&config, shape, budget.of(&config, &shape, device)?)?;
            let mut layer = llep::Executor::new(launch, device)?;
            let plan = layer.schedule(comm, &inputs.routing)?;
            layer.reserve(plan.max_workspace_bytes(Pass::Backward))?;
            let y = layer.forward(comm, &plan, &inputs)?;
            let grads = match dy {
                Some(dy) => Some(layer.backward(comm, &plan, &inputs, &dy[rows])?),
                None => None,
            };
            Ok((y, grads))
        };
        Ok(layer())
    });
    let per_rank = first_failure(results)?;
    let mut out = Outputs::default();
    let concat = |f: &dyn Fn(&RankResult) -> Option<&[f32]>| -> Vec<f32> {
        per_rank.iter().filter_map(f).flat_map(|s| s.iter().copied()).collect()
    };
    out.f32("y", &[p, n, h], &concat(&|r| Some(&r.0)));
    if dy.is_some() {
        out.f32("dx", &[p, n, h], &concat(&|r| r.1.as_ref().map(|g| g.dx.as_slice())));
        out.f32("d_weights", &[p, n, k], &concat(&|r| r.1.as_ref().map(|g| g.d_weights.as_slice())));
        out.f32("d_gate", &[e, h, i], &concat(&|r| r.1.as_ref().map(|g| g.d_gate.as_slice())));
        out.f32("d_up", &[e, h, i], &concat(&|r| r.1.as_ref().map(|g| g.d_up.as_slice())));
        out.f32("d_down", &[e, i, h], &concat(&|r| r.1.as_ref().map(|g| g.d_down.as_slice())));
    }
    Ok(out)
}
