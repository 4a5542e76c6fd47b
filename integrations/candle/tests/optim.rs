//! `StreamAdamW` against `candle_nn::AdamW`: a 20-step training loop of a tiny model, and the
//! step's guarantees (skip on a non-finite gradient, untouched Vars on bad input).
//!
//! candle's AdamW and torch's (which stream-adamw follows) compute the same update: m̂/(√v̂ + ε)
//! with v̂ = v/(1−β2^t) equals torch's m/(√v/√(1−β2^t) + ε)·1/(1−β1^t) in exact arithmetic,
//! and their defaults agree (lr 1e-3, β (0.9, 0.999), ε 1e-8, weight decay 0.01). They differ
//! in rounding (torch's order: lerp, addcmul, addcdiv), in candle's step count being one per
//! optimizer rather than one per parameter (equal here: every parameter has a gradient at every
//! step), and in candle having no AMSGrad, maximize, clipping or non-finite skip.

use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW};
use flatpeak_candle::{
    GradClip, Hyperparameters, LossOptions, StepOutcome, StreamAdamW, linear_cross_entropy,
};
use flatpeak_common::SplitMix64;

const VOCAB_IN: usize = 50;
const HIDDEN: usize = 16;
const VOCAB_OUT: usize = 203;
const TOKENS: usize = 64;

/// embedding → linear → tanh → the vocabulary projection.
struct Model {
    embedding: Var,
    linear: Var,
    head: Var,
}

impl Model {
    fn new(seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed);
        let mut var = |rows, cols, std| {
            Var::from_vec(rng.normal_f32(rows * cols, 0.0, std), (rows, cols), &Device::Cpu).unwrap()
        };
        Self {
            embedding: var(VOCAB_IN, HIDDEN, 1.0),
            linear: var(HIDDEN, HIDDEN, 0.3),
            head: var(VOCAB_OUT, HIDDEN, 0.2),
        }
    }
    fn vars(&self) -> Vec<Var> {
        vec![self.embedding.clone(), self.linear.clone(), self.head.clone()]
    }
    fn hidden(&self, ids: &Tensor) -> Tensor {
        self.embedding
            .as_tensor()
            .embedding(ids)
            .unwrap()
            .matmul(self.linear.as_tensor())
            .unwrap()
            .tanh()
            .unwrap()
    }
}

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let diff = (a - b).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64;
    let norm = b.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap() as f64;
    (diff / norm).sqrt()
}

