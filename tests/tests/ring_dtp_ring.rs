//! Ring-DTP over P ranks (LocalGroup threads) against the f64 reference of the whole problem
//! and against the single-device path: P ∈ {1, 2, 3, 4, 7}, both rings, f32 and bf16, ragged
//! and prime shapes (ranks with no tokens or no vocabulary rows included), every feature on and
//! off, by proptest over random shapes too; bitwise reproducibility; typed errors.

use flatpeak_common::comm::{LocalComm, LocalGroup, LocalGroupOptions};
use flatpeak_common::gemm::Threads;
use flatpeak_common::testing::{SplitMix64, proptest_config};
use flatpeak_common::{DType, Precision, relative_error};
use half::bf16;
use proptest::prelude::*;
use ring_dtp::cpu::reference::Rounding;
use ring_dtp::cpu::{self, reference};
use ring_dtp::{
    Budget, Config, Device, Error, Forward, GradOutput, Gradients, Inputs, Loss, Matrix, Plan, Reduction,
    RingKind, RingLinearCrossEntropy, RingOptions, RingPlan, Shape, Softcap, Upstream,
};

/// f32 bound, on errors normalised by the magnitudes each quantity sums (see tests/ring_dtp.rs).
const TOL: f64 = 1e-5;

struct Case {
    n: usize,
    d: usize,
    v: usize,
    x: Vec<f32>,
    w: Vec<f32>,
    xb: Vec<bf16>,
    wb: Vec<bf16>,
    bias: Vec<f32>,
    weights: Vec<f32>,
    targets: Vec<i64>,
    grad_tokens: Vec<f32>,
    dlse: Vec<f32>,
}

fn make_case(n: usize, d: usize, v: usize, seed: u64) -> Case {
    let mut rng = SplitMix64::new(seed);
    let x = rng.normal_f32(n * d, 0.0, 1.0);
    let mut w = rng.normal_f32(v * d, 0.0, 1.0 / (d as f32).sqrt());
    for j in (0..v).step_by(5) {
        let i = (j * 11) % n;
        w[j * d..(j + 1) * d].copy_from_slice(&x[i * d..(i + 1) * d]);
    }
    let targets =
        (0..n).map(|_| if rng.next_f64() < 0.2 { -100 } else { rng.below(v as u64) as i64 }).collect();
    Case {
        n,
        d,
        v,
        xb: x.iter().map(|&a| bf16::from_f32(a)).collect(),
        wb: w.iter().map(|&a| bf16::from_f32(a)).collect(),
        x,
        w,
        bias: rng.normal_f32(v, 0.0, 0.5),
        weights: rng.uniform_f32(n, 0.25, 2.0),
        targets,
        grad_tokens: rng.uniform_f32(n, -1.0, 1.0),
        dlse: rng.normal_f32(n, 0.0, 0.1),
    }
}

impl Case {
    fn matrices(&self, dtype: DType) -> (Matrix<'_>, Matrix<'_>) {
        match dtype {
            DType::Bf16 => (Matrix::Bf16(&self.xb), Matrix::Bf16(&self.wb)),
            _ => (Matrix::F32(&self.x), Matrix::F32(&self.w)),
        }
    }
}

fn slice<'a>(m: Matrix<'a>, rows: std::ops::Range<usize>, d: usize) -> Matrix<'a> {
    match m {
        Matrix::F32(s) => Matrix::F32(&s[rows.start * d..rows.end * d]),
        Matrix::Bf16(s) => Matrix::Bf16(&s[rows.start * d..rows.end * d]),
    }
}

/// Runs `f` on P LocalGroup ranks; each rank's result, in rank order.
fn on_ranks<R: Send>(
    p: usize,
    f: impl Fn(&LocalComm) -> ring_dtp::Result<R> + Sync,
) -> Vec<ring_dtp::Result<R>> {
    LocalGroup::run(p, LocalGroupOptions::default(), |comm| Ok(f(comm)))
        .into_iter()
        .map(|r| r.map_err(Error::Common).and_then(|x| x))
        .collect()
}

fn grad_of<'a>(config: &Config, g: &'a [f32]) -> GradOutput<'a> {
    match config.reduction {
        Reduction::None => GradOutput::PerToken(g),
        _ => GradOutput::Scalar(0.7),
    }
}

