//! ring-dtp against the f64 reference with materialized logits: ragged shapes, ignored rows and
//! an all-ignored batch, every feature on and off, per-token backward for reduction none, f32
//! and bf16 inputs, both schedules (budget-driven); bitwise reproducibility; typed errors.

use flatpeak_common::testing::{Backend, SplitMix64, proptest_config};
use flatpeak_common::{DType, Precision, relative_error};
use half::bf16;
use proptest::prelude::*;
use ring_dtp::cpu::reference::Rounding;
use ring_dtp::cpu::{self, reference};
use ring_dtp::{
    Bf16Kernel, BlockSchedule, Budget, Config, Device, Error, GradOutput, GradientsMut, Inputs,
    LinearCrossEntropy, Loss, Matrix, Plan, Reduction, Shape, Softcap, Upstream,
};

/// f32 bound (`docs/design.md`, exactness), on norm-wise errors normalised by the magnitudes each
/// quantity sums (identical to the plain relative error when nothing cancels).
const TOL: f64 = 1e-5;

#[derive(Debug, Clone)]
struct Case {
    n: usize,
    d: usize,
    v: usize,
    x: Vec<f32>,
    w: Vec<f32>,
    bias: Option<Vec<f32>>,
    weights: Option<Vec<f32>>,
    targets: Vec<i64>,
    grad_tokens: Vec<f32>,
    dlse: Option<Vec<f32>>,
}

fn make_case(n: usize, d: usize, v: usize, seed: u64, ignored: f64, extras: (bool, bool, bool)) -> Case {
    let mut rng = SplitMix64::new(seed);
    let x = rng.normal_f32(n * d, 0.0, 1.0);
    // W ~ N(0, 1/D) with some rows copied from X so a few logits are peaked (CCE's recipe).
    let mut w = rng.normal_f32(v * d, 0.0, 1.0 / (d as f32).sqrt());
    for j in (0..v).step_by(7) {
        let i = (j * 13) % n;
        w[j * d..(j + 1) * d].copy_from_slice(&x[i * d..(i + 1) * d]);
    }
    let targets =
        (0..n).map(|_| if rng.next_f64() < ignored { -100 } else { rng.below(v as u64) as i64 }).collect();
    Case {
        n,
        d,
        v,
        x,
        w,
        bias: extras.0.then(|| rng.normal_f32(v, 0.0, 0.5)),
        weights: extras.1.then(|| rng.uniform_f32(n, 0.25, 2.0)),
        targets,
        grad_tokens: rng.uniform_f32(n, -1.0, 1.0),
        dlse: extras.2.then(|| rng.normal_f32(n, 0.0, 0.1)),
    }
}

fn inputs<'a>(c: &'a Case, x: Matrix<'a>, w: Matrix<'a>) -> Inputs<'a> {
    let mut i = Inputs::new(x, w, &c.targets, c.d);
    if let Some(b) = &c.bias {
        i = i.with_bias(b);
    }
    if let Some(wt) = &c.weights {
        i = i.with_weights(wt);
    }
    i
}

fn grad_of<'a>(config: &Config, c: &'a Case) -> GradOutput<'a> {
    match config.reduction {
        Reduction::None => GradOutput::PerToken(&c.grad_tokens),
        _ => GradOutput::Scalar(0.7),
    }
}

fn check(what: &str, got: &[f32], want: &[f64]) -> Result<(), TestCaseError> {
    let err = relative_error(got, want);
    prop_assert!(err <= TOL, "{} relative error {:e}", what, err);
    Ok(())
}

/// ‖got − want‖ / ‖scale‖, with `scale` the magnitudes the quantity sums (see
/// `reference::Reference`): the plain relative error when nothing cancels, and still meaningful
/// for certain predictions, whose loss and gradient cancel to ≈ 0.
fn check_scaled(what: &str, got: &[f32], want: &[f64], scale: &[f64]) -> Result<(), TestCaseError> {
    let diff: f64 = got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).powi(2)).sum::<f64>().sqrt();
    let norm: f64 = scale.iter().map(|s| s * s).sum::<f64>().sqrt();
    let err = if diff == 0.0 { 0.0 } else { diff / norm };
    prop_assert!(err <= TOL, "{} relative error {:e} (of the magnitudes it sums)", what, err);
    Ok(())
}

fn check_loss(config: &Config, got: &Loss, r: &reference::Reference) -> Result<(), TestCaseError> {
    match (config.reduction, got) {
        (Reduction::None, Loss::PerToken(l)) => {
            check_scaled("per-token loss", l, &r.per_token, &r.per_token_scale)
        }
        (_, Loss::Scalar(l)) => {
            let err = (l - r.loss).abs() / r.loss_scale.max(1e-30);
            prop_assert!(
                err <= TOL || (l - r.loss).abs() < 1e-12,
                "loss {} vs {} (scale {})",
                l,
                r.loss,
                r.loss_scale
            );
            Ok(())
        }
        _ => Err(TestCaseError::fail("loss kind does not match the reduction")),
    }
}

