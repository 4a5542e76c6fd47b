//! The activation ring: token blocks circulate — X rows and resolved targets, with the running
//! statistics in forward, or the lse, gradient scale, dlse and an fp32 dX accumulator in
//! backward — while W and dW stay home.
//!
//! Step k of block b on rank r holds block b of rank o = (r − k) mod P's tokens and folds (or
//! differentiates against) the rank's whole shard, in vocabulary blocks. The X rows and targets
//! are sent on before the step's GEMMs; the statistics or the dX accumulator follow when the step
//! is done, and after step P − 1 they make the hop home. dW sums the blocks in arrival order,
//! fixed by the ring.

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
use crate::loss::StatsMut;

/// One travelling packet: C token rows in their input dtype and their targets, then the
/// forward statistics or the backward row data and dX accumulator.
pub(super) type Packet<'w> = crate::plan::Packet<Host<'w>>;

impl Packet<'_> {
    fn stats(&mut self, c: usize) -> StatsMut<'_> {
        StatsMut {
            max: &mut self.max[..c],
            sum: &mut self.sum[..c],
            target_logit: &mut self.target_logit[..c],
            logit_sum: &mut self.logit_sum[..c],
        }
    }
}

/// The activation ring's block scratch: a packet's logits against one vocabulary block, and
/// the bf16 X rows and W block widened.
pub(super) type Scratch<'w> = crate::plan::ActivationScratch<Host<'w>>;

type ActivationRing<'a, 'w, C> = RingBackend<'a, C, Packet<'w>, Scratch<'w>>;

impl<C: Communicator + ?Sized> ActivationRing<'_, '_, C> {
    fn backward(&self) -> bool {
        matches!(self.pass, Pass::Grad { .. })
    }
    /// Sends the part of the current packet the step changed: the statistics, or dX.
    fn send_result(&self, c: usize) -> Result<()> {
        let (comm, next, d, packet) = (self.comm, self.comm.next_rank(), self.plan.hidden(), &self.cur);
        if self.backward() {
            comm.send(next, &packet.dx[..c * d])?;
        } else {
            comm.send(next, &packet.max[..c])?;
            comm.send(next, &packet.sum[..c])?;
            comm.send(next, &packet.target_logit[..c])?;
            comm.send(next, &packet.logit_sum[..c])?;
        }
        Ok(())
    }
}

impl<C: Communicator + ?Sized> RingOps for ActivationRing<'_, '_, C> {
    fn enter(&mut self, own: &Step) -> Result<()> {
        let ((e, d), c, rows) = (self.widths(), own.unit.len(), own.unit.clone());
        let (cur, inputs) = (&mut self.cur, &self.rank.local);
        cur.x[..e * c * d].copy_from_slice(raw_rows(&inputs.x, rows.clone(), d));
        resolve_targets(self.config, inputs, rows.start, &mut cur.targets[..c]);
        match &self.pass {
            Pass::Fold(_) => {
                cur.max[..c].fill(f32::NEG_INFINITY);
                cur.sum[..c].fill(0.0);
                cur.target_logit[..c].fill(0.0);
                cur.logit_sum[..c].fill(0.0);
            }
            Pass::Grad { coef, lse, dlse, .. } => {
                cur.coef[..c].copy_from_slice(&coef[rows.clone()]);
                cur.lse[..c].copy_from_slice(&lse[rows.clone()]);
                match dlse {
                    Some(g) => cur.dlse[..c].copy_from_slice(&g[rows]),
                    None => cur.dlse[..c].fill(0.0),
                }
                cur.dx[..c * d].fill(0.0);
            }
        }
        Ok(())
    }

    fn send_inputs(&mut self, step: &Step, _incoming: usize) -> Result<()> {
        let ((e, d), c, backward) = (self.widths(), step.unit.len(), self.backward());
        let (comm, next, cur) = (self.comm, self.comm.next_rank(), &self.cur);
        self.credit.before_send(comm)?;
        comm.send(next, &cur.x[..e * c * d])?;
        comm.send(next, &cur.targets[..c])?;
        if backward {
            comm.send(next, &cur.coef[..c])?;
            comm.send(next, &cur.lse[..c])?;
            comm.send(next, &cur.dlse[..c])?;
        }
        Ok(())
    }

