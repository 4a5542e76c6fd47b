//! The offloaded step's schedule, written once over its [`CopyEngines`]: the CPU fallback's
//! engines are two threads fed in issue order (`schedule.rs`), a CUDA device's are two copy
//! streams with an event per slot (`cuda.rs`). Adam runs on the calling thread.
//!
//! - **Serial** (the ZeRO-Offload / FSDP2 `CPUOffloadPolicy` baseline): every gradient down,
//!   AdamW over everything, every parameter up, through one slot of N elements.
//! - **Pipelined**: buckets of N_b elements through R slots per direction. Before bucket j's
//!   Adam, every D2H copy whose grad slot is free is issued (buckets up to j + R − 1: the slot's
//!   last reader, Adam(m − R), has run); Adam(j) waits for D2H(j) into its grad slot and for
//!   H2D(j − R) out of its param slot, then H2D(j) is issued. So D2H runs up to R − 1 buckets
//!   ahead of Adam, and D2H(k) ‖ Adam(k−1) ‖ H2D(k−2) in the steady state.

use std::ops::Range;
use std::time::{Duration, Instant};

use crate::config::StepSchedule;
use crate::cpu::{ParamSink, adamw_update};
use crate::element::{GradElement, ParamElement};
use crate::error::{Error, Result};
use crate::hyperparameters::StepScalars;
use crate::plan::Plan;
use crate::state::OptimizerState;
use crate::step::StageTimes;

/// A stage of the offloaded step (fault injection names the one to fail).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// The D2H copy of a bucket's gradients.
    D2h,
    /// The CPU AdamW of a bucket.
    Adam,
    /// The H2D copy of a bucket's parameters.
    H2d,
}

/// A failure to inject (feature `testing`): `stage` fails at bucket `bucket` (on the CPU
/// fallback, a copy stage fails inside its engine thread, as a dying copy thread would).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// The stage that fails.
    pub stage: Stage,
    /// The bucket it fails at.
    pub bucket: usize,
}

/// The first element of the bucket at which each stage fails, from an injected [`Fault`].
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct FaultPoints {
    pub d2h: Option<usize>,
    pub adam: Option<usize>,
    pub h2d: Option<usize>,
}

impl FaultPoints {
    /// Where `fault` (if any) strikes in `plan`'s buckets.
    pub(crate) fn new(plan: &Plan, fault: Option<Fault>) -> Self {
        let at = |stage: Stage| fault.filter(|f| f.stage == stage).map(|f| plan.bucket(f.bucket).start);
        Self { d2h: at(Stage::D2h), adam: at(Stage::Adam), h2d: at(Stage::H2d) }
    }
}

/// One bucket on its way through the pipeline: its elements of the flat parameter vector and
/// the staging slot (a grad slot down, a param slot up) it passes through.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Staged {
    pub elements: Range<usize>,
    pub slot: usize,
}

/// An injected failure of `stage` when it reaches the bucket starting at `fails_at`.
pub(crate) fn injected(stage: &'static str, fails_at: Option<usize>, range: &Range<usize>) -> Result<()> {
    match fails_at {
        Some(start) if start == range.start => {
            Err(Error::PipelineStage { stage, reason: format!("injected fault at element {start}") })
        }
        _ => Ok(()),
    }
}

/// What one step updates: the state, the count of buckets whose update ran (on an error, 0
/// means the state is untouched), and the rollback journal, if any.
pub(crate) struct StepState<'a> {
    pub state: &'a mut OptimizerState,
    pub applied: &'a mut usize,
    pub journal: Option<&'a mut OptimizerState>,
}

