//! `flatpeak run` end to end: tensors written to a safetensors file, the component run, its
//! outputs read back and compared with an f64 reference (or with the other schedule, where the
//! crate promises equality); and every kind of bad input.

use std::path::PathBuf;

use flatpeak_common::{DType, SplitMix64, relative_error};
use half::bf16;

use super::*;

const TOL: f64 = 1e-5;

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("flatpeak-run-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        Self(dir)
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

fn run_with(
    dir: &TempDir,
    component: &str,
    inputs: &Outputs,
    config: Option<&str>,
) -> Result<TensorFile, RunError> {
    let (i, c, o) = (dir.path("in.safetensors"), dir.path("cfg.json"), dir.path("out.safetensors"));
    inputs.write(&i)?;
    if let Some(text) = config {
        std::fs::write(&c, text).expect("write config");
    }
    run(component, &i, config.map(|_| c.as_path()), &o)?;
    TensorFile::read(&o)
}

fn get(t: &TensorFile, name: &str, shape: &[usize]) -> Vec<f32> {
    let dims: Vec<Dim> = shape.iter().map(|&n| Dim::Is(n)).collect();
    t.f32(name, &dims).unwrap_or_else(|e| panic!("{e}")).0
}

/// A ring-dtp problem: its input file, X, W, the bias, the targets, and (N, D, V).
type RingCase = (Outputs, Vec<f32>, Vec<f32>, Vec<f32>, Vec<i64>, (usize, usize, usize));

fn ring_inputs(dtype: DType) -> RingCase {
    let (n, d, v) = (37, 16, 53);
    let mut rng = SplitMix64::new(3);
    let round = |a: Vec<f32>| -> Vec<f32> {
        if dtype == DType::Bf16 { a.iter().map(|&x| bf16::from_f32(x).to_f32()).collect() } else { a }
    };
    let x = round(rng.normal_f32(n * d, 0.0, 1.0));
    let w = round(rng.normal_f32(v * d, 0.0, 0.3));
    let bias = rng.normal_f32(v, 0.0, 0.1);
    let targets: Vec<i64> =
        (0..n).map(|i| if i % 7 == 0 { -100 } else { rng.below(v as u64) as i64 }).collect();
    let mut inputs = Outputs::default();
    if dtype == DType::Bf16 {
        let b = |a: &[f32]| a.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
        inputs.bf16("x", &[n, d], &b(&x));
        inputs.bf16("w", &[v, d], &b(&w));
    } else {
        inputs.f32("x", &[n, d], &x);
        inputs.f32("w", &[v, d], &w);
    }
    inputs.i64("targets", &[n], &targets);
    inputs.f32("bias", &[v], &bias);
    (inputs, x, w, bias, targets, (n, d, v))
}

#[test]
fn ring_dtp_matches_the_f64_reference_in_f32_and_bf16() {
    let dir = TempDir::new("ring");
    for dtype in [DType::F32, DType::Bf16] {
        let (inputs, x, w, bias, targets, (n, d, v)) = ring_inputs(dtype);
        // bf16 with f32 GEMMs: exact against the reference fed the same (rounded) values.
        let config =
            r#"{"label_smoothing": 0.1, "z_loss": 0.001, "budget_bytes": 65536, "precision": "f32"}"#;
        let out = run_with(&dir, "ring-dtp", &inputs, Some(config)).expect("run");
        let lce = serde_json::from_str::<ring_dtp::RingDtpConfig>(config).expect("config").to_config();
        let want = ::ring_dtp::cpu::reference::run(
            &::ring_dtp::Inputs::new(::ring_dtp::Matrix::F32(&x), ::ring_dtp::Matrix::F32(&w), &targets, d)
                .with_bias(&bias),
            &lce,
            ::ring_dtp::GradOutput::Scalar(1.0),
            None,
        )
        .expect("reference");
        let loss = out.f64("loss", &[]).expect("scalar loss").0[0];
        assert!((loss - want.loss).abs() <= TOL * want.loss.abs(), "{dtype}: loss {loss} vs {}", want.loss);
        for (name, shape, reference) in [
            ("lse", vec![n], &want.lse),
            ("dx", vec![n, d], &want.dx),
            ("dw", vec![v, d], &want.dw),
            ("dbias", vec![v], &want.dbias),
        ] {
            let err = relative_error(&get(&out, name, &shape), reference);
            assert!(err <= TOL, "{dtype}: {name} error {err:e}");
        }
    }
}

#[test]
fn llep_matches_the_dense_reference_and_every_scheme_agrees() {
    let dir = TempDir::new("llep");
    let (p, n, h, i, e, k) = (4, 9, 8, 4, 8, 2);
    let mut rng = SplitMix64::new(5);
    let x = rng.normal_f32(p * n * h, 0.0, 1.0);
    // Every slot of the first token of each rank to expert 0: skewed, with duplicates.
    let ids: Vec<i64> =
        (0..p * n * k).map(|r| if (r / k) % n == 0 { 0 } else { rng.below(e as u64) as i64 }).collect();
    let weights = rng.uniform_f32(p * n * k, 0.1, 1.0);
    let gate = rng.normal_f32(e * h * i, 0.0, 0.3);
    let up = rng.normal_f32(e * h * i, 0.0, 0.3);
    let down = rng.normal_f32(e * i * h, 0.0, 0.3);
    let dy = rng.normal_f32(p * n * h, 0.0, 1.0);
    let mut inputs = Outputs::default();
    inputs.f32("x", &[p, n, h], &x);
    inputs.i64("ids", &[p, n, k], &ids);
    inputs.f32("weights", &[p, n, k], &weights);
    inputs.f32("gate", &[e, h, i], &gate);
    inputs.f32("up", &[e, h, i], &up);
    inputs.f32("down", &[e, i, h], &down);
    inputs.f32("dy", &[p, n, h], &dy);

    // The whole problem on one rank is the reference's shape.
    let shape = ::llep::Shape {
        ranks: 1,
        tokens: p * n,
        hidden: h,
        intermediate: i,
        experts: e,
        top_k: k,
        dtype: DType::F32,
    };
    let whole = ::llep::RankInputs {
        x: &x,
        routing: ::llep::Routing { ids: &ids, weights: &weights },
        experts: ::llep::ExpertWeights { gate: &gate, up: &up, down: &down },
    };
    let y_ref = ::llep::cpu::reference::forward(&shape, &whole).expect("reference");
    let g_ref = ::llep::cpu::reference::backward(&shape, &whole, &dy).expect("reference");
    for scheme in ["pipelined", "llep", "standard_ep"] {
        let config = format!(r#"{{"scheme": "{scheme}", "min_chunk": 2, "pair_cap_rows": 3}}"#);
        let out = run_with(&dir, "llep", &inputs, Some(&config)).expect("run");
        for (name, shape, reference) in [
            ("y", vec![p, n, h], &y_ref),
            ("dx", vec![p, n, h], &g_ref.dx),
            ("d_weights", vec![p, n, k], &g_ref.d_weights),
            ("d_gate", vec![e, h, i], &g_ref.d_gate),
            ("d_up", vec![e, h, i], &g_ref.d_up),
            ("d_down", vec![e, i, h], &g_ref.d_down),
        ] {
            let err = relative_error(&get(&out, name, &shape), reference);
            assert!(err <= TOL, "{scheme}: {name} error {err:e}");
        }
    }
    // Without dy: forward only.
    let mut forward_only = Outputs::default();
    for (name, shape, data) in [
        ("x", vec![p, n, h], &x),
        ("weights", vec![p, n, k], &weights),
        ("gate", vec![e, h, i], &gate),
        ("up", vec![e, h, i], &up),
        ("down", vec![e, i, h], &down),
    ] {
        forward_only.f32(name, &shape, data);
    }
    forward_only.i64("ids", &[p, n, k], &ids);
    let out = run_with(&dir, "llep", &forward_only, None).expect("forward only");
    assert!(!out.has("dx") && out.has("y"));
    assert!(relative_error(&get(&out, "y", &[p, n, h]), &y_ref) <= TOL);
}

/// BF16 tensors run the bf16 layer: its results are within twice the naive bf16 layer's error
/// (+ 1e-2) of the f64 reference on the same (bf16-valued) inputs; an expert tensor of another
/// dtype than x is a typed error naming it.
#[test]
fn llep_runs_bf16_tensors_as_the_bf16_layer() {
    let dir = TempDir::new("llep-bf16");
    let (p, n, h, i, e, k) = (2, 12, 16, 8, 4, 2);
    let mut rng = SplitMix64::new(8);
    let round = |v: Vec<f32>| -> (Vec<bf16>, Vec<f32>) {
        let b: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
        let w = b.iter().map(|x| x.to_f32()).collect();
        (b, w)
    };
    let (xb, x) = round(rng.normal_f32(p * n * h, 0.0, 1.0));
    let ids: Vec<i64> = (0..p * n * k).map(|_| rng.below(e as u64) as i64).collect();
    let weights = rng.uniform_f32(p * n * k, 0.1, 1.0);
    let (gb, gate) = round(rng.normal_f32(e * h * i, 0.0, 0.3));
    let (ub, up) = round(rng.normal_f32(e * h * i, 0.0, 0.3));
    let (db, down) = round(rng.normal_f32(e * i * h, 0.0, 0.3));
    let (dyb, dy) = round(rng.normal_f32(p * n * h, 0.0, 1.0));
    let mut inputs = Outputs::default();
    inputs.bf16("x", &[p, n, h], &xb);
    inputs.i64("ids", &[p, n, k], &ids);
    inputs.f32("weights", &[p, n, k], &weights);
    inputs.bf16("gate", &[e, h, i], &gb);
    inputs.bf16("up", &[e, h, i], &ub);
    inputs.bf16("down", &[e, i, h], &db);
    inputs.bf16("dy", &[p, n, h], &dyb);
    let out = run_with(&dir, "llep", &inputs, Some(r#"{"min_chunk": 2}"#)).expect("bf16 run");

    let shape = ::llep::Shape {
        ranks: 1,
        tokens: p * n,
        hidden: h,
        intermediate: i,
        experts: e,
        top_k: k,
        dtype: DType::F32,
    };
    let whole = ::llep::RankInputs {
        x: &x,
        routing: ::llep::Routing { ids: &ids, weights: &weights },
        experts: ::llep::ExpertWeights { gate: &gate, up: &up, down: &down },
    };
    use ::llep::cpu::reference;
    let (y_ref, g_ref) =
        (reference::forward(&shape, &whole).unwrap(), reference::backward(&shape, &whole, &dy).unwrap());
    let y_naive = reference::naive_bf16_forward(&shape, &whole).unwrap();
    let g_naive = reference::naive_bf16_backward(&shape, &whole, &dy).unwrap();
    let narrow = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<f32>>();
    for (name, dims, naive, want) in [
        ("y", vec![p, n, h], narrow(&y_naive), &y_ref),
        ("dx", vec![p, n, h], narrow(&g_naive.dx), &g_ref.dx),
        ("d_gate", vec![e, h, i], narrow(&g_naive.d_gate), &g_ref.d_gate),
        ("d_down", vec![e, i, h], narrow(&g_naive.d_down), &g_ref.d_down),
    ] {
        let (err, naive_err) = (relative_error(&get(&out, name, &dims), want), relative_error(&naive, want));
        assert!(
            naive_err > 1e-4 && err <= 2.0 * naive_err + 1e-2,
            "{name}: {err:.3e} against naive {naive_err:.3e}"
        );
    }

    let mut mixed = Outputs::default();
    mixed.bf16("x", &[p, n, h], &xb);
    mixed.i64("ids", &[p, n, k], &ids);
    mixed.f32("weights", &[p, n, k], &weights);
    mixed.bf16("gate", &[e, h, i], &gb);
    mixed.f32("up", &[e, h, i], &up);
    mixed.bf16("down", &[e, i, h], &db);
    match run_with(&dir, "llep", &mixed, None) {
        Err(RunError::WrongDtype { name, expected, found }) => {
            assert_eq!((name.as_str(), found.as_str()), ("up", "F32"));
            assert!(expected.contains("BF16"), "{expected}");
        }
        other => panic!("expected WrongDtype for up, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn llep_reports_the_error_of_the_rank_that_failed_not_its_peers_loss() {
    let dir = TempDir::new("llep-bad-rank");
    let (p, n, h, i, e, k) = (4, 5, 8, 4, 8, 2);
    let mut rng = SplitMix64::new(6);
    let mut ids: Vec<i64> = (0..p * n * k).map(|_| rng.below(e as u64) as i64).collect();
    ids[n * k + 3] = e as i64; // one bad expert id, on rank 1
    let mut inputs = Outputs::default();
    inputs.f32("x", &[p, n, h], &rng.normal_f32(p * n * h, 0.0, 1.0));
    inputs.i64("ids", &[p, n, k], &ids);
    inputs.f32("weights", &[p, n, k], &rng.uniform_f32(p * n * k, 0.1, 1.0));
    inputs.f32("gate", &[e, h, i], &rng.normal_f32(e * h * i, 0.0, 0.3));
    inputs.f32("up", &[e, h, i], &rng.normal_f32(e * h * i, 0.0, 0.3));
    inputs.f32("down", &[e, i, h], &rng.normal_f32(e * i * h, 0.0, 0.3));
    let err = run_with(&dir, "llep", &inputs, None).expect_err("a bad expert id");
    let message = err.to_string();
    assert!(!message.contains("was lost"), "{message}");
    assert!(message.contains(&e.to_string()), "names the bad id: {message}");
}

#[test]
fn sco_offload_equals_no_checkpointing_bitwise_and_matches_the_formula() {
    let dir = TempDir::new("sco");
    let (s, h, i, l) = (6, 4, 5, 3);
    let mut rng = SplitMix64::new(9);
    let x = rng.normal_f32(s * h, 0.0, 1.0);
    let w1 = rng.normal_f32(l * h * i, 0.0, 0.5);
    let w2 = rng.normal_f32(l * i * h, 0.0, 0.5);
    let dy = rng.normal_f32(s * h, 0.0, 1.0);
    let mut inputs = Outputs::default();
    inputs.f32("x", &[s, h], &x);
    inputs.f32("w1", &[l, h, i], &w1);
    inputs.f32("w2", &[l, i, h], &w2);
    inputs.f32("dy", &[s, h], &dy);
    let offload = run_with(&dir, "sco", &inputs, None).expect("offload");
    let plain = run_with(&dir, "sco", &inputs, Some(r#"{"checkpointing": "off"}"#)).expect("off");
    for (name, shape) in
        [("y", vec![s, h]), ("dx", vec![s, h]), ("dw1", vec![l, h, i]), ("dw2", vec![l, i, h])]
    {
        assert_eq!(get(&offload, name, &shape), get(&plain, name, &shape), "{name}");
    }
    // y = x + relu(x·W1)·W2, layer by layer, in f64.
    let mut a: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    for j in 0..l {
        let (w1, w2) = (&w1[j * h * i..(j + 1) * h * i], &w2[j * i * h..(j + 1) * i * h]);
        let mut next = a.clone();
        for t in 0..s {
            let hidden: Vec<f64> = (0..i)
                .map(|q| (0..h).map(|c| a[t * h + c] * w1[c * i + q] as f64).sum::<f64>().max(0.0))
                .collect();
            for c in 0..h {
                next[t * h + c] += (0..i).map(|q| hidden[q] * w2[q * h + c] as f64).sum::<f64>();
            }
        }
        a = next;
    }
    assert!(relative_error(&get(&offload, "y", &[s, h]), &a) <= TOL);
}

#[test]
fn stream_adamw_is_one_torch_adamw_step() {
    let dir = TempDir::new("adamw");
    let n = 1000;
    let mut rng = SplitMix64::new(2);
    let param = rng.normal_f32(n, 0.0, 1.0);
    let grad = rng.normal_f32(n, 0.0, 0.1);
    let (m0, v0) = (rng.normal_f32(n, 0.0, 0.01), rng.uniform_f32(n, 0.0, 0.01));
    let mut inputs = Outputs::default();
    inputs.f32("param", &[n], &param);
    inputs.f32("grad", &[n], &grad);
    inputs.f32("exp_avg", &[n], &m0);
    inputs.f32("exp_avg_sq", &[n], &v0);
    inputs.i64("step", &[], &[4]);
    let config = r#"{"lr": 0.01, "weight_decay": 0.1, "bucket_elems": 128}"#;
    let out = run_with(&dir, "stream-adamw", &inputs, Some(config)).expect("run");
    let (lr, b1, b2, eps, wd, t) = (0.01f64, 0.9f64, 0.999f64, 1e-8f64, 0.1f64, 5i32);
    let (mut want_p, mut want_m, mut want_v) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
    for j in 0..n {
        let g = grad[j] as f64;
        want_m[j] = b1 * m0[j] as f64 + (1.0 - b1) * g;
        want_v[j] = b2 * v0[j] as f64 + (1.0 - b2) * g * g;
        let denom = want_v[j].sqrt() / (1.0 - b2.powi(t)).sqrt() + eps;
        want_p[j] = param[j] as f64 * (1.0 - lr * wd) - lr / (1.0 - b1.powi(t)) * want_m[j] / denom;
    }
    assert!(relative_error(&get(&out, "param", &[n]), &want_p) <= TOL);
    assert!(relative_error(&get(&out, "exp_avg", &[n]), &want_m) <= TOL);
    assert!(relative_error(&get(&out, "exp_avg_sq", &[n]), &want_v) <= TOL);
    assert_eq!(out.i64("step", &[]).expect("step").0, vec![5]);
    assert_eq!(out.i64("skipped", &[]).expect("skipped").0, vec![0]);
}

#[test]
fn bad_inputs_name_the_tensor_and_what_was_expected() {
    let dir = TempDir::new("bad");
    let (good, ..) = ring_inputs(DType::F32);
    let write_without = |skip: &str, replace: Option<(&str, &[usize], &[f32])>| {
        let (_, x, w, bias, targets, (n, d, v)) = ring_inputs(DType::F32);
        let mut inputs = Outputs::default();
        for (name, shape, data) in [("x", vec![n, d], &x), ("w", vec![v, d], &w), ("bias", vec![v], &bias)] {
            if name == skip {
                continue;
            }
            match replace {
                Some((r, s, dd)) if r == name => inputs.f32(name, s, dd),
                _ => inputs.f32(name, &shape, data),
            }
        }
        if skip != "targets" {
            inputs.i64("targets", &[n], &targets);
        }
        inputs
    };
    let err = run_with(&dir, "ring-dtp", &write_without("targets", None), None).expect_err("missing");
    assert!(matches!(&err, RunError::MissingTensor { name, .. } if name == "targets"), "{err}");
    assert!(err.to_string().contains("I64 [37]"), "{err}");
    let short = vec![0.0f32; 53 * 15];
    let err = run_with(&dir, "ring-dtp", &write_without("", Some(("w", &[53, 15], &short))), None)
        .expect_err("shape");
    assert!(
        matches!(&err, RunError::WrongShape { name, found, .. } if name == "w" && found == &vec![53, 15]),
        "{err}"
    );
    let mut wrong_dtype = Outputs::default();
    wrong_dtype.f32("param", &[4], &[1.0; 4]);
    wrong_dtype.i64("grad", &[4], &[1; 4]);
    let err = run_with(&dir, "stream-adamw", &wrong_dtype, None).expect_err("dtype");
    assert!(
        matches!(&err, RunError::WrongDtype { name, found, .. } if name == "grad" && found == "I64"),
        "{err}"
    );
    let err = run_with(&dir, "ring-dtp", &good, Some(r#"{"reduktion": "sum"}"#)).expect_err("config");
    assert!(matches!(&err, RunError::Config { message, .. } if message.contains("reduktion")), "{err}");
    let err = run_with(&dir, "ring-dtp", &good, Some(r#"{"reduction": "average"}"#)).expect_err("config");
    assert!(matches!(&err, RunError::Config { message, .. } if message.contains("average")), "{err}");
    let err = run_with(&dir, "flash-attention", &good, None).expect_err("component");
    assert!(matches!(err, RunError::UnknownComponent(_)));
    // A target out of range is the crate's own typed error.
    let (_, x, w, _, mut targets, (n, d, v)) = ring_inputs(DType::F32);
    targets[3] = v as i64;
    let mut bad_target = Outputs::default();
    bad_target.f32("x", &[n, d], &x);
    bad_target.f32("w", &[v, d], &w);
    bad_target.i64("targets", &[n], &targets);
    let err = run_with(&dir, "ring-dtp", &bad_target, None).expect_err("target");
    assert!(matches!(err, RunError::RingDtp(::ring_dtp::Error::TargetOutOfRange { token: 3, .. })), "{err}");
    // A grad_scale valid in f64 but ∞ or 0 in the kernel's f32 is refused, nothing written.
    let mut adamw = Outputs::default();
    adamw.f32("param", &[4], &[1.0; 4]);
    adamw.f32("grad", &[4], &[0.5; 4]);
    for scale in ["1e39", "1e-46"] {
        let config = format!(r#"{{"grad_scale": {scale}}}"#);
        let err = run_with(&dir, "stream-adamw", &adamw, Some(&config)).expect_err("grad_scale");
        assert!(err.to_string().contains("grad_scale"), "{scale}: {err}");
    }
    // A shift past the tokens ignores every row (it wrapped to other rows' targets before).
    let out =
        run_with(&dir, "ring-dtp", &good, Some(r#"{"shift": 18446744073709551615, "reduction": "sum"}"#))
            .expect("shift past the end");
    assert_eq!(out.f64("loss", &[]).expect("scalar loss").0, vec![0.0]);
}

/// One small valid run per component, laid out as the `run_inputs` fuzz target reads its input
/// (`[component][config length: u16 LE][config JSON][safetensors]`): each must run. With
/// `FLATPEAK_WRITE_FUZZ_SEEDS=<dir>` they are also written there as the fuzzer's seed corpus.
#[test]
fn fuzz_seeds_run() {
    let mut rng = SplitMix64::new(11);
    let mut seeds: Vec<(u8, &str, Outputs)> = Vec::new();
    let (ring, ..) = ring_inputs(DType::F32);
    seeds.push((0, r#"{"label_smoothing": 0.1, "budget_bytes": 65536}"#, ring));
    let (p, n, h, i, e, k) = (2, 3, 4, 2, 4, 2);
    let mut llep = Outputs::default();
    llep.f32("x", &[p, n, h], &rng.normal_f32(p * n * h, 0.0, 1.0));
    let ids: Vec<i64> = (0..p * n * k).map(|r| (r % e) as i64).collect();
    llep.i64("ids", &[p, n, k], &ids);
    llep.f32("weights", &[p, n, k], &rng.uniform_f32(p * n * k, 0.1, 1.0));
    llep.f32("gate", &[e, h, i], &rng.normal_f32(e * h * i, 0.0, 0.3));
    llep.f32("up", &[e, h, i], &rng.normal_f32(e * h * i, 0.0, 0.3));
    llep.f32("down", &[e, i, h], &rng.normal_f32(e * i * h, 0.0, 0.3));
    llep.f32("dy", &[p, n, h], &rng.normal_f32(p * n * h, 0.0, 1.0));
    seeds.push((1, "", llep));
    let (s, h, i, l) = (3, 2, 3, 2);
    let mut sco = Outputs::default();
    sco.f32("x", &[s, h], &rng.normal_f32(s * h, 0.0, 1.0));
    sco.f32("w1", &[l, h, i], &rng.normal_f32(l * h * i, 0.0, 0.5));
    sco.f32("w2", &[l, i, h], &rng.normal_f32(l * i * h, 0.0, 0.5));
    sco.f32("dy", &[s, h], &rng.normal_f32(s * h, 0.0, 1.0));
    seeds.push((2, "", sco));
    let n = 100;
    let mut adam = Outputs::default();
    adam.f32("param", &[n], &rng.normal_f32(n, 0.0, 1.0));
    adam.f32("grad", &[n], &rng.normal_f32(n, 0.0, 0.1));
    adam.f32("exp_avg", &[n], &rng.normal_f32(n, 0.0, 0.01));
    adam.f32("exp_avg_sq", &[n], &rng.uniform_f32(n, 0.0, 0.01));
    adam.i64("step", &[], &[4]);
    seeds.push((3, r#"{"lr": 0.01, "bucket_elems": 64}"#, adam));
    let out_dir = std::env::var_os("FLATPEAK_WRITE_FUZZ_SEEDS").map(PathBuf::from);
    for (component, config, tensors) in seeds {
        let name = ["ring-dtp", "llep", "sco", "stream-adamw"][usize::from(component)];
        let bytes = tensors.to_bytes(Path::new("seed")).expect("serialize");
        let parsed = TensorFile::parse(&bytes, Path::new("seed")).expect("parse");
        let cfg = (!config.is_empty()).then_some((config, Path::new("config.json")));
        run_parsed(name, &parsed, cfg).unwrap_or_else(|e| panic!("{name}: {e}"));
        if let Some(dir) = &out_dir {
            let mut seed = vec![component];
            seed.extend_from_slice(&(config.len() as u16).to_le_bytes());
            seed.extend_from_slice(config.as_bytes());
            seed.extend_from_slice(&bytes);
            std::fs::create_dir_all(dir).expect("seed dir");
            std::fs::write(dir.join(format!("seed-{name}")), seed).expect("write seed");
        }
    }
}
