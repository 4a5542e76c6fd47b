//! `flatpeak plan`: an analytic per-GPU memory model of one long-context MoE training step, for
//! a tuned FSDP2 baseline and for the flattened schedules, built from each crate's own plan
//! formulas.
//!
//! Setting: one sequence of `context` tokens over G GPUs, sharded along the sequence (context
//! parallelism), so each GPU holds `n = ⌈context / G⌉` tokens; experts are expert-parallel over
//! the same G GPUs (E/G each); every other parameter is FSDP-sharded over G with a window of
//! two unsharded layers (the current one and the prefetched next); bf16 weights, gradients and
//! activations. Per GPU, in bytes:
//!
//! | peak | baseline (FSDP2: checkpointing, CPU optimizer offload, materialized logits, standard EP) | flattened |
//! |---|---|---|
//! | `weights` | `2·P/G + 2·2·P_window` | same |
//! | `gradients` | `2·P/G + 2·2·P_window` | same |
//! | `activations` | one layer's recompute, `34·n·H` (Korthikanti et al., flash attention) | same |
//! | `dispatch` | standard EP, balanced routing: `llep::paper::PeakModel::paper_fit` send and receive terms at `k·n` rows (skew only adds) | `llep::Plan` (default config, the largest q whose dispatch buffers fit 256 MiB, backward pass) |
//! | `vocab` | `ring_dtp::paper::PaperPeaks::naive` (`8·n·V`) | `ring_dtp::RingPlan` over the G GPUs: the budget it is planned within (`RING_BUDGET`, 64 MiB; `RingPlan::new` fails if the shape cannot fit it) + `per_token_bytes` |
//! | `checkpoints` | `sco::Plan::plain_device_bytes` (`L·n·H·2`) | `sco::Plan::peak_slots · boundary_bytes` |
//!
//! The fourth peak, optimizer state (fp32 θ, m, v: 12 B per parameter), is on the host in both
//! columns (the baseline offloads it too), so it is reported under `host` with the other host
//! bytes each column needs per GPU: `optimizer_state` (`12·P/G`), `optimizer_staging` (pinned,
//! `stream_adamw::Plan::staging_bytes`: the whole shard for the serial step, R buckets for the
//! pipelined one) and `checkpoint_arena` (`sco::Plan::host_arena_bytes`, flattened only).
//!
//! `max_context` is the longest context (a multiple of G) whose total fits `gpu_mem`, found by
//! bisection (every term is non-decreasing in the context). What the model leaves out: the
//! attention's context-parallel exchange buffers, the allocator's fragmentation, CUDA context and
//! NCCL buffers, and routing skew in the baseline's dispatch (it only makes the baseline worse).

mod hf_config;
mod presets;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use flatpeak_common::DType;
use llep::{Buffers, Config as LlepConfig, Pass, Shape};

use llep::paper::{PeakModel, PeakTerms};
use ring_dtp::paper::PaperPeaks;
use ring_dtp::{Config, RingOptions, RingPlan};
use serde::{Deserialize, Serialize};

pub use hf_config::{from_hf_config, is_hf_config};
pub use presets::{PRESET_NAMES, preset};

/// Bytes of one transformer layer's recomputed activations per token per hidden unit (bf16,
/// flash attention, no s² term): Korthikanti et al., "Reducing Activation Recomputation in
/// Large Transformer Models", 34·s·h per layer.
pub const ACTIVATION_BYTES_PER_TOKEN_HIDDEN: u64 = 34;

/// Bytes per element of weights, gradients and activations (bf16).
const ELEM: u64 = 2;

/// The largest context `max_context` searches.
pub const MAX_SEARCH_CONTEXT: u64 = 1 << 34;

/// The three of flatpeak's four peaks that are device memory, by their key in
/// [`Estimate::peaks`] (the fourth, optimizer state, is host memory under CPU offload).
pub const DEVICE_PEAKS: [&str; 3] = ["dispatch", "vocab", "checkpoints"];