#[test]
fn twenty_steps_track_candle_adamw_with_candle_loss() {
    let mut rng = SplitMix64::new(42);
    let ids: Vec<u32> = (0..TOKENS).map(|_| rng.below(VOCAB_IN as u64) as u32).collect();
    let targets: Vec<u32> = (0..TOKENS).map(|_| rng.below(VOCAB_OUT as u64) as u32).collect();
    let ids = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
    let targets_u32 = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
    let targets_i64 = targets_u32.to_dtype(DType::I64).unwrap();

    // ε = 1e-6, not the default 1e-8: Adam's first step is g/(|g| + ε), a sign for |g| ≫ ε. Some
    // dW entries cancel over the tokens to |g| ~ 1e-8, where the two losses' last-bit
    // differences flip that sign (±lr: 4.5e-5 relative at step 1 with ε = 1e-8). With ε = 1e-6
    // those entries are in the linear regime. The optimizer alone, at the default ε, is
    // `optimizer_alone_tracks_candle_adamw_at_default_hyperparameters`.
    let (lr, weight_decay, eps) = (1e-2, 0.01, 1e-6);
    let candle_model = Model::new(7);
    let fused_model = Model::new(7);
    let params = ParamsAdamW { lr, weight_decay, eps, ..ParamsAdamW::default() };
    let mut candle_opt = AdamW::new(candle_model.vars(), params).unwrap();
    let hyperparameters = Hyperparameters::default().lr(lr).weight_decay(weight_decay).eps(eps);
    let mut fused_opt = StreamAdamW::new(fused_model.vars(), hyperparameters).unwrap();

    let mut worst = 0f64;
    for step in 1..=20 {
        let logits = candle_model.hidden(&ids).matmul(&candle_model.head.as_tensor().t().unwrap()).unwrap();
        let candle_loss = candle_nn::loss::cross_entropy(&logits, &targets_u32).unwrap();
        candle_opt.backward_step(&candle_loss).unwrap();

        let fused_loss = linear_cross_entropy(
            &fused_model.hidden(&ids),
            fused_model.head.as_tensor(),
            &targets_i64,
            &LossOptions::default(),
        )
        .unwrap();
        let report = fused_opt.step_report(&fused_loss.backward().unwrap()).unwrap();
        assert_eq!((report.outcome, report.updated), (StepOutcome::Applied, 3));

        let loss_err = rel(&fused_loss, &candle_loss);
        assert!(loss_err <= 1e-5, "step {step}: loss relative difference {loss_err:e}");
        for (name, a, b) in [
            ("embedding", &fused_model.embedding, &candle_model.embedding),
            ("linear", &fused_model.linear, &candle_model.linear),
            ("head", &fused_model.head, &candle_model.head),
        ] {
            let err = rel(a.as_tensor(), b.as_tensor());
            assert!(err <= 1e-5, "step {step}: {name} relative difference {err:e}");
            worst = worst.max(err);
        }
    }
    // The loop trained: the fused model's loss fell.
    let last = linear_cross_entropy(
        &fused_model.hidden(&ids),
        fused_model.head.as_tensor(),
        &targets_i64,
        &LossOptions::default(),
    )
    .unwrap()
    .to_scalar::<f32>()
    .unwrap();
    assert!(last < (VOCAB_OUT as f32).ln() * 0.9, "loss after 20 steps: {last}");
    println!("worst parameter relative difference over 20 steps: {worst:e}");
}

#[test]
fn optimizer_alone_tracks_candle_adamw_at_default_hyperparameters() {
    let mut rng = SplitMix64::new(3);
    let ids: Vec<u32> = (0..TOKENS).map(|_| rng.below(VOCAB_IN as u64) as u32).collect();
    let targets: Vec<u32> = (0..TOKENS).map(|_| rng.below(VOCAB_OUT as u64) as u32).collect();
    let ids = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
    let targets = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
    let (a, b) = (Model::new(11), Model::new(11));
    let mut candle_opt = AdamW::new(a.vars(), ParamsAdamW { lr: 1e-2, ..ParamsAdamW::default() }).unwrap();
    let mut fused_opt = StreamAdamW::new(b.vars(), Hyperparameters::default().lr(1e-2)).unwrap();
    for step in 1..=20 {
        // Both from candle's loss: the same gradients, bit for bit.
        let loss_a = candle_nn::loss::cross_entropy(
            &a.hidden(&ids).matmul(&a.head.as_tensor().t().unwrap()).unwrap(),
            &targets,
        )
        .unwrap();
        let loss_b = candle_nn::loss::cross_entropy(
            &b.hidden(&ids).matmul(&b.head.as_tensor().t().unwrap()).unwrap(),
            &targets,
        )
        .unwrap();
        candle_opt.backward_step(&loss_a).unwrap();
        fused_opt.backward_step(&loss_b).unwrap();
        for (x, y) in a.vars().iter().zip(b.vars().iter()) {
            let err = rel(y.as_tensor(), x.as_tensor());
            assert!(err <= 1e-6, "step {step}: relative difference {err:e}");
        }
    }
}

fn quadratic_grads(vars: &[&Var], scale: f64) -> candle_core::backprop::GradStore {
    let mut total = Tensor::zeros((), DType::F32, &Device::Cpu).unwrap();
    for v in vars {
        total = (total + (v.as_tensor().sqr().unwrap().sum_all().unwrap() * scale).unwrap()).unwrap();
    }
    total.backward().unwrap()
}

