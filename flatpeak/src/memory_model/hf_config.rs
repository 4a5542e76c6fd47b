//! A Hugging Face transformers `config.json` as a [`ModelSpec`], so `flatpeak plan --model
//! path/to/config.json` answers for the model a user holds.
//!
//! Read for the MoE model types whose keys it knows: `qwen3_moe`, `qwen2_moe`, `qwen3_next`,
//! `mixtral`, `olmoe`, `flex_olmo`, `gpt_oss`, `deepseek_v2`, `deepseek_v3`, `deepseek_v32`,
//! `dots1`, `glm4_moe`, `minimax`, `minimax_m2`, `ernie4_5_moe`, `exaone_moe`, `solar_open` and
//! `lfm2_moe` (any `model_type` with the same keys is read the same way; Hunyuan's `moe_topk`,
//! an integer or a per-layer list, is not read). A count key given as anything but a
//! non-negative integer (a per-layer list), or an ERNIE `moe_layer_end_index` that is not an
//! integer, is an error that names it. The mapping:
//!
//! | spec field | config keys |
//! |---|---|
//! | `layers`, `hidden`, `vocab` | `num_hidden_layers`, `hidden_size`, `vocab_size` |
//! | `experts` | `num_experts` (Qwen, OLMoE), `num_local_experts` (Mixtral, gpt-oss, MiniMax), `n_routed_experts` (DeepSeek, GLM) or `moe_num_experts` (ERNIE) |
//! | `top_k` | `num_experts_per_tok` (or gpt-oss's `experts_per_token`, ERNIE's `moe_k`) |
//! | `expert_intermediate` | `moe_intermediate_size`, else `intermediate_size` (Mixtral, OLMoE, gpt-oss: the experts' width) |
//! | `dense_layers` | `first_k_dense_replace` (DeepSeek, GLM, EXAONE) or `num_dense_layers` (LFM2), the layers outside ERNIE's `moe_layer_start_index` ..= `moe_layer_end_index` (−1: the last) every `moe_layer_interval`, or the layers Qwen's `mlp_only_layers` and `decoder_sparse_step` leave dense |
//! | `dense_intermediate` | `intermediate_size` when some layers are dense |
//! | `shared_experts` | `n_shared_experts` (DeepSeek, GLM), `moe_num_shared_experts` (ERNIE), `num_shared_experts` (EXAONE), or Qwen's `shared_expert_intermediate_size` in experts' widths (rounded up) |
//! | `attention_heads`, `kv_heads`, `head_dim` | `num_attention_heads`, `num_key_value_heads` (default: the heads), `head_dim` (default: hidden / heads; MLA: `v_head_dim`) |
//! | `attention_params_per_layer` | MLA only (`kv_lora_rank` present): `H·q_lora + q_lora·h·(d_nope + d_rope)` (or `H·h·(d_nope + d_rope)` without `q_lora_rank`) `+ H·(kv_lora + d_rope) + kv_lora·h·(d_nope + d_v) + h·d_v·H` |
//!
//! A config without routed experts (a dense model) or without a key it needs is an error that
//! names the keys.

use serde_json::Value;

use super::{ModelSpec, PlanError};

/// Config keys that name the routed experts' count, by model family.
const EXPERT_KEYS: [&str; 4] = ["num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"];

/// Every key read as a count: present (and not `null`), each must be a non-negative integer.
/// A family that gives one per layer (a list) is refused by name rather than read from a
/// fallback key (which would plan another width).
const COUNT_KEYS: [&str; 29] = [
    "num_hidden_layers",
    "hidden_size",
    "vocab_size",
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
    "num_experts_per_tok",
    "experts_per_token",
    "moe_k",
    "moe_intermediate_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "n_shared_experts",
    "moe_num_shared_experts",
    "num_shared_experts",
    "shared_expert_intermediate_size",
    "first_k_dense_replace",
    "num_dense_layers",
    "decoder_sparse_step",
    "moe_layer_start_index",
    "moe_layer_interval",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
];

/// Whether `json` is a transformers config (it names its `model_type`).
pub fn is_hf_config(json: &Value) -> bool {
    json.get("model_type").is_some_and(Value::is_string)
}

