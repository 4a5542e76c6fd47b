//! The ring schedule, written once for both rings and every backend. The CPU ring over a
//! [`Communicator`](flatpeak_common::Communicator) (`ring::weight`, `ring::activation`) and the
//! CUDA ring over NCCL (`cuda::ring`) run this loop through [`RingOps`]; what differs is only
//! how a backend moves a buffer to its neighbour and computes on it.
//!
//! The ring runs [`RingPlan::blocks`] rounds of P steps. At step k of round j, rank r holds
//! unit j of rank o = (r − k) mod P: a vocabulary sub-block of o's shard
//! ([`RingPlan::vocab_sub_block`], weight ring) or a token block of o's tokens
//! ([`RingPlan::token_sub_block`], activation ring). Each step
//! 1. (k = 0) brings the rank's own unit into the current buffer, with fresh accumulators;
//! 2. (k < P − 1) sends the unit's read-only part (W rows and bias; X rows, targets and row
//!    data) on to rank r + 1, before the step's GEMMs, so it travels while they run;
//! 3. computes on the unit against the rank's own data;
//! 4. (k < P − 1) passes the accumulators (dW; statistics or dX) on once the GEMMs are done,
//!    and makes the buffer received from rank r − 1 current;
//! 5. (k = P − 1) brings the accumulators home: the unit that arrives last is the rank's own,
//!    with every rank's contribution folded in, in the fixed order o, o + 1, …, o + P − 1.
//!
//! The weight ring's forward carries no accumulator (statistics stay with their tokens), so it
//! skips 4's accumulators and 5.

use std::ops::Range;

use crate::error::Result;
use crate::plan::{RingKind, RingPlan};

/// Where a ring step stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Step {
    /// Round j (the unit's index within its owner's shard or tokens).
    pub round: usize,
    /// Step k within the round: the current unit belongs to rank (r − k) mod P.
    pub k: usize,
    /// The unit's rows: global vocabulary rows (weight ring), or token rows relative to the
    /// owner's first token (activation ring).
    pub unit: Range<usize>,
}

impl Step {
    /// The first step of the first round: outputs written here are fresh memory.
    pub fn first(&self) -> bool {
        self.round == 0 && self.k == 0
    }
}

/// One backend's operations on a ring of two buffers (current and incoming). Each is called in
/// the order [`run_ring`] states; a backend keeps the call's inputs, its buffers and outputs.
pub(crate) trait RingOps {
    /// Step 0: the rank's own unit `own` enters the current buffer with fresh accumulators.
    fn enter(&mut self, own: &Step) -> Result<()>;
    /// Before the step's GEMMs: the current unit's read-only part (`step.unit`) starts toward
    /// the next rank; the incoming buffer is to receive `incoming` rows from the previous one.
    fn send_inputs(&mut self, step: &Step, incoming: usize) -> Result<()>;
    /// The step's GEMMs and kernels on the current unit.
    fn compute(&mut self, step: &Step) -> Result<()>;
    /// After the GEMMs (k < P − 1): the accumulators follow the inputs (when `carried`), the
    /// incoming buffer is complete, and it becomes current.
    fn pass_on(&mut self, step: &Step, incoming: usize, carried: bool) -> Result<()>;
    /// Step P − 1: the current unit's accumulators go home, into the outputs at rows `home` of
    /// this rank's own shard (weight ring: global vocabulary rows) or tokens.
    fn home(&mut self, step: &Step, home: Range<usize>) -> Result<()>;
    /// After the last step: no message outlives the pass.
    fn finish(&mut self) -> Result<()>;
}

/// The unit rank `owner` contributes to round `round`.
fn unit(plan: &RingPlan, owner: usize, round: usize) -> Range<usize> {
    match plan.kind() {
        RingKind::Weight => plan.vocab_sub_block(owner, round),
        RingKind::Activation => plan.token_sub_block(owner, round),
    }
}