/// A backend's copy engines and staging slots. Copies are issued in order and complete in
/// order within a direction; the waits name the copy most recently issued for a slot.
pub(crate) trait CopyEngines {
    /// The gradients' element.
    type Grad: GradElement;
    /// The device parameters' element.
    type Param: ParamElement;
    /// Issues the D2H copy of the bucket's device gradients into its grad slot.
    fn start_d2h(&mut self, bucket: Staged) -> Result<()>;
    /// Waits until the last D2H copy issued into grad slot `slot` has landed.
    fn wait_d2h(&mut self, slot: usize) -> Result<()>;
    /// Issues the H2D copy of the bucket's param slot into its device parameters.
    fn start_h2d(&mut self, bucket: Staged) -> Result<()>;
    /// Waits until the last H2D copy issued out of param slot `slot` has drained it.
    fn wait_h2d(&mut self, slot: usize) -> Result<()>;
    /// Runs `f` on the bucket's staged gradients (in its grad slot) and parameters (in its
    /// param slot): the operands of its Adam, which reads the former and writes the updated
    /// parameters, in the device dtype, into the latter.
    fn with_staged<R>(
        &mut self,
        bucket: &Staged,
        f: impl FnOnce(&[Self::Grad], &mut [Self::Param]) -> R,
    ) -> Result<R>;
    /// Waits for every issued copy; the D2H and H2D engines' times.
    fn finish(&mut self) -> Result<(Duration, Duration)>;
}

/// Runs `plan`'s schedule on `engines`, counting in `applied` the buckets whose update ran (on
/// an error, 0 means the state is untouched).
pub(crate) fn run_step<E: CopyEngines>(
    engines: &mut E,
    plan: &Plan,
    faults: &FaultPoints,
    step: StepState<'_>,
    scalars: &StepScalars,
    times: &mut StageTimes,
) -> Result<()> {
    let StepState { state, applied, mut journal } = step;
    // Journals a bucket's old values before its update ([`OnFailure::Rollback`]).
    let mut save = |state: &OptimizerState, range: Range<usize>| {
        if let Some(journal) = journal.as_deref_mut() {
            journal.copy_range_from(state, range);
        }
    };
    match plan.schedule() {
        StepSchedule::Serial => {
            let all = Staged { elements: 0..plan.n_params(), slot: 0 };
            engines.start_d2h(all.clone())?;
            engines.wait_d2h(0)?;
            save(state, all.elements.clone());
            times.adam += adam(engines, state, &all, faults, scalars)?;
            *applied += 1;
            engines.start_h2d(all)?;
        }
        StepSchedule::Pipelined => {
            let (buckets, slots) = (plan.n_buckets(), plan.staged_slots().max(1));
            let mut next = 0; // the next bucket to bring down
            for j in 0..buckets {
                // Every D2H whose grad slot is free: its last reader, Adam(m − R), has run.
                while next < buckets && next < j + slots {
                    engines.start_d2h(Staged { elements: plan.bucket(next), slot: next % slots })?;
                    next += 1;
                }
                let bucket = Staged { elements: plan.bucket(j), slot: j % slots };
                engines.wait_d2h(bucket.slot)?;
                engines.wait_h2d(bucket.slot)?;
                save(state, bucket.elements.clone());
                times.adam += adam(engines, state, &bucket, faults, scalars)?;
                *applied += 1;
                engines.start_h2d(bucket)?;
            }
        }
    }
    let (d2h, h2d) = engines.finish()?;
    times.d2h += d2h;
    times.h2d += h2d;
    Ok(())
}