/// The spec of the transformers config `json` read from `path`.
pub fn from_hf_config(path: &str, json: &Value) -> Result<ModelSpec, PlanError> {
    let model_type = json.get("model_type").and_then(Value::as_str).unwrap_or("?").to_string();
    let error = |message: String| PlanError::HfConfig {
        path: path.to_string(),
        model_type: model_type.clone(),
        message,
    };
    let uint = |key: &str| json.get(key).and_then(Value::as_u64);
    let first = |keys: &[&'static str]| keys.iter().find_map(|k| uint(k));
    for key in COUNT_KEYS {
        if let Some(value) = json.get(key).filter(|v| !v.is_null() && v.as_u64().is_none()) {
            return Err(error(format!("{key} is {value}, not a count (a non-negative integer)")));
        }
    }
    if let Some(value) = json.get("moe_layer_end_index").filter(|v| !v.is_null() && v.as_i64().is_none()) {
        return Err(error(format!(
            "moe_layer_end_index is {value}, not a layer index (an integer; -1: the last)"
        )));
    }
    let Some(experts) = first(&EXPERT_KEYS) else {
        return Err(error(format!(
            "no routed experts (none of {}): flatpeak plans MoE models; a dense model has no dispatch to plan",
            EXPERT_KEYS.join(", ")
        )));
    };
    let mut missing: Vec<&str> = Vec::new();
    let mut need = |keys: &[&'static str]| {
        let value = first(keys);
        if value.is_none() {
            missing.push(keys[0]);
        }
        value.unwrap_or(0)
    };
    let layers = need(&["num_hidden_layers"]);
    let hidden = need(&["hidden_size"]);
    let vocab = need(&["vocab_size"]);
    let top_k = need(&["num_experts_per_tok", "experts_per_token", "moe_k"]);
    let expert_intermediate = need(&["moe_intermediate_size", "intermediate_size"]);
    let heads = need(&["num_attention_heads"]);
    if !missing.is_empty() {
        return Err(error(format!("missing keys: {}", missing.join(", "))));
    }
    let kv_heads = uint("num_key_value_heads").unwrap_or(heads);
    let dense_layers = dense_layer_count(json, layers);
    let dense_intermediate = if dense_layers > 0 {
        uint("intermediate_size").ok_or_else(|| {
            error(format!("{dense_layers} dense layers, but no intermediate_size for their FFN"))
        })?
    } else {
        0
    };
    let shared_experts = match (
        first(&["n_shared_experts", "moe_num_shared_experts", "num_shared_experts"]),
        uint("shared_expert_intermediate_size"),
    ) {
        (Some(n), _) => n,
        (None, Some(width)) => width.div_ceil(expert_intermediate.max(1)),
        (None, None) => 0,
    };
    let mla = mla_attention_params(json, hidden, heads);
    let head_dim = match mla {
        Some(_) => uint("v_head_dim").unwrap_or(0),
        None => uint("head_dim").unwrap_or(hidden.checked_div(heads).unwrap_or(0)),
    };
    let name = json
        .get("_name_or_path")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .or_else(|| json.get("architectures").and_then(|a| a.get(0)).and_then(Value::as_str))
        .unwrap_or(&model_type)
        .to_string();
    let spec = ModelSpec {
        name,
        layers,
        dense_layers,
        hidden,
        vocab,
        experts,
        top_k,
        expert_intermediate,
        shared_experts,
        dense_intermediate,
        attention_heads: heads,
        kv_heads,
        head_dim,
        attention_params_per_layer: mla,
    };
    spec.validate()?;
    Ok(spec)
}

/// Layers with a dense FFN: DeepSeek's first `first_k_dense_replace` (LFM2's
/// `num_dense_layers`); under ERNIE's `moe_layer_start_index` a, `moe_layer_end_index` b (−1:
/// the last layer) and `moe_layer_interval` s, layer i is sparse when `(i + 1) % s == 0` and
/// `a ≤ i ≤ b`; under Qwen's `decoder_sparse_step` s and `mlp_only_layers`, layer i is sparse
/// when `(i + 1) % s == 0` and i is not listed.
fn dense_layer_count(json: &Value, layers: u64) -> u64 {
    if let Some(k) = ["first_k_dense_replace", "num_dense_layers"].iter().find_map(|k| json.get(*k)?.as_u64())
    {
        return k.min(layers);
    }
    if let Some(start) = json.get("moe_layer_start_index").and_then(Value::as_u64) {
        let end = match json.get("moe_layer_end_index").and_then(Value::as_i64) {
            Some(end) if end >= 0 => end as u64,
            _ => layers.saturating_sub(1),
        };
        let step = json.get("moe_layer_interval").and_then(Value::as_u64).unwrap_or(1).max(1);
        return (0..layers).filter(|&i| !((i + 1) % step == 0 && start <= i && i <= end)).count() as u64;
    }
    let step = json.get("decoder_sparse_step").and_then(Value::as_u64).unwrap_or(1).max(1);
    let mlp_only: Vec<u64> = json
        .get("mlp_only_layers")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    (0..layers).filter(|i| mlp_only.contains(i) || (i + 1) % step != 0).count() as u64
}

/// Multi-head latent attention's parameters per layer (without its two norms), when the config
/// has `kv_lora_rank`.
fn mla_attention_params(json: &Value, hidden: u64, heads: u64) -> Option<u64> {
    let uint = |key: &str| json.get(key).and_then(Value::as_u64);
    let kv_lora = uint("kv_lora_rank")?;
    let (nope, rope, v) = (uint("qk_nope_head_dim")?, uint("qk_rope_head_dim")?, uint("v_head_dim")?);
    let qk = heads.checked_mul(nope.checked_add(rope)?)?;
    let q = match uint("q_lora_rank") {
        Some(q_lora) => hidden.checked_mul(q_lora)?.checked_add(q_lora.checked_mul(qk)?)?,
        None => hidden.checked_mul(qk)?,
    };
    let kv_a = hidden.checked_mul(kv_lora.checked_add(rope)?)?;
    let kv_b = kv_lora.checked_mul(heads.checked_mul(nope.checked_add(v)?)?)?;
    let out = heads.checked_mul(v)?.checked_mul(hidden)?;
    q.checked_add(kv_a)?.checked_add(kv_b)?.checked_add(out)
}
