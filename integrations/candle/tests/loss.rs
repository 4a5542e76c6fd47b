//! The fused op against candle's own `cross_entropy(x.matmul(&w.t()))`: loss and gradients on
//! the same inputs, f32, vocabularies that no block divides, ignored targets masked by hand on
//! candle's side.

use candle_core::{D, DType, Device, Tensor, Var};
use flatpeak_candle::{
    Extras, LossOptions, Reduction, Softcap, linear_cross_entropy, linear_cross_entropy_with,
};
use flatpeak_common::SplitMix64;

const IGNORE: i64 = -100;

/// ‖a − b‖ / ‖b‖ over every element.
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let diff = (&a - &b).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap().sqrt();
    let norm = b.sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap().sqrt();
    diff / norm.max(f64::MIN_POSITIVE)
}

struct Case {
    x: Var,
    w: Var,
    bias: Option<Var>,
    targets: Tensor,
    targets_vec: Vec<i64>,
}

/// Inputs with `ignored` of every 7 tokens set to the ignore index (0: none).
fn case(n: usize, d: usize, v: usize, ignored: usize, bias: bool, seed: u64) -> Case {
    let dev = Device::Cpu;
    let mut rng = SplitMix64::new(seed);
    let x = Var::from_vec(rng.normal_f32(n * d, 0.0, 1.0), (n, d), &dev).unwrap();
    let w = Var::from_vec(rng.normal_f32(v * d, 0.0, 0.2), (v, d), &dev).unwrap();
    let bias = bias.then(|| Var::from_vec(rng.normal_f32(v, 0.0, 0.5), v, &dev).unwrap());
    let targets_vec: Vec<i64> = (0..n)
        .map(|i| if i % 7 < ignored { IGNORE } else { ((i as u64 * 2654435761 + seed) % v as u64) as i64 })
        .collect();
    let targets = Tensor::new(targets_vec.as_slice(), &dev).unwrap();
    Case { x, w, bias, targets, targets_vec }
}

/// candle's materialized loss: per-token `-log_softmax(x·Wᵀ + b)[target]`, ignored rows masked
/// to 0 (candle's `cross_entropy` has no ignore index), then reduced.
fn candle_reference(c: &Case, reduction: Reduction, token_weights: Option<&Tensor>) -> Tensor {
    let mut logits = c.x.as_tensor().matmul(&c.w.as_tensor().t().unwrap()).unwrap();
    if let Some(b) = &c.bias {
        logits = logits.broadcast_add(b.as_tensor()).unwrap();
    }
    let log_probs = candle_nn::ops::log_softmax(&logits, D::Minus1).unwrap();
    let safe: Vec<u32> = c.targets_vec.iter().map(|&t| if t == IGNORE { 0 } else { t as u32 }).collect();
    let mask: Vec<f32> = c.targets_vec.iter().map(|&t| if t == IGNORE { 0.0 } else { 1.0 }).collect();
    let n = safe.len();
    let idx = Tensor::from_vec(safe, (n, 1), &Device::Cpu).unwrap();
    let mut mask = Tensor::from_vec(mask, n, &Device::Cpu).unwrap();
    if let Some(w) = token_weights {
        mask = (mask * w).unwrap();
    }
    let per_token = (log_probs.gather(&idx, 1).unwrap().squeeze(1).unwrap().neg().unwrap() * &mask).unwrap();
    match reduction {
        Reduction::None => per_token,
        Reduction::Sum => per_token.sum_all().unwrap(),
        Reduction::Mean => (per_token.sum_all().unwrap()
            / mask.sum_all().unwrap().to_scalar::<f32>().unwrap() as f64)
            .unwrap(),
    }
}

/// A scalar to differentiate: the loss itself, or Σ uᵢ·ℓᵢ with a non-uniform upstream for none.
fn objective(loss: &Tensor, reduction: Reduction) -> Tensor {
    match reduction {
        Reduction::None => {
            let n = loss.dims()[0];
            let u = Tensor::arange(0f32, n as f32, loss.device()).unwrap().affine(0.01, 0.5).unwrap();
            (loss * u).unwrap().sum_all().unwrap()
        }
        _ => loss.clone(),
    }
}