    fn compute(&mut self, step: &Step) -> Result<()> {
        let Self { config, plan, rank, pass, scratch: Scratch { logits, x_up, w_up }, cur, cols, .. } = self;
        let (d, vbmax, c) = (plan.hidden(), plan.vocab_block(), step.unit.len());
        let e = elem_bytes(plan.dtype());
        let (inputs, shard) = (&rank.local, plan.shard(rank.rank));
        let x: &[f32] = match as_matrix(&cur.x[..e * c * d], plan.dtype()) {
            crate::inputs::Matrix::F32(x) => x,
            m @ crate::inputs::Matrix::Bf16(_) => {
                m.rows_f32(0..c, d, x_up);
                &x_up[..c * d]
            }
        };
        let tokens = TokenBlock { x, targets: &cur.targets[..c] };
        if matches!(pass, Pass::Grad { .. }) {
            column_grads(config, plan.vocab(), &cur.coef[..c], &cur.lse[..c], Some(&cur.dlse[..c]), cols);
        }
        for v0 in (0..shard.len()).step_by(vbmax.max(1)) {
            let vb = vbmax.min(shard.len() - v0);
            let w = w_rows(&inputs.w, v0, v0 + vb, d, w_up);
            let bias = inputs.bias.map(|bias| &bias[v0..v0 + vb]);
            let vocab = VocabBlock { w, bias, vb };
            form_logits(config, d, tokens, vocab, logits, plan.gemm_threads())?;
            match pass {
                Pass::Fold(_) => {
                    let st = StatsMut {
                        max: &mut cur.max[..c],
                        sum: &mut cur.sum[..c],
                        target_logit: &mut cur.target_logit[..c],
                        logit_sum: &mut cur.logit_sum[..c],
                    };
                    fold(config, tokens, (shard.start + v0, vb), logits, false, st);
                }
                Pass::Grad { grads, .. } => {
                    // dW is fresh output memory: the first packet writes it without reading it
                    // (no read-then-write page faults).
                    let out = BlockGrads {
                        dx_rows: Some(&mut cur.dx[..c * d]),
                        dx_mode: Accumulate::Add,
                        dw_blk: Some(&mut grads.dw[v0 * d..(v0 + vb) * d]),
                        dw_mode: if step.first() { Accumulate::Replace } else { Accumulate::Add },
                        dbias_blk: grads.dbias.as_mut().map(|db| &mut db[v0..v0 + vb]),
                        dx_partial: None,
                    };
                    let block = (tokens, vocab, shard.start + v0);
                    gradient_and_project((config, plan), block, (logits, cols), out)?;
                }
            }
        }
        Ok(())
    }

    fn pass_on(&mut self, step: &Step, c_in: usize, _carried: bool) -> Result<()> {
        let ((e, d), backward) = (self.widths(), self.backward());
        self.send_result(step.unit.len())?;
        self.credit.sent();
        let (comm, prev, inc) = (self.comm, self.comm.prev_rank(), &mut self.inc);
        comm.recv(prev, &mut inc.x[..e * c_in * d])?;
        comm.recv(prev, &mut inc.targets[..c_in])?;
        if backward {
            comm.recv(prev, &mut inc.coef[..c_in])?;
            comm.recv(prev, &mut inc.lse[..c_in])?;
            comm.recv(prev, &mut inc.dlse[..c_in])?;
            comm.recv(prev, &mut inc.dx[..c_in * d])?;
        } else {
            let st = inc.stats(c_in);
            comm.recv(prev, st.max)?;
            comm.recv(prev, st.sum)?;
            comm.recv(prev, st.target_logit)?;
            comm.recv(prev, st.logit_sum)?;
        }
        self.credit.received(comm)?;
        swap(&mut self.cur, &mut self.inc);
        Ok(())
    }

    fn home(&mut self, step: &Step, home: Range<usize>) -> Result<()> {
        let (d, h, p, comm) = (self.plan.hidden(), home.len(), self.plan.world(), self.comm);
        if p > 1 {
            self.credit.before_send(comm)?;
            self.send_result(step.unit.len())?;
            self.credit.sent();
        }
        let (prev, cur) = (comm.prev_rank(), &self.cur);
        match &mut self.pass {
            Pass::Fold(stats) => {
                let st = stats.rows_mut(home.start, h);
                if p > 1 {
                    comm.recv(prev, st.max)?;
                    comm.recv(prev, st.sum)?;
                    comm.recv(prev, st.target_logit)?;
                    comm.recv(prev, st.logit_sum)?;
                } else {
                    st.max.copy_from_slice(&cur.max[..h]);
                    st.sum.copy_from_slice(&cur.sum[..h]);
                    st.target_logit.copy_from_slice(&cur.target_logit[..h]);
                    st.logit_sum.copy_from_slice(&cur.logit_sum[..h]);
                }
            }
            Pass::Grad { grads, .. } => {
                let dx_out = &mut grads.dx[home.start * d..home.end * d];
                if p > 1 {
                    comm.recv(prev, dx_out)?;
                } else {
                    dx_out.copy_from_slice(&cur.dx[..h * d]);
                }
            }
        }
        if p > 1 {
            self.credit.received(comm)?;
        }
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        std::mem::take(&mut self.credit).finish(self.comm)
    }
}
