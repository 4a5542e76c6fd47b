//! The weight ring: W sub-blocks (and, in backward, their fp32 dW accumulators) circulate;
//! every rank's own tokens meet every sub-block once per pass.
//!
//! Step k of sub-block j on rank r holds sub-block j of shard s = (r − k) mod P. The W rows are
//! sent on before the step's GEMMs (they do not change); the dW accumulator follows when the
//! step is done, and after step P − 1 it makes the hop home, so shard s's dW sums the ranks'
//! contributions in the fixed order s, s + 1, …, s + P − 1.

use std::mem::swap;
use std::ops::Range;

use flatpeak_common::comm::{Communicator, CommunicatorExt};
use flatpeak_common::gemm::Accumulate;

use super::schedule::{RingOps, Step};
use super::{Host, Pass, RingBackend, as_matrix, elem_bytes, gradient_and_project, raw_rows};
use crate::cpu::{
    BlockGrads, TokenBlock, VocabBlock, column_grads, fold, form_logits, resolve_targets, w_rows,
};
use crate::error::Result;

/// One ring buffer: a W sub-block in its input dtype, its bias, and the travelling dW/dbias.
pub(super) type Slot<'w> = crate::plan::Slot<Host<'w>>;

/// The weight ring's block scratch: one token block's logits against a sub-block, its targets
/// and X rows in f32, and the bf16 sub-block widened.
pub(super) type Scratch<'w> = crate::plan::WeightScratch<Host<'w>>;

type WeightRing<'a, 'w, C> = RingBackend<'a, C, Slot<'w>, Scratch<'w>>;

impl<C: Communicator + ?Sized> WeightRing<'_, '_, C> {
    fn has_bias(&self) -> bool {
        self.rank.local.bias.is_some()
    }
    /// The current sub-block's rows within this rank's shard.
    fn local(&self, rows: &Range<usize>) -> Range<usize> {
        let own = self.plan.shard(self.rank.rank);
        rows.start - own.start..rows.end - own.start
    }
}

impl<C: Communicator + ?Sized> RingOps for WeightRing<'_, '_, C> {
    fn enter(&mut self, own: &Step) -> Result<()> {
        let ((e, d), vb, local) = (self.widths(), own.unit.len(), self.local(&own.unit));
        let inputs = &self.rank.local;
        self.cur.w[..e * vb * d].copy_from_slice(raw_rows(&inputs.w, local.clone(), d));
        if let Some(b) = inputs.bias {
            self.cur.bias[..vb].copy_from_slice(&b[local]);
        }
        self.cur.dw[..vb * d].fill(0.0);
        self.cur.dbias[..vb].fill(0.0);
        Ok(())
    }

    fn send_inputs(&mut self, step: &Step, _incoming: usize) -> Result<()> {
        let ((e, d), vb) = (self.widths(), step.unit.len());
        self.credit.before_send(self.comm)?;
        let next = self.comm.next_rank();
        self.comm.send(next, &self.cur.w[..e * vb * d])?;
        if self.has_bias() {
            self.comm.send(next, &self.cur.bias[..vb])?;
        }
        Ok(())
    }