/// AdamW of `bucket`'s parameters from its staged gradients into its param slot (after an
/// injected Adam fault, if one strikes it); its busy time.
fn adam<E: CopyEngines>(
    engines: &mut E,
    state: &mut OptimizerState,
    bucket: &Staged,
    faults: &FaultPoints,
    scalars: &StepScalars,
) -> Result<Duration> {
    injected("adam", faults.adam, &bucket.elements)?;
    engines.with_staged(bucket, |grads, params| {
        let start = Instant::now();
        adamw_update(state.view(bucket.elements.clone()), grads, ParamSink::Copy(params), scalars);
        start.elapsed()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::element::GradElement;
    use crate::plan::Shape;
    use flatpeak_common::{Budget, DType};
    use half::bf16;

    /// Records the order of operations and checks every slot rule as it goes.
    #[derive(Default)]
    struct Trace {
        ops: Vec<String>,
        /// Per grad slot: bucket written by the last D2H, and whether it landed.
        grad_slot: Vec<Option<(usize, bool)>>,
        /// Per param slot: whether its last H2D drained.
        param_busy: Vec<bool>,
        bucket_elems: usize,
    }

    impl CopyEngines for Trace {
        type Grad = f32;
        type Param = bf16;
        fn start_d2h(&mut self, Staged { elements, slot }: Staged) -> Result<()> {
            let bucket = elements.start / self.bucket_elems;
            // Never overwrite gradients Adam has not read yet.
            assert!(self.grad_slot[slot].is_none(), "D2H({bucket}) over slot {slot} before Adam read it");
            self.grad_slot[slot] = Some((bucket, false));
            self.ops.push(format!("d{bucket}"));
            Ok(())
        }
        fn wait_d2h(&mut self, slot: usize) -> Result<()> {
            if let Some((b, _)) = self.grad_slot[slot] {
                self.grad_slot[slot] = Some((b, true));
            }
            Ok(())
        }
        fn start_h2d(&mut self, Staged { elements, slot }: Staged) -> Result<()> {
            self.param_busy[slot] = true;
            self.ops.push(format!("h{}", elements.start / self.bucket_elems));
            Ok(())
        }
        fn wait_h2d(&mut self, slot: usize) -> Result<()> {
            self.param_busy[slot] = false;
            Ok(())
        }
        fn with_staged<R>(&mut self, staged: &Staged, f: impl FnOnce(&[f32], &mut [bf16]) -> R) -> Result<R> {
            let (slot, len) = (staged.slot, staged.elements.len());
            let bucket = staged.elements.start / self.bucket_elems;
            assert_eq!(
                self.grad_slot[slot],
                Some((bucket, true)),
                "Adam({bucket}) before its gradients landed"
            );
            assert!(!self.param_busy[slot], "Adam({bucket}) over a param slot still going up");
            self.grad_slot[slot] = None; // read
            self.ops.push(format!("a{bucket}"));
            Ok(f(&vec![0.0; len], &mut vec![bf16::ZERO; len]))
        }
        fn finish(&mut self) -> Result<(Duration, Duration)> {
            Ok((Duration::ZERO, Duration::ZERO))
        }
    }

    fn trace(slots: usize, schedule: StepSchedule) -> String {
        let config = Config::default().bucket_elems(64).slots(slots).schedule(schedule);
        let shape =
            Shape { params: 64 * 4, grad_dtype: <f32 as GradElement>::DTYPE, param_dtype: DType::Bf16 };
        let plan = Plan::new(&config, shape, Budget::Unlimited).unwrap();
        let mut t = Trace {
            grad_slot: vec![None; slots],
            param_busy: vec![false; slots],
            bucket_elems: if schedule == StepSchedule::Serial { 256 } else { 64 },
            ..Default::default()
        };
        let mut state = OptimizerState::new(vec![0.0; 256], Default::default());
        let scalars = StepScalars::new(&Default::default(), 1, 1.0);
        let step = StepState { state: &mut state, applied: &mut 0, journal: None };
        run_step(&mut t, &plan, &FaultPoints::default(), step, &scalars, &mut StageTimes::default()).unwrap();
        t.ops.join(" ")
    }

    #[test]
    fn the_pipeline_overlaps_and_never_reuses_a_busy_slot() {
        assert_eq!(trace(3, StepSchedule::Pipelined), "d0 d1 d2 a0 h0 d3 a1 h1 a2 h2 a3 h3");
        assert_eq!(trace(2, StepSchedule::Pipelined), "d0 d1 a0 h0 d2 a1 h1 d3 a2 h2 a3 h3");
        // One slot: the next D2H waits for the Adam that reads the slot.
        assert_eq!(trace(1, StepSchedule::Pipelined), "d0 a0 h0 d1 a1 h1 d2 a2 h2 d3 a3 h3");
        assert_eq!(trace(3, StepSchedule::Serial), "d0 a0 h0");
    }
}
