//! The gradient buffers a backward writes. Selection ([`GradientSelection`]): a backward that
//! skips dX, dW or dbias (a frozen input, weight or bias) computes the others bit for bit as the
//! backward of every gradient does. bf16 outputs ([`Bf16GradientsMut`]): they hold, bit for bit,
//! the fp32 backward's gradients rounded to bf16 (dbias, f32, equal). Both on each backend that
//! runs on the CPU (the fast path, the device schedule under the emulator), f32 and bf16 inputs
//! (native and f32 GEMMs), both schedules (fused and forward then backward), with and without a
//! bias; a buffer whose length disagrees with the selection is a `ShapeMismatch` naming it, with
//! nothing written; shapes without a block give zeros; the rings refuse a selection they do not
//! honour.

use flatpeak_common::comm::{Communicator, LocalGroup, LocalGroupOptions};
use flatpeak_common::testing::{Backend, SplitMix64};
use flatpeak_common::{DType, Precision};
use half::bf16;
use ring_dtp::{
    Bf16GradientsMut, Budget, Config, Device, Error, Forward, GradOutput, GradientBuffers, GradientSelection,
    GradientsMut, Inputs, LinearCrossEntropy, Matrix, Plan, RingLinearCrossEntropy, RingOptions, RingPlan,
    Shape, Upstream, Want,
};

/// One problem: X (N×D), W (V×D), a bias, targets (some ignored) and an upstream lse gradient.
struct Case {
    n: usize,
    d: usize,
    v: usize,
    x: Vec<f32>,
    w: Vec<f32>,
    bias: Vec<f32>,
    targets: Vec<i64>,
    dlse: Vec<f32>,
}

fn make_case(n: usize, d: usize, v: usize, seed: u64) -> Case {
    let mut rng = SplitMix64::new(seed);
    let x = rng.normal_f32(n * d, 0.0, 1.0);
    let w = rng.normal_f32(v * d, 0.0, 1.0 / (d as f32).sqrt());
    let bias = rng.normal_f32(v, 0.0, 0.1);
    let targets = (0..n).map(|i| if i % 5 == 3 { -100 } else { ((i * 7919) % v.max(1)) as i64 }).collect();
    let dlse = rng.normal_f32(n, 0.0, 0.1);
    Case { n, d, v, x, w, bias, targets, dlse }
}

/// The selections checked against every gradient computed.
fn selections() -> [GradientSelection; 5] {
    let all = GradientSelection::ALL;
    [
        all.dw(Want::Skip),
        all.dx(Want::Skip),
        all.dbias(Want::Skip),
        all.dx(Want::Skip).dbias(Want::Skip),
        all.dx(Want::Skip).dw(Want::Skip).dbias(Want::Skip),
    ]
}

/// How forward and backward are called.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Call {
    /// `backward_into` from forward's lse, with an upstream gradient of the lse too.
    Backward,
    /// `forward_backward_into` (the loss is the last op).
    Fused,
}

/// Gradient buffers for `wanted`: NaN where computed (stale values must not leak), empty or
/// absent where skipped.
struct Buffers {
    dx: Vec<f32>,
    dw: Vec<f32>,
    dbias: Option<Vec<f32>>,
    wanted: GradientSelection,
}

impl Buffers {
    fn new(c: &Case, has_bias: bool, wanted: GradientSelection) -> Self {
        let sized = |want: Want, len: usize| vec![f32::NAN; if want.is_computed() { len } else { 0 }];
        Self {
            dx: sized(wanted.dx, c.n * c.d),
            dw: sized(wanted.dw, c.v * c.d),
            dbias: (has_bias && wanted.dbias.is_computed()).then(|| vec![f32::NAN; c.v]),
            wanted,
        }
    }

    fn as_mut(&mut self) -> GradientsMut<'_> {
        GradientsMut::new(&mut self.dx, &mut self.dw, self.dbias.as_deref_mut()).selecting(self.wanted)
    }
}