/// Errors of the memory model.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// A field of the model spec is out of its domain.
    #[error("model spec field `{field}` = {value}: expected {expected}")]
    InvalidSpec {
        /// The field.
        field: &'static str,
        /// Its value.
        value: u64,
        /// What it must be.
        expected: &'static str,
    },
    /// A setup value is out of its domain.
    #[error("{what} = {value}: expected {expected}")]
    InvalidSetup {
        /// Which value.
        what: &'static str,
        /// Its value.
        value: u64,
        /// What it must be.
        expected: &'static str,
    },
    /// Neither a preset nor a readable spec file.
    #[error("model `{name}` is neither a preset ({presets}) nor a readable JSON file: {message}")]
    UnknownModel {
        /// What was given.
        name: String,
        /// The presets.
        presets: String,
        /// Why the file could not be used.
        message: String,
    },
    /// A transformers `config.json` that does not describe a MoE model flatpeak can plan.
    #[error("{path} (model_type {model_type}): {message}")]
    HfConfig {
        /// The file.
        path: String,
        /// Its `model_type`.
        model_type: String,
        /// What is missing or wrong, naming the keys.
        message: String,
    },
    /// A crate's plan rejected the shape.
    #[error("llep plan: {0}")]
    Llep(#[from] llep::Error),
    /// A crate's plan rejected the shape.
    #[error("ring-dtp plan: {0}")]
    RingDtp(#[from] ring_dtp::Error),
    /// A crate's plan rejected the shape.
    #[error("sco plan: {0}")]
    Sco(#[from] sco::Error),
    /// A crate's plan rejected the shape.
    #[error("stream-adamw plan: {0}")]
    StreamAdamW(#[from] stream_adamw::Error),
}

/// A MoE transformer's shape: the JSON schema of `flatpeak plan --model file.json` (every field
/// required except `attention_params_per_layer`; unknown fields are an error).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// Display name.
    pub name: String,
    /// Transformer layers L.
    pub layers: u64,
    /// How many of them (the first) have a dense FFN instead of experts.
    pub dense_layers: u64,
    /// Hidden size H.
    pub hidden: u64,
    /// Vocabulary V (input embedding and output projection, untied).
    pub vocab: u64,
    /// Routed experts per MoE layer E.
    pub experts: u64,
    /// Routes per token k.
    pub top_k: u64,
    /// Intermediate size of one expert I (SwiGLU: 3·H·I parameters).
    pub expert_intermediate: u64,
    /// Shared experts per MoE layer (each 3·H·I, replicated like attention).
    pub shared_experts: u64,
    /// Intermediate size of the dense layers' FFN.
    pub dense_intermediate: u64,
    /// Query heads.
    pub attention_heads: u64,
    /// Key/value heads (GQA).
    pub kv_heads: u64,
    /// Head dimension.
    pub head_dim: u64,
    /// Attention parameters per layer when the GQA formula does not apply (e.g. MLA).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_params_per_layer: Option<u64>,
}

impl ModelSpec {
    /// Reads a preset by name, else a JSON file at that path: this spec's own schema, or a
    /// Hugging Face transformers `config.json` (one with a `model_type`; see
    /// [`from_hf_config`]).
    pub fn load(name_or_path: &str) -> Result<Self, PlanError> {
        if let Some(spec) = preset(name_or_path) {
            return Ok(spec);
        }
        let unknown = |message: String| PlanError::UnknownModel {
            name: name_or_path.to_string(),
            presets: PRESET_NAMES.join(", "),
            message,
        };
        let text = std::fs::read_to_string(Path::new(name_or_path)).map_err(|e| unknown(e.to_string()))?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| unknown(e.to_string()))?;
        if is_hf_config(&json) {
            return from_hf_config(name_or_path, &json);
        }
        let spec: Self = serde_json::from_value(json).map_err(|e| unknown(e.to_string()))?;
        spec.validate()?;
        Ok(spec)
    }

    /// Checks every size is positive where it must be and `dense_layers ≤ layers`.
    pub fn validate(&self) -> Result<(), PlanError> {
        let positive = [
            ("layers", self.layers),
            ("hidden", self.hidden),
            ("vocab", self.vocab),
            ("experts", self.experts),
            ("top_k", self.top_k),
            ("expert_intermediate", self.expert_intermediate),
            ("attention_heads", self.attention_heads),
            ("kv_heads", self.kv_heads),
            ("head_dim", self.head_dim),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(PlanError::InvalidSpec { field, value, expected: "at least 1" });
            }
        }
        if self.dense_layers > self.layers {
            let expected = "at most `layers`";
            return Err(PlanError::InvalidSpec { field: "dense_layers", value: self.dense_layers, expected });
        }
        if self.top_k > self.experts {
            return Err(PlanError::InvalidSpec {
                field: "top_k",
                value: self.top_k,
                expected: "at most `experts`",
            });
        }
        if self.dense_layers > 0 && self.dense_intermediate == 0 {
            let expected = "at least 1 when dense_layers > 0";
            return Err(PlanError::InvalidSpec { field: "dense_intermediate", value: 0, expected });
        }
        if self.checked_params().and_then(|p| p.checked_mul(16)).is_none() {
            let expected = "small enough that the parameter count (and its 16 B of optimizer state each) fits in 64 bits";
            return Err(PlanError::InvalidSpec { field: "hidden", value: self.hidden, expected });
        }
        Ok(())
    }

    /// Attention parameters of one layer: the override, else `H·(heads + 2·kv_heads)·d_h`
    /// (Q, K, V) `+ heads·d_h·H` (output). Counts saturate at `u64::MAX` for a spec
    /// [`validate`](Self::validate) refuses (one whose parameter count overflows 64 bits).
    pub fn attention_params(&self) -> u64 {
        self.checked_attention_params().unwrap_or(u64::MAX)
    }

    /// MoE layers.
    pub fn moe_layers(&self) -> u64 {
        self.layers.saturating_sub(self.dense_layers)
    }

    /// Routed-expert parameters of the whole model: `L_moe·E·3·H·I`.
    pub fn expert_params(&self) -> u64 {
        self.checked_expert_params().unwrap_or(u64::MAX)
    }

    /// Non-expert parameters of the largest layer: attention, two norms, and the router with the
    /// shared experts (MoE layer) or the dense FFN.
    pub fn window_layer_params(&self) -> u64 {
        self.checked_window_layer_params().unwrap_or(u64::MAX)
    }

    /// Every parameter: experts, attention, norms, routers, shared experts, dense FFNs and the
    /// untied embedding and output projection.
    pub fn params(&self) -> u64 {
        self.checked_params().unwrap_or(u64::MAX)
    }

    fn checked_attention_params(&self) -> Option<u64> {
        if let Some(p) = self.attention_params_per_layer {
            return Some(p);
        }
        let (h, d) = (self.hidden, self.head_dim);
        let heads = self.attention_heads.checked_add(self.kv_heads.checked_mul(2)?)?;
        let qkv = product(&[h, heads, d])?;
        qkv.checked_add(product(&[self.attention_heads, d, h])?)
    }

    fn checked_expert_params(&self) -> Option<u64> {
        product(&[self.moe_layers(), self.experts, 3, self.hidden, self.expert_intermediate])
    }

    /// Router and shared experts of one MoE layer.
    fn checked_moe_layer_params(&self) -> Option<u64> {
        let h = self.hidden;
        let shared = product(&[self.shared_experts, 3, h, self.expert_intermediate])?;
        h.checked_mul(self.experts)?.checked_add(shared)
    }

    fn checked_window_layer_params(&self) -> Option<u64> {
        let h = self.hidden;
        let dense = if self.dense_layers > 0 { product(&[3, h, self.dense_intermediate])? } else { 0 };
        let widest = self.checked_moe_layer_params()?.max(dense);
        self.checked_attention_params()?.checked_add(h.checked_mul(2)?)?.checked_add(widest)
    }

    fn checked_params(&self) -> Option<u64> {
        let h = self.hidden;
        let per_layer = self.checked_attention_params()?.checked_add(h.checked_mul(2)?)?;
        let terms = [
            self.checked_expert_params()?,
            self.layers.checked_mul(per_layer)?,
            self.moe_layers().checked_mul(self.checked_moe_layer_params()?)?,
            product(&[self.dense_layers, 3, h, self.dense_intermediate])?,
            product(&[2, self.vocab, h])?,
            h,
        ];
        terms.iter().try_fold(0u64, |sum, &t| sum.checked_add(t))
    }
}