/// Runs the case through forward + backward (separately, with dlse) and fused, on f32 or bf16
/// inputs, against the reference fed the same (exactly upcast) values.
fn run_case(c: &Case, config: &Config, dtype: DType, budget: usize) -> Result<BlockSchedule, TestCaseError> {
    let (xb, wb): (Vec<bf16>, Vec<bf16>) =
        (c.x.iter().map(|&v| bf16::from_f32(v)).collect(), c.w.iter().map(|&v| bf16::from_f32(v)).collect());
    let (x, w) = match dtype {
        DType::Bf16 => (Matrix::Bf16(&xb), Matrix::Bf16(&wb)),
        _ => (Matrix::F32(&c.x), Matrix::F32(&c.w)),
    };
    let inp = inputs(c, x, w);
    if dtype == DType::Bf16 {
        run_case_bf16_native(c, &inp, config, budget)?;
    }
    // bf16 inputs at f32's bound: every GEMM in f32, the logit gradient unrounded.
    let config = &config.precision(Precision::F32);
    let plan =
        Plan::new(config, Shape { tokens: c.n, hidden: c.d, vocab: c.v, dtype }, Budget::Bytes(budget))
            .expect("budget holds the smallest schedule");
    let grad = grad_of(config, c);
    let r = reference::run(&inp, config, grad, c.dlse.as_deref()).expect("reference");
    let fwd = cpu::forward(&plan, &inp).expect("forward");
    check_loss(config, &fwd.loss, &r)?;
    check("lse", &fwd.lse, &r.lse)?;
    let g = cpu::backward(&plan, &inp, &fwd, Upstream::loss(grad).with_dlse(c.dlse.as_deref()))
        .expect("backward");
    check_scaled("dx", &g.dx, &r.dx, &r.dx_scale)?;
    check_scaled("dw", &g.dw, &r.dw, &r.dw_scale)?;
    if let Some(db) = &g.dbias {
        check_scaled("dbias", db, &r.dbias, &r.dbias_scale)?;
    }
    // Fused (no dlse): against the reference without it.
    let r0 = reference::run(&inp, config, grad, None).expect("reference");
    let (f2, g2) = cpu::forward_backward(&plan, &inp, grad).expect("fused");
    check_loss(config, &f2.loss, &r0)?;
    check_scaled("fused dx", &g2.dx, &r0.dx, &r0.dx_scale)?;
    check_scaled("fused dw", &g2.dw, &r0.dw, &r0.dw_scale)?;
    Ok(plan.schedule())
}

/// [`run_case`] for bf16 inputs under [`Precision::Native`] (forward on the CPU's bf16 dot
/// products where it has them), checked by [`check_bf16_native`]; the errors of dX and dW, separate then fused.
fn run_case_bf16_native(
    c: &Case,
    inp: &Inputs<'_>,
    config: &Config,
    budget: usize,
) -> Result<Vec<Bf16Errors>, TestCaseError> {
    let config = &config.precision(Precision::Native);
    let plan = Plan::new(
        config,
        Shape { tokens: c.n, hidden: c.d, vocab: c.v, dtype: DType::Bf16 },
        Budget::Bytes(budget),
    )
    .expect("budget holds the smallest schedule");
    let grad = grad_of(config, c);
    let fwd = cpu::forward(&plan, inp).expect("forward");
    let g =
        cpu::backward(&plan, inp, &fwd, Upstream::loss(grad).with_dlse(c.dlse.as_deref())).expect("backward");
    let separate = check_bf16_native(config, inp, (grad, c.dlse.as_deref()), &(fwd, g))?;
    let fused = cpu::forward_backward(&plan, inp, grad).expect("fused");
    let fused = check_bf16_native(config, inp, (grad, None), &fused)?;
    Ok([separate, fused].concat())
}

/// ‖a − b‖ / ‖b‖ (0 when both vanish).
fn norm_error(a: impl Iterator<Item = f64>, b: &[f64]) -> f64 {
    let diff: f64 = a.zip(b).map(|(x, y)| (x - y).powi(2)).sum::<f64>().sqrt();
    let norm: f64 = b.iter().map(|y| y * y).sum::<f64>().sqrt();
    if diff == 0.0 { 0.0 } else { diff / norm }
}

/// Errors of a bf16 run's dX or dW (norm-wise, relative): against the exact f64 result and
/// against the reference whose logit gradient is rounded to bf16.
#[derive(Debug, Clone, Copy)]
struct Bf16Errors {
    vs_exact: f64,
    vs_rounded: f64,
}

