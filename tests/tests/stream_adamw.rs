//! stream-adamw against an f64 reference of torch's AdamW, and the promises of the schedule:
//! pipelined == serial bitwise, thread count does not change a bit, non-finite gradients touch
//! nothing, state round-trips, and bad input is a typed error.

use flatpeak_common::relative_error;
use flatpeak_common::testing::{SplitMix64, proptest_config};
use half::bf16;
use proptest::prelude::*;
use stream_adamw::cpu::reference;
use stream_adamw::{
    Budget, Config, Error, GradClip, GradElement, HostDevice, Hyperparameters, Link, Objective, Plan,
    StepOptions, StepOutcome, StepSchedule, StreamAdamW, Variant,
};

/// The optimizer of `master` with `hyperparameters` and `options`, made the one way: a plan,
/// `StreamAdamW::new(plan, device)`, the master parameters loaded.
fn optimizer<G: GradElement>(
    master: Vec<f32>,
    hyperparameters: Hyperparameters,
    options: &Config,
    device: stream_adamw::Device,
) -> Result<StreamAdamW<G, bf16>, Error> {
    let config = options.hyperparameters(hyperparameters);
    let plan = Plan::new(&config, StreamAdamW::<G, bf16>::shape(master.len()), Budget::Unlimited)?;
    let mut opt = StreamAdamW::new(plan, device)?;
    opt.load_master(&master)?;
    Ok(opt)
}

/// Default hyperparameters with `edit` applied (the config is `#[non_exhaustive]`).
fn cfg(edit: impl FnOnce(&mut Hyperparameters)) -> Hyperparameters {
    let mut config = Hyperparameters::default();
    edit(&mut config);
    config
}

fn grads_f32(n: usize, seed: u64, std: f32) -> Vec<f32> {
    SplitMix64::new(seed).normal_f32(n, 0.0, std)
}

/// Runs `steps` steps and returns (optimizer, device) after them.
fn run<G: GradElement + Copy>(
    master: &[f32],
    grads: &[Vec<G>],
    config: Hyperparameters,
    options: Config,
    step: StepOptions,
) -> (StreamAdamW<G, bf16>, Vec<bf16>) {
    let n = master.len();
    let mut opt = optimizer::<G>(master.to_vec(), config, &options, stream_adamw::Device::Cpu).unwrap();
    let mut device = HostDevice::new(grads[0].clone(), vec![bf16::ZERO; n], Link::Memcpy);
    for g in grads {
        device.grads.copy_from_slice(g);
        let report = opt.step(&mut device, step).unwrap();
        assert_eq!(report.outcome, StepOutcome::Applied);
    }
    (opt, device.params)
}

fn config_strategy() -> impl Strategy<Value = Hyperparameters> {
    (
        1e-5f64..1e-1,
        prop_oneof![Just(0.0), 0.5f64..0.99],
        0.9f64..0.9999,
        1e-10f64..1e-6,
        prop_oneof![Just(0.0), 0.0f64..0.1],
        prop_oneof![Just(Variant::Adam), Just(Variant::AmsGrad)],
        prop_oneof![Just(Objective::Minimize), Just(Objective::Maximize)],
        prop_oneof![
            Just(GradClip::None),
            (0.05f64..5.0).prop_map(|max_norm| GradClip::GlobalNorm { max_norm })
        ],
    )
        .prop_map(|(lr, beta1, beta2, eps, weight_decay, variant, objective, clip)| {
            let mut c = Hyperparameters::default().lr(lr);
            (c.beta1, c.beta2, c.eps, c.weight_decay, c.variant, c.objective, c.clip) =
                (beta1, beta2, eps, weight_decay, variant, objective, clip);
            c
        })
}

fn size_strategy() -> impl Strategy<Value = usize> {
    prop_oneof![Just(0usize), Just(1), Just(15), Just(17), Just(65_539), 2usize..3000]
}

/// ‖got − want‖₂ / ‖scale‖₂ (0 when both are 0).
fn scaled_error(got: &[f32], want: &[f64], scale: &[f64]) -> f64 {
    let diff: f64 = got.iter().zip(want).map(|(&g, &w)| (g as f64 - w).powi(2)).sum::<f64>().sqrt();
    let norm: f64 = scale.iter().map(|s| s * s).sum::<f64>().sqrt();
    if diff == 0.0 { 0.0 } else { diff / norm }
}

