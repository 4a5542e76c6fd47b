//! The activation ring on CUDA devices: token blocks circulate against each rank's whole
//! vocabulary shard; see [`crate::ring`] for the schedule and [`super`] for the streams.

use std::ops::Range;

use flatpeak_common::nccl::DeviceCommunicator;

use super::{Packet, Pass, RingBackend, dtod, exchange_raw, ring_peers, zero};
use crate::cuda::engine::{LogitsBlock, RowViews, StatsViews};
use crate::cuda::rows_f32;
use crate::error::Result;
use crate::kernels::GradientStore;
use crate::ring::{RingOps, Step};

impl<C: DeviceCommunicator> RingBackend<'_, C, Packet> {
    /// Sends the current packet's statistics (forward) or dX (backward) on, and receives the
    /// previous rank's into the incoming packet.
    fn exchange_result(&mut self, c: usize, c_in: usize) -> Result<()> {
        let (comm, d) = (self.comm, self.plan.hidden());
        let (next, prev) = ring_peers(comm);
        let (cur, inc) = (&*self.cur, &mut *self.inc);
        if matches!(self.pass, Pass::Grad { .. }) {
            comm.exchange(&[cur.dx.slice(..c * d)], next, &mut [inc.dx.slice_mut(..c_in * d)], prev)?;
        } else {
            let send = [cur.max.slice(..c), cur.target_logit.slice(..c)];
            let mut recv = [inc.max.slice_mut(..c_in), inc.target_logit.slice_mut(..c_in)];
            comm.exchange(&send, next, &mut recv, prev)?;
            let send = [cur.sum.slice(..c), cur.logit_sum.slice(..c)];
            let mut recv = [inc.sum.slice_mut(..c_in), inc.logit_sum.slice_mut(..c_in)];
            comm.exchange(&send, next, &mut recv, prev)?;
        }
        Ok(())
    }
}