/// Runs one pass (forward, or `backward`) of `plan`'s ring on rank `rank`.
pub(crate) fn run_ring<O: RingOps>(ops: &mut O, plan: &RingPlan, rank: usize, backward: bool) -> Result<()> {
    let p = plan.world();
    // Accumulators travel and come home in every pass but the weight ring's forward.
    let carried = backward || plan.kind() == RingKind::Activation;
    for round in 0..plan.blocks() {
        for k in 0..p {
            let owner = (rank + p - k) % p;
            let step = Step { round, k, unit: unit(plan, owner, round) };
            if k == 0 {
                ops.enter(&step)?;
            }
            let incoming = unit(plan, (owner + p - 1) % p, round).len();
            if k + 1 < p {
                ops.send_inputs(&step, incoming)?;
            }
            ops.compute(&step)?;
            if k + 1 < p {
                ops.pass_on(&step, incoming, carried)?;
            } else if carried {
                ops.home(&step, unit(plan, rank, round))?;
            }
        }
    }
    ops.finish()
}

#[cfg(test)]
mod tests {
    use flatpeak_common::{Budget, DType};

    use super::*;
    use crate::config::Config;
    use crate::plan::{RingOptions, Shape};

    /// Records every call.
    #[derive(Default)]
    struct Trace(Vec<String>);

    fn rows(r: &Range<usize>) -> String {
        format!("{}..{}", r.start, r.end)
    }

    impl RingOps for Trace {
        fn enter(&mut self, own: &Step) -> Result<()> {
            self.0.push(format!("enter{}", rows(&own.unit)));
            Ok(())
        }
        fn send_inputs(&mut self, step: &Step, incoming: usize) -> Result<()> {
            self.0.push(format!("send{}<{incoming}", rows(&step.unit)));
            Ok(())
        }
        fn compute(&mut self, step: &Step) -> Result<()> {
            self.0.push(format!("z{}{}", rows(&step.unit), if step.first() { "!" } else { "" }));
            Ok(())
        }
        fn pass_on(&mut self, _: &Step, incoming: usize, carried: bool) -> Result<()> {
            self.0.push(format!("pass{}<{incoming}", if carried { "+acc" } else { "" }));
            Ok(())
        }
        fn home(&mut self, step: &Step, home: Range<usize>) -> Result<()> {
            self.0.push(format!("home{}>{}", rows(&step.unit), rows(&home)));
            Ok(())
        }
        fn finish(&mut self) -> Result<()> {
            self.0.push("end".into());
            Ok(())
        }
    }

    fn trace(kind: RingKind, p: usize, rank: usize, backward: bool) -> String {
        let shape = Shape { tokens: 10, hidden: 4, vocab: 10, dtype: DType::F32 };
        let options = RingOptions::default().ranks(p).ring(kind);
        let plan = RingPlan::new(&Config::default(), shape, Budget::Unlimited, options).unwrap();
        let mut t = Trace::default();
        run_ring(&mut t, &plan, rank, backward).unwrap();
        t.0.join(" ")
    }

    #[test]
    fn every_unit_meets_every_rank_once_and_its_accumulators_come_home() {
        // P = 2, rank 1, one round: the own shard 5..10, then rank 0's 0..5, whose accumulators
        // go home to rank 0 while rank 1's arrive.
        assert_eq!(
            trace(RingKind::Weight, 2, 1, true),
            "enter5..10 send5..10<5 z5..10! pass+acc<5 z0..5 home0..5>5..10 end"
        );
        // The weight ring's forward carries nothing home.
        assert_eq!(trace(RingKind::Weight, 2, 1, false), "enter5..10 send5..10<5 z5..10! pass<5 z0..5 end");
        // P = 1: no sends; the accumulators come home from the rank itself.
        assert_eq!(trace(RingKind::Activation, 1, 0, true), "enter0..10 z0..10! home0..10>0..10 end");
        // The activation ring's forward carries the statistics home.
        assert_eq!(
            trace(RingKind::Activation, 2, 0, false),
            "enter0..5 send0..5<5 z0..5! pass+acc<5 z0..5 home0..5>0..5 end"
        );
        // P = 3, rank 0: units of ranks 0, 2, 1 (the last rank's tokens are fewer: 4 + 4 + 2).
        assert_eq!(
            trace(RingKind::Activation, 3, 0, true),
            "enter0..4 send0..4<2 z0..4! pass+acc<2 send0..2<4 z0..2 pass+acc<4 z0..4 home0..4>0..4 end"
        );
    }
}