/// The product of `factors`; `None` on overflow.
fn product(factors: &[u64]) -> Option<u64> {
    factors.iter().try_fold(1u64, |p, &f| p.checked_mul(f))
}

/// Which set of schedules a column of the model describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedules {
    /// Tuned FSDP2: activation checkpointing, serial CPU optimizer offload, materialized
    /// logits, standard EP dispatch.
    Baseline,
    /// The four flatpeak schedules: PipelinedLLEP, Ring-DTP, selective checkpoint offload,
    /// OffloadStreamAdamW.
    Flattened,
}

/// One column's per-GPU bytes at one context.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Estimate {
    /// Device bytes per component (see the module docs for the keys).
    pub peaks: BTreeMap<String, u64>,
    /// Their sum.
    pub total: u64,
    /// The largest of the device peaks flatpeak bounds ([`DEVICE_PEAKS`]) at this context.
    pub binding: String,
    /// Host bytes per GPU (optimizer state, pinned optimizer staging, checkpoint arena).
    pub host: BTreeMap<String, u64>,
}

/// The per-rank budget the flattened column holds ring-dtp's ring plan to.
pub const RING_BUDGET: ring_dtp::Budget = ring_dtp::Budget::mib(64);

/// Bytes of one rank's dispatch buffers (send and receive rows with their metadata, every
/// pipeline copy) that the flattened column gives PipelinedLLEP.
pub const DISPATCH_BUDGET: usize = 256 << 20;