fn compare(c: &Case, options: &LossOptions, token_weights: Option<&Tensor>, label: &str) {
    let reduction = options.config.reduction;
    let extras = Extras { bias: c.bias.as_ref().map(|b| b.as_tensor()), token_weights };
    let fused =
        linear_cross_entropy_with(c.x.as_tensor(), c.w.as_tensor(), &c.targets, extras, options).unwrap();
    let reference = candle_reference(c, reduction, token_weights);
    assert_eq!(fused.dims(), reference.dims(), "{label}: loss shape");
    let loss_err = rel(&fused, &reference);
    assert!(loss_err <= 1e-5, "{label}: loss relative error {loss_err:e}");

    let g_fused = objective(&fused, reduction).backward().unwrap();
    let g_ref = objective(&reference, reduction).backward().unwrap();
    let dx_err = rel(g_fused.get(c.x.as_tensor()).unwrap(), g_ref.get(c.x.as_tensor()).unwrap());
    let dw_err = rel(g_fused.get(c.w.as_tensor()).unwrap(), g_ref.get(c.w.as_tensor()).unwrap());
    assert!(dx_err <= 1e-5, "{label}: dX relative error {dx_err:e}");
    assert!(dw_err <= 1e-4, "{label}: dW relative error {dw_err:e}");
    if let Some(b) = &c.bias {
        let db_err = rel(g_fused.get(b.as_tensor()).unwrap(), g_ref.get(b.as_tensor()).unwrap());
        assert!(db_err <= 1e-4, "{label}: dbias relative error {db_err:e}");
    }
}

#[test]
fn matches_candle_cross_entropy_over_shapes_reductions_and_ignored_targets() {
    // V prime or odd, so no vocabulary block divides it; small budgets force many blocks.
    let shapes = [(37, 24, 1009, 16 << 10), (128, 64, 4099, 64 << 10), (200, 48, 2053, 4 << 20)];
    for (i, &(n, d, v, budget)) in shapes.iter().enumerate() {
        for ignored in [0, 2] {
            for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
                let c = case(n, d, v, ignored, false, i as u64 * 10 + ignored as u64);
                let options = LossOptions::default().reduction(reduction).budget_bytes(budget);
                compare(&c, &options, None, &format!("N={n} D={d} V={v} ignored={ignored}/7 {reduction:?}"));
            }
        }
    }
}

#[test]
fn bias_and_token_weights() {
    let c = case(96, 32, 1031, 1, true, 5);
    let weights = Tensor::arange(0f32, 96.0, &Device::Cpu).unwrap().affine(1.0 / 48.0, 0.25).unwrap();
    for reduction in [Reduction::Mean, Reduction::None] {
        let options = LossOptions::default().reduction(reduction).budget_bytes(32 << 10);
        compare(&c, &options, None, &format!("bias {reduction:?}"));
        compare(&c, &options, Some(&weights), &format!("bias + token weights {reduction:?}"));
    }
}

#[test]
fn batched_input_and_u32_targets() {
    let c = case(48, 16, 517, 0, false, 9);
    let options = LossOptions::default().reduction(Reduction::None);
    let flat = linear_cross_entropy(c.x.as_tensor(), c.w.as_tensor(), &c.targets, &options).unwrap();
    let x3 = c.x.as_tensor().reshape((4, 12, 16)).unwrap();
    let t3 = c.targets.to_dtype(DType::U32).unwrap().reshape((4, 12)).unwrap();
    let batched = linear_cross_entropy(&x3, c.w.as_tensor(), &t3, &options).unwrap();
    assert_eq!(batched.dims(), &[4, 12]);
    assert_eq!(batched.flatten_all().unwrap().to_vec1::<f32>().unwrap(), flat.to_vec1::<f32>().unwrap());
    // The gradient flows back through the reshape to the [B, S, D] input.
    let x3 = Var::from_tensor(&x3).unwrap();
    let loss = linear_cross_entropy(x3.as_tensor(), c.w.as_tensor(), &t3, &LossOptions::default()).unwrap();
    let grads = loss.backward().unwrap();
    assert_eq!(grads.get(x3.as_tensor()).unwrap().dims(), &[4, 12, 16]);
}