/// bf16 inputs under [`Precision::Native`]: the loss and lse at f32's bound (products of bf16
/// values are exact in f32, the sums f32); dbias (summed from the unrounded G) too. dX and dW,
/// against the exact f64 result, within twice the naive bf16 computation's error
/// ([`Rounding::NaiveBf16`]) plus 1e-2, and within 2⁻⁸ of the reference that rounds G to bf16
/// ([`Rounding::Bf16Gradient`]): a value of G near a rounding boundary may round the other way
/// in f32 than in f64 (most of all a confident token's `p − 1`, which cancels), moving a few
/// elements by one bf16 ulp. Returns dX's and dW's errors.
fn check_bf16_native(
    config: &Config,
    inp: &Inputs<'_>,
    (grad, dlse): (GradOutput<'_>, Option<&[f32]>),
    (f, g): &(ring_dtp::Forward, ring_dtp::Gradients),
) -> Result<[Bf16Errors; 2], TestCaseError> {
    let exact =
        reference::run_rounded(inp, config, ring_dtp::Upstream::loss(grad).with_dlse(dlse), Rounding::Exact)
            .expect("reference");
    let rounded = reference::run_rounded(
        inp,
        config,
        ring_dtp::Upstream::loss(grad).with_dlse(dlse),
        Rounding::Bf16Gradient,
    )
    .expect("reference");
    let naive = reference::run_rounded(
        inp,
        config,
        ring_dtp::Upstream::loss(grad).with_dlse(dlse),
        Rounding::NaiveBf16,
    )
    .expect("reference");
    check_loss(config, &f.loss, &exact)?;
    check("lse", &f.lse, &exact.lse)?;
    if let Some(db) = &g.dbias {
        check_scaled("dbias", db, &exact.dbias, &exact.dbias_scale)?;
    }
    let mut errors = [Bf16Errors { vs_exact: 0.0, vs_rounded: 0.0 }; 2];
    for (out, (what, got, e, r, nv)) in errors.iter_mut().zip([
        ("dx", &g.dx, &exact.dx, &rounded.dx, &naive.dx),
        ("dw", &g.dw, &exact.dw, &rounded.dw, &naive.dw),
    ]) {
        let got64 = || got.iter().map(|&v| v as f64);
        let (vs_exact, vs_rounded) = (norm_error(got64(), e), norm_error(got64(), r));
        let naive_err = norm_error(nv.iter().copied(), e);
        prop_assert!(
            vs_rounded <= 2f64.powi(-8),
            "bf16 {what}: error {vs_rounded:e} against the rounded-gradient reference"
        );
        prop_assert!(
            vs_exact <= 2.0 * naive_err + 1e-2,
            "bf16 {what}: error {vs_exact:e}, naive bf16 {naive_err:e}"
        );
        *out = Bf16Errors { vs_exact, vs_rounded };
    }
    Ok(errors)
}

fn config_strategy() -> impl Strategy<Value = Config> {
    (
        prop_oneof![Just(Reduction::Mean), Just(Reduction::Sum), Just(Reduction::None)],
        prop_oneof![Just(0.0f32), Just(0.1), Just(1.0)],
        prop_oneof![Just(0.0f32), Just(1e-4)],
        prop_oneof![Just(Softcap::Off), Just(Softcap::Tanh { cap: 20.0 }), Just(Softcap::Tanh { cap: 30.0 })],
        prop_oneof![Just(0usize), Just(2)],
    )
        .prop_map(|(reduction, label_smoothing, z_loss, softcap, shift)| {
            let mut c = Config::default().reduction(reduction);
            (c.label_smoothing, c.z_loss, c.softcap, c.shift) = (label_smoothing, z_loss, softcap, shift);
            c
        })
}

proptest! {
    #![proptest_config(proptest_config(32))]

    #[test]
    fn matches_the_f64_reference(
        n in 1usize..90, d in 1usize..40, v in 1usize..260, seed in any::<u64>(),
        config in config_strategy(), extras in (any::<bool>(), any::<bool>(), any::<bool>()),
        bf16_inputs in any::<bool>(), budget in prop_oneof![Just(1usize << 14), Just(1 << 16), Just(1 << 24)],
        kernel in prop_oneof![Just(Bf16Kernel::Detect), Just(Bf16Kernel::Avx512Bf16), Just(Bf16Kernel::Widened)],
    ) {
        let c = make_case(n, d, v, seed, 0.2, extras);
        let config = config.bf16_kernel(kernel);
        let dtype = if bf16_inputs { DType::Bf16 } else { DType::F32 };
        // The smallest budgets force vocabulary blocks; raise one below the minimum to it.
        let budget = match Plan::new(&config, Shape { tokens: n, hidden: d, vocab: v, dtype }, Budget::Bytes(budget)) {
            Err(Error::BudgetTooSmall { needed, .. }) => needed,
            _ => budget,
        };
        run_case(&c, &config, dtype, budget)?;
    }
}

#[test]
fn ragged_prime_shapes_and_both_schedules() {
    // 252 × 507 × 123 as in Cut Cross-Entropy's tests, and N, V prime.
    // The last shape has V > WIDEN_ROWS: a bf16 W is widened in several sub-blocks.
    for (n, v, d, seed) in [(252usize, 507usize, 123usize, 1u64), (251, 509, 67, 2), (40, 4501, 16, 3)] {
        let c = make_case(n, d, v, seed, 0.2, (true, true, true));
        let mut all = Config::default().reduction(Reduction::None);
        (all.label_smoothing, all.z_loss, all.softcap) = (0.1, 1e-4, Softcap::Tanh { cap: 30.0 });
        let mut seen = Vec::new();
        for budget in [1usize << 30, 300 << 10] {
            for dtype in [DType::F32, DType::Bf16] {
                seen.push(run_case(&c, &all, dtype, budget).expect("matches the reference"));
            }
        }
        assert!(
            seen.contains(&BlockSchedule::FullVocab) && seen.contains(&BlockSchedule::VocabBlocked),
            "{seen:?}"
        );
    }
}

/// bf16 inputs under the default [`Precision::Native`], both schedules, dX's split reduction,
/// every feature on and off, on the CPU's fastest bf16 kernel (AMX tiles or AVX512-BF16 dot
/// products, where it has them) and on the widening fallback: [`check_bf16_native`].
#[test]
fn bf16_native_rounds_the_logit_gradient() {
    let split = 2 * ring_dtp::plan::SPLIT_K_MIN_ROWS + 3;
    for (n, v, d, seed) in [(252usize, 507usize, 123usize, 11u64), (40, 4501, 16, 12), (37, split, 24, 13)] {
        let c = make_case(n, d, v, seed, 0.2, (true, true, true));
        let (xb, wb): (Vec<bf16>, Vec<bf16>) = (
            c.x.iter().map(|&a| bf16::from_f32(a)).collect(),
            c.w.iter().map(|&a| bf16::from_f32(a)).collect(),
        );
        let inp = inputs(&c, Matrix::Bf16(&xb), Matrix::Bf16(&wb));
        let mut all = Config::default().reduction(Reduction::None);
        (all.label_smoothing, all.z_loss, all.softcap) = (0.1, 1e-4, Softcap::Tanh { cap: 30.0 });
        let configs = [all, Config::default()];
        for config in
            [Bf16Kernel::Detect, Bf16Kernel::Widened].map(|k| configs.map(|c| c.bf16_kernel(k))).concat()
        {
            for budget in [1usize << 30, 300 << 10] {
                // On these cases G's rounding is what separates the result from the exact one:
                // it sits at most a quarter as far from the reference that rounds G (an f32 G
                // fails this, by about 1e-3 against 1e-6).
                for e in run_case_bf16_native(&c, &inp, &config, budget).expect("bf16 within its bounds") {
                    assert!(e.vs_rounded <= 0.25 * e.vs_exact + TOL, "{n}x{v}x{d}: {e:?}");
                }
            }
        }
    }
}

#[test]
fn an_all_ignored_batch_has_zero_loss_and_gradients() {
    let mut c = make_case(40, 16, 100, 3, 1.0, (true, false, false));
    c.targets.iter_mut().for_each(|t| *t = -100);
    for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
        let config = Config::default().reduction(reduction);
        let inp = inputs(&c, Matrix::F32(&c.x), Matrix::F32(&c.w));
        let plan = Plan::new(
            &config,
            Shape { tokens: 40, hidden: 16, vocab: 100, dtype: DType::F32 },
            Budget::Bytes(1 << 20),
        )
        .expect("plan");
        let (fwd, g) = cpu::forward_backward(&plan, &inp, grad_of(&config, &c)).expect("runs");
        match fwd.loss {
            Loss::Scalar(l) => assert_eq!(l, 0.0),
            Loss::PerToken(l) => assert!(l.iter().all(|&x| x == 0.0)),
        }
        assert!(g.dx.iter().chain(&g.dw).chain(g.dbias.iter().flatten()).all(|&x| x == 0.0));
        assert!(fwd.lse.iter().all(|x| x.is_finite()));
    }
}

