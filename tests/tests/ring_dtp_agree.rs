//! A ring call of each rank's own tokens ([`ring_dtp::ring::agree`]): ranks with uneven token
//! counts (zero included) get, for their own rows, the loss, lse and gradients of the whole
//! problem on one device, on both rings, f32 and bf16, with every feature; every disagreement
//! between ranks is an error on every rank naming the rank, and the group stays usable after it;
//! a CUDA call's rows per rank are a multiple of the quantum.

use flatpeak_common::comm::{LocalComm, LocalGroup, LocalGroupOptions, Refusal};
use flatpeak_common::testing::SplitMix64;
use flatpeak_common::{Communicator, DTypeNames, Error as CommonError, ErrorKind};
use half::bf16;
use ring_dtp::ring::{AgreedRing, CUDA_ROWS_QUANTUM, RankShare, RingCall, agree};
use ring_dtp::{
    Budget, Config, DType, Device, Error, GradOutput, Gradients, GradientsMut, Inputs, LinearCrossEntropy,
    Loss, LossBudget, Matrix, Plan, Reduction, RingChoice, RingKind, RingLinearCrossEntropy, Shape, Upstream,
};

const D: usize = 6;

/// max |a − b| / max(1, max |b|).
fn relative_error(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1.0f64, |m, &x| m.max(f64::from(x).abs()));
    a.iter().zip(b).fold(0.0f64, |m, (&x, &y)| m.max((f64::from(x) - f64::from(y)).abs())) / scale
}

/// The whole problem: `counts[r]` tokens of rank r (concatenated in rank order), V rows.
struct Problem {
    counts: Vec<usize>,
    v: usize,
    x: Vec<f32>,
    w: Vec<f32>,
    xb: Vec<bf16>,
    wb: Vec<bf16>,
    bias: Vec<f32>,
    weights: Vec<f32>,
    targets: Vec<i64>,
    grad: Vec<f32>,
    /// Whether the tokens carry weights (without them padding must ignore its rows by target).
    weighted: bool,
}

impl Problem {
    fn new(counts: &[usize], v: usize, seed: u64) -> Self {
        let n: usize = counts.iter().sum();
        let mut rng = SplitMix64::new(seed);
        let x = rng.normal_f32(n * D, 0.0, 1.0);
        let w = rng.normal_f32(v * D, 0.0, 0.4);
        let targets = (0..n).map(|i| if i % 4 == 3 { -100 } else { rng.below(v as u64) as i64 }).collect();
        Self {
            counts: counts.to_vec(),
            v,
            xb: x.iter().map(|&a| bf16::from_f32(a)).collect(),
            wb: w.iter().map(|&a| bf16::from_f32(a)).collect(),
            x,
            w,
            bias: rng.normal_f32(v, 0.0, 0.3),
            weights: rng.uniform_f32(n, 0.5, 1.5),
            targets,
            grad: rng.uniform_f32(n, -1.0, 1.0),
            weighted: seed.is_multiple_of(2),
        }
    }

    fn tokens(&self, r: usize) -> std::ops::Range<usize> {
        let start: usize = self.counts[..r].iter().sum();
        start..start + self.counts[r]
    }

    /// Rank r's shard in the ring's layout.
    fn shard(&self, r: usize) -> std::ops::Range<usize> {
        let per = self.v.div_ceil(self.counts.len());
        (r * per).min(self.v)..((r + 1) * per).min(self.v)
    }

    fn matrices(
        &self,
        dtype: DType,
        t: std::ops::Range<usize>,
        s: std::ops::Range<usize>,
    ) -> (Matrix<'_>, Matrix<'_>) {
        match dtype {
            DType::Bf16 => (
                Matrix::Bf16(&self.xb[t.start * D..t.end * D]),
                Matrix::Bf16(&self.wb[s.start * D..s.end * D]),
            ),
            _ => (Matrix::F32(&self.x[t.start * D..t.end * D]), Matrix::F32(&self.w[s.start * D..s.end * D])),
        }
    }