#[test]
fn smoothing_z_loss_and_softcap_follow_their_formulas() {
    // label smoothing α, z-loss λ and softcap c against the composed candle formula:
    // z = c·tanh(u/c), ℓ = (1−α)(lse − z_t) + α(lse − mean(z)) + λ·lse².
    let c = case(64, 32, 701, 0, false, 3);
    let (alpha, lambda, cap) = (0.1f32, 1e-3f32, 5.0f32);
    let options = LossOptions::default().label_smoothing(alpha).z_loss(lambda).softcap(Softcap::Tanh { cap });
    let fused = linear_cross_entropy(c.x.as_tensor(), c.w.as_tensor(), &c.targets, &options).unwrap();
    let u = c.x.as_tensor().matmul(&c.w.as_tensor().t().unwrap()).unwrap();
    let z = ((u / cap as f64).unwrap().tanh().unwrap() * cap as f64).unwrap();
    let lse = z.exp().unwrap().sum(1).unwrap().log().unwrap();
    let idx =
        Tensor::from_vec(c.targets_vec.iter().map(|&t| t as u32).collect::<Vec<_>>(), (64, 1), &Device::Cpu)
            .unwrap();
    let z_t = z.gather(&idx, 1).unwrap().squeeze(1).unwrap();
    let z_mean = z.mean(1).unwrap();
    let per_token = ((((&lse - &z_t).unwrap() * (1.0 - alpha) as f64).unwrap()
        + ((&lse - &z_mean).unwrap() * alpha as f64).unwrap())
    .unwrap()
        + (lse.sqr().unwrap() * lambda as f64).unwrap())
    .unwrap();
    let reference = per_token.mean_all().unwrap();
    let err = rel(&fused, &reference);
    assert!(err <= 1e-5, "loss relative error {err:e}");
    let dw_err = rel(
        fused.backward().unwrap().get(c.w.as_tensor()).unwrap(),
        reference.backward().unwrap().get(c.w.as_tensor()).unwrap(),
    );
    assert!(dw_err <= 1e-4, "dW relative error {dw_err:e}");
}

#[test]
fn bf16_inputs_give_bf16_gradients_close_to_the_f32_loss() {
    let c = case(64, 32, 509, 1, false, 11);
    let (xb, wb) =
        (c.x.as_tensor().to_dtype(DType::BF16).unwrap(), c.w.as_tensor().to_dtype(DType::BF16).unwrap());
    let (xb, wb) = (Var::from_tensor(&xb).unwrap(), Var::from_tensor(&wb).unwrap());
    let loss =
        linear_cross_entropy(xb.as_tensor(), wb.as_tensor(), &c.targets, &LossOptions::default()).unwrap();
    assert_eq!(loss.dtype(), DType::F32);
    // The f32 loss of the same (bf16-rounded) inputs: the op accumulates in f32.
    let rounded = Case {
        x: Var::from_tensor(&xb.as_tensor().to_dtype(DType::F32).unwrap()).unwrap(),
        w: Var::from_tensor(&wb.as_tensor().to_dtype(DType::F32).unwrap()).unwrap(),
        bias: None,
        targets: c.targets.clone(),
        targets_vec: c.targets_vec.clone(),
    };
    let reference = candle_reference(&rounded, Reduction::Mean, None);
    assert!(rel(&loss, &reference) <= 1e-5);
    let grads = loss.backward().unwrap();
    let dw = grads.get(wb.as_tensor()).unwrap();
    assert_eq!(dw.dtype(), DType::BF16);
    let dw_ref = reference.backward().unwrap();
    assert!(rel(dw, dw_ref.get(rounded.w.as_tensor()).unwrap()) <= 1e-2);
}

