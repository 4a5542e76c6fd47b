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