/// Checks the f32 state after the steps against the f64 reference fed the same (widened)
/// gradients.
fn check_against_reference(
    master: &[f32],
    grads: &[Vec<f32>],
    config: Hyperparameters,
    step: StepOptions,
    opt_state: &stream_adamw::StateDict,
) -> Result<(), TestCaseError> {
    let mut r = reference::State::new(master);
    for g in grads {
        let g64: Vec<f64> = g.iter().map(|&x| x as f64).collect();
        let norm = g64.iter().map(|x| x * x).sum::<f64>().sqrt() * step.grad_scale;
        let coef = stream_adamw::hyperparameters::clip_coefficient(config.clip, norm);
        reference::step(&mut r, &g64, &config, coef * step.grad_scale);
    }
    prop_assert_eq!(opt_state.step, grads.len() as u64);
    // Norm-wise relative error, normalised by the magnitudes each recurrence sums: the same as
    // ‖got − want‖/‖want‖ when nothing cancels, and still meaningful when m or θ of a short
    // vector cancels to near zero (where no f32 implementation can be relatively accurate).
    for (what, got, want, scale) in [
        ("param", &opt_state.param, &r.param, &r.param_scale),
        ("exp_avg", &opt_state.exp_avg, &r.exp_avg, &r.exp_avg_scale),
        ("exp_avg_sq", &opt_state.exp_avg_sq, &r.exp_avg_sq, &r.exp_avg_sq),
    ] {
        let err = scaled_error(got, want, scale);
        prop_assert!(err <= 1e-6, "{} relative error {:e}", what, err);
    }
    if config.variant == Variant::AmsGrad && !master.is_empty() {
        let got = opt_state.max_exp_avg_sq.as_ref().expect("AMSGrad state");
        let err = relative_error(got, &r.max_exp_avg_sq);
        prop_assert!(err <= 1e-6, "max_exp_avg_sq relative error {:e}", err);
    }
    Ok(())
}

proptest! {
    #![proptest_config(proptest_config(24))]

    #[test]
    fn matches_torch_adamw_in_f64_over_ten_steps_f32_grads(
        n in size_strategy(), config in config_strategy(), seed in any::<u64>(),
        bucket in prop_oneof![Just(64usize), Just(128), Just(1024)], loss_scale in prop_oneof![Just(1.0f64), Just(1024.0)],
    ) {
        let master = SplitMix64::new(seed).normal_f32(n, 0.0, 1.0);
        let grads: Vec<Vec<f32>> = (0..10).map(|s| grads_f32(n, seed ^ (s + 1), 0.1 * loss_scale as f32)).collect();
        let step = StepOptions::unscale(loss_scale);
        let (opt, params) = run(&master, &grads, config, Config::default().bucket_elems(bucket), step);
        check_against_reference(&master, &grads, config, step, &opt.export_state())?;
        prop_assert!(params.iter().zip(opt.state().param()).all(|(p, x)| *p == bf16::from_f32(*x)));
    }

    #[test]
    fn matches_torch_adamw_in_f64_over_ten_steps_bf16_grads(
        n in size_strategy(), config in config_strategy(), seed in any::<u64>(),
    ) {
        let master = SplitMix64::new(seed).normal_f32(n, 0.0, 1.0);
        let grads: Vec<Vec<bf16>> = (0..10)
            .map(|s| grads_f32(n, seed ^ (s + 1), 0.1).iter().map(|&x| bf16::from_f32(x)).collect())
            .collect();
        let (opt, _) = run(&master, &grads, config, Config::default().bucket_elems(256), StepOptions::default());
        // The reference sees the same gradients: widening bf16 → f32 is exact.
        let widened: Vec<Vec<f32>> = grads.iter().map(|g| g.iter().map(|x| x.to_f32()).collect()).collect();
        check_against_reference(&master, &widened, config, StepOptions::default(), &opt.export_state())?;
    }

    #[test]
    fn pipelined_equals_serial_bitwise(
        n in size_strategy(), config in config_strategy(), seed in any::<u64>(),
        bucket in prop_oneof![Just(64usize), Just(192), Just(4096)], slots in 1usize..6,
    ) {
        let master = SplitMix64::new(seed).normal_f32(n, 0.0, 1.0);
        let grads: Vec<Vec<f32>> = (0..3).map(|s| grads_f32(n, seed ^ (s + 7), 0.1)).collect();
        let pipe = Config::default().bucket_elems(bucket).slots(slots);
        let serial = pipe.schedule(StepSchedule::Serial);
        let (a, pa) = run(&master, &grads, config, pipe, StepOptions::default());
        let (b, pb) = run(&master, &grads, config, serial, StepOptions::default());
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let (sa, sb) = (a.export_state(), b.export_state());
        prop_assert_eq!(bits(&sa.param), bits(&sb.param));
        prop_assert_eq!(bits(&sa.exp_avg), bits(&sb.exp_avg));
        prop_assert_eq!(bits(&sa.exp_avg_sq), bits(&sb.exp_avg_sq));
        prop_assert_eq!(pa, pb);
    }
}