#[test]
fn bitwise_reproducible_run_to_run() {
    let c = make_case(300, 64, 1000, 4, 0.2, (true, true, false));
    let config = Config::default();
    let inp = inputs(&c, Matrix::F32(&c.x), Matrix::F32(&c.w));
    for budget in [1usize << 30, 256 << 10] {
        let plan = Plan::new(
            &config,
            Shape { tokens: 300, hidden: 64, vocab: 1000, dtype: DType::F32 },
            Budget::Bytes(budget),
        )
        .expect("plan");
        let a = cpu::forward_backward(&plan, &inp, GradOutput::Scalar(1.0)).expect("run");
        let b = cpu::forward_backward(&plan, &inp, GradOutput::Scalar(1.0)).expect("run");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a.1.dx), bits(&b.1.dx));
        assert_eq!(bits(&a.1.dw), bits(&b.1.dw));
        assert_eq!(a.0, b.0);
    }
}

/// dX's GEMM split in two halves of its reduction (`cpu::splits_dx`: vocabulary blocks, or bf16
/// sub-blocks, of at least `SPLIT_K_MIN_ROWS` rows) against the f64 reference: V odd so the
/// halves differ, a full-vocabulary plan (every block splits), and blocks of 3001 + 1098 rows
/// (the first splits, the last does not); every feature on and off, f32 and bf16 (whose
/// 2048-row sub-blocks split and whose 3-row tail does not; on bf16 GEMMs, every block of at
/// least that many rows splits). Then bitwise the same on 1, 2 and 3 threads, f32 and bf16, since
/// the split depends on shapes only.
#[test]
fn split_dx_reduction_matches_the_reference_on_any_thread_count() {
    let (n, d, v) = (37usize, 24usize, 2 * ring_dtp::plan::SPLIT_K_MIN_ROWS + 3);
    let c = make_case(n, d, v, 41, 0.2, (true, true, true));
    for_every_config_and_dtype(&c, |config, dtype, inp| {
        let grad = grad_of(config, &c);
        let with_dlse = reference::run(inp, config, grad, c.dlse.as_deref()).expect("reference");
        let without = reference::run(inp, config, grad, None).expect("reference");
        for blocks in [(16, usize::MAX), (16, 3001)] {
            let plan = Plan::with_blocks(config, Shape { tokens: n, hidden: d, vocab: v, dtype }, blocks)
                .expect("plan");
            assert!(ring_dtp::plan::splits_dx(plan.vocab_block(), dtype), "{plan:?}");
            let fused = cpu::forward_backward(&plan, inp, grad).expect("runs");
            check_against_reference(config, &fused, &without);
            let f = cpu::forward(&plan, inp).expect("forward");
            let g = cpu::backward(&plan, inp, &f, Upstream::loss(grad).with_dlse(c.dlse.as_deref()))
                .expect("backward");
            check_against_reference(config, &(f, g), &with_dlse);
        }
    });
    let config = Config::default();
    for_each_dtype(&c, |dtype, inp| {
        let plan =
            Plan::with_blocks(&config, Shape { tokens: n, hidden: d, vocab: v, dtype }, (16, usize::MAX))
                .expect("plan");
        let bits = |threads: usize| {
            let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("pool");
            let (f, g) =
                pool.install(|| cpu::forward_backward(&plan, inp, GradOutput::Scalar(1.0))).expect("runs");
            let to_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            (to_bits(&f.lse), to_bits(&g.dx), to_bits(&g.dw))
        };
        let one = bits(1);
        assert!(one == bits(2) && one == bits(3), "{dtype:?}: the split changed bits with the thread count");
    });
}

/// The `_into` calls overwrite whatever their buffers held: filled with NaN first, they end
/// bit for bit as the allocating calls' gradients, for the fused and the 4-GEMM schedule, f32
/// and bf16, with a bias (which blocks add into) and without.
#[test]
fn into_buffers_are_overwritten_whatever_they_held() {
    let (n, d, v) = (70usize, 32usize, 900usize);
    for with_bias in [true, false] {
        let c = make_case(n, d, v, 12, 0.1, (with_bias, true, false));
        for_each_dtype(&c, |dtype, inp| {
            for budget in [1usize << 30, 64 << 10] {
                let config = Config::default();
                let shape = Shape { tokens: n, hidden: d, vocab: v, dtype };
                let plan = Plan::new(&config, shape, Budget::Bytes(budget)).expect("plan");
                let mut lce = LinearCrossEntropy::new(plan, Device::Cpu).expect("executor");
                let (f, g) = lce.forward_backward(inp, GradOutput::Scalar(1.0)).expect("runs");
                let (mut dx, mut dw) = (vec![f32::NAN; n * d], vec![f32::NAN; v * d]);
                let mut db = vec![f32::NAN; if with_bias { v } else { 0 }];
                let out = GradientsMut::new(&mut dx, &mut dw, with_bias.then_some(&mut db[..]));
                let f_into = lce.forward_backward_into(inp, GradOutput::Scalar(1.0), out).expect("runs");
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                let what = format!("{dtype:?} {:?} bias={with_bias}", plan.schedule());
                assert_eq!(f_into.lse, f.lse, "{what}");
                assert_eq!(bits(&dx), bits(&g.dx), "dx {what}");
                assert_eq!(bits(&dw), bits(&g.dw), "dw {what}");
                assert_eq!(bits(&db), bits(g.dbias.as_deref().unwrap_or(&[])), "dbias {what}");
            }
        });
    }
}