#[test]
fn a_non_finite_gradient_skips_the_whole_step() {
    let a = Var::new(&[1.0f32, 2.0], &Device::Cpu).unwrap();
    let b = Var::new(&[3.0f32, -4.0], &Device::Cpu).unwrap();
    let mut opt = StreamAdamW::new(vec![a.clone(), b.clone()], Hyperparameters::default().lr(0.1)).unwrap();
    let before = (a.as_tensor().to_vec1::<f32>().unwrap(), b.as_tensor().to_vec1::<f32>().unwrap());
    // b's gradient is infinite: neither a nor b moves, and no step is counted.
    let report = opt.step_report(&quadratic_grads(&[&a, &b], f64::INFINITY)).unwrap();
    assert_eq!(report.outcome, StepOutcome::SkippedNonFinite);
    assert_eq!((a.as_tensor().to_vec1::<f32>().unwrap(), b.as_tensor().to_vec1::<f32>().unwrap()), before);
    assert_eq!(opt.steps().collect::<Vec<_>>(), vec![0, 0]);
    // The next finite step applies to both.
    let report = opt.step_report(&quadratic_grads(&[&a, &b], 1.0)).unwrap();
    assert_eq!((report.outcome, report.updated), (StepOutcome::Applied, 2));
    assert_ne!(a.as_tensor().to_vec1::<f32>().unwrap(), before.0);
}

#[test]
fn a_var_without_a_gradient_is_left_alone() {
    let a = Var::new(&[1.0f32, 2.0], &Device::Cpu).unwrap();
    let b = Var::new(&[3.0f32], &Device::Cpu).unwrap();
    let mut opt = StreamAdamW::new(vec![a.clone(), b.clone()], Hyperparameters::default()).unwrap();
    opt.step(&quadratic_grads(&[&a], 1.0)).unwrap();
    assert_eq!(b.as_tensor().to_vec1::<f32>().unwrap(), vec![3.0]);
    assert_eq!(opt.steps().collect::<Vec<_>>(), vec![1, 0]);
}

#[test]
fn clipping_scales_by_the_global_norm() {
    // With one step, Adam's update is lr·sign(g) whatever the scale, so clipping shows in the
    // report: ‖g‖ = 2·‖θ‖ = 10, max_norm 1 → coefficient 0.1.
    let a = Var::new(&[3.0f32, 4.0], &Device::Cpu).unwrap();
    let clip = GradClip::GlobalNorm { max_norm: 1.0 };
    let mut opt = StreamAdamW::new(vec![a.clone()], Hyperparameters::default().clip(clip)).unwrap();
    let report = opt.step_report(&quadratic_grads(&[&a], 1.0)).unwrap();
    assert!((report.grad_norm - 10.0).abs() < 1e-9, "{}", report.grad_norm);
    assert!((report.clip_coef - 0.1).abs() < 1e-6, "{}", report.clip_coef);
}

#[test]
fn bad_vars_and_rates_are_errors_that_touch_nothing() {
    let f64_var = Var::new(&[1.0f64], &Device::Cpu).unwrap();
    let err = StreamAdamW::new(vec![f64_var], Hyperparameters::default()).unwrap_err().to_string();
    assert!(err.contains("var 0: dtype F64"), "{err}");
    let err = StreamAdamW::new(vec![], Hyperparameters::default().lr(-1.0)).unwrap_err().to_string();
    assert!(err.contains("lr") && err.contains("-1"), "{err}");

    let a = Var::new(&[1.0f32, 2.0], &Device::Cpu).unwrap();
    let mut opt = StreamAdamW::new(vec![a.clone()], Hyperparameters::default()).unwrap();
    opt.set_learning_rate(f64::NAN);
    assert!(opt.learning_rate().is_nan());
    let err = opt.step(&quadratic_grads(&[&a], 1.0)).unwrap_err().to_string();
    assert!(err.contains("lr"), "{err}");
    assert_eq!(a.as_tensor().to_vec1::<f32>().unwrap(), vec![1.0, 2.0]);
    assert_eq!(opt.steps().collect::<Vec<_>>(), vec![0]);
    opt.set_learning_rate(1e-3);
    opt.step(&quadratic_grads(&[&a], 1.0)).unwrap();
    assert_eq!(opt.steps().collect::<Vec<_>>(), vec![1]);
}
