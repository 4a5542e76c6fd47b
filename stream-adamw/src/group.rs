//! One step's decision over a group of ranks ([`step_parts_over`], [`agree`]): the ranks of a
//! sharded or expert-parallel model each hold some of the parameters, so the skip on a
//! non-finite gradient and the global-norm clip coefficient must come from the gradients of all
//! of them, and be the same on every rank, or the replicas drift apart.
//!
//! Each rank computes its [`Statistics`] (phase one: every buffer checked, nothing written),
//! weighting each part so that every element of the model counts once: a part whose elements
//! `k` ranks hold alike (DDP's replicas, HSDP's replicate axis, the experts' `efsdp` axis) is
//! [`Replicated`] with `k` copies and contributes Σg²/k from each. Then **one** exchange of a
//! few words per rank ([`agree_and_gather`]) carries every rank's verdict on its own input, its
//! step terms (clipping, gradient scale, non-finite policy) and its Σg²'s bits; every rank adds
//! the Σg²s in rank order, so the global norm, the clip coefficient and the skip are bitwise the
//! same everywhere:
//!
//! `‖g‖² = Σ_r Σ_{parts p of r} Σg²_p / copies_p`
//!
//! A rank whose input was bad, or whose terms differ from rank 0's, makes the step an error on
//! every rank before anything is written ([`Error::Common`]: `Refused` there, `PeerInput`
//! elsewhere). Phase two ([`apply_parts`]) is local.
//!
//! ```
//! use stream_adamw::cpu::StateMut;
//! use stream_adamw::{GradRef, Hyperparameters, InPlaceGroup, InPlaceGroups, InPlaceParam, OnNonFinite,
//!     Replicated, StepOptions, step_parts_over};
//! use flatpeak_common::{Communicator, LocalGroup, LocalGroupOptions};
//!
//! // Two ranks, each holding half of a parameter (FSDP's shards: one copy of each element).
//! let reports = LocalGroup::run(2, LocalGroupOptions::default(), |comm| {
//!     let (mut p, mut m, mut v) = (vec![1.0f32; 4], vec![0.0; 4], vec![0.0; 4]);
//!     let grad = vec![if comm.rank() == 0 { 3.0f32 } else { 4.0 }; 4];
//!     let state = StateMut { param: &mut p, exp_avg: &mut m, exp_avg_sq: &mut v, max_exp_avg_sq: &mut [] };
//!     let param = InPlaceParam { state, grad: GradRef::F32(&grad), bf16_param: None, step: 0 };
//!     let mut groups = [InPlaceGroup { hyperparameters: Hyperparameters::default(), params: vec![param] }];
//!     let mut shard = Replicated { part: InPlaceGroups(&mut groups), copies: 1 };
//!     Ok(step_parts_over(comm, &mut [&mut shard], StepOptions::default(), OnNonFinite::Skip))
//! });
//! for report in reports {
//!     assert_eq!(report.unwrap()?.grad_norm, 10.0); // √(4·3² + 4·4²), on both ranks
//! }
//! # Ok::<(), stream_adamw::Error>(())
//! ```

use flatpeak_common::comm::agree_and_gather;
use flatpeak_common::{Communicator, ErrorKind, HasErrorKind};

use crate::error::{Error, Result};
use crate::hyperparameters::GradClip;
use crate::parts::{OnNonFinite, Statistics, StepPart, apply_parts, statistics};
use crate::step::{StepDecision, StepOptions, StepReport};

/// A part whose elements `copies` ranks of the group hold alike (a replicated parameter): each
/// rank adds its Σg² divided by `copies`, so every element counts once in the group's norm.
/// `copies: 1` is a part only this rank holds (a shard, a rank's own experts).
#[derive(Debug)]
pub struct Replicated<P> {
    /// The part.
    pub part: P,
    /// How many ranks of the group hold it (≥ 1).
    pub copies: u64,
}

impl<P: StepPart> StepPart for Replicated<P> {
    fn grad_sq_sum(&mut self) -> Result<f64> {
        if self.copies == 0 {
            return Err(Error::invalid_config("copies", 0, "≥ 1 (the ranks that hold the part)"));
        }
        Ok(self.part.grad_sq_sum()? / self.copies as f64)
    }
    fn check(&mut self) -> Result<()> {
        if self.copies == 0 {
            return Err(Error::invalid_config("copies", 0, "≥ 1 (the ranks that hold the part)"));
        }
        self.part.check()
    }
    fn clip(&self) -> GradClip {
        self.part.clip()
    }
    fn steps(&self) -> u64 {
        self.part.steps()
    }
    fn apply(&mut self, decision: &StepDecision) -> Result<()> {
        self.part.apply(decision)
    }
}

