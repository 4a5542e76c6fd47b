use super::*;

const GIB: u64 = 1 << 30;

#[test]
fn presets_match_the_published_parameter_counts() {
    for (name, billions) in [("gpt-oss-120b", 116.8), ("Qwen3-235B-A22B", 235.1), ("DeepSeek-V3", 671.0)] {
        let spec = preset(name).expect("preset");
        spec.validate().expect("valid");
        let got = spec.params() as f64 / 1e9;
        assert!((got / billions - 1.0).abs() < 0.02, "{name}: {got:.1} B against {billions} B");
    }
    assert!(preset("qwen3-235b-a22b").is_some(), "names are case-insensitive");
}

#[test]
fn every_term_grows_with_the_context_and_the_flattened_peaks_stay_below() {
    let spec = preset("Qwen3-235B-A22B").expect("preset");
    for schedules in [Schedules::Baseline, Schedules::Flattened] {
        let mut last: Option<Estimate> = None;
        for context in [8 << 10, 64 << 10, 512 << 10, 4 << 20] {
            let e = estimate(&spec, context, 64, schedules).expect("estimate");
            if let Some(prev) = &last {
                for (key, &bytes) in &e.peaks {
                    assert!(bytes >= prev.peaks[key], "{schedules:?} {key} shrank at context {context}");
                }
            }
            last = Some(e);
        }
    }
    let base = estimate(&spec, 1 << 20, 64, Schedules::Baseline).expect("baseline");
    let flat = estimate(&spec, 1 << 20, 64, Schedules::Flattened).expect("flattened");
    for key in DEVICE_PEAKS {
        assert!(flat.peaks[key] <= base.peaks[key], "{key}: {} > {}", flat.peaks[key], base.peaks[key]);
    }
    for key in ["weights", "gradients", "activations"] {
        assert_eq!(flat.peaks[key], base.peaks[key], "{key} is the same under both");
    }
    // The baseline's vocabulary peak is the materialized 8 B per logit; the flattened one is
    // the budget ring-dtp's ring plan is held to, plus the per-token statistics.
    assert_eq!(base.peaks["vocab"], 8 * (1u64 << 20) / 64 * spec.vocab);
    let ring = RingPlan::new(
        &Config::default(),
        ring_dtp::Shape {
            tokens: 1 << 20,
            hidden: spec.hidden as usize,
            vocab: spec.vocab as usize,
            dtype: DType::Bf16,
        },
        RING_BUDGET,
        RingOptions::default().ranks(64),
    )
    .expect("ring plan");
    assert!(ring.bound_bytes() <= RING_BUDGET.bytes());
    assert_eq!(flat.peaks["vocab"], (RING_BUDGET.bytes() + ring.per_token_bytes()) as u64);
}

#[test]
fn max_context_is_the_boundary_of_what_fits() {
    let spec = preset("gpt-oss-120b").expect("preset");
    let (gpus, mem) = (32, 141 * GIB);
    for schedules in [Schedules::Baseline, Schedules::Flattened] {
        let best = max_context(&spec, gpus, mem, schedules).expect("search");
        assert!(best > 0 && best.is_multiple_of(gpus), "{schedules:?}: {best}");
        assert!(estimate(&spec, best, gpus, schedules).expect("at max").total <= mem);
        assert!(estimate(&spec, best + gpus, gpus, schedules).expect("past max").total > mem);
    }
    let base = max_context(&spec, gpus, mem, Schedules::Baseline).expect("baseline");
    let flat = max_context(&spec, gpus, mem, Schedules::Flattened).expect("flattened");
    assert!(flat > base, "flattened {flat} ≤ baseline {base}");
    assert_eq!(max_context(&spec, gpus, GIB, Schedules::Flattened).expect("tiny GPU"), 0);
}

