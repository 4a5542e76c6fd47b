//! The weight ring on CUDA devices: W sub-blocks (and, in backward, their fp32 dW accumulators)
//! circulate; see [`crate::ring`] for the schedule and [`super`] for the streams.

use std::ops::Range;

use flatpeak_common::nccl::DeviceCommunicator;

use super::{Pass, RingBackend, WeightSlot, dtod, exchange_raw, ring_peers, zero};
use crate::cuda::engine::{LogitsBlock, RowViews};
use crate::cuda::rows_f32;
use crate::error::Result;
use crate::kernels::GradientStore;
use crate::ring::{RingOps, Step};

impl<C: DeviceCommunicator> RingBackend<'_, C, WeightSlot> {
    /// The rows `rows` (global vocabulary rows) within this rank's shard.
    fn local(&self, rows: &Range<usize>) -> Range<usize> {
        let own = self.plan.shard(self.comm.rank());
        rows.start - own.start..rows.end - own.start
    }
}

impl<C: DeviceCommunicator> RingOps for RingBackend<'_, C, WeightSlot> {
    fn enter(&mut self, own: &Step) -> Result<()> {
        let (e, d, vb, local) = (self.e, self.plan.hidden(), own.unit.len(), self.local(&own.unit));
        self.cur.w.load(e, &self.inputs.w, local.start * d..local.end * d)?;
        if let Some(bias) = self.inputs.bias {
            dtod(e, &bias.slice(local), &mut self.cur.bias.slice_mut(..vb))?;
        }
        if matches!(self.pass, Pass::Grad { .. }) {
            zero(e, &mut self.cur.dw.slice_mut(..vb * d))?;
            zero(e, &mut self.cur.dbias.slice_mut(..vb))?;
        }
        Ok(())
    }

    /// Early: the W rows and bias travel on while this step's GEMMs read them.
    fn send_inputs(&mut self, step: &Step, vb_in: usize) -> Result<()> {
        let (comm, d, vb) = (self.comm, self.plan.hidden(), step.unit.len());
        let (next, prev) = ring_peers(comm);
        exchange_raw(comm, (&self.cur.w, vb * d), (&mut self.inc.w, vb_in * d))?;
        if self.inputs.bias.is_some() {
            comm.exchange(&[self.cur.bias.slice(..vb)], next, &mut [self.inc.bias.slice_mut(..vb_in)], prev)?;
        }
        Ok(())
    }

    fn compute(&mut self, step: &Step) -> Result<()> {
        let Self { config, plan, comm, e, logits, x_wide, w_wide, cur, inputs, resolved, pass, .. } = self;
        let (d, vb, v0) = (plan.hidden(), step.unit.len(), step.unit.start);
        let (n, cb) = (plan.tokens(comm.rank()).len(), plan.token_block());
        let has_bias = inputs.bias.is_some();
        let w = cur.w.f32(e, vb * d, w_wide)?;
        for t0 in (0..n).step_by(cb.max(1)) {
            let c = cb.min(n - t0);
            let x = rows_f32(e, &inputs.x, t0..t0 + c, d, x_wide)?;
            e.logits(&w, &x, (c, vb, d), logits)?;
            let block = LogitsBlock {
                logits,
                rows: c,
                vb,
                v0,
                bias: has_bias.then(|| cur.bias.slice(..vb)),
                targets: resolved.slice(t0..t0 + c),
            };
            match pass {
                Pass::Fold(stats) => e.fold(config, block, stats.rows(t0, c))?,
                Pass::Grad { coef, lse, dlse, grads } => {
                    let rv = RowViews {
                        coef: coef.slice(t0..t0 + c),
                        lse: lse.slice(t0..t0 + c),
                        dlse: dlse.map(|g| g.slice(t0..t0 + c)),
                    };
                    e.gradient((config, plan.vocab()), block, rv, GradientStore::F32)?;
                    // dbias sums the f32 G; bf16 inputs then round G to bf16 (as on the CPU).
                    if has_bias {
                        e.bias_grad(logits, (c, vb), &mut cur.dbias.slice_mut(..vb))?;
                    }
                    if crate::cpu::rounds_gradient(config, plan.dtype()) {
                        e.round_bf16(logits, c * vb)?;
                    }
                    e.dx(&w, logits, (c, vb, d), &mut grads.dx.slice_mut(t0 * d..(t0 + c) * d))?;
                    e.dw(&x, logits, (c, vb, d), &mut cur.dw.slice_mut(..vb * d))?;
                }
            }
        }
        Ok(())
    }

    /// Late: the accumulators follow once the step's GEMMs are done.
    fn pass_on(&mut self, step: &Step, vb_in: usize, carried: bool) -> Result<()> {
        let (d, vb) = (self.plan.hidden(), step.unit.len());
        if carried {
            let (next, prev) = ring_peers(self.comm);
            let mut send = vec![self.cur.dw.slice(..vb * d)];
            let mut recv = vec![self.inc.dw.slice_mut(..vb_in * d)];
            if self.inputs.bias.is_some() {
                send.push(self.cur.dbias.slice(..vb));
                recv.push(self.inc.dbias.slice_mut(..vb_in));
            }
            self.comm.exchange(&send, next, &mut recv, prev)?;
        }
        std::mem::swap(&mut self.cur, &mut self.inc);
        Ok(())
    }

    /// Step P − 1: this rank's own sub-block comes home, complete, into the outputs.
    fn home(&mut self, step: &Step, home: Range<usize>) -> Result<()> {
        let (d, vb, local) = (self.plan.hidden(), step.unit.len(), self.local(&home));
        let (p, comm, e, cur) = (self.plan.world(), self.comm, self.e, &*self.cur);
        let Pass::Grad { grads, .. } = &mut self.pass else {
            return Ok(()); // the forward pass carries nothing home (`run_ring` never asks)
        };
        let mut dw_out = grads.dw.slice_mut(local.start * d..local.end * d);
        let mut db_out = grads.dbias.as_mut().map(|db| db.slice_mut(local.clone()));
        if p > 1 {
            let (next, prev) = ring_peers(comm);
            let (mut send, mut recv) = (vec![cur.dw.slice(..vb * d)], vec![dw_out]);
            if let Some(db) = db_out {
                send.push(cur.dbias.slice(..vb));
                recv.push(db);
            }
            comm.exchange(&send, next, &mut recv, prev)?;
        } else {
            dtod(e, &cur.dw.slice(..vb * d), &mut dw_out)?;
            if let Some(db) = db_out.as_mut() {
                dtod(e, &cur.dbias.slice(..vb), db)?;
            }
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        Ok(())
    }
}