    fn inputs(&self, dtype: DType, r: usize) -> Inputs<'_> {
        let (t, s) = (self.tokens(r), self.shard(r));
        let (x, w) = self.matrices(dtype, t.clone(), s.clone());
        let inputs = Inputs::new(x, w, &self.targets[t.clone()], D).with_bias(&self.bias[s]);
        if self.weighted { inputs.with_weights(&self.weights[t]) } else { inputs }
    }

    fn share(&self, dtype: DType, r: usize) -> RankShare {
        let (t, s) = (self.tokens(r), self.shard(r));
        RankShare { tokens: t.len(), hidden: D, shard: s.len(), dtype, device: Device::Cpu, bias: true }
    }

    /// The loss and gradients of the whole problem on one device.
    fn single_device(&self, config: &Config, dtype: DType) -> (Loss, Vec<f32>, Gradients) {
        let n: usize = self.counts.iter().sum();
        let (x, w) = self.matrices(dtype, 0..n, 0..self.v);
        let inputs = Inputs::new(x, w, &self.targets, D).with_bias(&self.bias);
        let inputs = if self.weighted { inputs.with_weights(&self.weights) } else { inputs };
        let shape = Shape { tokens: n, hidden: D, vocab: self.v, dtype };
        let plan = Plan::new(config, shape, Budget::Unlimited).expect("plan");
        let mut lce = LinearCrossEntropy::new(plan, Device::Cpu).expect("executor");
        let fwd = lce.forward(&inputs).expect("forward");
        let grad = upstream(config, &self.grad);
        let grads = lce.backward(&inputs, &fwd, grad.into()).expect("backward");
        (fwd.loss, fwd.lse, grads)
    }
}

fn upstream<'a>(config: &Config, g: &'a [f32]) -> GradOutput<'a> {
    match config.reduction {
        Reduction::None => GradOutput::PerToken(g),
        _ => GradOutput::Scalar(0.8),
    }
}

/// One rank's call: forward and backward of its own rows.
fn rank_call(
    comm: &LocalComm,
    problem: &Problem,
    (call, dtype): (&RingCall, DType),
) -> ring_dtp::Result<(AgreedRing, Loss, Vec<f32>, Gradients)> {
    let r = comm.rank();
    let agreed = agree(comm, call, Ok::<_, Error>(problem.share(dtype, r)))?;
    let mut ring = RingLinearCrossEntropy::new(*agreed.plan(), Device::Cpu)?;
    let inputs = problem.inputs(dtype, r);
    let fwd = agreed.forward(&mut ring, comm, &inputs)?;
    let (t, s) = (problem.tokens(r), problem.shard(r));
    let mut grads = Gradients {
        dx: vec![f32::NAN; t.len() * D],
        dw: vec![f32::NAN; s.len() * D],
        dbias: Some(vec![f32::NAN; s.len()]),
    };
    let out = GradientsMut::new(&mut grads.dx, &mut grads.dw, grads.dbias.as_deref_mut());
    let grad = upstream(&call.config, &problem.grad[t]);
    agreed.backward_into(&mut ring, comm, &inputs, &fwd.lse, grad.into(), out)?;
    Ok((agreed, fwd.loss, fwd.lse, grads))
}

#[test]
fn uneven_ranks_get_their_rows_of_the_whole_problem_on_both_rings() {
    let configs = [
        Config::default().label_smoothing(0.1).z_loss(1e-3),
        Config::default().reduction(Reduction::None),
        Config::default().reduction(Reduction::Sum),
    ];
    for (seed, counts) in [vec![5, 0, 9, 2], vec![7, 7], vec![0, 3, 1], vec![4, 1, 6]].into_iter().enumerate()
    {
        let problem = Problem::new(&counts, 23, seed as u64);
        for kind in [RingKind::Weight, RingKind::Activation] {
            for dtype in [DType::F32, DType::Bf16] {
                for config in configs {
                    let call = RingCall::default().config(config).ring(RingChoice::Force(kind));
                    let out = LocalGroup::run(counts.len(), LocalGroupOptions::default(), |comm| {
                        Ok(rank_call(comm, &problem, (&call, dtype)))
                    });
                    let (loss, lse, grads) = problem.single_device(&config, dtype);
                    let what = format!("{counts:?} {kind:?} {dtype} {:?}", config.reduction);
                    let tol = if dtype == DType::Bf16 { 2e-2 } else { 1e-5 };
                    let mut dw = Vec::new();
                    let mut dbias = Vec::new();
                    for (r, out) in out.into_iter().enumerate() {
                        let (agreed, rank_loss, rank_lse, rank_grads) =
                            out.unwrap().unwrap_or_else(|e| panic!("{what}: {e}"));
                        let t = problem.tokens(r);
                        let most = *counts.iter().max().unwrap();
                        assert_eq!((agreed.own_tokens(), agreed.planned_tokens()), (t.len(), most), "{what}");
                        assert_eq!(agreed.plan().n_tokens(), most * counts.len(), "{what}");
                        match (&rank_loss, &loss) {
                            (Loss::Scalar(a), Loss::Scalar(b)) => {
                                assert!((a - b).abs() <= tol * b.abs().max(1.0), "{what}: {a} vs {b}")
                            }
                            (Loss::PerToken(a), Loss::PerToken(b)) => {
                                assert!(relative_error(a, &b[t.clone()]) <= tol, "{what}: per-token losses")
                            }
                            other => panic!("{what}: {other:?}"),
                        }
                        assert!(relative_error(&rank_lse, &lse[t.clone()]) <= tol, "{what}: lse");
                        assert!(
                            relative_error(&rank_grads.dx, &grads.dx[t.start * D..t.end * D]) <= tol,
                            "{what}: dx"
                        );
                        dw.extend(rank_grads.dw);
                        dbias.extend(rank_grads.dbias.unwrap());
                    }
                    assert!(relative_error(&dw, &grads.dw) <= tol, "{what}: dw");
                    assert!(relative_error(&dbias, grads.dbias.as_ref().unwrap()) <= tol, "{what}: dbias");
                }
            }
        }
    }
}