/// Every rank's forward and backward (with dlse), in rank order.
fn run_ring(
    c: &Case,
    config: &Config,
    dtype: DType,
    p: usize,
    (budget, options): (Budget, RingOptions),
) -> (RingPlan, Vec<(Forward, Gradients)>) {
    let plan = RingPlan::new(
        config,
        Shape { tokens: c.n, hidden: c.d, vocab: c.v, dtype },
        budget,
        options.ranks(p),
    )
    .expect("plan");
    let (x, w) = c.matrices(dtype);
    let results = on_ranks(p, |comm: &LocalComm| {
        use flatpeak_common::comm::Communicator;
        let r = comm.rank();
        let (t, s) = (plan.tokens(r), plan.shard(r));
        let inputs =
            Inputs::new(slice(x, t.clone(), c.d), slice(w, s.clone(), c.d), &c.targets[t.clone()], c.d)
                .with_bias(&c.bias[s])
                .with_weights(&c.weights[t.clone()]);
        let mut ring = RingLinearCrossEntropy::new(plan, Device::Cpu)?;
        let fwd = ring.forward(comm, &inputs)?;
        let grad = grad_of(config, &c.grad_tokens[t.clone()]);
        let g = ring.backward(comm, &inputs, &fwd, Upstream::loss(grad).with_dlse(Some(&c.dlse[t])))?;
        // No message of the ring outlives its pass: a stray one would fail the barrier.
        comm.barrier()?;
        Ok((fwd, g))
    });
    (plan, results.into_iter().map(|r| r.expect("rank succeeds")).collect())
}

/// bf16 inputs under [`Precision::Native`] round the logit gradient to bf16 before dX and dW
/// (`tests/ring_dtp.rs` checks that choice against the naive bf16 computation): the reference
/// models it, and a value of G rounded the other way than the f64 reference's (near a rounding
/// boundary) moves dX and dW by up to one bf16 ulp of a term, hence the looser bound
/// (that of `tests/ring_dtp.rs`).
fn gradient_check(config: &Config, dtype: DType) -> (Rounding, f64) {
    if dtype == DType::Bf16 && config.precision != Precision::F32 {
        (Rounding::Bf16Gradient, 2f64.powi(-8))
    } else {
        (Rounding::Exact, TOL)
    }
}

fn scaled_error(got: &[f32], want: &[f64], scale: &[f64]) -> f64 {
    let diff: f64 = got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).powi(2)).sum::<f64>().sqrt();
    let norm: f64 = scale.iter().map(|s| s * s).sum::<f64>().sqrt();
    if diff == 0.0 { 0.0 } else { diff / norm }
}

fn check_against_reference(
    c: &Case,
    config: &Config,
    dtype: DType,
    p: usize,
    options: (Budget, RingOptions),
) {
    let (plan, ranks) = run_ring(c, config, dtype, p, options);
    compare(c, config, dtype, &plan, &ranks);
}