impl<C: DeviceCommunicator> RingOps for RingBackend<'_, C, Packet> {
    fn enter(&mut self, own: &Step) -> Result<()> {
        let (e, d, c, rows) = (self.e, self.plan.hidden(), own.unit.len(), own.unit.clone());
        let cur = &mut *self.cur;
        cur.x.load(e, &self.inputs.x, rows.start * d..rows.end * d)?;
        dtod(e, &self.resolved.slice(rows.clone()), &mut cur.targets.slice_mut(..c))?;
        match &self.pass {
            Pass::Fold(_) => {
                e.fill_neg_inf(&mut cur.max.slice_mut(..c))?;
                zero(e, &mut cur.target_logit.slice_mut(..c))?;
                zero(e, &mut cur.sum.slice_mut(..c))?;
                zero(e, &mut cur.logit_sum.slice_mut(..c))?;
            }
            Pass::Grad { coef, lse, dlse, .. } => {
                dtod(e, &coef.slice(rows.clone()), &mut cur.coef.slice_mut(..c))?;
                dtod(e, &lse.slice(rows.clone()), &mut cur.lse.slice_mut(..c))?;
                match dlse {
                    Some(g) => dtod(e, &g.slice(rows), &mut cur.dlse.slice_mut(..c))?,
                    None => zero(e, &mut cur.dlse.slice_mut(..c))?,
                }
                zero(e, &mut cur.dx.slice_mut(..c * d))?;
            }
        }
        Ok(())
    }

    /// Early: the X rows, targets and backward row data travel on while this step's GEMMs read
    /// them.
    fn send_inputs(&mut self, step: &Step, c_in: usize) -> Result<()> {
        let (comm, d, c) = (self.comm, self.plan.hidden(), step.unit.len());
        let (next, prev) = ring_peers(comm);
        let (cur, inc) = (&*self.cur, &mut *self.inc);
        exchange_raw(comm, (&cur.x, c * d), (&mut inc.x, c_in * d))?;
        comm.exchange(&[cur.targets.slice(..c)], next, &mut [inc.targets.slice_mut(..c_in)], prev)?;
        if matches!(self.pass, Pass::Grad { .. }) {
            let send = [cur.coef.slice(..c), cur.lse.slice(..c), cur.dlse.slice(..c)];
            let mut recv =
                [inc.coef.slice_mut(..c_in), inc.lse.slice_mut(..c_in), inc.dlse.slice_mut(..c_in)];
            comm.exchange(&send, next, &mut recv, prev)?;
        }
        Ok(())
    }

    fn compute(&mut self, step: &Step) -> Result<()> {
        let Self { config, plan, comm, e, logits, x_wide, w_wide, cur, inputs, pass, .. } = self;
        let (d, c, vbmax, shard) =
            (plan.hidden(), step.unit.len(), plan.vocab_block(), plan.shard(comm.rank()));
        let x = cur.x.f32(e, c * d, x_wide)?;
        for v0 in (0..shard.len()).step_by(vbmax.max(1)) {
            let vb = vbmax.min(shard.len() - v0);
            let w = rows_f32(e, &inputs.w, v0..v0 + vb, d, w_wide)?;
            e.logits(&w, &x, (c, vb, d), logits)?;
            let block = LogitsBlock {
                logits,
                rows: c,
                vb,
                v0: shard.start + v0,
                bias: inputs.bias.map(|b| b.slice(v0..v0 + vb)),
                targets: cur.targets.slice(..c),
            };
            match pass {
                Pass::Fold(_) => {
                    let st = StatsViews {
                        max: cur.max.slice_mut(..c),
                        sum: cur.sum.slice_mut(..c),
                        target_logit: cur.target_logit.slice_mut(..c),
                        logit_sum: cur.logit_sum.slice_mut(..c),
                    };
                    e.fold(config, block, st)?;
                }
                Pass::Grad { grads, .. } => {
                    let rv = RowViews {
                        coef: cur.coef.slice(..c),
                        lse: cur.lse.slice(..c),
                        dlse: Some(cur.dlse.slice(..c)),
                    };
                    e.gradient((config, plan.vocab()), block, rv, GradientStore::F32)?;
                    // dbias sums the f32 G; bf16 inputs then round G to bf16 (as on the CPU).
                    if let Some(db) = grads.dbias.as_mut() {
                        e.bias_grad(logits, (c, vb), &mut db.slice_mut(v0..v0 + vb))?;
                    }
                    if crate::cpu::rounds_gradient(config, plan.dtype()) {
                        e.round_bf16(logits, c * vb)?;
                    }
                    e.dx(&w, logits, (c, vb, d), &mut cur.dx.slice_mut(..c * d))?;
                    e.dw(&x, logits, (c, vb, d), &mut grads.dw.slice_mut(v0 * d..(v0 + vb) * d))?;
                }
            }
        }
        Ok(())
    }

    /// Late: the statistics or dX follow once the step's GEMMs are done.
    fn pass_on(&mut self, step: &Step, c_in: usize, _carried: bool) -> Result<()> {
        self.exchange_result(step.unit.len(), c_in)?;
        std::mem::swap(&mut self.cur, &mut self.inc);
        Ok(())
    }

    /// Step P − 1: this rank's own block comes home, complete, into the outputs.
    fn home(&mut self, step: &Step, home: Range<usize>) -> Result<()> {
        let (d, c, p, comm, e, cur) =
            (self.plan.hidden(), step.unit.len(), self.plan.world(), self.comm, self.e, &*self.cur);
        let (next, prev) = ring_peers(comm);
        match &mut self.pass {
            Pass::Fold(stats) => {
                let st = stats.rows(home.start, home.len());
                if p > 1 {
                    let send = [cur.max.slice(..c), cur.target_logit.slice(..c)];
                    comm.exchange(&send, next, &mut [st.max, st.target_logit], prev)?;
                    let send = [cur.sum.slice(..c), cur.logit_sum.slice(..c)];
                    comm.exchange(&send, next, &mut [st.sum, st.logit_sum], prev)?;
                } else {
                    let StatsViews { mut max, mut sum, mut target_logit, mut logit_sum } = st;
                    dtod(e, &cur.max.slice(..c), &mut max)?;
                    dtod(e, &cur.sum.slice(..c), &mut sum)?;
                    dtod(e, &cur.target_logit.slice(..c), &mut target_logit)?;
                    dtod(e, &cur.logit_sum.slice(..c), &mut logit_sum)?;
                }
            }
            Pass::Grad { grads, .. } => {
                let mut dx_out = grads.dx.slice_mut(home.start * d..home.end * d);
                if p > 1 {
                    comm.exchange(&[cur.dx.slice(..c * d)], next, &mut [dx_out], prev)?;
                } else {
                    dtod(e, &cur.dx.slice(..c * d), &mut dx_out)?;
                }
            }
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}