#[test]
fn bad_input_is_a_typed_error() {
    let c = make_case(10, 4, 20, 5, 0.0, (false, false, false));
    let config = Config::default();
    let plan = Plan::new(
        &config,
        Shape { tokens: 10, hidden: 4, vocab: 20, dtype: DType::F32 },
        Budget::Bytes(1 << 20),
    )
    .expect("plan");
    let mut targets = c.targets.clone();
    targets[3] = 20;
    let inp = Inputs::new(Matrix::F32(&c.x), Matrix::F32(&c.w), &targets, 4);
    assert_eq!(
        cpu::forward(&plan, &inp).unwrap_err(),
        Error::TargetOutOfRange { token: 3, target: 20, vocab: 20 }
    );
    targets[3] = -7;
    let inp = Inputs::new(Matrix::F32(&c.x), Matrix::F32(&c.w), &targets, 4);
    assert_eq!(
        cpu::forward(&plan, &inp).unwrap_err(),
        Error::TargetOutOfRange { token: 3, target: -7, vocab: 20 }
    );
    // The f64 reference checks its inputs as the fast path does (it indexed W by the target).
    let inp = Inputs::new(Matrix::F32(&c.x), Matrix::F32(&c.w), &targets, 4);
    assert_eq!(
        reference::run(&inp, &config, GradOutput::Scalar(1.0), None).unwrap_err(),
        Error::TargetOutOfRange { token: 3, target: -7, vocab: 20 }
    );
    let short_weights = [1.0f32; 9];
    let inp = Inputs::new(Matrix::F32(&c.x), Matrix::F32(&c.w), &c.targets, 4).with_weights(&short_weights);
    assert!(matches!(
        reference::run(&inp, &config, GradOutput::Scalar(1.0), None),
        Err(Error::ShapeMismatch { what: "weights (n)", expected: 10, got: 9 })
    ));
    let inp = Inputs::new(Matrix::F32(&c.x), Matrix::F32(&c.w), &c.targets, 4);
    assert!(matches!(
        reference::run(&inp, &config, GradOutput::PerToken(&[1.0; 10]), None),
        Err(Error::GradOutputKind { .. })
    ));
    let short = Inputs::new(Matrix::F32(&c.x[..39]), Matrix::F32(&c.w), &c.targets, 4);
    assert!(matches!(
        cpu::forward(&plan, &short),
        Err(Error::ShapeMismatch { what: "x (n·d)", expected: 40, got: 39 })
    ));
    let wb: Vec<bf16> = c.w.iter().map(|&x| bf16::from_f32(x)).collect();
    let mixed = Inputs::new(Matrix::F32(&c.x), Matrix::Bf16(&wb), &c.targets, 4);
    assert!(matches!(cpu::forward(&plan, &mixed), Err(Error::DtypeMismatch { .. })));
    let ok = Inputs::new(Matrix::F32(&c.x), Matrix::F32(&c.w), &c.targets, 4);
    let other = Plan::new(
        &config,
        Shape { tokens: 11, hidden: 4, vocab: 20, dtype: DType::F32 },
        Budget::Bytes(1 << 20),
    )
    .expect("plan");
    assert!(matches!(cpu::forward(&other, &ok), Err(Error::ShapeMismatch { what: "n", .. })));
    let none = Config::default().reduction(Reduction::None);
    let per_token_plan = Plan::new(&none, plan.shape(), Budget::Bytes(1 << 20)).expect("plan");
    let fwd = cpu::forward(&per_token_plan, &ok).expect("forward");
    assert!(matches!(
        cpu::backward(&per_token_plan, &ok, &fwd, GradOutput::Scalar(1.0).into()),
        Err(Error::GradOutputKind { .. })
    ));
    assert!(matches!(
        cpu::backward(&per_token_plan, &ok, &fwd, GradOutput::PerToken(&[1.0; 3]).into()),
        Err(Error::ShapeMismatch { what: "grad_output (n)", .. })
    ));
    assert!(matches!(
        cpu::backward(&plan, &ok, &fwd, GradOutput::PerToken(&[1.0; 10]).into()),
        Err(Error::GradOutputKind { .. })
    ));
    assert!(matches!(
        Plan::new(&config, Shape { tokens: 10, hidden: 4, vocab: 20, dtype: DType::F32 }, Budget::Bytes(100)),
        Err(Error::BudgetTooSmall { budget: 100, .. })
    ));
}

/// Forward then backward on `backend`: the CPU fast path, or the device schedule (raw-logits
/// GEMM, then the fold / gradient / bias-gradient kernels) emulated or on a GPU.
fn run_on(
    backend: Backend,
    plan: &Plan,
    inp: &Inputs<'_>,
    grad: GradOutput<'_>,
    dlse: Option<&[f32]>,
) -> Result<(ring_dtp::Forward, ring_dtp::Gradients), Error> {
    run_pass_on(backend, plan, inp, grad, Pass::Separate { dlse })
}

/// How forward and backward are called.
#[derive(Debug, Clone, Copy)]
enum Pass<'a> {
    /// `forward`, then `backward` with an optional upstream gradient of the lse.
    Separate { dlse: Option<&'a [f32]> },
    /// `forward_backward` (the loss is the last op).
    Fused,
}