/// The words each rank brings to the agreement.
const WORDS: usize = 5;

/// The words of one rank's statistics and terms: the call's tag, the clipping (kind, bound's
/// bits), the gradient scale's bits, the policy, and Σg²'s bits.
fn words(stats: &Statistics, options: StepOptions, on_nonfinite: OnNonFinite) -> [u64; WORDS] {
    let (kind, bound) = match stats.clip {
        GradClip::None => (0, 0),
        GradClip::GlobalNorm { max_norm } => (1, max_norm.to_bits()),
    };
    let policy = match on_nonfinite {
        OnNonFinite::Skip => 0,
        OnNonFinite::Raise => 1,
        OnNonFinite::Ignore => 2,
    };
    // A step that read no gradient brings no Σg² (every rank with the same terms read none).
    let grad_sq = stats.grad_sq.unwrap_or(0.0);
    [kind, bound, options.grad_scale.to_bits(), policy, grad_sq.to_bits()]
}

/// The terms a rank's words name, as a message shows them.
fn terms(w: &[u64]) -> String {
    let clip =
        if w[0] == 0 { "no clipping".to_string() } else { format!("max_norm = {}", f64::from_bits(w[1])) };
    let policy = match w[3] {
        0 => "skip",
        1 => "raise",
        _ => "ignore",
    };
    format!("{clip}, grad_scale = {}, on_nonfinite = {policy}", f64::from_bits(w[2]))
}

/// The refusal of rank `rank`'s input as rank `me` returns it.
fn refuse(me: usize, rank: usize, kind: ErrorKind, message: String) -> Error {
    let e = if rank == me {
        flatpeak_common::Error::Refused { kind, message }
    } else {
        flatpeak_common::Error::PeerInput { rank, kind, message }
    };
    e.into()
}

/// The decision of a step over `comm`'s ranks, the same on every rank, from every rank's
/// `local` [`Statistics`] (or why it has none: its own input was bad), `options` and
/// `on_nonfinite` (see the module docs). One exchange; every rank returns together: the decision,
/// or an error on every rank (a rank's own error on that rank).
pub fn agree<C, E>(
    comm: &C,
    local: std::result::Result<Statistics, E>,
    options: StepOptions,
    on_nonfinite: OnNonFinite,
) -> std::result::Result<StepDecision, E>
where
    C: Communicator + ?Sized,
    E: HasErrorKind + std::fmt::Display + From<flatpeak_common::Error> + From<Error>,
{
    let mine = match &local {
        Ok(stats) => words(stats, options, on_nonfinite),
        Err(_) => [0; WORDS],
    };
    let (stats, all) = agree_and_gather(comm, local, &mine)?;
    let ranks: Vec<&[u64]> = all.chunks_exact(WORDS).collect();
    let me = comm.rank();
    if let Some(r) = ranks.iter().position(|w| w[..4] != ranks[0][..4]) {
        let message = format!(
            "rank {r} steps with {} where rank 0 steps with {}: every rank of the group must step \
             with the same terms",
            terms(ranks[r]),
            terms(ranks[0])
        );
        return Err(refuse(me, r, ErrorKind::Value, message).into());
    }
    if !on_nonfinite.reads_gradients(stats.clip) {
        // The terms agree: no rank read its gradients.
        return Ok(StepDecision::unchecked(options)?);
    }
    // Every rank adds the same numbers in the same order: the same bits everywhere.
    let grad_sq: f64 = ranks.iter().map(|w| f64::from_bits(w[4])).sum();
    let bad: Vec<usize> = (0..ranks.len()).filter(|&r| !f64::from_bits(ranks[r][4]).is_finite()).collect();
    if on_nonfinite == OnNonFinite::Raise && !bad.is_empty() {
        let ranks_named = bad.iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ");
        let first = f64::from_bits(ranks[bad[0]][4]);
        return Err(Error::NonFinite { ranks: ranks_named, grad_sq: first }.into());
    }
    Ok(StepDecision::new(grad_sq, options, stats.clip)?)
}

