//! [`step_parts`]: one optimizer step over everything a framework's optimizer holds, however its
//! state is kept — parameters whose state lives in the framework's tensors
//! ([`InPlaceGroups`]), offloaded parameters each with its own [`StreamAdamW`]
//! ([`OffloadedStep`]), or a framework's own kind of [`StepPart`] — under **one** decision: the
//! Σg² of every part's gradients decides it ([`StepDecision`]: a non-finite gradient anywhere
//! skips every part; global-norm clipping scales every gradient by the coefficient of the norm
//! over all of them). Every part checks its buffers before any part is written, so a bad buffer
//! leaves everything untouched. A binding calls this one function; the statistics, the decision
//! and the update are the crate's.
//!
//! The step is two phases over the gradients, public for the callers that decide between them:
//! [`statistics`] (every buffer checked, the Σg²; nothing written), then [`apply_parts`] with a
//! [`StepDecision`]. A group of ranks agrees on the decision in between
//! ([`step_parts_over`](crate::step_parts_over)).

use crate::element::{GradElement, ParamElement};
use crate::error::{Error, Result};
use crate::hyperparameters::GradClip;
use crate::in_place::{InPlaceGroup, apply_in_place, check_groups, global_clip, in_place_grad_sq};
use crate::optimizer::{StepBuffers, StreamAdamW};
use crate::step::{StageTimes, StepDecision, StepOptions, StepReport};

/// One part of a framework's step: some of its parameters, with their gradients and state.
pub trait StepPart: Send {
    /// Σg² over the part's gradients, in f64 (non-finite when any element is NaN or ±∞), every
    /// buffer of the part checked first (lengths, devices, step counts): nothing is written.
    fn grad_sq_sum(&mut self) -> Result<f64>;
    /// Every buffer of the part checked (lengths, devices, step counts) without reading the
    /// gradients: what a step that needs no Σg² ([`OnNonFinite::Ignore`] without clipping) asks
    /// instead of [`grad_sq_sum`](Self::grad_sq_sum). The default reads them anyway.
    fn check(&mut self) -> Result<()> {
        self.grad_sq_sum().map(drop)
    }
    /// The global-norm clipping its hyperparameters ask for (every part must ask the same: it
    /// bounds the norm over all of them).
    fn clip(&self) -> GradClip;
    /// The most steps any of its parameters has taken.
    fn steps(&self) -> u64;
    /// Applies `decision` (never a skipping one): every parameter's update and step count.
    fn apply(&mut self, decision: &StepDecision) -> Result<()>;
}

/// In-place parameters, by param group ([`step_in_place`]'s): their state
/// in the framework's own buffers.
#[derive(Debug)]
pub struct InPlaceGroups<'g, 'a>(pub &'g mut [InPlaceGroup<'a>]);

impl StepPart for InPlaceGroups<'_, '_> {
    fn grad_sq_sum(&mut self) -> Result<f64> {
        global_clip(self.0)?;
        check_groups(self.0)?;
        Ok(in_place_grad_sq(self.0))
    }
    fn check(&mut self) -> Result<()> {
        global_clip(self.0)?;
        check_groups(self.0)
    }
    fn clip(&self) -> GradClip {
        global_clip(self.0).unwrap_or_default()
    }
    fn steps(&self) -> u64 {
        self.0.iter().flat_map(|g| &g.params).map(|p| p.step).max().unwrap_or(0)
    }
    fn apply(&mut self, decision: &StepDecision) -> Result<()> {
        apply_in_place(self.0, decision).map(drop)
    }
}

/// An offloaded parameter: its [`StreamAdamW`] (hyperparameters set for this step) and the
/// device buffers of the step.
#[derive(Debug)]
pub struct OffloadedStep<'o, 'b, G: GradElement, P: ParamElement> {
    /// The parameter's optimizer.
    pub optimizer: &'o mut StreamAdamW<G, P>,
    /// Its gradients and parameters on its device.
    pub buffers: StepBuffers<'b, G, P>,
}

impl<G: GradElement, P: ParamElement> StepPart for OffloadedStep<'_, '_, G, P> {
    fn grad_sq_sum(&mut self) -> Result<f64> {
        self.optimizer.grad_sq_sum(self.buffers.reborrow())
    }
    fn check(&mut self) -> Result<()> {
        self.optimizer.check_buffers(&self.buffers)
    }
    fn clip(&self) -> GradClip {
        self.optimizer.hyperparameters().clip
    }
    fn steps(&self) -> u64 {
        self.optimizer.state().step
    }
    fn apply(&mut self, decision: &StepDecision) -> Result<()> {
        self.optimizer.step_decided(self.buffers.reborrow(), decision).map(drop)
    }
}