/// PipelinedLLEP's launch plan in the flattened column: the default config with the largest
/// pair cap q whose dispatch buffers fit [`DISPATCH_BUDGET`] (at most N).
pub fn launch_plan(shape: &Shape) -> Result<llep::Plan, llep::Error> {
    let config = LlepConfig::default();
    let per_pair_row = Buffers::dispatch_bytes_per_row(shape, Pass::Backward)
        .saturating_mul(config.pipeline_depth)
        .saturating_mul(shape.ranks);
    let q = (DISPATCH_BUDGET / per_pair_row.max(1)).clamp(1, shape.tokens.max(1));
    llep::Plan::new(&config.pair_cap(llep::PairCap::Rows(q)), *shape, llep::Budget::Unlimited)
}

fn setup_error(what: &'static str, value: u64, expected: &'static str) -> PlanError {
    PlanError::InvalidSetup { what, value, expected }
}

fn to_usize(what: &'static str, value: u64) -> Result<usize, PlanError> {
    usize::try_from(value).map_err(|_| setup_error(what, value, "a size this machine can address"))
}

/// Per-GPU bytes of `schedules` for `spec` at `context` tokens over `gpus` GPUs.
pub fn estimate(
    spec: &ModelSpec,
    context: u64,
    gpus: u64,
    schedules: Schedules,
) -> Result<Estimate, PlanError> {
    spec.validate()?;
    if gpus == 0 {
        return Err(setup_error("gpus", 0, "at least 1"));
    }
    if !spec.experts.is_multiple_of(gpus) {
        return Err(setup_error("gpus", gpus, "a divisor of the model's expert count (expert parallelism)"));
    }
    let n = context.div_ceil(gpus).max(1);
    let (h, v, k) = (spec.hidden, spec.vocab, spec.top_k);
    // Every byte count below is checked: a context too long for 64-bit sizes is an error.
    let too_long = || setup_error("context", context, "short enough that per-GPU byte counts fit in 64 bits");
    let checked = |bytes: Option<u64>| bytes.ok_or_else(too_long);
    let params = spec.params();
    let shard = params.div_ceil(gpus);
    let window = checked(product(&[2, ELEM, spec.window_layer_params()]))?;
    let flat = schedules == Schedules::Flattened;

    let shape = Shape {
        ranks: to_usize("gpus", gpus)?,
        tokens: to_usize("tokens per GPU", n)?,
        hidden: to_usize("hidden", h)?,
        intermediate: to_usize("expert_intermediate", spec.expert_intermediate)?,
        experts: to_usize("experts", spec.experts)?,
        top_k: to_usize("top_k", k)?,
        dtype: DType::Bf16,
    };
    let dispatch = if flat {
        launch_plan(&shape)?.buffers(Pass::Backward).workspace_bytes() as u64
    } else {
        let model = PeakModel::paper_fit();
        let rows = k as f64 * n as f64;
        let terms = PeakTerms { send_rows: rows, recv_rows: rows, expert_rows: 0.0, foreign_experts: 0.0 };
        (model.peak(&shape, terms) - model.m0_bytes).ceil() as u64
    };
    let (context_rows, hidden, vocab_rows) =
        (to_usize("context", context.max(gpus))?, to_usize("hidden", h)?, to_usize("vocab", v)?);
    let vocab = if flat {
        // `RingPlan::new` picks blocks whose bound fits the budget (or fails): the device holds
        // at most the budget, whatever the blocks, plus the per-token statistics. Non-decreasing
        // in the context (the bisection needs it), unlike the chosen blocks' own bound, which
        // can shrink when more tokens per rank move the choice to a narrower vocabulary block.
        let shape_all =
            ring_dtp::Shape { tokens: context_rows, hidden, vocab: vocab_rows, dtype: DType::Bf16 };
        let options = RingOptions::default().ranks(shape.ranks);
        let ring = RingPlan::new(&Config::default(), shape_all, RING_BUDGET, options)?;
        checked((RING_BUDGET.bytes() as u64).checked_add(ring.per_token_bytes() as u64))?
    } else {
        PaperPeaks::at(context_rows, hidden, vocab_rows, shape.ranks).naive.ceil() as u64
    };
    let sco_shape = sco::Shape {
        layers: to_usize("layers", spec.layers)?,
        boundary_elems: to_usize("boundary elements", checked(n.checked_mul(h))?)?,
        element_bytes: ELEM as usize,
    };
    let sco_plan = sco::Plan::new(&sco::Config::default(), sco_shape, sco::Budget::Unlimited)?;
    let checkpoints = if flat {
        checked((sco_plan.peak_slots() as u64).checked_mul(sco_plan.boundary_bytes() as u64))?
    } else {
        sco_plan.plain_device_bytes() as u64
    };
    let schedule =
        if flat { stream_adamw::StepSchedule::Pipelined } else { stream_adamw::StepSchedule::Serial };
    let optimizer_staging = stream_adamw::Plan::new(
        &stream_adamw::Config::default().schedule(schedule),
        stream_adamw::Shape {
            params: to_usize("parameters per GPU", shard)?,
            grad_dtype: DType::Bf16,
            param_dtype: DType::Bf16,
        },
        stream_adamw::Budget::Unlimited,
    )?
    .staging_bytes() as u64;

    let sharded = checked(product(&[ELEM, shard]).and_then(|b| b.checked_add(window)))?;
    let peaks = BTreeMap::from([
        ("weights".to_string(), sharded),
        ("gradients".to_string(), sharded),
        ("activations".to_string(), checked(product(&[ACTIVATION_BYTES_PER_TOKEN_HIDDEN, n, h]))?),
        ("dispatch".to_string(), dispatch),
        ("vocab".to_string(), vocab),
        ("checkpoints".to_string(), checkpoints),
    ]);
    let host = BTreeMap::from([
        ("optimizer_state".to_string(), checked(shard.checked_mul(12))?),
        ("optimizer_staging".to_string(), optimizer_staging),
        ("checkpoint_arena".to_string(), if flat { sco_plan.host_arena_bytes() as u64 } else { 0 }),
    ]);
    let total = checked(peaks.values().try_fold(0u64, |sum, &b| sum.checked_add(b)))?;
    let binding = DEVICE_PEAKS
        .iter()
        .max_by_key(|key| peaks.get(**key).copied().unwrap_or(0))
        .map_or_else(String::new, |key| key.to_string());
    Ok(Estimate { peaks, total, binding, host })
}