#[test]
fn plan_output_has_the_documented_json_shape() {
    let spec = preset("DeepSeek-V3").expect("preset");
    let out = plan(&spec, 1 << 20, 64, 141 * GIB).expect("plan");
    let json: serde_json::Value = serde_json::to_value(&out).expect("json");
    for column in ["baseline", "flattened"] {
        let c = &json[column];
        assert!(c["peaks"].is_object() && c["fits"].is_boolean() && c["max_context"].is_u64(), "{c}");
        for key in DEVICE_PEAKS {
            assert!(c["peaks"][key].is_u64(), "{column}.peaks.{key}");
        }
    }
    assert!(json["flattened"]["host"]["checkpoint_arena"].is_u64());
    assert_eq!(json["model"], "DeepSeek-V3");
    assert_eq!(json["context"], 1 << 20);
    assert!(render_text(&out).contains("max context"));
}

#[test]
fn bad_specs_and_setups_are_typed_errors() {
    let spec = preset("gpt-oss-120b").expect("preset");
    let bad = ModelSpec { top_k: 200, ..spec.clone() };
    assert!(matches!(bad.validate(), Err(PlanError::InvalidSpec { field: "top_k", value: 200, .. })));
    let bad = ModelSpec { hidden: 0, ..spec.clone() };
    assert!(matches!(bad.validate(), Err(PlanError::InvalidSpec { field: "hidden", .. })));
    assert!(matches!(
        estimate(&spec, 1024, 3, Schedules::Baseline),
        Err(PlanError::InvalidSetup { what: "gpus", value: 3, .. })
    ));
    assert!(matches!(plan(&spec, 0, 8, GIB), Err(PlanError::InvalidSetup { what: "context", .. })));
    assert!(matches!(ModelSpec::load("/nonexistent/model.json"), Err(PlanError::UnknownModel { .. })));
    // Sizes past 64 bits are errors, never a wrapped total that "fits" (this printed a
    // fitting baseline at context 2⁶⁴ − 1) or a debug panic.
    for schedules in [Schedules::Baseline, Schedules::Flattened] {
        match estimate(&spec, u64::MAX, 8, schedules) {
            Err(PlanError::InvalidSetup { what, .. }) => {
                assert!(what == "context" || what.contains("tokens"), "{what}")
            }
            Err(
                PlanError::RingDtp(_) | PlanError::Sco(_) | PlanError::Llep(_) | PlanError::StreamAdamW(_),
            ) => {}
            other => panic!("{schedules:?}: {other:?}"),
        }
    }
    assert!(plan(&spec, u64::MAX, 8, 80 * GIB).is_err());
    let huge = ModelSpec { hidden: 1 << 40, expert_intermediate: 1 << 40, ..spec.clone() };
    assert!(matches!(huge.validate(), Err(PlanError::InvalidSpec { field: "hidden", .. })));
    assert_eq!(huge.params(), u64::MAX);
}