/// The ranks' pieces, reassembled in rank order, against the f64 reference of the whole problem.
fn compare(c: &Case, config: &Config, dtype: DType, plan: &RingPlan, ranks: &[(Forward, Gradients)]) {
    let p = plan.world();
    let (x, w) = c.matrices(dtype);
    let full = Inputs::new(x, w, &c.targets, c.d).with_bias(&c.bias).with_weights(&c.weights);
    let (rounding, grad_tol) = gradient_check(config, dtype);
    let grad = grad_of(config, &c.grad_tokens);
    let r = reference::run_rounded(
        &full,
        config,
        ring_dtp::Upstream::loss(grad).with_dlse(Some(&c.dlse)),
        rounding,
    )
    .expect("reference");
    let what = format!("P={p} {:?} {dtype} C={} Vb={}", plan.kind(), plan.token_block(), plan.vocab_block());
    let (mut lse, mut dx, mut dw, mut db, mut per_token) = (vec![], vec![], vec![], vec![], vec![]);
    for (fwd, g) in ranks {
        lse.extend_from_slice(&fwd.lse);
        dx.extend_from_slice(&g.dx);
        dw.extend_from_slice(&g.dw);
        db.extend_from_slice(g.dbias.as_ref().expect("bias given"));
        match &fwd.loss {
            Loss::PerToken(l) => per_token.extend_from_slice(l),
            Loss::Scalar(l) => {
                let err = (l - r.loss).abs() / r.loss_scale.max(1e-30);
                assert!(err <= TOL, "{what}: loss {l} vs {} (scale {})", r.loss, r.loss_scale);
                assert_eq!(fwd.loss, ranks[0].0.loss, "{what}: every rank holds the same loss");
            }
        }
    }
    if config.reduction == Reduction::None {
        let e = scaled_error(&per_token, &r.per_token, &r.per_token_scale);
        assert!(e <= TOL, "{what}: per-token loss error {e:e}");
    }
    let e = relative_error(&lse, &r.lse);
    assert!(e <= TOL, "{what}: lse error {e:e}");
    for (name, got, want, scale, tol) in [
        ("dx", &dx, &r.dx, &r.dx_scale, grad_tol),
        ("dw", &dw, &r.dw, &r.dw_scale, grad_tol),
        ("dbias", &db, &r.dbias, &r.dbias_scale, TOL),
    ] {
        let e = scaled_error(got, want, scale);
        assert!(e <= tol, "{what}: {name} error {e:e}");
    }
}

fn all_features(reduction: Reduction) -> Config {
    let mut config = Config::default().reduction(reduction);
    (config.label_smoothing, config.z_loss, config.softcap) = (0.1, 1e-4, Softcap::Tanh { cap: 30.0 });
    config
}

#[test]
fn every_world_size_and_ring_matches_the_reference() {
    // N and V prime, so no P divides them; at P = 7 the last rank owns 1 token of 61.
    let c = make_case(61, 24, 131, 7);
    for p in [1, 2, 3, 4, 7] {
        for kind in [RingKind::Weight, RingKind::Activation] {
            // A small budget forces several blocks per shard and per rank.
            let options = (Budget::Bytes(64 << 10), RingOptions::default().ring(kind));
            check_against_reference(&c, &all_features(Reduction::None), DType::F32, p, options);
            check_against_reference(&c, &Config::default(), DType::F32, p, options);
        }
    }
}

/// The single-device path on the whole problem, with the same features and inputs.
fn single_device(c: &Case, config: &Config, dtype: DType) -> (Forward, Gradients) {
    let (x, w) = c.matrices(dtype);
    let full = Inputs::new(x, w, &c.targets, c.d).with_bias(&c.bias).with_weights(&c.weights);
    let plan =
        Plan::new(config, Shape { tokens: c.n, hidden: c.d, vocab: c.v, dtype }, Budget::Bytes(1 << 24))
            .expect("single-device plan");
    let fwd = cpu::forward(&plan, &full).expect("forward");
    let grads = cpu::backward(
        &plan,
        &full,
        &fwd,
        Upstream::loss(grad_of(config, &c.grad_tokens)).with_dlse(Some(&c.dlse)),
    )
    .expect("backward");
    (fwd, grads)
}