fn run_pass_on(
    backend: Backend,
    plan: &Plan,
    inp: &Inputs<'_>,
    grad: GradOutput<'_>,
    pass: Pass<'_>,
) -> Result<(ring_dtp::Forward, ring_dtp::Gradients), Error> {
    match (backend, pass) {
        (Backend::Cpu, Pass::Fused) => cpu::forward_backward(plan, inp, grad),
        (Backend::Cpu, Pass::Separate { dlse }) => {
            let f = cpu::forward(plan, inp)?;
            let g = cpu::backward(plan, inp, &f, Upstream::loss(grad).with_dlse(dlse))?;
            Ok((f, g))
        }
        #[cfg(feature = "cuda-emu")]
        (Backend::CudaEmu, Pass::Fused) => ring_dtp::emu::forward_backward(plan, inp, grad),
        #[cfg(feature = "cuda-emu")]
        (Backend::CudaEmu, Pass::Separate { dlse }) => {
            let f = ring_dtp::emu::forward(plan, inp)?;
            let mut g = ring_dtp::Gradients::zeros(inp);
            ring_dtp::emu::backward_into(
                plan,
                inp,
                &f.lse,
                Upstream::loss(grad).with_dlse(dlse),
                g.as_mut(),
            )?;
            Ok((f, g))
        }
        #[cfg(feature = "cuda")]
        (Backend::Cuda, pass) => cuda_run(plan, inp, grad, pass),
        #[allow(unreachable_patterns)]
        other => panic!("{other:?} is not built in"),
    }
}

#[cfg(feature = "cuda")]
fn cuda_run(
    plan: &Plan,
    inp: &Inputs<'_>,
    grad: GradOutput<'_>,
    pass: Pass<'_>,
) -> Result<(ring_dtp::Forward, ring_dtp::Gradients), Error> {
    use ring_dtp::cuda::{DeviceInputs, DeviceMatrix};
    let mut lce = ring_dtp::LinearCrossEntropy::new(*plan, flatpeak_common::Device::Cuda(0))?;
    let s = lce.stream()?.clone();
    let up = |e| Error::Common(flatpeak_common::Error::Cuda { op: "upload", message: format!("{e:?}") });
    let (xf, wf, xb, wb);
    let (x, w) = match (inp.x, inp.w) {
        (Matrix::F32(x), Matrix::F32(w)) => {
            (xf, wf) = (s.clone_htod(x).map_err(up)?, s.clone_htod(w).map_err(up)?);
            (DeviceMatrix::F32(&xf), DeviceMatrix::F32(&wf))
        }
        (Matrix::Bf16(x), Matrix::Bf16(w)) => {
            (xb, wb) = (s.clone_htod(x).map_err(up)?, s.clone_htod(w).map_err(up)?);
            (DeviceMatrix::Bf16(&xb), DeviceMatrix::Bf16(&wb))
        }
        _ => return Err(Error::DtypeMismatch { x: inp.x.dtype(), w: inp.w.dtype() }),
    };
    let targets = s.clone_htod(inp.targets).map_err(up)?;
    let bias = inp.bias.map(|b| s.clone_htod(b)).transpose().map_err(up)?;
    let weights = inp.weights.map(|b| s.clone_htod(b)).transpose().map_err(up)?;
    let mut dev = DeviceInputs::on_device(x, w, &targets, inp.d);
    (dev.bias, dev.weights, dev.n, dev.v) = (bias.as_ref(), weights.as_ref(), inp.n, inp.v);
    let (f, g) = match pass {
        Pass::Separate { dlse } => {
            let f = lce.forward(&dev)?;
            let g = lce.backward(&dev, &f, Upstream::loss(grad).with_dlse(dlse))?;
            (f, g)
        }
        Pass::Fused => lce.forward_backward(&dev, grad)?,
    };
    let down = |d: &flatpeak_common::cuda::cudarc::driver::CudaSlice<f32>| s.clone_dtoh(d).map_err(up);
    let grads = ring_dtp::Gradients {
        dx: down(&g.dx)?,
        dw: down(&g.dw)?,
        dbias: g.dbias.as_ref().map(down).transpose()?,
    };
    Ok((f, grads))
}

/// The device schedule's kernels against the f64 reference on ragged shapes, every feature on
/// and off, f32 and bf16, several blocks per dimension, with a bias (bf16 G rounded after dbias
/// sums it) and without (rounded by the gradient kernel itself), vocabulary blocks of 16-byte
/// rows (vectorized) and not; and a bad target as a typed error.
fn device_schedule_matches_the_reference(backend: Backend) {
    for (n, v, d, seed, bias) in
        [(45usize, 131usize, 24usize, 21u64, true), (33, 67, 16, 22, true), (40, 128, 16, 23, false)]
    {
        let c = make_case(n, d, v, seed, 0.2, (bias, true, true));
        for_every_config_and_dtype(&c, |config, dtype, inp| {
            // Room for 16 tokens × 64 vocabulary rows: several blocks both ways.
            let upcast = if dtype == DType::Bf16 { 64 * d } else { 0 };
            let budget = 4 * (16 * 64 + 16 * d + upcast) + 3 * 64;
            let plan =
                Plan::new(config, Shape { tokens: n, hidden: d, vocab: v, dtype }, Budget::Bytes(budget))
                    .expect("plan");
            assert!(plan.vocab_block() < v, "several vocabulary blocks");
            let grad = grad_of(config, &c);
            let r = reference::run(inp, config, grad, c.dlse.as_deref()).expect("reference");
            let out = run_on(backend, &plan, inp, grad, c.dlse.as_deref()).expect("runs");
            check_against_reference(config, &out, &r);
            if dtype == DType::Bf16 {
                // The default bf16 arithmetic: bf16 GEMMs, G narrowed to bf16 (on CUDA in place
                // by `lce_narrow_rows_bf16`, run here by the emulator or the GPU).
                let native = config.precision(Precision::Native);
                let plan = Plan::new(&native, plan.shape(), Budget::Bytes(budget)).expect("plan");
                let out = run_on(backend, &plan, inp, grad, c.dlse.as_deref()).expect("runs");
                check_bf16_native(&native, inp, (grad, c.dlse.as_deref()), &out).unwrap();
            }
        });
    }
    let c = make_case(10, 4, 20, 5, 0.0, (false, false, false));
    let mut targets = c.targets.clone();
    targets[6] = 20;
    let config = Config::default();
    let plan = Plan::new(
        &config,
        Shape { tokens: 10, hidden: 4, vocab: 20, dtype: DType::F32 },
        Budget::Bytes(1 << 20),
    )
    .expect("plan");
    let inp = Inputs::new(Matrix::F32(&c.x), Matrix::F32(&c.w), &targets, 4);
    let err = run_on(backend, &plan, &inp, GradOutput::Scalar(1.0), None).unwrap_err();
    assert_eq!(err, Error::TargetOutOfRange { token: 6, target: 20, vocab: 20 });
    // A NaN, infinite or negative per-token weight is refused (it gave a loss of 0 with NaN or
    // nonzero gradients).
    for bad in [f32::NAN, f32::INFINITY, -0.5] {
        let mut weights = vec![1.0f32; 10];
        weights[4] = bad;
        let inp = Inputs::new(Matrix::F32(&c.x), Matrix::F32(&c.w), &c.targets, 4).with_weights(&weights);
        let err = run_on(backend, &plan, &inp, GradOutput::Scalar(1.0), None).unwrap_err();
        assert!(matches!(err, Error::InvalidWeight { token: 4, .. }), "{bad}: {err}");
    }
}

