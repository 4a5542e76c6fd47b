//! [`step_in_place`](crate::step_in_place): the optimizer step of parameters whose fp32 state lives in the caller's
//! memory — a framework's own tensors (`torch.optim`'s `state[p]`, a candle `Var` and its
//! moments) — with the whole step logic of [`StreamAdamW::step`](crate::StreamAdamW::step):
//! every gradient and state buffer checked, the global Σg², the skip on a non-finite gradient,
//! global-norm clipping and the step counts, before the first write. A binding keeps only the
//! glue that finds its tensors.
//!
//! A bf16 model keeps an fp32 master copy of each parameter (DeepSpeed's and torch AMP's
//! "master weights"): its `state.param` is the master, its gradient bf16, and
//! [`InPlaceParam::bf16_param`] the model's parameter, written as θ rounded to bf16 (nearest
//! even) after each applied step. An fp32 parameter's step is unchanged by it (bitwise).
//!
//! Memory: nothing beyond the caller's buffers (the update runs in place, tile by tile).

use half::bf16;

use crate::cpu::{ParamSink, Shard, StateMut, adamw_update_shards, grad_sq_sums};
use crate::element::{GradElement, ParamElement};
use crate::error::{Error, Result};
use crate::hyperparameters::{GradClip, Hyperparameters, Variant};
use crate::step::{StageTimes, StepDecision, StepReport};

/// A gradient in the dtype the framework keeps it in.
#[derive(Debug, Clone, Copy)]
pub enum GradRef<'a> {
    /// fp32.
    F32(&'a [f32]),
    /// bf16 (widened to f32 tile by tile, as the offloaded step widens it).
    Bf16(&'a [bf16]),
}

impl GradRef<'_> {
    fn len(&self) -> usize {
        match self {
            Self::F32(g) => g.len(),
            Self::Bf16(g) => g.len(),
        }
    }
}

impl<'a> From<&'a [f32]> for GradRef<'a> {
    fn from(grad: &'a [f32]) -> Self {
        Self::F32(grad)
    }
}

/// One parameter: its state (θ, m, v and, with AMSGrad, max v), its gradient, and the steps it
/// has taken. [`step_in_place`](crate::step_in_place) advances `step` when the step is applied.
#[derive(Debug)]
pub struct InPlaceParam<'a> {
    /// θ, m, v (and max v with AMSGrad, else empty), each of the gradient's length.
    pub state: StateMut<'a>,
    /// The gradient.
    pub grad: GradRef<'a>,
    /// A bf16 model's parameter, of the gradient's length, whose fp32 master copy is
    /// `state.param`: written as the updated θ rounded to bf16. `None`: `state.param` is the
    /// parameter itself.
    pub bf16_param: Option<&'a mut [bf16]>,
    /// Steps taken so far (0 before the first).
    pub step: u64,
}

/// Parameters that share hyperparameters (torch's param group).
#[derive(Debug)]
pub struct InPlaceGroup<'a> {
    /// The group's hyperparameters.
    pub hyperparameters: Hyperparameters,
    /// Its parameters.
    pub params: Vec<InPlaceParam<'a>>,
}

/// Checks one parameter's buffers against its gradient and its group's variant.
fn check(param: &InPlaceParam<'_>, variant: Variant) -> Result<()> {
    let n = param.grad.len();
    let s = &param.state;
    let max_len = if variant == Variant::AmsGrad { n } else { 0 };
    let bf16_len = param.bf16_param.as_ref().map_or(n, |p| p.len());
    for (what, expected, got) in [
        ("param (the gradient's length)", n, s.param.len()),
        ("bf16 param (the gradient's length)", n, bf16_len),
        ("exp_avg (the gradient's length)", n, s.exp_avg.len()),
        ("exp_avg_sq (the gradient's length)", n, s.exp_avg_sq.len()),
        ("max_exp_avg_sq (the gradient's length with AMSGrad, else 0)", max_len, s.max_exp_avg_sq.len()),
    ] {
        if expected != got {
            return Err(Error::ShapeMismatch { what, expected, got });
        }
    }
    StepDecision::next_step(param.step).map(|_| ())
}