/// The ranks' pieces, reassembled, against the single-device path: within the tolerance of
/// each quantity's scale (both are within it of the f64 reference, in different orders).
fn compare_single_device(c: &Case, config: &Config, dtype: DType, ranks: &[(Forward, Gradients)]) {
    let (x, w) = c.matrices(dtype);
    let full = Inputs::new(x, w, &c.targets, c.d).with_bias(&c.bias).with_weights(&c.weights);
    let r = reference::run(&full, config, grad_of(config, &c.grad_tokens), Some(&c.dlse)).expect("reference");
    let (fwd, g) = single_device(c, config, dtype);
    let wide = |v: &[f32]| v.iter().map(|&a| a as f64).collect::<Vec<f64>>();
    let cat = |f: fn(&(Forward, Gradients)) -> &[f32]| {
        ranks.iter().flat_map(|r| f(r).to_vec()).collect::<Vec<f32>>()
    };
    let bias = |g: &Gradients| g.dbias.clone().expect("bias given");
    let what = format!("P={} {dtype} vs single device", ranks.len());
    let lse = cat(|r| &r.0.lse);
    assert_eq!(lse.len(), fwd.lse.len(), "{what}: lse length");
    let e = relative_error(&lse, &wide(&fwd.lse));
    assert!(e <= 2.0 * TOL, "{what}: lse error {e:e}");
    let pieces = [
        ("dx", cat(|r| &r.1.dx), wide(&g.dx), r.dx_scale.clone()),
        ("dw", cat(|r| &r.1.dw), wide(&g.dw), r.dw_scale.clone()),
        ("dbias", ranks.iter().flat_map(|(_, g)| bias(g)).collect(), wide(&bias(&g)), r.dbias_scale.clone()),
    ];
    let grad_tol = gradient_check(config, dtype).1;
    for (name, got, want, scale) in pieces {
        let lengths = (got.len(), want.len(), scale.len());
        assert!(lengths.0 == lengths.1 && lengths.1 == lengths.2, "{what}: {name} lengths {lengths:?}");
        let e = scaled_error(&got, &want, &scale);
        let tol = if name == "dbias" { TOL } else { grad_tol };
        assert!(e <= 2.0 * tol, "{what}: {name} error {e:e}");
    }
    match (&fwd.loss, &ranks[0].0.loss) {
        (Loss::Scalar(a), Loss::Scalar(b)) => {
            let e = (a - b).abs() / r.loss_scale.max(1e-30);
            assert!(e <= 2.0 * TOL, "{what}: loss {b} vs {a}");
        }
        (Loss::PerToken(a), Loss::PerToken(_)) => {
            let per_token = |f: &Forward| match &f.loss {
                Loss::PerToken(l) => l.clone(),
                Loss::Scalar(_) => Vec::new(),
            };
            let got: Vec<f32> = ranks.iter().flat_map(|(f, _)| per_token(f)).collect();
            assert_eq!(got.len(), a.len(), "{what}: per-token losses");
            let e = scaled_error(&got, &wide(a), &r.per_token_scale);
            assert!(e <= 2.0 * TOL, "{what}: per-token loss error {e:e}");
        }
        (a, b) => panic!("{what}: loss kinds differ: {a:?} vs {b:?}"),
    }
}

fn ring_config_strategy() -> impl Strategy<Value = Config> {
    (
        prop_oneof![Just(Reduction::Mean), Just(Reduction::Sum), Just(Reduction::None)],
        prop_oneof![Just(0.0f32), Just(0.1)],
        prop_oneof![Just(0.0f32), Just(1e-4)],
        prop_oneof![Just(Softcap::Off), Just(Softcap::Tanh { cap: 30.0 })],
    )
        .prop_map(|(reduction, smoothing, z_loss, softcap)| {
            let mut config = Config::default().reduction(reduction);
            (config.label_smoothing, config.z_loss, config.softcap) = (smoothing, z_loss, softcap);
            config
        })
}

proptest! {
    #![proptest_config(proptest_config(24))]

    /// Random shapes, world sizes, rings, dtypes, budgets and features: the ring equals the
    /// f64 reference and the single-device path.
    #[test]
    fn random_rings_match_the_reference_and_the_single_device_path(
        n in 1usize..80, d in 1usize..24, v in 1usize..200, seed in any::<u64>(),
        p in prop::sample::select(vec![1usize, 2, 3, 4, 7]),
        kind in prop_oneof![Just(RingKind::Weight), Just(RingKind::Activation)],
        bf16_inputs in any::<bool>(), config in ring_config_strategy(),
        budget in prop_oneof![Just(1usize << 14), Just(1 << 16), Just(1 << 22)],
    ) {
        let c = make_case(n, d, v, seed);
        let dtype = if bf16_inputs { DType::Bf16 } else { DType::F32 };
        // A budget below the smallest schedule is raised to it.
        let options = (Budget::Bytes(budget), RingOptions::default().ring(kind));
        let options = match RingPlan::new(&config, Shape { tokens: n, hidden: d, vocab: v, dtype }, options.0, options.1.ranks(p)) {
            Err(Error::BudgetTooSmall { needed, .. }) => (Budget::Bytes(needed), RingOptions::default().ring(kind)),
            _ => options,
        };
        let (plan, ranks) = run_ring(&c, &config, dtype, p, options);
        compare(&c, &config, dtype, &plan, &ranks);
        compare_single_device(&c, &config, dtype, &ranks);
    }
}