/// Each rank's error after `edit` changed what rank `bad` brings, and then a good call on every
/// rank (the group is intact).
fn refused(p: usize, bad: usize, edit: impl Fn(&mut RankShare, &mut RingCall) + Sync) -> Vec<Error> {
    let problem = Problem::new(&vec![4; p], 3 * p, 7);
    let out = LocalGroup::run(p, LocalGroupOptions::default(), |comm| {
        let r = comm.rank();
        let (mut share, mut call) =
            (problem.share(DType::F32, r), RingCall::default().names(DTypeNames::Torch));
        if r == bad {
            edit(&mut share, &mut call);
        }
        let err = agree(comm, &call, Ok::<_, Error>(share)).unwrap_err();
        let good = rank_call(comm, &problem, (&RingCall::default(), DType::F32)).map(|_| ());
        Ok((err, good))
    });
    out.into_iter()
        .map(|r| {
            let (err, good) = r.unwrap();
            good.expect("a good call after the refusal");
            err
        })
        .collect()
}

/// `errors[bad]` is the rank's own refusal and every other rank's a `PeerInput` naming it, of
/// `kind`, each message containing `text`.
fn named(errors: &[Error], bad: usize, kind: ErrorKind, text: &str) {
    for (r, e) in errors.iter().enumerate() {
        let ok = match e {
            Error::Common(CommonError::Refused { kind: k, message }) => {
                r == bad && *k == kind && message.contains(text)
            }
            Error::Common(CommonError::PeerInput { rank, kind: k, message }) => {
                r != bad && *rank == bad && *k == kind && message.contains(text)
            }
            _ => false,
        };
        assert!(ok, "rank {r}: {e:?} (expected rank {bad}'s {kind:?} refusal containing {text:?})");
    }
}

#[test]
fn a_disagreement_between_ranks_is_an_error_on_every_rank_naming_the_rank() {
    named(
        &refused(3, 1, |s, _| s.dtype = DType::Bf16),
        1,
        ErrorKind::Type,
        "rank 1 passed torch.bfloat16 tensors where rank 0 passed torch.float32",
    );
    named(
        &refused(3, 2, |s, _| s.device = Device::Cuda(0)),
        2,
        ErrorKind::Type,
        "rank 2 passed CUDA tensors where rank 0 passed CPU tensors",
    );
    named(
        &refused(3, 2, |s, _| s.hidden = D + 1),
        2,
        ErrorKind::Value,
        "rank 2 passed hidden size 7 where rank 0 passed 6",
    );
    named(
        &refused(2, 1, |_, c| c.config = c.config.label_smoothing(0.2)),
        1,
        ErrorKind::Value,
        "rank 1 passed other loss options than rank 0",
    );
    named(
        &refused(2, 1, |_, c| c.budget = LossBudget::Bytes(1 << 20)),
        1,
        ErrorKind::Value,
        "other loss options",
    );
    named(
        &refused(2, 1, |_, c| c.ring = RingChoice::Force(RingKind::Activation)),
        1,
        ErrorKind::Value,
        "the same ring plan",
    );
    named(
        &refused(3, 1, |s, _| s.bias = false),
        1,
        ErrorKind::Value,
        "rank 1 passed no bias where rank 0 passed a bias shard",
    );
    named(
        &refused(3, 0, |s, _| s.shard -= 1),
        0,
        ErrorKind::Value,
        "the ranks' weight shards have [2, 3, 3] rows",
    );
    // Rank 0 differing is named by the first rank that differs from it.
    named(
        &refused(3, 0, |s, _| s.hidden = D + 1),
        1,
        ErrorKind::Value,
        "rank 1 passed hidden size 6 where rank 0 passed 7",
    );
}