/// The first phase of a step: every part's buffers checked and its Σg² summed, nothing written.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Statistics {
    /// Σg² over every part's gradients, in f64, in the parts' order (each part's own weighting:
    /// a [`Replicated`](crate::Replicated) one divides by its copies); non-finite when any
    /// gradient is NaN or ±∞. `None` when the step needs no Σg² and the gradients were not read
    /// ([`OnNonFinite::Ignore`] without clipping).
    pub grad_sq: Option<f64>,
    /// The one global-norm clipping every part asks for.
    pub clip: GradClip,
    /// How long the pass took.
    pub elapsed: std::time::Duration,
}

/// What a step does when a gradient is NaN or infinite.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnNonFinite {
    /// Skip the step, touching nothing (GradScaler's `found_inf`): the report says so.
    #[default]
    Skip,
    /// Return [`Error::NonFinite`] (a training loop that halts, as torchtitan's does): nothing is
    /// touched either.
    Raise,
    /// Do not check: without clipping the step reads no gradient before the update (no
    /// statistics pass, 4 B/param less than [`Skip`](Self::Skip) over fp32 gradients) and
    /// updates as torch's `AdamW` and DeepSpeed's CPU Adam do, a NaN or ±∞ reaching the
    /// parameters whose gradients hold it (over ranks too: each rank's own shards, and replicas
    /// alike since their gradients are). With clipping the norm is read anyway, and a non-finite
    /// one skips the step as under [`Skip`](Self::Skip).
    Ignore,
}

impl OnNonFinite {
    /// Whether a step under this policy and `clip` needs the gradients' Σg².
    pub fn reads_gradients(self, clip: GradClip) -> bool {
        self != Self::Ignore || clip != GradClip::None
    }
}

impl Statistics {
    /// The decision of one process from its own statistics, under `options` and `on_nonfinite`
    /// (a non-finite Σg² skips the step, or is [`Error::NonFinite`] on rank 0; no Σg² applies
    /// it unchecked).
    pub fn decide(&self, options: StepOptions, on_nonfinite: OnNonFinite) -> Result<StepDecision> {
        let Some(grad_sq) = self.grad_sq else {
            return StepDecision::unchecked(options);
        };
        if on_nonfinite == OnNonFinite::Raise && !grad_sq.is_finite() {
            return Err(Error::NonFinite { ranks: "0".into(), grad_sq });
        }
        StepDecision::new(grad_sq, options, self.clip)
    }
}

/// The first phase of a step ([`Statistics`]): the parts' one clipping rule (parts that
/// disagree are [`Error::InvalidConfig`], `clip`) and every part's Σg², each part checking its
/// buffers; only the checks when `on_nonfinite` and the clipping need no Σg²
/// ([`OnNonFinite::reads_gradients`]). Nothing is written.
pub fn statistics(parts: &mut [&mut dyn StepPart], on_nonfinite: OnNonFinite) -> Result<Statistics> {
    let start = std::time::Instant::now();
    let clip = parts.first().map(|p| p.clip()).unwrap_or_default();
    if let Some(other) = parts.iter().find(|p| p.clip() != clip) {
        return Err(Error::invalid_config(
            "clip",
            other.clip(),
            "the same global-norm clipping in every group (it clips the norm over all of them)",
        ));
    }
    if !on_nonfinite.reads_gradients(clip) {
        for part in parts.iter_mut() {
            part.check()?;
        }
        return Ok(Statistics { grad_sq: None, clip, elapsed: start.elapsed() });
    }
    let mut grad_sq = 0.0;
    for part in parts.iter_mut() {
        grad_sq += part.grad_sq_sum()?;
    }
    Ok(Statistics { grad_sq: Some(grad_sq), clip, elapsed: start.elapsed() })
}

/// The second phase of a step: unless `decision` skips, every part's update in order. The
/// report's step is the most steps any parameter has taken after it; its times are this phase's
/// (`stats` zero).
pub fn apply_parts(parts: &mut [&mut dyn StepPart], decision: &StepDecision) -> Result<StepReport> {
    let start = std::time::Instant::now();
    if !decision.skips() {
        for part in parts.iter_mut() {
            part.apply(decision)?;
        }
    }
    let total = start.elapsed();
    let steps = parts.iter().map(|p| p.steps()).max().unwrap_or(0);
    Ok(decision.report(steps, StageTimes { adam: total, total, ..StageTimes::default() }))
}