#[test]
fn bf16_sum_and_tiny_vocabularies() {
    // V < P: some ranks own no vocabulary rows; N < P: some own no tokens.
    for (n, v, p) in [(45, 37, 4), (5, 3, 7), (3, 50, 4)] {
        let c = make_case(n, 16, v, n as u64);
        for kind in [RingKind::Weight, RingKind::Activation] {
            let options = (Budget::Bytes(48 << 10), RingOptions::default().ring(kind));
            check_against_reference(&c, &all_features(Reduction::Sum), DType::Bf16, p, options);
            check_against_reference(&c, &all_features(Reduction::Mean), DType::F32, p, options);
        }
    }
}

#[test]
fn auto_ring_follows_the_shapes() {
    let config = Config::default();
    let a = RingPlan::new(
        &config,
        Shape { tokens: 64, hidden: 8, vocab: 4096, dtype: DType::F32 },
        Budget::mib(64),
        RingOptions::default().ranks(4),
    )
    .unwrap();
    let b = RingPlan::new(
        &config,
        Shape { tokens: 4096, hidden: 8, vocab: 64, dtype: DType::F32 },
        Budget::mib(64),
        RingOptions::default().ranks(4),
    )
    .unwrap();
    assert_eq!((a.kind(), b.kind()), (RingKind::Activation, RingKind::Weight));
}

#[test]
fn bitwise_reproducible_run_to_run_and_on_any_gemm_threads() {
    let c = make_case(97, 32, 211, 9);
    for kind in [RingKind::Weight, RingKind::Activation] {
        let options = (Budget::Bytes(96 << 10), RingOptions::default().ring(kind));
        let config = all_features(Reduction::Mean);
        let (_, a) = run_ring(&c, &config, DType::F32, 3, options);
        let (_, b) =
            run_ring(&c, &config, DType::F32, 3, (options.0, options.1.gemm_threads(Threads::Single)));
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for ((fa, ga), (fb, gb)) in a.iter().zip(&b) {
            assert_eq!(fa, fb);
            assert_eq!(bits(&ga.dx), bits(&gb.dx));
            assert_eq!(bits(&ga.dw), bits(&gb.dw));
        }
    }
}