/// One step of every part over `comm`'s ranks: [`statistics`], the decision [`agree`]d by the
/// group, then [`apply_parts`]. Every rank of the group calls it with its own parts; they return
/// the same decision (norm, clip coefficient, skip), or all an error with nothing written.
pub fn step_parts_over<C: Communicator + ?Sized>(
    comm: &C,
    parts: &mut [&mut dyn StepPart],
    options: StepOptions,
    on_nonfinite: OnNonFinite,
) -> Result<StepReport> {
    let stats = statistics(parts, on_nonfinite);
    let elapsed = stats.as_ref().map(|s| s.elapsed).unwrap_or_default();
    let decision = agree::<C, Error>(comm, stats, options, on_nonfinite)?;
    let mut report = apply_parts(parts, &decision)?;
    report.times.stats = elapsed;
    report.times.total += elapsed;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::StateMut;
    use crate::hyperparameters::Hyperparameters;
    use crate::in_place::{GradRef, InPlaceGroup, InPlaceParam};
    use crate::parts::{InPlaceGroups, step_parts};
    use crate::step::StepOutcome;
    use flatpeak_common::{LocalGroup, LocalGroupOptions};

    /// θ, m, v of a parameter of `n` elements at step 0.
    fn state(n: usize, seed: u32) -> [Vec<f32>; 3] {
        let p = (0..n as u32).map(|i| ((i * 5 + seed) % 16) as f32 / 8.0 - 1.0).collect();
        [p, vec![0.0; n], vec![0.0; n]]
    }

    /// Gradients exact in f32, whose squares sum exactly in any order (multiples of 1/8 below 4).
    fn grad(n: usize, seed: u32) -> Vec<f32> {
        (0..n as u32).map(|i| ((i * 3 + seed * 7) % 32) as f32 / 8.0 - 2.0).collect()
    }

    fn param<'a>(s: &'a mut [Vec<f32>; 3], g: &'a [f32]) -> InPlaceParam<'a> {
        let [p, m, v] = s;
        let state = StateMut { param: p, exp_avg: m, exp_avg_sq: v, max_exp_avg_sq: &mut [] };
        InPlaceParam { state, grad: GradRef::F32(g), bf16_param: None, step: 0 }
    }

    const CLIP: GradClip = GradClip::GlobalNorm { max_norm: 0.5 };

    /// One step of a rank holding `shard` (its own elements) and `replica` (held alike by every
    /// rank), over `comm`; returns the report and the two parameters' θ after it.
    fn rank_step(
        comm: &dyn Communicator,
        mut shard: ([Vec<f32>; 3], Vec<f32>),
        mut replica: ([Vec<f32>; 3], Vec<f32>),
        hp: Hyperparameters,
        on_nonfinite: OnNonFinite,
    ) -> (Result<StepReport>, [Vec<f32>; 2]) {
        let world = comm.world_size() as u64;
        let report = {
            let mut own = [InPlaceGroup { hyperparameters: hp, params: vec![param(&mut shard.0, &shard.1)] }];
            let mut same =
                [InPlaceGroup { hyperparameters: hp, params: vec![param(&mut replica.0, &replica.1)] }];
            let mut own = Replicated { part: InPlaceGroups(&mut own), copies: 1 };
            let mut same = Replicated { part: InPlaceGroups(&mut same), copies: world };
            step_parts_over(comm, &mut [&mut own, &mut same], StepOptions::default(), on_nonfinite)
        };
        let [p, ..] = shard.0;
        let [q, ..] = replica.0;
        (report, [p, q])
    }

    #[test]
    fn shards_and_replicas_step_as_the_whole_model_in_one_process() {
        let (n, world) = (24, 3);
        let hp = Hyperparameters::default().lr(1e-2).clip(CLIP);
        // The whole model: the sharded parameter (every rank's slice) and the replicated one.
        let whole = {
            let mut s = state(n * world, 0);
            let g: Vec<f32> = (0..world as u32).flat_map(|r| grad(n, r)).collect();
            let mut r = state(n, 9);
            let rg = grad(n, 9);
            let mut groups =
                [InPlaceGroup { hyperparameters: hp, params: vec![param(&mut s, &g), param(&mut r, &rg)] }];
            let report = step_in_place_report(&mut groups);
            (report, s[0].clone(), r[0].clone())
        };
        let out = LocalGroup::run(world, LocalGroupOptions::default(), |comm| {
            let r = comm.rank();
            let mut shard = state(n * world, 0);
            shard.iter_mut().for_each(|v| *v = v[r * n..(r + 1) * n].to_vec());
            let (report, params) =
                rank_step(comm, (shard, grad(n, r as u32)), (state(n, 9), grad(n, 9)), hp, OnNonFinite::Skip);
            Ok((report, params))
        });
        for (r, got) in out.into_iter().enumerate() {
            let (report, [shard, replica]) = got.unwrap();
            let report = report.unwrap();
            assert!(report.clip_coef < 1.0, "the test clips");
            assert_eq!(
                (report.grad_norm, report.clip_coef, report.step),
                (whole.0.grad_norm, whole.0.clip_coef, 1)
            );
            assert_eq!(shard, whole.1[r * n..(r + 1) * n], "rank {r}'s shard");
            assert_eq!(replica, whole.2, "rank {r}'s replica");
        }
    }

    fn step_in_place_report(groups: &mut [InPlaceGroup<'_>]) -> StepReport {
        step_parts(&mut [&mut InPlaceGroups(groups)], StepOptions::default()).unwrap()
    }

    #[test]
    fn a_non_finite_gradient_on_one_rank_skips_or_raises_on_every_rank() {
        let n = 16;
        let hp = Hyperparameters::default().lr(1e-2).clip(CLIP);
        let cases = [
            (f32::NAN, OnNonFinite::Skip),
            (f32::INFINITY, OnNonFinite::Raise),
            (f32::NAN, OnNonFinite::Ignore),
        ];
        for (bad, policy) in cases {
            let out = LocalGroup::run(4, LocalGroupOptions::default(), |comm| {
                let mut g = grad(n, comm.rank() as u32);
                if comm.rank() == 2 {
                    g[3] = bad;
                }
                let (report, params) =
                    rank_step(comm, (state(n, 1), g), (state(n, 2), grad(n, 5)), hp, policy);
                Ok((report, params))
            });
            for (r, got) in out.into_iter().enumerate() {
                let (report, params) = got.unwrap();
                assert_eq!(params, [state(n, 1)[0].clone(), state(n, 2)[0].clone()], "rank {r}: untouched");
                match policy {
                    // Ignore reads the norm when clipping, and skips a non-finite one.
                    OnNonFinite::Skip | OnNonFinite::Ignore => {
                        let report = report.unwrap();
                        assert_eq!(
                            (report.outcome, report.step),
                            (StepOutcome::SkippedNonFinite, 0),
                            "rank {r}"
                        );
                    }
                    OnNonFinite::Raise => {
                        let e = report.unwrap_err();
                        assert!(
                            matches!(&e, Error::NonFinite { ranks, .. } if ranks == "2"),
                            "rank {r}: {e}"
                        );
                        assert_eq!(e.error_kind(), ErrorKind::Runtime);
                    }
                }
            }
        }
    }

    #[test]
    fn ignore_without_clipping_reads_nothing_and_every_rank_applies() {
        let n = 16;
        let hp = Hyperparameters::default().lr(1e-2);
        let out = LocalGroup::run(3, LocalGroupOptions::default(), |comm| {
            let mut g = grad(n, comm.rank() as u32);
            if comm.rank() == 2 {
                g[3] = f32::NAN;
            }
            let exact = rank_step(
                comm,
                (state(n, 1), grad(n, comm.rank() as u32)),
                (state(n, 2), grad(n, 5)),
                hp,
                OnNonFinite::Skip,
            );
            let ignored =
                rank_step(comm, (state(n, 1), g), (state(n, 2), grad(n, 5)), hp, OnNonFinite::Ignore);
            Ok((exact, ignored))
        });
        for (r, got) in out.into_iter().enumerate() {
            let ((exact, exact_params), (report, params)) = got.unwrap();
            let report = report.unwrap();
            assert_eq!((report.outcome, report.step), (StepOutcome::Applied, 1), "rank {r}");
            assert!(report.grad_norm.is_nan() && exact.unwrap().grad_norm.is_finite());
            assert_eq!(params[1], exact_params[1], "rank {r}: the replica as the checked step's");
            for i in 0..n {
                let poisoned = r == 2 && i == 3;
                assert_eq!(params[0][i].is_nan(), poisoned, "rank {r}, element {i}");
                if !poisoned {
                    assert_eq!(params[0][i], exact_params[0][i], "rank {r}, element {i}");
                }
            }
        }
        // A rank that would check where the others ignore: the terms differ, refused everywhere.
        let out = LocalGroup::run(3, LocalGroupOptions::default(), |comm| {
            let policy = if comm.rank() == 1 { OnNonFinite::Skip } else { OnNonFinite::Ignore };
            Ok(rank_step(comm, (state(n, 1), grad(n, 0)), (state(n, 2), grad(n, 3)), hp, policy))
        });
        for (r, got) in out.into_iter().enumerate() {
            let (report, [shard, _]) = got.unwrap();
            let message = report.unwrap_err().to_string();
            assert!(
                message.contains("on_nonfinite = skip") && message.contains("on_nonfinite = ignore"),
                "{message}"
            );
            assert_eq!(shard, state(n, 1)[0], "rank {r}: untouched");
        }
    }

    #[test]
    fn bad_input_or_other_terms_on_one_rank_are_an_error_on_every_rank() {
        let n = 8;
        let hp = Hyperparameters::default().lr(1e-2).clip(CLIP);
        // Rank 1's state is short: its own error there, PeerInput elsewhere, nothing written.
        let out = LocalGroup::run(3, LocalGroupOptions::default(), |comm| {
            let mut s = state(n, 1);
            if comm.rank() == 1 {
                s[1].pop();
            }
            Ok(rank_step(comm, (s, grad(n, 0)), (state(n, 2), grad(n, 3)), hp, OnNonFinite::Skip))
        });
        for (r, got) in out.into_iter().enumerate() {
            let (report, [shard, _]) = got.unwrap();
            let e = report.unwrap_err();
            if r == 1 {
                assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
            } else {
                assert!(
                    matches!(&e, Error::Common(flatpeak_common::Error::PeerInput { rank: 1, .. })),
                    "rank {r}: {e}"
                );
                assert!(e.to_string().contains("exp_avg"), "{e}");
            }
            assert_eq!(shard, state(n, 1)[0], "rank {r}: untouched");
        }
        // Rank 2 clips at another bound: refused there by name, PeerInput elsewhere.
        let out = LocalGroup::run(3, LocalGroupOptions::default(), |comm| {
            let hp = if comm.rank() == 2 { hp.clip(GradClip::GlobalNorm { max_norm: 2.0 }) } else { hp };
            Ok(rank_step(comm, (state(n, 1), grad(n, 0)), (state(n, 2), grad(n, 3)), hp, OnNonFinite::Skip).0)
        });
        for (r, got) in out.into_iter().enumerate() {
            let e = got.unwrap().unwrap_err();
            let message = e.to_string();
            assert!(
                message.contains("rank 2 steps with max_norm = 2") && message.contains("max_norm = 0.5"),
                "{message}"
            );
            let own = matches!(e, Error::Common(flatpeak_common::Error::Refused { .. }));
            assert_eq!(own, r == 2, "rank {r}: {e}");
        }
        // A part of no copies is the caller's mistake, named.
        let out = LocalGroup::run(1, LocalGroupOptions::default(), |comm| {
            let mut s = state(n, 1);
            let g = grad(n, 0);
            let mut groups = [InPlaceGroup { hyperparameters: hp, params: vec![param(&mut s, &g)] }];
            let mut part = Replicated { part: InPlaceGroups(&mut groups), copies: 0 };
            Ok(step_parts_over(comm, &mut [&mut part], StepOptions::default(), OnNonFinite::Skip))
        });
        let e = out.into_iter().next().unwrap().unwrap().unwrap_err();
        assert!(matches!(e, Error::InvalidConfig { field: "copies", .. }), "{e}");
    }

    #[test]
    fn every_rank_takes_the_same_bits_whatever_its_values() {
        let n = 1000;
        let hp = Hyperparameters::default().lr(1e-3).clip(GradClip::GlobalNorm { max_norm: 1.0 });
        let out = LocalGroup::run(4, LocalGroupOptions::default(), |comm| {
            let r = comm.rank() as f32;
            let g: Vec<f32> = (0..n).map(|i| ((i as f32 * 0.37 + r).sin() * 1e-2) / (1.0 + r)).collect();
            Ok(rank_step(comm, (state(n, 1), g), (state(n, 2), grad(n, 3)), hp, OnNonFinite::Skip).0)
        });
        let reports: Vec<StepReport> = out.into_iter().map(|r| r.unwrap().unwrap()).collect();
        for r in &reports {
            assert_eq!(r.grad_norm.to_bits(), reports[0].grad_norm.to_bits());
            assert_eq!(r.clip_coef.to_bits(), reports[0].clip_coef.to_bits());
        }
    }
}