/// One step of every part under one decision (see the module docs): [`statistics`], the
/// decision from their Σg² and `options`, then [`apply_parts`]. The decision of several ranks
/// is [`step_parts_over`](crate::step_parts_over)'s.
pub fn step_parts(parts: &mut [&mut dyn StepPart], options: StepOptions) -> Result<StepReport> {
    let stats = statistics(parts, OnNonFinite::Skip)?;
    let decision = stats.decide(options, OnNonFinite::Skip)?;
    let mut report = apply_parts(parts, &decision)?;
    report.times.stats = stats.elapsed;
    report.times.total += stats.elapsed;
    Ok(report)
}

/// One AdamW step of every parameter of every group, in place. Everything is checked first
/// (each group's hyperparameters, every buffer's length, every step count, one clipping rule
/// for all groups: it is over the global norm), then Σg² over every gradient decides the step
/// ([`StepDecision`]): a non-finite gradient skips it, touching nothing; otherwise every
/// parameter is updated by torch's AdamW ([`adamw_update`](crate::cpu::adamw_update)) with its group's hyperparameters
/// and its own step count, which then advances. On an error nothing was written.
pub fn step_in_place(groups: &mut [InPlaceGroup<'_>], options: StepOptions) -> Result<StepReport> {
    step_parts(&mut [&mut InPlaceGroups(groups)], options)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::cpu::StateMut;
    use crate::host::HostDevice;
    use crate::hyperparameters::Hyperparameters;
    use crate::in_place::{GradRef, InPlaceParam};
    use crate::plan::Plan;
    use crate::step::StepOutcome;
    use flatpeak_common::{Budget, Device, Link};

    const N: usize = 37;

    /// One fp32 parameter at step 0 over `s` (θ, m, v) with gradient `g`.
    fn param<'a>(s: &'a mut [Vec<f32>; 3], g: &'a [f32]) -> InPlaceParam<'a> {
        let [p, m, v] = s;
        let state = StateMut { param: p, exp_avg: m, exp_avg_sq: v, max_exp_avg_sq: &mut [] };
        InPlaceParam { state, grad: GradRef::F32(g), bf16_param: None, step: 0 }
    }

    /// Values in [-scale, scale), exact in f32 (no libm: a `sin` the compiler folds and one the
    /// program calls may differ in the last bit, so "untouched" must not compare two of them).
    fn values(seed: u32, scale: f32) -> Vec<f32> {
        (0..N as u32).map(|i| (((i * 7 + seed * 13) % 32) as f32 / 16.0 - 1.0) * scale).collect()
    }

    /// Two parameters of N elements, `grads[1]` given to the offloaded one when `offload`, the
    /// other in place; returns each parameter's θ after one step of `hp`, and the report.
    fn one_step(
        grads: [Vec<f32>; 2],
        hp: Hyperparameters,
        offload: bool,
    ) -> (Result<StepReport>, [Vec<f32>; 2]) {
        let mut state: Vec<[Vec<f32>; 3]> =
            (0..2).map(|p| [values(p, 1.0), vec![0.0; N], vec![0.0; N]]).collect();
        let plan = Plan::new(
            &Config::default().bucket_elems(64).hyperparameters(hp),
            StreamAdamW::<f32, f32>::shape(N),
            Budget::Unlimited,
        )
        .unwrap();
        let mut opt = StreamAdamW::<f32, f32>::new(plan, Device::Cpu).unwrap();
        opt.load_master(&values(1, 1.0)).unwrap();
        let mut device = HostDevice::new(grads[1].clone(), values(1, 1.0), Link::Memcpy);
        let [s0, s1] = &mut state[..] else { unreachable!() };
        let report = if offload {
            let mut groups = [InPlaceGroup { hyperparameters: hp, params: vec![param(s0, &grads[0])] }];
            let mut offloaded = OffloadedStep { optimizer: &mut opt, buffers: (&mut device).into() };
            step_parts(&mut [&mut InPlaceGroups(&mut groups), &mut offloaded], StepOptions::default())
        } else {
            let mut groups = [InPlaceGroup {
                hyperparameters: hp,
                params: vec![param(s0, &grads[0]), param(s1, &grads[1])],
            }];
            step_in_place(&mut groups, StepOptions::default())
        };
        let second = if offload { device.params.clone() } else { state[1][0].clone() };
        (report, [state[0][0].clone(), second])
    }

    #[test]
    fn offloaded_and_in_place_parameters_take_one_decision() {
        let hp = Hyperparameters::default().lr(1e-2).clip(GradClip::GlobalNorm { max_norm: 0.5 });
        let grads = [values(3, 0.3), values(4, 0.2)];
        let (split, split_params) = one_step(grads.clone(), hp, true);
        let (whole, whole_params) = one_step(grads.clone(), hp, false);
        let (split, whole) = (split.unwrap(), whole.unwrap());
        // The norm and the clip coefficient are over both; each parameter's update is the same
        // whichever part holds it.
        assert_eq!((split.grad_norm, split.clip_coef, split.step), (whole.grad_norm, whole.clip_coef, 1));
        assert!(split.clip_coef < 1.0);
        assert_eq!(split_params, whole_params);
        // A non-finite gradient of the offloaded parameter skips the in-place one too.
        let mut bad = grads.clone();
        bad[1][5] = f32::NAN;
        let (skipped, params) = one_step(bad, hp, true);
        assert_eq!(skipped.unwrap().outcome, StepOutcome::SkippedNonFinite);
        assert_eq!(params, [values(0, 1.0), values(1, 1.0)], "nothing was touched");
    }

    #[test]
    fn parts_that_disagree_or_a_bad_buffer_touch_nothing() {
        let hp = Hyperparameters::default().lr(1e-2);
        let mut state = [values(0, 1.0), vec![0.0; N], vec![0.0; N]];
        let grad = values(3, 0.1);
        let clipped = hp.clip(GradClip::GlobalNorm { max_norm: 1.0 });
        let plan = Plan::new(
            &Config::default().hyperparameters(clipped),
            StreamAdamW::<f32, f32>::shape(N),
            Budget::Unlimited,
        )
        .unwrap();
        let mut opt = StreamAdamW::<f32, f32>::new(plan, Device::Cpu).unwrap();
        let mut device = HostDevice::new(grad.clone(), vec![0.0; N], Link::Memcpy);
        let [p, m, v] = &mut state;
        let param = InPlaceParam {
            state: StateMut { param: p, exp_avg: m, exp_avg_sq: v, max_exp_avg_sq: &mut [] },
            grad: GradRef::F32(&grad),
            bf16_param: None,
            step: 0,
        };
        let mut groups = [InPlaceGroup { hyperparameters: hp, params: vec![param] }];
        let mut offloaded = OffloadedStep { optimizer: &mut opt, buffers: (&mut device).into() };
        let e = step_parts(&mut [&mut InPlaceGroups(&mut groups), &mut offloaded], StepOptions::default())
            .unwrap_err();
        assert!(matches!(e, Error::InvalidConfig { field: "clip", .. }), "{e}");
        // An offloaded part whose gradients are short: refused before the in-place part is written.
        opt.set_hyperparameters(hp).unwrap();
        let mut short = HostDevice::new(vec![0.0f32; N - 1], vec![0.0; N], Link::Memcpy);
        let mut offloaded = OffloadedStep { optimizer: &mut opt, buffers: (&mut short).into() };
        let e = step_parts(&mut [&mut InPlaceGroups(&mut groups), &mut offloaded], StepOptions::default())
            .unwrap_err();
        assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
        assert_eq!(groups[0].params[0].step, 0);
        assert_eq!(*groups[0].params[0].state.param, values(0, 1.0)[..]);
    }

    /// A part that counts how often its gradients are read and its buffers checked.
    struct Counting<'g, 'a> {
        inner: InPlaceGroups<'g, 'a>,
        reads: usize,
        checks: usize,
    }

    impl StepPart for Counting<'_, '_> {
        fn grad_sq_sum(&mut self) -> Result<f64> {
            self.reads += 1;
            self.inner.grad_sq_sum()
        }
        fn check(&mut self) -> Result<()> {
            self.checks += 1;
            self.inner.check()
        }
        fn clip(&self) -> GradClip {
            self.inner.clip()
        }
        fn steps(&self) -> u64 {
            self.inner.steps()
        }
        fn apply(&mut self, decision: &StepDecision) -> Result<()> {
            self.inner.apply(decision)
        }
    }

    /// θ after one step of one parameter under `policy` and `clip`, with `grad`; its statistics
    /// and how often the gradients were read.
    fn policy_step(
        grad: &[f32],
        policy: OnNonFinite,
        clip: GradClip,
    ) -> (Result<StepReport>, Vec<f32>, usize) {
        let hp = Hyperparameters::default().lr(1e-2).clip(clip);
        let mut state = [values(0, 1.0), vec![0.0; grad.len()], vec![0.0; grad.len()]];
        let mut groups = [InPlaceGroup { hyperparameters: hp, params: vec![param(&mut state, grad)] }];
        let mut part = Counting { inner: InPlaceGroups(&mut groups), reads: 0, checks: 0 };
        let report = statistics(&mut [&mut part], policy).and_then(|stats| {
            assert_eq!(stats.grad_sq.is_none(), !policy.reads_gradients(clip));
            let decision = stats.decide(StepOptions::default(), policy)?;
            apply_parts(&mut [&mut part], &decision)
        });
        assert_eq!(part.reads + part.checks, 1, "one pass over the part before the update");
        let reads = part.reads;
        (report, state[0].clone(), reads)
    }

    #[test]
    fn ignore_reads_no_gradient_unless_clipping_and_updates_as_torch_does() {
        let clean = values(3, 0.3);
        let (report, exact, reads) = policy_step(&clean, OnNonFinite::Skip, GradClip::None);
        assert_eq!((report.unwrap().outcome, reads), (StepOutcome::Applied, 1));
        // Without clipping: no read, the same update bit for bit, the norm unknown.
        let (report, ignored, reads) = policy_step(&clean, OnNonFinite::Ignore, GradClip::None);
        let report = report.unwrap();
        assert_eq!((report.outcome, reads, report.clip_coef), (StepOutcome::Applied, 0, 1.0));
        assert!(report.grad_norm.is_nan());
        assert_eq!(ignored, exact);
        // A NaN reaches its own element only (torch's AdamW does the same), where Skip skips.
        let mut bad = clean.clone();
        bad[5] = f32::NAN;
        let (report, poisoned, _) = policy_step(&bad, OnNonFinite::Ignore, GradClip::None);
        assert_eq!(report.unwrap().outcome, StepOutcome::Applied);
        assert!(poisoned[5].is_nan());
        assert!((0..N).filter(|&i| i != 5).all(|i| poisoned[i] == exact[i]));
        let (report, untouched, _) = policy_step(&bad, OnNonFinite::Skip, GradClip::None);
        assert_eq!(report.unwrap().outcome, StepOutcome::SkippedNonFinite);
        assert_eq!(untouched, values(0, 1.0));
        // With clipping the norm is read anyway, and a non-finite one skips.
        let clip = GradClip::GlobalNorm { max_norm: 0.5 };
        let (report, untouched, reads) = policy_step(&bad, OnNonFinite::Ignore, clip);
        assert_eq!((report.unwrap().outcome, reads), (StepOutcome::SkippedNonFinite, 1));
        assert_eq!(untouched, values(0, 1.0));
        let (clipped, _, _) = policy_step(&clean, OnNonFinite::Ignore, clip);
        let (exact, _, _) = policy_step(&clean, OnNonFinite::Skip, clip);
        assert_eq!(clipped.unwrap().grad_norm, exact.unwrap().grad_norm);
        // A replicated part too reads nothing (it passes the check on).
        let hp = Hyperparameters::default();
        let mut state = [values(0, 1.0), vec![0.0; N], vec![0.0; N]];
        let mut groups = [InPlaceGroup { hyperparameters: hp, params: vec![param(&mut state, &clean)] }];
        let counting = Counting { inner: InPlaceGroups(&mut groups), reads: 0, checks: 0 };
        let mut part = crate::Replicated { part: counting, copies: 2 };
        assert_eq!(statistics(&mut [&mut part], OnNonFinite::Ignore).unwrap().grad_sq, None);
        assert_eq!((part.part.reads, part.part.checks), (0, 1));
        // The buffers are still checked: a short gradient is refused, nothing written.
        let short = &clean[..N - 1];
        let (e, untouched, reads) = policy_step(short, OnNonFinite::Ignore, GradClip::None);
        assert!(matches!(e, Err(Error::ShapeMismatch { .. })), "{e:?}");
        assert_eq!((untouched, reads), (values(0, 1.0), 0));
    }
}