#[test]
fn bad_input_is_a_typed_error_on_every_rank() {
    let c = make_case(20, 8, 30, 11);
    let config = Config::default();
    let plan = RingPlan::new(
        &config,
        Shape { tokens: 20, hidden: 8, vocab: 30, dtype: DType::F32 },
        Budget::mib(64),
        RingOptions::default().ranks(2),
    )
    .unwrap();
    let mut targets = c.targets.clone();
    targets[3] = 30;
    let results = on_ranks(2, |comm: &LocalComm| {
        use flatpeak_common::comm::Communicator;
        let r = comm.rank();
        let (t, s) = (plan.tokens(r), plan.shard(r));
        let inputs = Inputs::new(
            Matrix::F32(&c.x[t.start * 8..t.end * 8]),
            Matrix::F32(&c.w[s.start * 8..s.end * 8]),
            &targets[t],
            8,
        );
        RingLinearCrossEntropy::new(plan, Device::Cpu)?.forward(comm, &inputs)
    });
    assert_eq!(
        results[0].as_ref().unwrap_err(),
        &Error::TargetOutOfRange { token: 3, target: 30, vocab: 30 }
    );
    // Rank 1's inputs are fine: the verdicts are agreed on before the first message, so it
    // raises the peer's refusal, naming it, instead of waiting on the ring.
    assert!(
        matches!(&results[1], Err(Error::Common(flatpeak_common::Error::PeerInput { rank: 0, message, .. }))
            if message.contains("target 30 of token 3")),
        "{:?}",
        results[1]
    );
    // A negative weight on rank 1's tokens: rank 1 names it; rank 0 learns its peer is gone.
    let mut weights = vec![1.0f32; c.n];
    weights[plan.tokens(1).start + 2] = -1.0;
    let results = on_ranks(2, |comm: &LocalComm| {
        use flatpeak_common::comm::Communicator;
        let (t, s) = (plan.tokens(comm.rank()), plan.shard(comm.rank()));
        let inputs = Inputs::new(
            Matrix::F32(&c.x[t.start * 8..t.end * 8]),
            Matrix::F32(&c.w[s.start * 8..s.end * 8]),
            &c.targets[t.clone()],
            8,
        )
        .with_weights(&weights[t]);
        RingLinearCrossEntropy::new(plan, Device::Cpu)?.forward(comm, &inputs)
    });
    assert!(matches!(results[1], Err(Error::InvalidWeight { token: 2, weight: -1.0 })), "{:?}", results[1]);
    assert!(
        matches!(&results[0], Err(Error::Common(flatpeak_common::Error::PeerInput { rank: 1, .. }))),
        "{:?}",
        results[0]
    );
    // A bias on one rank only would change which messages the ring sends: refused on both.
    let bias = [0.5f32; 30];
    let results = on_ranks(2, |comm: &LocalComm| {
        use flatpeak_common::comm::Communicator;
        let (t, s) = (plan.tokens(comm.rank()), plan.shard(comm.rank()));
        let inputs = Inputs::new(
            Matrix::F32(&c.x[t.start * 8..t.end * 8]),
            Matrix::F32(&c.w[s.start * 8..s.end * 8]),
            &c.targets[t],
            8,
        );
        let inputs = if comm.rank() == 0 { inputs.with_bias(&bias[s]) } else { inputs };
        RingLinearCrossEntropy::new(plan, Device::Cpu)?.forward(comm, &inputs)
    });
    for r in results {
        assert!(matches!(&r, Err(Error::InvalidConfig { field: "bias", .. })), "{r:?}");
    }
    // Ranks that planned different rings: refused on both before any message.
    let other = RingPlan::new(
        &config,
        Shape { tokens: 20, hidden: 8, vocab: 30, dtype: DType::F32 },
        Budget::mib(64),
        RingOptions::default().ranks(2).ring(if plan.kind() == RingKind::Weight {
            RingKind::Activation
        } else {
            RingKind::Weight
        }),
    )
    .unwrap();
    let results = on_ranks(2, |comm: &LocalComm| {
        use flatpeak_common::comm::Communicator;
        let mine = if comm.rank() == 0 { &plan } else { &other };
        let (t, s) = (mine.tokens(comm.rank()), mine.shard(comm.rank()));
        let inputs = Inputs::new(
            Matrix::F32(&c.x[t.start * 8..t.end * 8]),
            Matrix::F32(&c.w[s.start * 8..s.end * 8]),
            &c.targets[t],
            8,
        );
        RingLinearCrossEntropy::new(*mine, Device::Cpu)?.forward(comm, &inputs)
    });
    for r in results {
        assert!(matches!(&r, Err(Error::InvalidConfig { field: "plan", .. })), "{r:?}");
    }
    // A plan for another world size, and shards of the wrong shape.
    let results = on_ranks(3, |comm: &LocalComm| {
        let inputs = Inputs::new(Matrix::F32(&c.x[..80]), Matrix::F32(&c.w[..120]), &c.targets[..10], 8);
        RingLinearCrossEntropy::new(plan, Device::Cpu)?.forward(comm, &inputs)
    });
    for r in results {
        assert!(matches!(r, Err(Error::ShapeMismatch { what: "world size", expected: 2, got: 3 })));
    }
    let results = on_ranks(2, |comm: &LocalComm| {
        let inputs = Inputs::new(Matrix::F32(&c.x[..80]), Matrix::F32(&c.w[..119]), &c.targets[..10], 8);
        RingLinearCrossEntropy::new(plan, Device::Cpu)?.forward(comm, &inputs)
    });
    for r in results {
        assert!(matches!(r, Err(Error::ShapeMismatch { what: "w shard (v_r·d)", expected: 120, got: 119 })));
    }
    let f16 = RingPlan::new(
        &config,
        Shape { tokens: 20, hidden: 8, vocab: 30, dtype: DType::F16 },
        Budget::mib(64),
        RingOptions::default().ranks(2),
    );
    assert!(matches!(f16, Err(Error::InvalidConfig { field: "dtype", .. })));
}