#[test]
fn bad_input_is_an_error_naming_the_values() {
    let c = case(16, 8, 100, 0, false, 1);
    let (x, w, t) = (c.x.as_tensor(), c.w.as_tensor(), &c.targets);
    let opts = LossOptions::default();
    let message = |r: candle_core::Result<Tensor>| r.unwrap_err().to_string();

    let w_wrong = Tensor::zeros((100, 9), DType::F32, &Device::Cpu).unwrap();
    assert!(
        message(linear_cross_entropy(x, &w_wrong, t, &opts))
            .contains("weight: expected shape [V, 8], got [100, 9]")
    );
    let t_short = Tensor::zeros(15, DType::I64, &Device::Cpu).unwrap();
    assert!(
        message(linear_cross_entropy(x, w, &t_short, &opts))
            .contains("targets: expected shape [16], got [15]")
    );
    let w_bf16 = w.to_dtype(DType::BF16).unwrap();
    assert!(
        message(linear_cross_entropy(x, &w_bf16, t, &opts))
            .contains("weight: expected input's dtype, got BF16")
    );
    let t_float = Tensor::zeros(16, DType::F32, &Device::Cpu).unwrap();
    assert!(
        message(linear_cross_entropy(x, w, &t_float, &opts)).contains("targets: expected i64, u32 or i32")
    );
    let x_f64 = x.to_dtype(DType::F64).unwrap();
    assert!(message(linear_cross_entropy(&x_f64, w, t, &opts)).contains("input: expected f32 or bf16"));
    let x_1d = Tensor::zeros(8, DType::F32, &Device::Cpu).unwrap();
    assert!(
        message(linear_cross_entropy(&x_1d, w, &t.narrow(0, 0, 1).unwrap(), &opts))
            .contains("input: expected shape [N, D]")
    );

    // ring-dtp's own errors keep their message: a target outside the vocabulary, a bad option.
    let mut bad = c.targets_vec.clone();
    bad[3] = 100;
    let t_bad = Tensor::new(bad.as_slice(), &Device::Cpu).unwrap();
    let m = message(linear_cross_entropy(x, w, &t_bad, &opts));
    assert!(m.contains("100"), "{m}");
    let m = message(linear_cross_entropy(x, w, t, &opts.label_smoothing(1.5)));
    assert!(m.contains("label_smoothing") && m.contains("1.5"), "{m}");
    let m = message(linear_cross_entropy(x, w, t, &opts.budget_bytes(0)));
    assert!(!m.is_empty());
}

/// The CUDA path against the CPU path on the same inputs (feature `cuda`, on a machine with a
/// GPU; without one it says so and checks nothing).
#[cfg(feature = "cuda")]
#[test]
fn cuda_matches_cpu() {
    let Ok(gpu) = Device::new_cuda(0) else {
        eprintln!("cuda_matches_cpu: no CUDA device, nothing checked");
        return;
    };
    let c = case(300, 64, 4099, 2, true, 21);
    for dtype in [DType::F32, DType::BF16] {
        for reduction in [Reduction::Mean, Reduction::None] {
            let options = LossOptions::default().reduction(reduction).budget_bytes(256 << 10);
            let on = |dev: &Device| {
                let x = Var::from_tensor(&c.x.as_tensor().to_dtype(dtype).unwrap().to_device(dev).unwrap())
                    .unwrap();
                let w = Var::from_tensor(&c.w.as_tensor().to_dtype(dtype).unwrap().to_device(dev).unwrap())
                    .unwrap();
                let b =
                    Var::from_tensor(&c.bias.as_ref().unwrap().as_tensor().to_device(dev).unwrap()).unwrap();
                let t = c.targets.to_device(dev).unwrap();
                let extras = Extras { bias: Some(b.as_tensor()), token_weights: None };
                let loss =
                    linear_cross_entropy_with(x.as_tensor(), w.as_tensor(), &t, extras, &options).unwrap();
                let grads = objective(&loss, reduction).backward().unwrap();
                let cpu = |v: &Var| grads.get(v.as_tensor()).unwrap().to_device(&Device::Cpu).unwrap();
                (loss.to_device(&Device::Cpu).unwrap(), cpu(&x), cpu(&w), cpu(&b))
            };
            let (gpu_out, cpu_out) = (on(&gpu), on(&Device::Cpu));
            let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
            for (what, a, b) in [
                ("loss", &gpu_out.0, &cpu_out.0),
                ("dX", &gpu_out.1, &cpu_out.1),
                ("dW", &gpu_out.2, &cpu_out.2),
                ("dbias", &gpu_out.3, &cpu_out.3),
            ] {
                let err = rel(a, b);
                assert!(err <= tol, "{dtype:?} {reduction:?} {what}: CUDA vs CPU relative error {err:e}");
            }
        }
    }
}