#[test]
fn thread_count_does_not_change_a_bit() {
    let n = 300_001;
    let master = SplitMix64::new(1).normal_f32(n, 0.0, 1.0);
    let grads: Vec<Vec<f32>> = (0..3).map(|s| grads_f32(n, 10 + s, 0.1)).collect();
    let config = cfg(|c| {
        c.variant = Variant::AmsGrad;
        c.clip = GradClip::GlobalNorm { max_norm: 1.0 };
    });
    let on = |threads: usize| {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        pool.install(|| {
            run(&master, &grads, config, Config::default().bucket_elems(1 << 16), StepOptions::default())
        })
    };
    let (one, p1) = on(1);
    for threads in [2, 7] {
        let (other, p) = on(threads);
        assert_eq!(one.export_state(), other.export_state(), "{threads} threads");
        assert_eq!(p1, p);
    }
}

#[test]
fn non_finite_gradients_skip_the_step_and_touch_nothing() {
    let n = 5000;
    let master = SplitMix64::new(2).normal_f32(n, 0.0, 1.0);
    for schedule in [StepSchedule::Serial, StepSchedule::Pipelined] {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let options = Config::default().bucket_elems(512).schedule(schedule);
            let mut opt = optimizer::<f32>(
                master.clone(),
                Hyperparameters::default(),
                &options,
                stream_adamw::Device::Cpu,
            )
            .unwrap();
            let mut device = HostDevice::new(grads_f32(n, 3, 0.1), vec![bf16::ONE; n], Link::Memcpy);
            opt.step(&mut device, StepOptions::default()).unwrap();
            let (before, params_before) = (opt.export_state(), device.params.clone());
            device.grads = grads_f32(n, 4, 0.1);
            device.grads[4321] = bad;
            let report = opt.step(&mut device, StepOptions::default()).unwrap();
            assert_eq!(report.outcome, StepOutcome::SkippedNonFinite);
            assert_eq!(report.step, 1);
            assert!(!report.grad_norm.is_finite());
            assert_eq!(opt.export_state(), before, "{schedule:?} {bad}");
            assert_eq!(device.params, params_before);
        }
    }
}

#[test]
fn state_round_trips_exactly() {
    let n = 2048;
    let master = SplitMix64::new(5).normal_f32(n, 0.0, 1.0);
    let grads: Vec<Vec<f32>> = (0..6).map(|s| grads_f32(n, 20 + s, 0.1)).collect();
    let config = cfg(|c| c.variant = Variant::AmsGrad);
    let options = Config::default().bucket_elems(256);
    let (whole, _) = run(&master, &grads, config, options, StepOptions::default());
    let (first, _) = run(&master, &grads[..3], config, options, StepOptions::default());
    let mut resumed = optimizer::<f32>(vec![0.0; n], config, &options, stream_adamw::Device::Cpu).unwrap();
    resumed.import_state(first.export_state()).unwrap();
    let mut device = HostDevice::new(vec![0.0; n], vec![bf16::ZERO; n], Link::Memcpy);
    for g in &grads[3..] {
        device.grads.copy_from_slice(g);
        resumed.step(&mut device, StepOptions::default()).unwrap();
    }
    assert_eq!(resumed.export_state(), whole.export_state());
}