#[test]
fn a_local_refusal_or_a_bad_backward_reaches_every_rank_and_the_group_stays_usable() {
    let problem = Problem::new(&[3, 5, 2], 9, 3);
    let out = LocalGroup::run(3, LocalGroupOptions::default(), |comm| {
        let r = comm.rank();
        let local = if r == 2 {
            Err(Refusal { kind: ErrorKind::Type, message: "target: expected dtype torch.int64".into() })
        } else {
            Ok(problem.share(DType::F32, r))
        };
        let refused = agree(comm, &RingCall::default(), local).map(|_| ()).unwrap_err();
        // A backward whose lse has the wrong length on rank 1: refused on every rank, before the
        // ring's first message.
        let run = || -> ring_dtp::Result<()> {
            let agreed = agree(comm, &RingCall::default(), Ok::<_, Error>(problem.share(DType::F32, r)))?;
            let mut ring = RingLinearCrossEntropy::new(*agreed.plan(), Device::Cpu)?;
            let inputs = problem.inputs(DType::F32, r);
            let fwd = agreed.forward(&mut ring, comm, &inputs)?;
            let (t, s) = (problem.tokens(r), problem.shard(r));
            let lse = if r == 1 { &fwd.lse[1..] } else { &fwd.lse[..] };
            let (mut dx, mut dw, mut db) =
                (vec![0.0; t.len() * D], vec![0.0; s.len() * D], vec![0.0; s.len()]);
            let out = GradientsMut::new(&mut dx, &mut dw, Some(&mut db));
            agreed.backward_into(&mut ring, comm, &inputs, lse, Upstream::loss(GradOutput::Scalar(1.0)), out)
        };
        let bad_backward = run().unwrap_err();
        let good = rank_call(comm, &problem, (&RingCall::default(), DType::F32)).map(|_| ());
        Ok((refused, bad_backward, good))
    });
    let out: Vec<_> = out.into_iter().map(|r| r.unwrap()).collect();
    let refusals: Vec<Error> = out.iter().map(|o| o.0.clone()).collect();
    named(&refusals, 2, ErrorKind::Type, "target: expected dtype torch.int64");
    for (r, (_, bad_backward, good)) in out.into_iter().enumerate() {
        let ok = match &bad_backward {
            Error::ShapeMismatch { what: "lse (this rank's tokens)", expected: 5, got: 4 } => r == 1,
            Error::Common(CommonError::PeerInput { rank: 1, message, .. }) => {
                r != 1 && message.contains("lse")
            }
            _ => false,
        };
        assert!(ok, "rank {r}: {bad_backward:?}");
        good.expect("a good call after the refusals");
    }
}

#[test]
fn a_cuda_calls_rows_per_rank_are_a_multiple_of_the_quantum() {
    let out = LocalGroup::run(2, LocalGroupOptions::default(), |comm| {
        let share = RankShare {
            tokens: [130, 7][comm.rank()],
            hidden: D,
            shard: 5,
            dtype: DType::F32,
            device: Device::Cuda(comm.rank()),
            bias: false,
        };
        Ok(agree(comm, &RingCall::default(), Ok::<_, Error>(share)))
    });
    for (rank, r) in out.into_iter().enumerate() {
        let agreed = r.unwrap().unwrap();
        assert_eq!(
            agreed.plan().n_tokens(),
            2 * 2 * CUDA_ROWS_QUANTUM,
            "⌈130 / 128⌉ × 128 rows on each of 2 ranks"
        );
        assert_eq!(agreed.planned_tokens(), 2 * CUDA_ROWS_QUANTUM);
        assert_eq!(agreed.device(), Device::Cuda(rank));
    }
}