/// The device rings over every local GPU through NCCL (one rank per device; NCCL does not put
/// two ranks on one GPU, so a one-GPU machine runs P = 1), both rings, f32 and bf16.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device and NCCL"]
fn device_rings_match_the_reference() {
    use flatpeak_common::cuda::cudarc::driver::CudaContext;
    use flatpeak_common::nccl::NcclComm;
    use ring_dtp::cuda::{DeviceGradients, DeviceInputs, DeviceMatrix};
    if !flatpeak_common::nccl::nccl_available() {
        eprintln!("skipped: libnccl is not installed on this machine");
        return;
    }
    let p = flatpeak_common::cuda_device_count().expect("a CUDA device");
    let c = make_case(61, 24, 131, 7);
    for kind in [RingKind::Weight, RingKind::Activation] {
        for dtype in [DType::F32, DType::Bf16] {
            let config = all_features(Reduction::None);
            let options = (Budget::Bytes(64 << 10), RingOptions::default().ring(kind));
            let plan = RingPlan::new(
                &config,
                Shape { tokens: c.n, hidden: c.d, vocab: c.v, dtype },
                options.0,
                options.1.ranks(p),
            )
            .expect("plan");
            let streams = (0..p).map(|i| CudaContext::new(i).expect("context").default_stream()).collect();
            let comms = NcclComm::for_devices(streams).expect("NCCL");
            let ranks: Vec<(Forward, Gradients)> = std::thread::scope(|scope| {
                let handles: Vec<_> = comms
                    .into_iter()
                    .enumerate()
                    .map(|(r, comm)| {
                        let (c, plan, config) = (&c, &plan, &config);
                        scope.spawn(move || {
                            let s = flatpeak_common::nccl::DeviceCommunicator::stream(&comm).clone();
                            let (t, sh) = (plan.tokens(r), plan.shard(r));
                            let d = c.d;
                            let (xf, wf) = (
                                s.clone_htod(&c.x[t.start * d..t.end * d]).unwrap(),
                                s.clone_htod(&c.w[sh.start * d..sh.end * d]).unwrap(),
                            );
                            let (xb, wb) = (
                                s.clone_htod(&c.xb[t.start * d..t.end * d]).unwrap(),
                                s.clone_htod(&c.wb[sh.start * d..sh.end * d]).unwrap(),
                            );
                            let (x, w) = match dtype {
                                DType::Bf16 => (DeviceMatrix::Bf16(&xb), DeviceMatrix::Bf16(&wb)),
                                _ => (DeviceMatrix::F32(&xf), DeviceMatrix::F32(&wf)),
                            };
                            let targets = s.clone_htod(&c.targets[t.clone()]).unwrap();
                            let bias = s.clone_htod(&c.bias[sh]).unwrap();
                            let weights = s.clone_htod(&c.weights[t.clone()]).unwrap();
                            let inputs = DeviceInputs::on_device(x, w, &targets, d)
                                .with_bias(&bias)
                                .with_weights(&weights);
                            let mut ring = RingLinearCrossEntropy::new(*plan, Device::Cuda(r)).expect("ring");
                            let fwd = ring.forward(&comm, &inputs).expect("forward");
                            let grad = grad_of(config, &c.grad_tokens[t.clone()]);
                            let g: DeviceGradients = ring
                                .backward(
                                    &comm,
                                    &inputs,
                                    &fwd,
                                    Upstream::loss(grad).with_dlse(Some(&c.dlse[t])),
                                )
                                .expect("backward");
                            let down = |v: &flatpeak_common::cuda::cudarc::driver::CudaSlice<f32>,
                                        len: usize| {
                                s.clone_dtoh(&v.slice(..len)).unwrap()
                            };
                            let (n_r, v_r) = (plan.tokens(r).len(), plan.shard(r).len());
                            let grads = Gradients {
                                dx: down(&g.dx, n_r * d),
                                dw: down(&g.dw, v_r * d),
                                dbias: g.dbias.as_ref().map(|b| down(b, v_r)),
                            };
                            ring.synchronize(&comm).expect("synchronize before the communicator drops");
                            (fwd, grads)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
            });
            compare(&c, &config, dtype, &plan, &ranks);
        }
    }
}

/// Every path runs the config its plan carries, checked when the plan is made: an invalid one is
/// refused there, with the offending field named, for a single device and for a ring alike.
#[test]
fn executors_revalidate_the_config_they_are_given() {
    let c = make_case(12, 4, 10, 9);
    let config = Config::default();
    let shape = Shape { tokens: c.n, hidden: c.d, vocab: c.v, dtype: DType::F32 };
    let bad = config.label_smoothing(1.5);
    let err = Plan::new(&bad, shape, Budget::Unlimited).unwrap_err();
    assert!(matches!(err, Error::InvalidConfig { field: "label_smoothing", .. }), "{err}");
    let refused = RingPlan::new(&bad, shape, Budget::Unlimited, RingOptions::default().ranks(2));
    assert!(matches!(refused, Err(Error::InvalidConfig { field: "label_smoothing", .. })), "{refused:?}");
}

/// Fault injection: one rank's communicator fails at each of its operations in turn, on both
/// rings. The failing rank returns the injected error, every rank returns (under a short group
/// timeout, so a hang fails the test), and a pass on a fresh group afterwards matches the
/// reference: nothing global is left broken.
#[test]
fn a_rank_failing_at_any_ring_step_fails_promptly_and_the_next_pass_runs() {
    use flatpeak_common::comm::Communicator;
    use flatpeak_common::testing::FaultyComm;
    let c = make_case(24, 8, 40, 12);
    let p = 3;
    let options = LocalGroupOptions::with_timeout(std::time::Duration::from_secs(20));
    for kind in [RingKind::Weight, RingKind::Activation] {
        let config = Config::default();
        let shape = Shape { tokens: c.n, hidden: c.d, vocab: c.v, dtype: DType::F32 };
        let plan = RingPlan::new(
            &config,
            shape,
            Budget::Bytes(64 << 10),
            RingOptions::default().ring(kind).ranks(p),
        )
        .expect("plan");
        let (x, w) = c.matrices(DType::F32);
        let d = c.d;
        for failing in 0..p {
            let mut fail_at = 0;
            loop {
                let endpoints = LocalGroup::endpoints(p, options).expect("group");
                let results: Vec<ring_dtp::Result<usize>> = std::thread::scope(|scope| {
                    let handles: Vec<_> = endpoints
                        .into_iter()
                        .map(|comm| {
                            let (plan, targets) = (&plan, &c.targets);
                            scope.spawn(move || {
                                let r = comm.rank();
                                let comm =
                                    FaultyComm::new(comm, if r == failing { fail_at } else { usize::MAX });
                                let (t, s) = (plan.tokens(r), plan.shard(r));
                                let inputs = Inputs::new(
                                    slice(x, t.clone(), d),
                                    slice(w, s.clone(), d),
                                    &targets[t],
                                    d,
                                );
                                let mut ring = RingLinearCrossEntropy::new(*plan, Device::Cpu)?;
                                let fwd = ring.forward(&comm, &inputs)?;
                                ring.backward(&comm, &inputs, &fwd, GradOutput::Scalar(1.0).into())?;
                                Ok(comm.ops())
                            })
                        })
                        .collect();
                    handles.into_iter().map(|h| h.join().expect("no panic")).collect()
                });
                let what = format!("{kind:?}: rank {failing} failing at operation {fail_at}");
                match &results[failing] {
                    // The fault lay past this rank's last operation: every rank passed.
                    Ok(ops) => {
                        assert!(
                            *ops <= fail_at && fail_at > 4,
                            "{what}: every operation before it was failed once"
                        );
                        assert!(results.iter().all(|r| r.is_ok()), "{what}");
                        break;
                    }
                    Err(e) => assert!(
                        matches!(e, Error::InvalidConfig { field: "injected fault", .. }),
                        "{what}: {e:?}"
                    ),
                }
                fail_at += 1;
                assert!(fail_at < 10_000, "{what}: the pass never ends");
            }
        }
        // A fresh group afterwards runs the pass exactly.
        check_against_reference(
            &c,
            &config,
            DType::F32,
            p,
            (Budget::Bytes(64 << 10), RingOptions::default().ring(kind)),
        );
    }
}