#[test]
fn bad_input_is_a_typed_error_never_a_panic() {
    let bad_configs = [
        (cfg(|c| c.beta1 = 1.0), "beta1"),
        (cfg(|c| c.beta2 = -0.5), "beta2"),
        (cfg(|c| c.eps = 0.0), "eps"),
        (cfg(|c| c.eps = -1e-8), "eps"),
        (cfg(|c| c.lr = f64::NAN), "lr"),
        (cfg(|c| c.beta1 = f64::NAN), "beta1"),
        (cfg(|c| c.weight_decay = f64::INFINITY), "weight_decay"),
    ];
    for (config, name) in bad_configs {
        match optimizer::<f32>(vec![0.0; 4], config, &Config::default(), stream_adamw::Device::Cpu) {
            Err(Error::InvalidConfig { field: n, .. }) => assert_eq!(n, name),
            other => panic!("{name}: {other:?}"),
        }
    }
    let mut opt = optimizer::<f32>(
        vec![0.0; 4],
        Hyperparameters::default(),
        &Config::default(),
        stream_adamw::Device::Cpu,
    )
    .unwrap();
    let mut short = HostDevice::new(vec![0.0f32; 3], vec![bf16::ZERO; 4], Link::Memcpy);
    assert_eq!(
        opt.step(&mut short, StepOptions::default()).unwrap_err(),
        Error::ShapeMismatch { what: "device grads", expected: 4, got: 3 }
    );
    let mut ok = HostDevice::new(vec![0.1f32; 4], vec![bf16::ZERO; 4], Link::Memcpy);
    assert!(matches!(
        opt.step(&mut ok, StepOptions::with_grad_scale(0.0)),
        Err(Error::InvalidConfig { field: "grad_scale", .. })
    ));
    // A link that cannot carry the copies (a regression: it once stepped as `Applied`).
    for gbps in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        let mut dead = HostDevice::new(vec![0.1f32; 4], vec![bf16::ZERO; 4], Link::Simulated { gbps });
        match opt.step(&mut dead, StepOptions::default()) {
            Err(Error::InvalidConfig { field: "link gbps", .. }) => {}
            other => panic!("link of {gbps} GB/s: {other:?}"),
        }
        assert!(dead.params.iter().all(|p| *p == bf16::ZERO), "{gbps}: nothing written");
    }
    assert_eq!(opt.state().step(), 0);
    let mut dict = opt.export_state();
    dict.exp_avg.pop();
    assert!(matches!(opt.import_state(dict), Err(Error::ShapeMismatch { what: "exp_avg", .. })));
    let mut dict = opt.export_state();
    dict.max_exp_avg_sq = Some(vec![0.0; 4]);
    assert!(matches!(opt.import_state(dict), Err(Error::StateMismatch { .. })));
    // A second moment that is negative or not finite would make every later step NaN: refused,
    // and the state is what it was.
    let before = opt.export_state();
    for bad in [-1e-3f32, f32::NAN, f32::INFINITY] {
        let mut dict = opt.export_state();
        dict.exp_avg_sq[2] = bad;
        match opt.import_state(dict) {
            Err(Error::InvalidState { what: "exp_avg_sq", index: 2, .. }) => {}
            other => panic!("{bad}: {other:?}"),
        }
        assert_eq!(opt.export_state(), before);
    }
    // A CUDA device that is not there: an error that says why, never a silent CPU fallback.
    let missing = stream_adamw::Device::Cuda(1 << 20);
    match optimizer::<f32>(vec![0.0; 4], Hyperparameters::default(), &Config::default(), missing) {
        Err(Error::Common(flatpeak_common::Error::CudaUnavailable { reason })) => assert!(!reason.is_empty()),
        other => panic!("expected CudaUnavailable, got {other:?}"),
    }
    assert_eq!(opt.device(), stream_adamw::Device::Cpu);
    assert!(matches!(
        optimizer::<f32>(
            vec![0.0; 4],
            Hyperparameters::default(),
            &Config::default().bucket_elems(100), stream_adamw::Device::Cpu),
        Err(Error::InvalidConfig { field: "bucket_elems", ref value, .. }) if value == "100"
    ));
}