    fn compute(&mut self, step: &Step) -> Result<()> {
        let Self {
            config,
            plan,
            rank,
            pass,
            scratch: Scratch { logits, targets, xblk, w_up },
            cur,
            cols,
            ..
        } = self;
        let (d, cb, vb, rows) = (plan.hidden(), plan.token_block(), step.unit.len(), &step.unit);
        let e = elem_bytes(plan.dtype());
        let inputs = &rank.local;
        let has_bias = inputs.bias.is_some();
        let w = w_rows(&as_matrix(&cur.w[..e * vb * d], plan.dtype()), 0, vb, d, w_up);
        let vocab = VocabBlock { w, bias: has_bias.then_some(&cur.bias[..vb]), vb };
        for t0 in (0..inputs.n).step_by(cb.max(1)) {
            let c = cb.min(inputs.n - t0);
            inputs.x.rows_f32(t0..t0 + c, d, xblk);
            resolve_targets(config, inputs, t0, &mut targets[..c]);
            let tokens = TokenBlock { x: &xblk[..c * d], targets: &targets[..c] };
            form_logits(config, d, tokens, vocab, logits, plan.gemm_threads())?;
            match pass {
                Pass::Fold(stats) => {
                    fold(config, tokens, (rows.start, vb), logits, false, stats.rows_mut(t0, c))
                }
                Pass::Grad { coef, lse, dlse, grads } => {
                    let dlse = dlse.map(|g| &g[t0..t0 + c]);
                    column_grads(config, plan.vocab(), &coef[t0..t0 + c], &lse[t0..t0 + c], dlse, cols);
                    // dX is fresh output memory: the first step's first sub-block writes it
                    // without reading it (no read-then-write page faults).
                    let out = BlockGrads {
                        dx_rows: Some(&mut grads.dx[t0 * d..(t0 + c) * d]),
                        dx_mode: if step.first() { Accumulate::Replace } else { Accumulate::Add },
                        dw_blk: Some(&mut cur.dw[..vb * d]),
                        dw_mode: Accumulate::Add,
                        dbias_blk: has_bias.then_some(&mut cur.dbias[..vb]),
                        dx_partial: None,
                    };
                    gradient_and_project((config, plan), (tokens, vocab, rows.start), (logits, cols), out)?;
                }
            }
        }
        Ok(())
    }

    fn pass_on(&mut self, step: &Step, vb_in: usize, carried: bool) -> Result<()> {
        let ((e, d), vb, has_bias) = (self.widths(), step.unit.len(), self.has_bias());
        let (comm, next, prev) = (self.comm, self.comm.next_rank(), self.comm.prev_rank());
        if carried {
            comm.send(next, &self.cur.dw[..vb * d])?;
            if has_bias {
                comm.send(next, &self.cur.dbias[..vb])?;
            }
        }
        self.credit.sent();
        comm.recv(prev, &mut self.inc.w[..e * vb_in * d])?;
        if has_bias {
            comm.recv(prev, &mut self.inc.bias[..vb_in])?;
        }
        if carried {
            comm.recv(prev, &mut self.inc.dw[..vb_in * d])?;
            if has_bias {
                comm.recv(prev, &mut self.inc.dbias[..vb_in])?;
            }
        }
        self.credit.received(comm)?;
        swap(&mut self.cur, &mut self.inc);
        Ok(())
    }

    fn home(&mut self, step: &Step, home: Range<usize>) -> Result<()> {
        let ((_, d), vb, local) = (self.widths(), step.unit.len(), self.local(&home));
        let (comm, p) = (self.comm, self.plan.world());
        let Pass::Grad { grads, .. } = &mut self.pass else {
            return Ok(()); // the forward pass carries nothing home (`run_ring` never asks)
        };
        let dw_out = &mut grads.dw[local.start * d..local.end * d];
        if p == 1 {
            dw_out.copy_from_slice(&self.cur.dw[..vb * d]);
            if let Some(db) = grads.dbias.as_mut() {
                db[local].copy_from_slice(&self.cur.dbias[..vb]);
            }
            return Ok(());
        }
        self.credit.before_send(comm)?;
        comm.send(comm.next_rank(), &self.cur.dw[..vb * d])?;
        if grads.dbias.is_some() {
            comm.send(comm.next_rank(), &self.cur.dbias[..vb])?;
        }
        self.credit.sent();
        comm.recv(comm.prev_rank(), dw_out)?;
        if let Some(db) = grads.dbias.as_mut() {
            comm.recv(comm.prev_rank(), &mut db[local])?;
        }
        self.credit.received(comm)
    }

    fn finish(&mut self) -> Result<()> {
        std::mem::take(&mut self.credit).finish(self.comm)
    }
}