flatpeak_common::test_backends!(device_schedule, device_schedule_matches_the_reference, cpu_gemm);

/// A shift at or past the tokens (up to `usize::MAX`, where `i + shift` would wrap) ignores every
/// row on every backend: loss 0 and zero gradients, never a row scored against a wrapped index.
fn a_shift_past_the_tokens_ignores_every_row(backend: Backend) {
    let c = make_case(12, 4, 20, 7, 0.0, (true, false, false));
    for shift in [12, 13, usize::MAX - 3, usize::MAX] {
        for reduction in [Reduction::Mean, Reduction::Sum, Reduction::None] {
            let config = Config::default().reduction(reduction).shift(shift);
            let shape = Shape { tokens: 12, hidden: 4, vocab: 20, dtype: DType::F32 };
            let plan = Plan::new(&config, shape, Budget::Bytes(1 << 20)).expect("plan");
            let inp = inputs(&c, Matrix::F32(&c.x), Matrix::F32(&c.w));
            let (fwd, g) = run_on(backend, &plan, &inp, grad_of(&config, &c), None).expect("runs");
            match fwd.loss {
                Loss::Scalar(l) => assert_eq!(l, 0.0, "shift {shift}"),
                Loss::PerToken(l) => assert!(l.iter().all(|&x| x == 0.0), "shift {shift}: {l:?}"),
            }
            assert!(
                g.dx.iter().chain(&g.dw).chain(g.dbias.iter().flatten()).all(|&x| x == 0.0),
                "shift {shift}"
            );
            // The kernel resolves no target either (the loss above is masked on the host too).
            #[cfg(feature = "cuda-emu")]
            if backend == Backend::CudaEmu {
                let resolved = ring_dtp::emu::resolve_targets(&config, &inp).expect("resolves");
                assert!(resolved.iter().all(|&t| t == u32::MAX), "shift {shift}: {resolved:?}");
            }
        }
    }
}

flatpeak_common::test_backends!(shift, a_shift_past_the_tokens_ignores_every_row);

/// The fused forward + backward (3 GEMMs: each token block's full-vocabulary logits folded,
/// finished and differentiated in place) against the f64 reference on ragged shapes, every
/// feature on and off, f32 and bf16, several token blocks.
fn fused_schedule_matches_the_reference(backend: Backend) {
    for (n, v, d, seed, bias) in
        [(45usize, 131usize, 24usize, 31u64, true), (33, 67, 16, 32, false), (40, 128, 16, 33, false)]
    {
        let c = make_case(n, d, v, seed, 0.2, (bias, true, false));
        for_every_config_and_dtype(&c, |config, dtype, inp| {
            // The smallest budget whose plan is one pass over the whole vocabulary: several token
            // blocks for f32 (for bf16 the widened W dominates, so the plan's first
            // full-vocabulary choice holds every token).
            let plan = (1..)
                .map(|step| {
                    Plan::new(
                        config,
                        Shape { tokens: n, hidden: d, vocab: v, dtype },
                        Budget::Bytes(step * 64),
                    )
                })
                .find(|p| p.as_ref().is_ok_and(|p| p.schedule() == BlockSchedule::FullVocab))
                .expect("some budget")
                .expect("plan");
            assert!(dtype == DType::Bf16 || plan.token_block() <= 32, "{plan:?}");
            // And explicit blocks: 7 tokens (a ragged last block) over the whole vocabulary.
            let explicit =
                Plan::with_blocks(config, Shape { tokens: n, hidden: d, vocab: v, dtype }, (7, usize::MAX))
                    .expect("plan");
            assert_eq!(explicit.schedule(), BlockSchedule::FullVocab);
            let grad = grad_of(config, &c);
            let r = reference::run(inp, config, grad, None).expect("reference");
            let native = config.precision(Precision::Native);
            for plan in [plan, explicit] {
                let out = run_pass_on(backend, &plan, inp, grad, Pass::Fused).expect("runs");
                check_against_reference(config, &out, &r);
                if dtype == DType::Bf16 {
                    // The default bf16 arithmetic on the same blocks.
                    let blocks = (plan.token_block(), plan.vocab_block());
                    let plan = Plan::with_blocks(&native, plan.shape(), blocks).expect("plan");
                    let out = run_pass_on(backend, &plan, inp, grad, Pass::Fused).expect("runs");
                    check_bf16_native(&native, inp, (grad, None), &out).unwrap();
                }
            }
        });
    }
}

