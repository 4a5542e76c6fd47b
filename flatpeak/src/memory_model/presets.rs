//! The built-in model presets of `flatpeak plan --model`, from the models' published configs.

use super::ModelSpec;

/// Names accepted by `--model`, in the order `flatpeak plan` lists them.
pub const PRESET_NAMES: [&str; 3] = ["gpt-oss-120b", "Qwen3-235B-A22B", "DeepSeek-V3"];

/// The preset called `name` (case-insensitive), if any.
pub fn preset(name: &str) -> Option<ModelSpec> {
    let spec = match name.to_ascii_lowercase().as_str() {
        // 36 layers, H = 2880, 128 experts top-4 of width 2880, GQA 64/8 heads of 64,
        // vocabulary 201,088: ≈ 117 B parameters.
        "gpt-oss-120b" => ModelSpec {
            name: "gpt-oss-120b".into(),
            layers: 36,
            dense_layers: 0,
            hidden: 2880,
            vocab: 201_088,
            experts: 128,
            top_k: 4,
            expert_intermediate: 2880,
            shared_experts: 0,
            dense_intermediate: 0,
            attention_heads: 64,
            kv_heads: 8,
            head_dim: 64,
            attention_params_per_layer: None,
        },
        // 94 layers, H = 4096, 128 experts top-8 of width 1536, GQA 64/4 heads of 128,
        // vocabulary 151,936: ≈ 235 B parameters.
        "qwen3-235b-a22b" => ModelSpec {
            name: "Qwen3-235B-A22B".into(),
            layers: 94,
            dense_layers: 0,
            hidden: 4096,
            vocab: 151_936,
            experts: 128,
            top_k: 8,
            expert_intermediate: 1536,
            shared_experts: 0,
            dense_intermediate: 0,
            attention_heads: 64,
            kv_heads: 4,
            head_dim: 128,
            attention_params_per_layer: None,
        },
        // 61 layers (the first 3 dense, FFN 18,432), H = 7168, 256 routed experts top-8 of width
        // 2048 plus 1 shared, MLA attention (187,105,280 parameters per layer: q and kv LoRA
        // ranks 1536 / 512, 128 heads), vocabulary 129,280: ≈ 671 B parameters.
        "deepseek-v3" => ModelSpec {
            name: "DeepSeek-V3".into(),
            layers: 61,
            dense_layers: 3,
            hidden: 7168,
            vocab: 129_280,
            experts: 256,
            top_k: 8,
            expert_intermediate: 2048,
            shared_experts: 1,
            dense_intermediate: 18_432,
            attention_heads: 128,
            kv_heads: 128,
            head_dim: 128,
            attention_params_per_layer: Some(187_105_280),
        },
        _ => return None,
    };
    Some(spec)
}