#[test]
fn a_json_spec_round_trips_and_rejects_unknown_fields() {
    let dir = std::env::temp_dir().join(format!("flatpeak-plan-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let spec = preset("Qwen3-235B-A22B").expect("preset");
    let path = dir.join("model.json");
    std::fs::write(&path, serde_json::to_string(&spec).expect("json")).expect("write");
    assert_eq!(ModelSpec::load(path.to_str().expect("utf-8")).expect("load"), spec);
    let mut value = serde_json::to_value(&spec).expect("json");
    value["hiden"] = serde_json::json!(4096);
    std::fs::write(&path, value.to_string()).expect("write");
    let err = ModelSpec::load(path.to_str().expect("utf-8")).expect_err("unknown field");
    assert!(err.to_string().contains("hiden"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Below 512 tokens per GPU the ring plan's block choice moves with every token; every peak
/// must still be non-decreasing there, token by token, or `max_context`'s bisection is void.
#[test]
fn every_term_is_non_decreasing_token_by_token_at_short_contexts() {
    let gpus = 64;
    for name in PRESET_NAMES {
        let spec = preset(name).expect("preset");
        for schedules in [Schedules::Baseline, Schedules::Flattened] {
            let mut last = estimate(&spec, gpus, gpus, schedules).expect("estimate");
            for per_gpu in 2..=600 {
                let e = estimate(&spec, per_gpu * gpus, gpus, schedules).expect("estimate");
                for (key, &bytes) in &e.peaks {
                    assert!(
                        bytes >= last.peaks[key],
                        "{name} {schedules:?} {key} shrank at {per_gpu} tokens per GPU"
                    );
                }
                last = e;
            }
        }
    }
}

/// The presets as seeds of the `model_json` fuzz target (`[context: u64 LE][gpus: u8][gpu
/// memory: u64 LE][model JSON]`), each planned as the target would; with
/// `FLATPEAK_WRITE_FUZZ_SEEDS=<dir>` also written there.
#[test]
fn fuzz_seeds_plan() {
    let out_dir = std::env::var_os("FLATPEAK_WRITE_FUZZ_SEEDS").map(std::path::PathBuf::from);
    for (i, name) in PRESET_NAMES.iter().enumerate() {
        let spec = preset(name).expect("preset");
        let json = serde_json::to_vec(&spec).expect("json");
        let back: ModelSpec = serde_json::from_slice(&json).expect("round trip");
        let (context, gpus, gpu_mem) = (131_072u64 << (i % 3), 8u8, 80 * GIB);
        plan(&back, context, u64::from(gpus), gpu_mem).expect("plan");
        if let Some(dir) = &out_dir {
            let mut seed = context.to_le_bytes().to_vec();
            seed.push(gpus - 1); // the target plans on (byte % 16) + 1 GPUs
            seed.extend_from_slice(&gpu_mem.to_le_bytes());
            seed.extend_from_slice(&json);
            std::fs::create_dir_all(dir).expect("seed dir");
            std::fs::write(dir.join(format!("seed-{name}")), seed).expect("write seed");
        }
    }
}

/// The published `config.json` of each preset's model, as transformers writes it (the keys that
/// matter, and some that do not): reading it gives the preset.
fn published_config(name: &str) -> serde_json::Value {
    match name {
        "Qwen3-235B-A22B" => serde_json::json!({
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu", "hidden_size": 4096,
            "intermediate_size": 12288, "max_position_embeddings": 40960, "mlp_only_layers": [],
            "moe_intermediate_size": 1536, "norm_topk_prob": true, "num_attention_heads": 64,
            "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 94,
            "num_key_value_heads": 4, "rope_theta": 1000000.0, "tie_word_embeddings": false,
            "torch_dtype": "bfloat16", "vocab_size": 151936
        }),
        "DeepSeek-V3" => serde_json::json!({
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "first_k_dense_replace": 3, "hidden_size": 7168, "intermediate_size": 18432,
            "kv_lora_rank": 512, "moe_intermediate_size": 2048, "moe_layer_freq": 1,
            "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": true,
            "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
            "num_key_value_heads": 128, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64, "routed_scaling_factor": 2.5, "topk_group": 4,
            "v_head_dim": 128, "vocab_size": 129280
        }),
        "gpt-oss-120b" => serde_json::json!({
            "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "head_dim": 64,
            "hidden_size": 2880, "intermediate_size": 2880, "num_attention_heads": 64,
            "num_experts_per_tok": 4, "num_hidden_layers": 36, "num_key_value_heads": 8,
            "num_local_experts": 128, "vocab_size": 201088, "sliding_window": 128
        }),
        other => panic!("no published config for {other}"),
    }
}

#[test]
fn a_transformers_config_of_each_preset_reads_as_the_preset() {
    let dir = std::env::temp_dir().join(format!("flatpeak-hf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    for name in PRESET_NAMES {
        let path = dir.join(format!("{name}.json"));
        std::fs::write(&path, published_config(name).to_string()).expect("write");
        let spec = ModelSpec::load(path.to_str().expect("utf-8")).expect("a transformers config");
        let want = preset(name).expect("preset");
        assert_eq!(ModelSpec { name: want.name.clone(), ..spec }, want, "{name}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_other_moe_families_read_with_their_own_keys() {
    // Mixtral-8x7B: the experts' width is intermediate_size; head_dim defaults to H / heads.
    let mixtral = serde_json::json!({
        "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_experts_per_tok": 2, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "vocab_size": 32000
    });
    let spec = from_hf_config("mixtral.json", &mixtral).expect("mixtral");
    assert_eq!((spec.experts, spec.top_k, spec.expert_intermediate, spec.head_dim), (8, 2, 14336, 128));
    // Qwen1.5-MoE-A2.7B: a shared expert of 4 experts' width; every other layer dense under a
    // sparse step of 2 plus layer 0 listed MLP-only.
    let mut qwen2 = serde_json::json!({
        "model_type": "qwen2_moe", "hidden_size": 2048, "intermediate_size": 5632,
        "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
        "num_attention_heads": 16, "num_experts": 60, "num_experts_per_tok": 4,
        "num_hidden_layers": 24, "num_key_value_heads": 16, "vocab_size": 151936,
        "decoder_sparse_step": 1, "mlp_only_layers": []
    });
    let spec = from_hf_config("qwen2.json", &qwen2).expect("qwen2_moe");
    assert_eq!((spec.shared_experts, spec.dense_layers, spec.dense_intermediate), (4, 0, 0));
    qwen2["decoder_sparse_step"] = serde_json::json!(2);
    qwen2["mlp_only_layers"] = serde_json::json!([1, 2]);
    // Sparse: i with (i + 1) % 2 == 0 and i not in [1, 2] -> 3, 5, ..., 23 (11 of 24).
    let spec = from_hf_config("qwen2.json", &qwen2).expect("qwen2_moe");
    assert_eq!((spec.dense_layers, spec.dense_intermediate), (13, 5632));
    let olmoe = serde_json::json!({
        "model_type": "olmoe", "hidden_size": 2048, "intermediate_size": 1024,
        "num_attention_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
        "num_hidden_layers": 16, "num_key_value_heads": 16, "vocab_size": 50304
    });
    let spec = from_hf_config("olmoe.json", &olmoe).expect("olmoe");
    assert_eq!((spec.experts, spec.top_k, spec.expert_intermediate, spec.layers), (64, 8, 1024, 16));
    // GLM-4.5-Air-like: DeepSeek's keys (routed and shared experts, the first layer dense).
    let glm = serde_json::json!({
        "model_type": "glm4_moe", "hidden_size": 4096, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "n_routed_experts": 128, "n_shared_experts": 1,
        "num_experts_per_tok": 8, "first_k_dense_replace": 1, "num_hidden_layers": 46,
        "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151552
    });
    let spec = from_hf_config("glm.json", &glm).expect("glm4_moe");
    assert_eq!(
        (spec.experts, spec.top_k, spec.shared_experts, spec.dense_layers, spec.dense_intermediate),
        (128, 8, 1, 1, 10944)
    );
    // ERNIE-4.5-MoE-like: its own moe_* keys; layers 1 ..= 27 of 28 sparse, then every other
    // one from layer 3 to the last (-1) under an interval of 2.
    let mut ernie = serde_json::json!({
        "model_type": "ernie4_5_moe", "hidden_size": 2560, "intermediate_size": 12288,
        "moe_intermediate_size": 1536, "moe_num_experts": 64, "moe_k": 6,
        "moe_num_shared_experts": 2, "moe_layer_start_index": 1, "moe_layer_end_index": 27,
        "moe_layer_interval": 1, "num_hidden_layers": 28, "num_attention_heads": 20,
        "num_key_value_heads": 4, "vocab_size": 103424
    });
    let spec = from_hf_config("ernie.json", &ernie).expect("ernie4_5_moe");
    assert_eq!(
        (spec.experts, spec.top_k, spec.expert_intermediate, spec.shared_experts, spec.dense_layers),
        (64, 6, 1536, 2, 1)
    );
    ernie["moe_layer_start_index"] = serde_json::json!(3);
    ernie["moe_layer_end_index"] = serde_json::json!(-1);
    ernie["moe_layer_interval"] = serde_json::json!(2);
    // Sparse: odd i in 3 ..= 27 (13 of 28).
    let spec = from_hf_config("ernie.json", &ernie).expect("ernie4_5_moe");
    assert_eq!(spec.dense_layers, 15);
    // EXAONE-MoE-like: num_shared_experts; LFM2-MoE-like: its first num_dense_layers dense.
    let exaone = serde_json::json!({
        "model_type": "exaone_moe", "hidden_size": 4096, "intermediate_size": 16384,
        "moe_intermediate_size": 1024, "num_experts": 64, "num_experts_per_tok": 8,
        "num_shared_experts": 1, "first_k_dense_replace": 1, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 102400
    });
    let spec = from_hf_config("exaone.json", &exaone).expect("exaone_moe");
    assert_eq!((spec.experts, spec.shared_experts, spec.dense_layers), (64, 1, 1));
    let lfm2 = serde_json::json!({
        "model_type": "lfm2_moe", "hidden_size": 2048, "intermediate_size": 7168,
        "moe_intermediate_size": 1792, "num_experts": 32, "num_experts_per_tok": 4,
        "num_dense_layers": 2, "num_hidden_layers": 24, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 65536
    });
    let spec = from_hf_config("lfm2.json", &lfm2).expect("lfm2_moe");
    assert_eq!((spec.experts, spec.top_k, spec.dense_layers, spec.dense_intermediate), (32, 4, 2, 7168));
}

#[test]
fn a_count_given_per_layer_is_refused_by_name_not_read_from_a_fallback_key() {
    // Without the check, moe_intermediate_size (a list) would be skipped for intermediate_size,
    // the dense FFN's width: another model's plan.
    let per_layer = serde_json::json!({
        "model_type": "hunyuan_v1_moe", "hidden_size": 4096, "intermediate_size": 3072,
        "moe_intermediate_size": [3072, 3072], "num_experts": 64, "num_experts_per_tok": 8,
        "num_hidden_layers": 2, "num_attention_heads": 32, "vocab_size": 128000
    });
    let err = from_hf_config("hunyuan.json", &per_layer).expect_err("a list").to_string();
    assert!(err.contains("moe_intermediate_size is [3072,3072], not a count"), "{err}");
    let negative = serde_json::json!({
        "model_type": "qwen3_moe", "hidden_size": 64, "num_experts": -8, "vocab_size": 10
    });
    let err = from_hf_config("negative.json", &negative).expect_err("negative").to_string();
    assert!(err.contains("num_experts is -8, not a count"), "{err}");
    let end = serde_json::json!({
        "model_type": "ernie4_5_moe", "hidden_size": 64, "moe_num_experts": 8, "moe_k": 2,
        "moe_layer_start_index": 1, "moe_layer_end_index": "last", "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 10
    });
    let err = from_hf_config("end.json", &end).expect_err("a string").to_string();
    assert!(err.contains("moe_layer_end_index is \"last\", not a layer index"), "{err}");
}

#[test]
fn a_dense_or_incomplete_transformers_config_names_the_keys() {
    let llama = serde_json::json!({
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
        "num_attention_heads": 32, "num_hidden_layers": 32, "vocab_size": 32000
    });
    let err = from_hf_config("llama.json", &llama).expect_err("dense");
    let text = err.to_string();
    assert!(
        text.contains("llama") && text.contains("num_experts, num_local_experts, n_routed_experts"),
        "{text}"
    );
    let partial = serde_json::json!({ "model_type": "qwen3_moe", "num_experts": 8, "hidden_size": 64 });
    let err = from_hf_config("partial.json", &partial).expect_err("missing keys").to_string();
    for key in [
        "num_hidden_layers",
        "vocab_size",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "num_attention_heads",
    ] {
        assert!(err.contains(key), "{key} not named: {err}");
    }
    assert!(!err.contains("hidden_size"), "{err}");
}