/// Runs `body` for the configuration with every feature on (reduction none, label smoothing,
/// z-loss, softcap) and the default one, each on the case's inputs in f32 and in bf16.
fn for_every_config_and_dtype(c: &Case, mut body: impl FnMut(&Config, DType, &Inputs<'_>)) {
    let mut all = Config::default().reduction(Reduction::None);
    (all.label_smoothing, all.z_loss, all.softcap) = (0.1, 1e-4, Softcap::Tanh { cap: 30.0 });
    for config in [all, Config::default()] {
        // bf16 at f32's bound: f32 GEMMs ([`bf16_native_rounds_the_logit_gradient`] runs the
        // default bf16 arithmetic).
        for_each_dtype(c, |dtype, inp| body(&config.precision(Precision::F32), dtype, inp));
    }
}

/// `body` on the case's inputs in f32, then rounded to bf16.
fn for_each_dtype(c: &Case, mut body: impl FnMut(DType, &Inputs<'_>)) {
    let (xb, wb): (Vec<bf16>, Vec<bf16>) =
        (c.x.iter().map(|&a| bf16::from_f32(a)).collect(), c.w.iter().map(|&a| bf16::from_f32(a)).collect());
    body(DType::F32, &inputs(c, Matrix::F32(&c.x), Matrix::F32(&c.w)));
    body(DType::Bf16, &inputs(c, Matrix::Bf16(&xb), Matrix::Bf16(&wb)));
}

/// Loss, lse, dX, dW and dbias of one run against the f64 reference.
fn check_against_reference(
    config: &Config,
    (f, g): &(ring_dtp::Forward, ring_dtp::Gradients),
    r: &reference::Reference,
) {
    check_loss(config, &f.loss, r).unwrap();
    check("lse", &f.lse, &r.lse).unwrap();
    check_scaled("dx", &g.dx, &r.dx, &r.dx_scale).unwrap();
    check_scaled("dw", &g.dw, &r.dw, &r.dw_scale).unwrap();
    if let Some(dbias) = g.dbias.as_ref() {
        check_scaled("dbias", dbias, &r.dbias, &r.dbias_scale).unwrap();
    }
}

flatpeak_common::test_backends!(fused_schedule, fused_schedule_matches_the_reference, cpu_gemm);

/// [`Precision::Tf32`]: on a GPU, f32 inputs on tensor cores as TF32, within TF32's error
/// (about 1e-3; bound 1e-2) of the f64 reference and measurably not f32's (so the mode took
/// effect), and bf16 inputs refused; on the CPU and the emulator, a typed error naming the
/// backend — never f32 or bf16 GEMMs run in its place.
fn tf32_runs_on_cuda_for_f32_inputs_only(backend: Backend) {
    let (n, d, v) = (256, 512, 1024);
    let c = make_case(n, d, v, 41, 0.0, (false, false, false));
    let tf32 = Config::default().precision(Precision::Tf32);
    let shape = Shape { tokens: n, hidden: d, vocab: v, dtype: DType::F32 };
    let plan = Plan::new(&tf32, shape, Budget::Bytes(64 << 20)).expect("plan");
    let inp = Inputs::new(Matrix::F32(&c.x), Matrix::F32(&c.w), &c.targets, d);
    let grad = GradOutput::Scalar(1.0);
    let out = run_pass_on(backend, &plan, &inp, grad, Pass::Fused);
    if backend != Backend::Cuda {
        assert!(
            matches!(
                &out,
                Err(Error::UnsupportedPrecision { precision: Precision::Tf32, dtype: DType::F32, backend })
                    if backend.contains("CPU") || backend.contains("emulated")
            ),
            "{:?}",
            out.map(|_| ())
        );
        return;
    }
    let (_, g) = out.expect("TF32 on a GPU");
    let r = reference::run(&inp, &Config::default(), grad, None).expect("reference");
    let err = relative_error(&g.dx, &r.dx);
    assert!(err > 1e-6 && err <= 1e-2, "dX under TF32: relative error {err:.3e}, expected (1e-6, 1e-2]");
    #[cfg(feature = "cuda")]
    {
        let bf16_plan = Plan::new(&tf32, Shape { dtype: DType::Bf16, ..shape }, Budget::Bytes(64 << 20));
        let refused =
            ring_dtp::LinearCrossEntropy::new(bf16_plan.expect("plan"), flatpeak_common::Device::Cuda(0));
        assert!(
            matches!(refused, Err(Error::UnsupportedPrecision { dtype: DType::Bf16, .. })),
            "{:?}",
            refused.map(|_| ())
        );
    }
}

flatpeak_common::test_backends!(tf32, tf32_runs_on_cuda_for_f32_inputs_only);

/// TF32 asked of the CPU executor and of a CUDA executor with bf16 inputs is refused when the
/// executor is made (the CUDA check comes before any device is touched, so it holds here).
#[test]
fn tf32_is_refused_when_the_executor_is_made() {
    let tf32 = Config::default().precision(Precision::Tf32);
    let shape = Shape { tokens: 8, hidden: 4, vocab: 16, dtype: DType::F32 };
    let plan = Plan::new(&tf32, shape, Budget::Bytes(1 << 20)).expect("plan");
    let made = ring_dtp::LinearCrossEntropy::new(plan, flatpeak_common::Device::Cpu);
    assert!(
        matches!(
            &made,
            Err(Error::UnsupportedPrecision { precision: Precision::Tf32, backend: "the CPU", .. })
        ),
        "{:?}",
        made.map(|_| ())
    );
    #[cfg(feature = "cuda")]
    {
        let plan =
            Plan::new(&tf32, Shape { dtype: DType::Bf16, ..shape }, Budget::Bytes(1 << 20)).expect("plan");
        let made = ring_dtp::LinearCrossEntropy::new(plan, flatpeak_common::Device::Cuda(0));
        assert!(
            matches!(
                &made,
                Err(Error::UnsupportedPrecision { dtype: DType::Bf16, backend: "a CUDA device", .. })
            ),
            "{:?}",
            made.map(|_| ())
        );
    }
}
