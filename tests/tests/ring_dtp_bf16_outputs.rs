//! bf16 gradient outputs ([`Bf16GradientsMut`]): a backward into them holds, bit for bit, the
//! fp32 backward's gradients rounded to bf16 (dbias, f32, equal), on each backend that runs
//! on the CPU (the fast path, the device schedule under the emulator), for f32 and bf16 inputs,
//! native and f32 GEMMs, both schedules (fused, forward then backward), with and without a
//! bias, every gradient selection, and token blocks that end mid-page; a buffer of the wrong
//! length is a `ShapeMismatch` naming it, with nothing written; shapes without a block give
//! zeros.

use flatpeak_common::testing::{Backend, SplitMix64};
use flatpeak_common::{DType, Precision};
use half::bf16;
use ring_dtp::{
    Bf16GradientsMut, Budget, Config, Device, Error, Forward, GradOutput, GradientBuffers, GradientSelection,
    GradientsMut, Inputs, LinearCrossEntropy, Matrix, Plan, Shape, Upstream, Want,
};

/// One problem: X (N×D), W (V×D), a bias, targets (some ignored) and an upstream lse gradient.
struct Case {
    d: usize,
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
    Case { d, x, w, bias, targets, dlse }
}

/// How forward and backward are called.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Call {
    /// `backward_into` from forward's lse, with an upstream gradient of the lse too.
    Backward,
    /// `forward_backward_into` (the loss is the last op).
    Fused,
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

/// `len` elements where `want` computes the gradient, none where it skips it.
fn sized<T: Copy>(want: Want, len: usize, fill: T) -> Vec<T> {
    vec![fill; if want.is_computed() { len } else { 0 }]
}

fn rounded_bits(g: &[f32]) -> Vec<u16> {
    g.iter().map(|&x| bf16::from_f32(x).to_bits()).collect()
}

fn bits(g: &[bf16]) -> Vec<u16> {
    g.iter().map(|x| x.to_bits()).collect()
}

/// A shape `(N, D, V)` and the blocks `(C, Vb)` it runs on.
type Problem = (usize, usize, usize, &'static [(usize, usize)]);

/// Every selection, bf16 outputs against the fp32 outputs rounded, on `backend`.
fn bf16_outputs_are_the_fp32_gradients_rounded(backend: Backend) {
    // A ragged shape on both schedules, and one whose token blocks of 24 rows × 700 columns
    // end mid-page, whose vocabulary spans several bf16 widening sub-blocks and splits dX's GEMM.
    let shapes: &[Problem] = &[(13, 6, 37, &[(5, 37), (5, 16)]), (61, 700, 2300, &[(24, 2300), (24, 1000)])];
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
                    let config = Config::default().label_smoothing(0.1).precision(precision);
                    let mut inp = Inputs::new(x, w, &c.targets, c.d);
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
                            let all = GradientSelection::ALL;
                            for wanted in [all, all.dw(Want::Skip), all.dx(Want::Skip).dbias(Want::Skip)] {
                                let db_len =
                                    |fill| (has_bias && wanted.dbias.is_computed()).then(|| vec![fill; v]);
                                let (mut dx, mut dw, mut db) = (
                                    sized(wanted.dx, n * d, 0f32),
                                    sized(wanted.dw, v * d, 0f32),
                                    db_len(0f32),
                                );
                                let f32_out =
                                    GradientsMut::new(&mut dx, &mut dw, db.as_deref_mut()).selecting(wanted);
                                let f32_fwd = run(backend, &plan, &inp, (call, &fwd, &c.dlse), f32_out)
                                    .unwrap_or_else(|e| panic!("{what} {wanted:?}: {e}"));
                                // Stale values in the bf16 buffers must not leak into the result.
                                let (mut dx16, mut dw16, mut db16) = (
                                    sized(wanted.dx, n * d, bf16::NAN),
                                    sized(wanted.dw, v * d, bf16::NAN),
                                    db_len(f32::NAN),
                                );
                                let out = Bf16GradientsMut::new(&mut dx16, &mut dw16, db16.as_deref_mut())
                                    .selecting(wanted);
                                let bf16_fwd = run(backend, &plan, &inp, (call, &fwd, &c.dlse), out)
                                    .unwrap_or_else(|e| panic!("{what} {wanted:?}: {e}"));
                                assert_eq!(bf16_fwd, f32_fwd, "forward {what} {wanted:?}");
                                assert_eq!(bits(&dx16), rounded_bits(&dx), "dx {what} {wanted:?}");
                                assert_eq!(bits(&dw16), rounded_bits(&dw), "dw {what} {wanted:?}");
                                let f32_bits = |b: &Option<Vec<f32>>| {
                                    b.as_ref().map(|b| b.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
                                };
                                assert_eq!(f32_bits(&db16), f32_bits(&db), "dbias {what} {wanted:?}");
                            }
                        }
                    }
                }
            }
        }
    }
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
        let inp = Inputs { targets: &targets, v, ..inp };
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

/// The emulated variant runs the device schedule with a CPU GEMM standing in for cuBLAS; a CUDA
/// executor's gradients are fp32 device buffers (a binding narrows them on the device).
mod rounded {
    #[test]
    fn cpu() {
        super::bf16_outputs_are_the_fp32_gradients_rounded(super::Backend::Cpu)
    }
    #[cfg(feature = "cuda-emu")]
    #[test]
    fn cuda_emu_with_cpu_gemm() {
        super::bf16_outputs_are_the_fp32_gradients_rounded(super::Backend::CudaEmu)
    }
}

mod refused_and_empty {
    #[test]
    fn cpu() {
        super::wrong_lengths_are_refused_and_empty_shapes_give_zeros(super::Backend::Cpu)
    }
    #[cfg(feature = "cuda-emu")]
    #[test]
    fn cuda_emu_with_cpu_gemm() {
        super::wrong_lengths_are_refused_and_empty_shapes_give_zeros(super::Backend::CudaEmu)
    }
}