/// Runs `call` on `backend` into `out` (fp32 or bf16 buffers); the forward it ran (or was given).
fn run(
    backend: Backend,
    plan: &Plan,
    inp: &Inputs<'_>,
    (call, fwd, dlse): (Call, &Forward, &[f32]),
    out: impl GradientBuffers,
) -> Result<Forward, Error> {
    let grad = GradOutput::Scalar(0.75);
    let upstream = Upstream::loss(grad).with_dlse(Some(dlse));
    match backend {
        Backend::Cpu => {
            let mut lce = LinearCrossEntropy::new(*plan, Device::Cpu)?;
            match call {
                Call::Backward => lce.backward_into(inp, &fwd.lse, upstream, out).map(|()| fwd.clone()),
                Call::Fused => lce.forward_backward_into(inp, grad, out),
            }
        }
        #[cfg(feature = "cuda-emu")]
        Backend::CudaEmu => match call {
            Call::Backward => {
                ring_dtp::emu::backward_into(plan, inp, &fwd.lse, upstream, out).map(|()| fwd.clone())
            }
            Call::Fused => ring_dtp::emu::forward_backward_into(plan, inp, grad, out),
        },
        #[allow(unreachable_patterns)]
        other => panic!("{other:?} is not built in"),
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// A shape `(N, D, V)` and the blocks `(C, Vb)` it runs on.
type Problem = (usize, usize, usize, &'static [(usize, usize)]);

/// Buffers of lengths `(dx, dw, dbias)` for a selection, and the mismatch `(what, expected,
/// got)` they give.
type Mismatch = (GradientSelection, (usize, usize, Option<usize>), (&'static str, usize, usize));

/// One configuration of a problem, ready to run: the case, its plan and inputs, forward's
/// result, how backward is called, and a description for assertion messages.
struct Setup<'a> {
    case: &'a Case,
    plan: Plan,
    inp: Inputs<'a>,
    fwd: Forward,
    call: Call,
    has_bias: bool,
    what: String,
}

impl Setup<'_> {
    /// Runs this setup's call on `backend` into `out`.
    fn run(&self, backend: Backend, out: impl GradientBuffers) -> Result<Forward, Error> {
        run(backend, &self.plan, &self.inp, (self.call, &self.fwd, &self.case.dlse), out)
    }
}

/// Runs `check` on every configuration of `shapes` on `backend`: f32 and bf16 inputs, native and
/// f32 GEMMs, with and without a bias, each shape's blocks, `backward_into` and the fused call.
fn for_each_setup(backend: Backend, shapes: &[Problem], config: Config, check: impl Fn(&Setup<'_>)) {
    for &(n, d, v, blocks) in shapes {
        let c = make_case(n, d, v, (n * v) as u64);
        let (xb, wb): (Vec<bf16>, Vec<bf16>) = (
            c.x.iter().map(|&a| bf16::from_f32(a)).collect(),
            c.w.iter().map(|&a| bf16::from_f32(a)).collect(),
        );
        let operands = [
            (DType::F32, Matrix::F32(&c.x), Matrix::F32(&c.w)),
            (DType::Bf16, Matrix::Bf16(&xb), Matrix::Bf16(&wb)),
        ];
        for (dtype, x, w) in operands {
            for precision in [Precision::Native, Precision::F32] {
                for has_bias in [true, false] {
                    let config = config.precision(precision);
                    let mut inp = Inputs::new(x, w, &c.targets, d);
                    if has_bias {
                        inp = inp.with_bias(&c.bias);
                    }
                    for &blocks in blocks {
                        let shape = Shape { tokens: n, hidden: d, vocab: v, dtype };
                        let plan = Plan::with_blocks(&config, shape, blocks).expect("plan");
                        let fwd = ring_dtp::cpu::forward(&plan, &inp).expect("forward");
                        for call in [Call::Backward, Call::Fused] {
                            let what = format!(
                                "{backend:?} {dtype:?} {precision:?} bias={has_bias} {blocks:?} {call:?}"
                            );
                            let fwd = fwd.clone();
                            check(&Setup { case: &c, plan, inp, fwd, call, has_bias, what });
                        }
                    }
                }
            }
        }
    }
}

/// Every selection against the backward of every gradient, bit for bit, on `backend`.
fn skipped_gradients_leave_the_others_bitwise_unchanged(backend: Backend) {
    // A small ragged shape, and one whose vocabulary spans several bf16 widening sub-blocks and
    // splits dX's GEMM in two (`DxPartial`) on the full-vocabulary schedule.
    let shapes: &[Problem] = &[(13, 6, 37, &[(5, 37), (5, 16)]), (9, 4, 4500, &[(8, 4500), (8, 2500)])];
    let config = Config::default().label_smoothing(0.1).z_loss(1e-3);
    for_each_setup(backend, shapes, config, |s| {
        let what = &s.what;
        let mut all = Buffers::new(s.case, s.has_bias, GradientSelection::ALL);
        s.run(backend, all.as_mut()).expect("all");
        assert!(all.dx.iter().chain(&all.dw).all(|g| g.is_finite()), "{what}");
        for wanted in selections() {
            let mut some = Buffers::new(s.case, s.has_bias, wanted);
            let f = s.run(backend, some.as_mut()).unwrap_or_else(|e| panic!("{what} {wanted:?}: {e}"));
            assert_eq!(bits(&f.lse), bits(&s.fwd.lse), "lse {what} {wanted:?}");
            let pick = |want: Want, g: &[f32]| if want.is_computed() { bits(g) } else { vec![] };
            assert_eq!(bits(&some.dx), pick(wanted.dx, &all.dx), "dx {what} {wanted:?}");
            assert_eq!(bits(&some.dw), pick(wanted.dw, &all.dw), "dw {what} {wanted:?}");
            let dbias = all.dbias.as_deref().filter(|_| wanted.dbias.is_computed());
            assert_eq!(some.dbias.as_deref().map(bits), dbias.map(bits), "dbias {what} {wanted:?}");
        }
    });
}

/// A buffer whose length disagrees with the selection is a `ShapeMismatch` naming it, before
/// anything runs, on `backend`.
fn a_buffer_that_disagrees_with_the_selection_is_a_shape_mismatch(backend: Backend) {
    let c = make_case(7, 3, 11, 5);
    let (n, d, v) = (c.n, c.d, c.v);
    let inp = Inputs::new(Matrix::F32(&c.x), Matrix::F32(&c.w), &c.targets, d).with_bias(&c.bias);
    let config = Config::default();
    let plan =
        Plan::new(&config, Shape { tokens: n, hidden: d, vocab: v, dtype: DType::F32 }, Budget::Unlimited)
            .expect("plan");
    let fwd = ring_dtp::cpu::forward(&plan, &inp).expect("forward");
    let all = GradientSelection::ALL;
    let cases: [Mismatch; 6] = [
        // A skipped gradient given its full buffer.
        (all.dx(Want::Skip), (n * d, v * d, Some(v)), ("dx (skipped: empty)", 0, n * d)),
        (all.dw(Want::Skip), (n * d, v * d, Some(v)), ("dw (skipped: empty)", 0, v * d)),
        (
            all.dbias(Want::Skip),
            (n * d, v * d, Some(v)),
            ("dbias (absent: no bias, or its gradient skipped)", 0, v),
        ),
        // A computed gradient given an empty buffer (what a skipped one has).
        (all.dw(Want::Skip), (0, 0, Some(v)), ("dx (n·d)", n * d, 0)),
        (all.dx(Want::Skip), (0, 0, Some(v)), ("dw (v·d)", v * d, 0)),
        (all, (n * d, v * d, None), ("dbias (v, present with a bias whose gradient is computed)", v, 0)),
    ];
    for (wanted, (dx, dw, dbias), (what, expected, got)) in cases {
        let (mut dx, mut dw, mut db) = (vec![0.0; dx], vec![0.0; dw], vec![0.0; dbias.unwrap_or(0)]);
        let out = GradientsMut::new(&mut dx, &mut dw, dbias.map(|_| &mut db[..])).selecting(wanted);
        assert!(out.check(&inp).is_err(), "{wanted:?}");
        for call in [Call::Backward, Call::Fused] {
            let out = GradientsMut::new(&mut dx, &mut dw, dbias.map(|_| &mut db[..])).selecting(wanted);
            match run(backend, &plan, &inp, (call, &fwd, &c.dlse), out) {
                Err(Error::ShapeMismatch { what: w, expected: e, got: g }) => {
                    assert_eq!((w, e, g), (what, expected, got), "{backend:?} {call:?} {wanted:?}")
                }
                other => panic!("{backend:?} {call:?} {wanted:?}: expected ShapeMismatch, got {other:?}"),
            }
        }
    }
}

// The emulated variant runs the device schedule with a CPU GEMM standing in for cuBLAS. No
// CUDA variant (`host_only`): that is the CUDA executor's own tests' (`DeviceGradientsMut` is
// built as these are, and its projection skips the same GEMMs).
flatpeak_common::test_backends!(
    skipped_gradients,
    skipped_gradients_leave_the_others_bitwise_unchanged,
    cpu_gemm,
    host_only
);

flatpeak_common::test_backends!(
    mismatched_buffers,
    a_buffer_that_disagrees_with_the_selection_is_a_shape_mismatch,
    cpu_gemm,
    host_only
);

/// `len` elements where `want` computes the gradient, none where it skips it.
fn sized<T: Copy>(want: Want, len: usize, fill: T) -> Vec<T> {
    vec![fill; if want.is_computed() { len } else { 0 }]
}

fn rounded_bits(g: &[f32]) -> Vec<u16> {
    g.iter().map(|&x| bf16::from_f32(x).to_bits()).collect()
}

fn bf16_bits(g: &[bf16]) -> Vec<u16> {
    g.iter().map(|x| x.to_bits()).collect()
}

/// Every selection, bf16 outputs against the fp32 outputs rounded, on `backend`.
fn bf16_outputs_are_the_fp32_gradients_rounded(backend: Backend) {
    // A ragged shape on both schedules, and one whose token blocks of 24 rows × 700 columns
    // end mid-page, whose vocabulary spans several bf16 widening sub-blocks and splits dX's GEMM.
    let shapes: &[Problem] = &[(13, 6, 37, &[(5, 37), (5, 16)]), (61, 700, 2300, &[(24, 2300), (24, 1000)])];
    for_each_setup(backend, shapes, Config::default().label_smoothing(0.1), |s| {
        let (what, c) = (&s.what, s.case);
        let all = GradientSelection::ALL;
        for wanted in [all, all.dw(Want::Skip), all.dx(Want::Skip).dbias(Want::Skip)] {
            let mut fp32 = Buffers::new(c, s.has_bias, wanted);
            let f32_fwd = s.run(backend, fp32.as_mut()).unwrap_or_else(|e| panic!("{what} {wanted:?}: {e}"));
            // Stale values in the bf16 buffers must not leak into the result.
            let (mut dx, mut dw, mut db) = (
                sized(wanted.dx, c.n * c.d, bf16::NAN),
                sized(wanted.dw, c.v * c.d, bf16::NAN),
                fp32.dbias.as_ref().map(|b| vec![f32::NAN; b.len()]),
            );
            let out = Bf16GradientsMut::new(&mut dx, &mut dw, db.as_deref_mut()).selecting(wanted);
            let bf16_fwd = s.run(backend, out).unwrap_or_else(|e| panic!("{what} {wanted:?}: {e}"));
            assert_eq!(bf16_fwd, f32_fwd, "forward {what} {wanted:?}");
            assert_eq!(bf16_bits(&dx), rounded_bits(&fp32.dx), "dx {what} {wanted:?}");
            assert_eq!(bf16_bits(&dw), rounded_bits(&fp32.dw), "dw {what} {wanted:?}");
            assert_eq!(db.as_deref().map(bits), fp32.dbias.as_deref().map(bits), "dbias {what} {wanted:?}");
        }
    });
}

/// A bf16 buffer of the wrong length is a `ShapeMismatch` naming it before anything runs (the
/// buffers keep their values); shapes without a single block give zero gradients.
fn wrong_lengths_are_refused_and_empty_shapes_give_zeros(backend: Backend) {
    let (n, d, v) = (7, 3, 11);
    let c = make_case(n, d, v, 5);
    let inp = Inputs::new(Matrix::F32(&c.x), Matrix::F32(&c.w), &c.targets, d);
    let shape = Shape { tokens: n, hidden: d, vocab: v, dtype: DType::F32 };
    let plan = Plan::new(&Config::default(), shape, Budget::Unlimited).expect("plan");
    let fwd = ring_dtp::cpu::forward(&plan, &inp).expect("forward");
    for call in [Call::Backward, Call::Fused] {
        let (mut dx, mut dw) = (vec![bf16::ONE; n * d], vec![bf16::ONE; v * d - 1]);
        let out = Bf16GradientsMut::new(&mut dx, &mut dw, None);
        match run(backend, &plan, &inp, (call, &fwd, &c.dlse), out) {
            Err(Error::ShapeMismatch { what: "dw (v·d)", expected: 33, got: 32 }) => {}
            other => panic!("{backend:?} {call:?}: expected ShapeMismatch, got {other:?}"),
        }
        assert!(dx.iter().chain(&dw).all(|&g| g == bf16::ONE), "{backend:?} {call:?}: nothing written");
    }
    // No token, or no vocabulary: every block loop is empty, and the gradients are zero.
    for (n, v) in [(0, 11), (7, 0)] {
        let c = make_case(n, d, v, 9);
        let inp = Inputs::new(Matrix::F32(&c.x), Matrix::F32(&c.w), &c.targets, d);
        let targets: Vec<i64> = vec![-100; n];
        let inp = Inputs { targets: &targets[..], v, ..inp };
        let shape = Shape { tokens: n, hidden: d, vocab: v, dtype: DType::F32 };
        let plan = Plan::new(&Config::default(), shape, Budget::Unlimited).expect("plan");
        let fwd = Forward { loss: ring_dtp::Loss::Scalar(0.0), lse: vec![0.0; n] };
        let dlse = vec![0.0; n];
        for call in [Call::Backward, Call::Fused] {
            let (mut dx, mut dw) = (vec![bf16::NAN; n * d], vec![bf16::NAN; v * d]);
            let out = Bf16GradientsMut::new(&mut dx, &mut dw, None);
            run(backend, &plan, &inp, (call, &fwd, &dlse), out)
                .unwrap_or_else(|e| panic!("{backend:?} N={n} V={v} {call:?}: {e}"));
            assert!(dx.iter().chain(&dw).all(|&g| g == bf16::ZERO), "{backend:?} N={n} V={v} {call:?}");
        }
    }
}

flatpeak_common::test_backends!(
    bf16_outputs_rounded,
    bf16_outputs_are_the_fp32_gradients_rounded,
    cpu_gemm,
    host_only
);

flatpeak_common::test_backends!(
    bf16_outputs_refused_and_empty,
    wrong_lengths_are_refused_and_empty_shapes_give_zeros,
    cpu_gemm,
    host_only
);

/// The rings compute every gradient: a selection that skips one is refused on every rank
/// (the checks are agreed on before the first message), never silently ignored.
#[test]
fn the_rings_refuse_a_selection() {
    let c = make_case(6, 4, 10, 9);
    let (n, d, v, p) = (c.n, c.d, c.v, 2);
    let config = Config::default();
    let shape = Shape { tokens: n, hidden: d, vocab: v, dtype: DType::F32 };
    let plan =
        RingPlan::new(&config, shape, Budget::Unlimited, RingOptions::default().ranks(p)).expect("plan");
    let results = LocalGroup::run(p, LocalGroupOptions::default(), |comm| {
        let rank = comm.rank();
        let (t, s) = (plan.tokens(rank), plan.shard(rank));
        let inputs = Inputs::new(
            Matrix::F32(&c.x[t.start * d..t.end * d]),
            Matrix::F32(&c.w[s.start * d..s.end * d]),
            &c.targets[t.clone()],
            d,
        );
        let lse = vec![0.0; t.len()];
        let (mut dx, mut dw) = (vec![0.0; t.len() * d], Vec::new());
        // Rank 0 alone skips dW: every rank refuses.
        let wanted = if rank == 0 { GradientSelection::ALL.dw(Want::Skip) } else { GradientSelection::ALL };
        if rank != 0 {
            dw = vec![0.0; s.len() * d];
        }
        let out = GradientsMut::new(&mut dx, &mut dw, None).selecting(wanted);
        let ring = RingLinearCrossEntropy::new(plan, Device::Cpu);
        Ok(ring.and_then(|mut ring| {
            ring.backward_into(comm, &inputs, &lse, Upstream::loss(GradOutput::Scalar(1.0)), out)
        }))
    });
    for (rank, r) in results.into_iter().enumerate() {
        match r.expect("the group ran") {
            Err(Error::UnsupportedSelection { backend: "the CPU rings", .. }) if rank == 0 => {}
            Err(Error::Common(flatpeak_common::Error::PeerInput { .. })) if rank != 0 => {}
            other => panic!("rank {rank}: expected a refusal, got {other:?}"),
        }
    }
}