/// The longest context (a multiple of `gpus`, at most [`MAX_SEARCH_CONTEXT`]) whose per-GPU
/// total fits `gpu_mem`; 0 when not even `gpus` tokens fit.
pub fn max_context(
    spec: &ModelSpec,
    gpus: u64,
    gpu_mem: u64,
    schedules: Schedules,
) -> Result<u64, PlanError> {
    let fits = |units: u64| -> Result<bool, PlanError> {
        Ok(estimate(spec, units * gpus.max(1), gpus, schedules)?.total <= gpu_mem)
    };
    if !fits(1)? {
        return Ok(0);
    }
    let top = MAX_SEARCH_CONTEXT / gpus.max(1);
    let (mut lo, mut hi) = (1u64, 2u64);
    while hi <= top && fits(hi)? {
        lo = hi;
        hi *= 2;
    }
    let mut hi = hi.min(top + 1);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid)? { lo = mid } else { hi = mid }
    }
    Ok(lo * gpus.max(1))
}

/// One column of `flatpeak plan`'s output.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Column {
    /// Bytes per component at the requested context.
    pub peaks: BTreeMap<String, u64>,
    /// Their sum.
    pub total: u64,
    /// Whether the total fits the GPU.
    pub fits: bool,
    /// The largest of the device peaks flatpeak bounds at the requested context.
    pub binding: String,
    /// The longest context that fits.
    pub max_context: u64,
    /// Host bytes per GPU at the requested context.
    pub host: BTreeMap<String, u64>,
}