/// The clipping of a step over `groups`: one rule for all of them, since it bounds the norm
/// over all of their gradients ([`GradClip::None`] without groups); groups that disagree are
/// [`Error::InvalidConfig`].
pub fn global_clip(groups: &[InPlaceGroup<'_>]) -> Result<GradClip> {
    let clip = groups.first().map(|g| g.hyperparameters.clip).unwrap_or_default();
    match groups.iter().find(|g| g.hyperparameters.clip != clip) {
        Some(other) => Err(Error::invalid_config(
            "clip",
            other.hyperparameters.clip,
            "the same global-norm clipping in every group (it clips the norm over all of them)",
        )),
        None => Ok(clip),
    }
}

/// Σ g² over every gradient of every group, in f64 (non-finite when any gradient is): each
/// gradient's sum (one parallel pass per dtype), added in the parameters' order.
pub fn in_place_grad_sq(groups: &[InPlaceGroup<'_>]) -> f64 {
    let grads: Vec<GradRef<'_>> = groups.iter().flat_map(|g| &g.params).map(|p| p.grad).collect();
    let of_f32: Vec<&[f32]> =
        grads.iter().filter_map(|g| if let GradRef::F32(g) = g { Some(*g) } else { None }).collect();
    let of_bf16: Vec<&[bf16]> =
        grads.iter().filter_map(|g| if let GradRef::Bf16(g) = g { Some(*g) } else { None }).collect();
    let (mut f32_sums, mut bf16_sums) =
        (grad_sq_sums(&of_f32).into_iter(), grad_sq_sums(&of_bf16).into_iter());
    grads
        .iter()
        .map(|g| match g {
            GradRef::F32(_) => f32_sums.next(),
            GradRef::Bf16(_) => bf16_sums.next(),
        })
        .map(|sum| sum.unwrap_or(0.0))
        .sum()
}

/// Checks every group's hyperparameters, buffers and step counts.
pub(crate) fn check_groups(groups: &[InPlaceGroup<'_>]) -> Result<()> {
    for group in groups {
        group.hyperparameters.validate()?;
        for param in &group.params {
            check(param, group.hyperparameters.variant)?;
        }
    }
    Ok(())
}

/// The step [`step_in_place`](crate::step_in_place) takes, for a `decision` made over more gradients than these (a
/// framework stepping these and offloaded optimizers as one: their Σg² added to
/// [`in_place_grad_sq`]). The groups' own clipping is the decision's. Everything is checked
/// before the first write; a skipping decision touches nothing.
pub fn apply_in_place(groups: &mut [InPlaceGroup<'_>], decision: &StepDecision) -> Result<StepReport> {
    check_groups(groups)?;
    let start = std::time::Instant::now();
    let mut times = StageTimes::default();
    let steps = groups.iter().flat_map(|g| &g.params).map(|p| p.step);
    if decision.skips() {
        times.total = start.elapsed();
        return Ok(decision.report(steps.max().unwrap_or(0), times));
    }
    // Every parameter's scalars first (its group's hyperparameters, its own step count), then
    // one parallel pass over all of their chunks.
    let mut scalars = Vec::new();
    for group in groups.iter() {
        for param in &group.params {
            let step = StepDecision::next_step(param.step)?;
            scalars.push((step, decision.scalars(&group.hyperparameters, step)));
        }
    }
    // One parallel pass per kind of parameter (the kernel is generic over the gradient's dtype
    // and the copy it writes): an all-fp32 model's is the one pass it always was.
    let mut kinds = ShardsByKind::default();
    for (param, (_, scalars)) in groups.iter_mut().flat_map(|g| &mut g.params).zip(&scalars) {
        let state = StateMut {
            param: &mut *param.state.param,
            exp_avg: &mut *param.state.exp_avg,
            exp_avg_sq: &mut *param.state.exp_avg_sq,
            max_exp_avg_sq: &mut *param.state.max_exp_avg_sq,
        };
        kinds.push(state, param.grad, param.bf16_param.as_deref_mut(), scalars);
    }
    kinds.update();
    let mut last_step = 0;
    for (param, &(step, _)) in groups.iter_mut().flat_map(|g| &mut g.params).zip(&scalars) {
        param.step = step;
        last_step = last_step.max(step);
    }
    times.adam = start.elapsed();
    times.total = times.adam;
    Ok(decision.report(last_step, times))
}

/// The shards of one step, split by gradient dtype and by whether a bf16 copy is written.
#[derive(Default)]
struct ShardsByKind<'a> {
    f32_grad: Vec<Shard<'a, f32, f32>>,
    f32_grad_bf16_param: Vec<Shard<'a, f32, bf16>>,
    bf16_grad: Vec<Shard<'a, bf16, f32>>,
    bf16_grad_bf16_param: Vec<Shard<'a, bf16, bf16>>,
}

impl<'a> ShardsByKind<'a> {
    fn push(
        &mut self,
        state: StateMut<'a>,
        grad: GradRef<'a>,
        bf16_param: Option<&'a mut [bf16]>,
        scalars: &'a crate::StepScalars,
    ) {
        match (grad, bf16_param) {
            (GradRef::F32(grad), None) => {
                self.f32_grad.push(Shard { state, grad, sink: ParamSink::None, scalars })
            }
            (GradRef::F32(grad), Some(p)) => {
                self.f32_grad_bf16_param.push(Shard { state, grad, sink: ParamSink::Copy(p), scalars })
            }
            (GradRef::Bf16(grad), None) => {
                self.bf16_grad.push(Shard { state, grad, sink: ParamSink::None, scalars })
            }
            (GradRef::Bf16(grad), Some(p)) => {
                self.bf16_grad_bf16_param.push(Shard { state, grad, sink: ParamSink::Copy(p), scalars })
            }
        }
    }

    fn update(self) {
        fn pass<G: GradElement, P: ParamElement>(shards: Vec<Shard<'_, G, P>>) {
            if !shards.is_empty() {
                adamw_update_shards(shards);
            }
        }
        pass(self.f32_grad);
        pass(self.f32_grad_bf16_param);
        pass(self.bf16_grad);
        pass(self.bf16_grad_bf16_param);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::adamw_update;
    use crate::parts::step_in_place;
    use crate::step::StepOptions;

    fn one(param: &mut [f32], m: &mut [f32], v: &mut [f32], grad: &[f32], hp: Hyperparameters) -> StepReport {
        let state = StateMut { param, exp_avg: m, exp_avg_sq: v, max_exp_avg_sq: &mut [] };
        let mut groups = [InPlaceGroup {
            hyperparameters: hp,
            params: vec![InPlaceParam { state, grad: grad.into(), bf16_param: None, step: 0 }],
        }];
        step_in_place(&mut groups, StepOptions::default()).unwrap()
    }

    #[test]
    fn equals_the_kernel_with_the_clip_folded_in_and_skips_non_finite() {
        let grad = [3.0f32, -4.0, 0.5, 2.0];
        let hp = Hyperparameters::default().clip(GradClip::GlobalNorm { max_norm: 1.0 });
        let (mut p, mut m, mut v) = ([1.0f32, 2.0, -1.0, 0.0], [0.0f32; 4], [0.0f32; 4]);
        let report = one(&mut p, &mut m, &mut v, &grad, hp);
        let norm = (9.0f64 + 16.0 + 0.25 + 4.0).sqrt();
        assert_eq!((report.step, report.grad_norm), (1, norm));
        let (mut q, mut qm, mut qv) = ([1.0f32, 2.0, -1.0, 0.0], [0.0f32; 4], [0.0f32; 4]);
        let scalars = crate::StepScalars::new(&hp, 1, report.clip_coef);
        let state =
            StateMut { param: &mut q, exp_avg: &mut qm, exp_avg_sq: &mut qv, max_exp_avg_sq: &mut [] };
        adamw_update::<f32, f32>(state, &grad, ParamSink::None, &scalars);
        assert_eq!((p, m, v), (q, qm, qv));

        let before = (p, m, v);
        let report = one(&mut p, &mut m, &mut v, &[1.0, f32::NAN, 0.0, 0.0], hp);
        assert_eq!(report.outcome, crate::StepOutcome::SkippedNonFinite);
        assert_eq!((p, m, v), before);
    }

    #[test]
    fn a_bad_buffer_or_mixed_clipping_touches_nothing() {
        let (mut p, mut m, mut v) = ([1.0f32; 4], [0.0f32; 4], [0.0f32; 3]);
        let (mut p2, mut m2, mut v2) = ([1.0f32; 2], [0.0f32; 2], [0.0f32; 2]);
        let grad = [1.0f32; 4];
        let mut bad = [
            InPlaceGroup {
                hyperparameters: Hyperparameters::default(),
                params: vec![InPlaceParam {
                    state: StateMut {
                        param: &mut p2,
                        exp_avg: &mut m2,
                        exp_avg_sq: &mut v2,
                        max_exp_avg_sq: &mut [],
                    },
                    grad: GradRef::F32(&grad[..2]),
                    bf16_param: None,
                    step: 0,
                }],
            },
            InPlaceGroup {
                hyperparameters: Hyperparameters::default(),
                params: vec![InPlaceParam {
                    state: StateMut {
                        param: &mut p,
                        exp_avg: &mut m,
                        exp_avg_sq: &mut v,
                        max_exp_avg_sq: &mut [],
                    },
                    grad: GradRef::F32(&grad),
                    bf16_param: None,
                    step: 0,
                }],
            },
        ];
        let e = step_in_place(&mut bad, StepOptions::default()).unwrap_err();
        assert!(matches!(e, Error::ShapeMismatch { expected: 4, got: 3, .. }), "{e}");
        assert_eq!(bad[0].params[0].step, 0);
        bad[1].params.clear();
        bad[1].hyperparameters = Hyperparameters::default().clip(GradClip::GlobalNorm { max_norm: 1.0 });
        let e = step_in_place(&mut bad, StepOptions::default()).unwrap_err();
        assert!(matches!(e, Error::InvalidConfig { field: "clip", .. }), "{e}");
        assert_eq!(bad[0].params[0].state.param, &[1.0, 1.0]);
    }

    /// A bf16 parameter with an fp32 master: the master, m and v take exactly the fp32 step on
    /// the widened gradient, the bf16 parameter is the master rounded to bf16, and a
    /// non-finite bf16 gradient skips the step, touching neither; a bf16 copy of the wrong
    /// length is refused before anything is written.
    #[test]
    fn a_bf16_parameter_steps_its_fp32_master_and_takes_the_rounded_result() {
        let hp = Hyperparameters::default();
        let grad32 = [0.5f32, -1.25, 3.0, 0.0078125, -2.5];
        let grad16: Vec<bf16> = grad32.iter().map(|&g| bf16::from_f32(g)).collect();
        let start = [1.0f32, -0.3, 0.7, 2.0, -1.1];
        let (mut want_p, mut want_m, mut want_v) = (start, [0.0f32; 5], [0.0f32; 5]);
        one(&mut want_p, &mut want_m, &mut want_v, &grad32, hp);
        let (mut p, mut m, mut v) = (start, [0.0f32; 5], [0.0f32; 5]);
        let mut model = [bf16::ZERO; 5];
        let mut bf16_step = |grad: &[bf16], model: &mut [bf16], step| {
            let state =
                StateMut { param: &mut p, exp_avg: &mut m, exp_avg_sq: &mut v, max_exp_avg_sq: &mut [] };
            let param = InPlaceParam { state, grad: GradRef::Bf16(grad), bf16_param: Some(model), step };
            step_in_place(
                &mut [InPlaceGroup { hyperparameters: hp, params: vec![param] }],
                StepOptions::default(),
            )
        };
        let report = bf16_step(&grad16, &mut model, 0).unwrap();
        assert_eq!(report.step, 1);
        let nan: Vec<bf16> = [1.0, f32::NAN, 0.0, 0.0, 0.0].iter().map(|&g| bf16::from_f32(g)).collect();
        let skipped = bf16_step(&nan, &mut model, 1).unwrap();
        let mut short = [bf16::ZERO; 4];
        let refused = bf16_step(&grad16, &mut short, 1).unwrap_err();
        // The first step took the fp32 step; the skipped one and the refused one touched nothing.
        assert_eq!((p, m, v), (want_p, want_m, want_v));
        assert_eq!(model.map(f32::from), want_p.map(|x| bf16::from_f32(x).to_f32()));
        assert!(skipped.outcome != crate::StepOutcome::Applied);
        assert!(matches!(refused, Error::ShapeMismatch { expected: 5, got: 4, .. }), "{refused}");
        assert_eq!(short, [bf16::ZERO; 4]);
    }
}