/// The statistics pass (Σ g², the non-finite check) on every backend: the CPU path, the
/// `stream_adamw.cu` kernel under the SIMT emulator, and on a device.
fn statistics_pass_matches_f64(backend: flatpeak_common::testing::Backend) {
    fn sum_sq<G: stream_adamw::GradElement>(backend: flatpeak_common::testing::Backend, g: &[G]) -> f64 {
        use flatpeak_common::testing::Backend;
        match backend {
            Backend::Cpu => stream_adamw::cpu::grad_sq_sum(g),
            #[cfg(feature = "cuda-emu")]
            Backend::CudaEmu => stream_adamw::emu::grad_sq_sum(g).expect("emulated launch"),
            #[cfg(feature = "cuda")]
            Backend::Cuda => cuda_sum_sq(g),
            #[allow(unreachable_patterns)]
            other => panic!("{other:?} is not built into this test binary"),
        }
    }
    for n in [0usize, 1, 31, 255, 256, 257, 1025, 5000] {
        let g = grads_f32(n, n as u64 + 1, 0.5);
        let want: f64 = g.iter().map(|&x| (x as f64) * (x as f64)).sum();
        let got = sum_sq(backend, &g);
        assert!((got - want).abs() <= 1e-12 * want.max(1.0), "f32 n={n}: {got} vs {want}");
        let h: Vec<bf16> = g.iter().map(|&x| bf16::from_f32(x)).collect();
        let want: f64 = h.iter().map(|x| (x.to_f32() as f64).powi(2)).sum();
        let got = sum_sq(backend, &h);
        assert!((got - want).abs() <= 1e-12 * want.max(1.0), "bf16 n={n}: {got} vs {want}");
        if n > 0 {
            let mut bad = g.clone();
            bad[n / 2] = f32::NAN;
            assert!(!sum_sq(backend, &bad).is_finite(), "NaN n={n}");
            bad[n / 2] = f32::NEG_INFINITY;
            assert!(!sum_sq(backend, &bad).is_finite(), "inf n={n}");
        }
    }
}

#[cfg(feature = "cuda")]
fn cuda_sum_sq<G: stream_adamw::GradElement>(g: &[G]) -> f64 {
    let plan = stream_adamw::Plan::new(
        &Config::default(),
        StreamAdamW::<G, bf16>::shape(g.len()),
        stream_adamw::Budget::Unlimited,
    )
    .expect("plan");
    let offload = stream_adamw::cuda::CudaOffload::<G, bf16>::new(&plan, 0).expect("a CUDA device");
    let dev = offload.compute_stream().clone_htod(g).expect("upload");
    offload.grad_sq_sum(&dev).expect("statistics kernel")
}

flatpeak_common::test_backends!(statistics_pass, statistics_pass_matches_f64);

/// On a GPU: the pipelined CUDA step equals the CPU fallback's step bitwise, and so does the
/// serial CUDA step; non-finite gradients skip it. Ignored without a device.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_step_equals_the_cpu_step_bitwise() {
    use stream_adamw::cuda::CudaDevice;
    let n = 1_000_003;
    let master = SplitMix64::new(31).normal_f32(n, 0.0, 1.0);
    let grads: Vec<Vec<f32>> = (0..3).map(|s| grads_f32(n, 40 + s, 0.1)).collect();
    let config = cfg(|c| c.clip = GradClip::GlobalNorm { max_norm: 1.0 });
    let options = Config::default().bucket_elems(1 << 16);
    let (cpu, cpu_params) = run(&master, &grads, config, options, StepOptions::default());
    for schedule in [StepSchedule::Pipelined, StepSchedule::Serial] {
        let device = stream_adamw::Device::Cuda(0);
        let mut opt =
            optimizer::<f32>(master.clone(), config, &options.schedule(schedule), device).expect("device");
        let stream = flatpeak_common::cuda::context(0).expect("a CUDA device").default_stream();
        let mut device = CudaDevice {
            grads: stream.clone_htod(&grads[0]).expect("upload"),
            params: stream.alloc_zeros::<bf16>(n).expect("alloc"),
        };
        for g in &grads {
            stream.memcpy_htod(g, &mut device.grads).expect("upload");
            let report = opt.step(&mut device, StepOptions::default()).expect("step");
            assert_eq!(report.outcome, StepOutcome::Applied);
        }
        assert_eq!(opt.export_state(), cpu.export_state(), "{schedule:?}");
        assert_eq!(stream.clone_dtoh(&device.params).expect("download"), cpu_params, "{schedule:?}");
        let mut bad = grads[0].clone();
        bad[n - 1] = f32::NAN;
        stream.memcpy_htod(&bad, &mut device.grads).expect("upload");
        let before = opt.export_state();
        let report = opt.step(&mut device, StepOptions::default()).expect("step");
        assert_eq!(report.outcome, StepOutcome::SkippedNonFinite);
        assert_eq!(opt.export_state(), before);
    }
}