/// `flatpeak plan`'s output (its JSON form).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanOutput {
    /// The model's name.
    pub model: String,
    /// Tokens of the sequence.
    pub context: u64,
    /// GPUs.
    pub gpus: u64,
    /// Bytes per GPU.
    pub gpu_mem: u64,
    /// Parameters of the model.
    pub params: u64,
    /// The tuned FSDP2 baseline.
    pub baseline: Column,
    /// The flattened schedules.
    pub flattened: Column,
}

/// Both columns for `spec` at `context` tokens over `gpus` GPUs of `gpu_mem` bytes.
pub fn plan(spec: &ModelSpec, context: u64, gpus: u64, gpu_mem: u64) -> Result<PlanOutput, PlanError> {
    if context == 0 {
        return Err(setup_error("context", 0, "at least 1 token"));
    }
    let column = |schedules| -> Result<Column, PlanError> {
        let e = estimate(spec, context, gpus, schedules)?;
        Ok(Column {
            fits: e.total <= gpu_mem,
            max_context: max_context(spec, gpus, gpu_mem, schedules)?,
            peaks: e.peaks,
            total: e.total,
            binding: e.binding,
            host: e.host,
        })
    };
    Ok(PlanOutput {
        model: spec.name.clone(),
        context,
        gpus,
        gpu_mem,
        params: spec.params(),
        baseline: column(Schedules::Baseline)?,
        flattened: column(Schedules::Flattened)?,
    })
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// The human-readable table of [`PlanOutput`].
pub fn render_text(out: &PlanOutput) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{}: {:.1} B parameters, context {} tokens over {} GPUs of {} ({} tokens per GPU)",
        out.model,
        out.params as f64 / 1e9,
        out.context,
        out.gpus,
        gib(out.gpu_mem),
        out.context.div_ceil(out.gpus.max(1)),
    );
    let _ = writeln!(s, "{:<18} {:>14} {:>14}", "per GPU", "baseline", "flattened");
    for key in out.baseline.peaks.keys() {
        let b = out.baseline.peaks[key];
        let f = out.flattened.peaks.get(key).copied().unwrap_or(0);
        let _ = writeln!(s, "{key:<18} {:>14} {:>14}", gib(b), gib(f));
    }
    let _ = writeln!(
        s,
        "{:<18} {:>14} {:>14}",
        "device total",
        gib(out.baseline.total),
        gib(out.flattened.total)
    );
    let fits = |c: &Column| if c.fits { "yes" } else { "NO" };
    let _ = writeln!(s, "{:<18} {:>14} {:>14}", "fits", fits(&out.baseline), fits(&out.flattened));
    let _ = writeln!(s, "{:<18} {:>14} {:>14}", "largest peak", out.baseline.binding, out.flattened.binding);
    let _ = writeln!(
        s,
        "{:<18} {:>14} {:>14}",
        "max context", out.baseline.max_context, out.flattened.max_context
    );
    let _ = writeln!(s, "host, per GPU:");
    for key in out.baseline.host.keys() {
        let b = out.baseline.host[key];
        let f = out.flattened.host.get(key).copied().unwrap_or(0);
        let _ = writeln!(s, "  {key:<18} {:>14} {:>14}", gib(b), gib(f));
    }
    if out.baseline.max_context > 0 {
        let _ = writeln!(
            s,
            "reach: {:.1}× the baseline's longest context",
            out.flattened.max_context as f64 / out.baseline.max_context as f64
        );
    }
    s
}

#[cfg(test)]
mod tests;