/// Fault injection: each stage fails at each bucket, under both failure policies. The error is
/// typed and returns (under a watchdog); `step` never moves. A failure before any bucket's
/// update leaves everything untouched. After some updates: `Poison` refuses to step until a
/// consistent state is imported; `Rollback` restores the state and the device parameters
/// exactly. Either way the next step is the clean run's, bit for bit.
#[test]
fn an_injected_failure_at_every_stage_and_bucket_is_typed_and_leaves_a_known_state() {
    use stream_adamw::{Fault, OnFailure, Stage};
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let n = 4 * 256 + 17; // 5 buckets, the last one short
        let master = grads_f32(n, 1, 1.0);
        let config = cfg(|c| c.lr = 1e-2);
        let (g1, g2) = (grads_f32(n, 2, 0.1), grads_f32(n, 3, 0.1));
        for on_failure in [OnFailure::Poison, OnFailure::Rollback] {
            let options = Config::default().bucket_elems(256).slots(2).on_failure(on_failure);
            let fresh =
                || optimizer::<f32>(master.clone(), config, &options, stream_adamw::Device::Cpu).unwrap();
            // The run that never fails: two steps.
            let mut clean = fresh();
            let mut clean_device = HostDevice::new(g1.clone(), vec![bf16::ZERO; n], Link::Memcpy);
            clean.step(&mut clean_device, StepOptions::default()).unwrap();
            let after_one = (clean.export_state(), clean_device.params.clone());
            clean_device.grads.copy_from_slice(&g2);
            clean.step(&mut clean_device, StepOptions::default()).unwrap();
            let buckets = clean.plan().n_buckets();
            assert_eq!(buckets, 5);
            for stage in [Stage::D2h, Stage::Adam, Stage::H2d] {
                for bucket in 0..buckets {
                    let what = format!("{on_failure:?}: {stage:?} at bucket {bucket}");
                    let mut opt = fresh();
                    let mut device = HostDevice::new(g1.clone(), vec![bf16::ZERO; n], Link::Memcpy);
                    opt.step(&mut device, StepOptions::default()).unwrap();
                    let before = (opt.export_state(), device.params.clone());
                    assert_eq!(before, after_one, "{what}");
                    device.grads.copy_from_slice(&g2);
                    opt.inject_fault(Fault { stage, bucket });
                    let err = opt.step(&mut device, StepOptions::default()).unwrap_err();
                    assert!(matches!(err, Error::PipelineStage { .. }), "{what}: {err:?}");
                    assert_eq!(opt.state().step(), 1, "{what}: the step count never moves on a failure");
                    let untouched = bucket == 0 && stage != Stage::H2d;
                    if untouched || on_failure == OnFailure::Rollback {
                        assert!(!opt.is_poisoned(), "{what}");
                        assert_eq!(opt.export_state(), before.0, "{what}: the state is as before");
                        assert_eq!(device.params, before.1, "{what}: the device parameters are as before");
                    } else {
                        assert!(opt.is_poisoned(), "{what}");
                        let refused = opt.step(&mut device, StepOptions::default()).unwrap_err();
                        assert!(
                            matches!(refused, Error::Poisoned { step: 1, buckets: 5, .. }),
                            "{what}: {refused:?}"
                        );
                        opt.import_state(before.0.clone()).unwrap();
                        device.params.copy_from_slice(&before.1);
                    }
                    // The next step is the clean run's second step, bit for bit.
                    opt.step(&mut device, StepOptions::default()).unwrap();
                    assert_eq!(opt.export_state(), clean.export_state(), "{what}");
                    assert_eq!(device.params, clean_device.params, "{what}");
                }
            }
        }
        done.send(()).unwrap();
    });
    finished.recv_timeout(std::time::Duration::from_secs(120)).expect("no hang");
}

#[test]
fn hyperparameters_change_between_steps_but_not_the_variant() {
    let n = 300;
    let mut opt =
        optimizer::<f32>(grads_f32(n, 1, 1.0), cfg(|_| ()), &Config::default(), stream_adamw::Device::Cpu)
            .unwrap();
    opt.set_hyperparameters(cfg(|c| c.lr = 5e-3)).unwrap();
    assert_eq!(opt.hyperparameters().lr, 5e-3);
    assert!(matches!(
        opt.set_hyperparameters(cfg(|c| c.lr = -1.0)),
        Err(Error::InvalidConfig { field: "lr", .. })
    ));
    assert!(matches!(
        opt.set_hyperparameters(cfg(|c| c.variant = Variant::AmsGrad)),
        Err(Error::StateMismatch { .. })
    ));
    assert_eq!(opt.hyperparameters().lr, 5e-3, "a refused change changes nothing");
}
