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

use flatpeak_common::comm::{Communicator, CommunicatorExt};
use flatpeak_common::gemm::Accumulate;
use flatpeak_common::{DType, Workspace};

use super::{LinkCredit, Pass, Rank, as_matrix, elem_bytes, raw_rows};
use crate::config::Config;
use crate::cpu::{
    BlockGrads, StatsMut, TokenBlock, VocabBlock, accumulate_grads, column_grads, fold, form_logits,
    gradient, resolve_targets, w_rows,
};
use crate::error::Result;
use crate::plan::RingPlan;

/// One travelling packet: C token rows in their input dtype and their targets, then the
/// forward statistics or the backward row data and dX accumulator.
struct Packet<'w> {
    x: &'w mut [u8],
    targets: &'w mut [u32],
    max: &'w mut [f32],
    sum: &'w mut [f64],
    target_logit: &'w mut [f32],
    logit_sum: &'w mut [f64],
    lse: &'w mut [f32],
    coef: &'w mut [f32],
    dlse: &'w mut [f32],
    dx: &'w mut [f32],
}

impl<'w> Packet<'w> {
    fn carve(ws: &'w Workspace, plan: &RingPlan) -> Result<Self> {
        let (c, d) = (plan.token_block(), plan.d());
        Ok(Self {
            x: ws.take(elem_bytes(plan.dtype()) * c * d)?,
            dx: ws.take(c * d)?,
            targets: ws.take(c)?,
            max: ws.take(c)?,
            sum: ws.take(c)?,
            target_logit: ws.take(c)?,
            logit_sum: ws.take(c)?,
            lse: ws.take(c)?,
            coef: ws.take(c)?,
            dlse: ws.take(c)?,
        })
    }

    fn stats(&mut self, c: usize) -> StatsMut<'_> {
        StatsMut {
            max: &mut self.max[..c],
            sum: &mut self.sum[..c],
            target_logit: &mut self.target_logit[..c],
            logit_sum: &mut self.logit_sum[..c],
        }
    }
}

pub(super) fn run<C: Communicator + ?Sized>(
    comm: &C,
    config: &Config,
    plan: &RingPlan,
    rank: &Rank<'_>,
    mut pass: Pass<'_>,
) -> Result<()> {
    let (p, r, d) = (plan.world(), rank.rank, plan.d());
    let (next, prev) = (comm.next_rank(), comm.prev_rank());
    let (cb, vbmax, e) = (plan.token_block(), plan.vocab_block(), elem_bytes(plan.dtype()));
    let inputs = &rank.local;
    let shard = plan.shard(r);
    let bf16 = plan.dtype() != DType::F32;
    let backward = matches!(pass, Pass::Grad { .. });
    let ws = Workspace::new(plan.workspace_bytes());
    let logits = ws.take::<f32>(cb * vbmax)?;
    let x_up = ws.take::<f32>(if bf16 { cb * d } else { 0 })?;
    let w_up = ws.take::<f32>(if bf16 { vbmax * d } else { 0 })?;
    let (mut cur, mut inc) = (Packet::carve(&ws, plan)?, Packet::carve(&ws, plan)?);
    let mut cols = crate::cpu::ColumnGrads::with_capacity(cb);
    let mut credit = LinkCredit::default();
    for b in 0..plan.blocks() {
        for k in 0..p {
            let o = (r + p - k) % p;
            let c = plan.token_sub_block(o, b).len();
            if k == 0 {
                // The own block enters the ring from the inputs.
                let rows = plan.token_sub_block(r, b);
                cur.x[..e * c * d].copy_from_slice(raw_rows(&inputs.x, rows.clone(), d));
                resolve_targets(config, inputs, rows.start, &mut cur.targets[..c]);
                match &pass {
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
            }
            if p > 1 {
                credit.before_send(comm)?;
            }
            if k + 1 < p {
                comm.send(next, &cur.x[..e * c * d])?;
                comm.send(next, &cur.targets[..c])?;
                if backward {
                    comm.send(next, &cur.coef[..c])?;
                    comm.send(next, &cur.lse[..c])?;
                    comm.send(next, &cur.dlse[..c])?;
                }
            }
            let x: &[f32] = match as_matrix(&cur.x[..e * c * d], plan.dtype()) {
                crate::inputs::Matrix::F32(x) => x,
                m @ crate::inputs::Matrix::Bf16(_) => {
                    m.rows_f32(0..c, d, x_up);
                    &x_up[..c * d]
                }
            };
            let tokens = TokenBlock { x, targets: &cur.targets[..c] };
            if backward {
                column_grads(
                    config,
                    plan.v(),
                    &cur.coef[..c],
                    &cur.lse[..c],
                    Some(&cur.dlse[..c]),
                    &mut cols,
                );
            }
            for v0 in (0..shard.len()).step_by(vbmax.max(1)) {
                let vb = vbmax.min(shard.len() - v0);
                let w = w_rows(&inputs.w, v0, v0 + vb, d, w_up);
                let bias = inputs.bias.map(|bias| &bias[v0..v0 + vb]);
                let vocab = VocabBlock { w, bias, vb };
                form_logits(config, d, tokens, vocab, logits, plan.gemm_threads())?;
                match &mut pass {
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
                        gradient(config, tokens, (shard.start + v0, vb), logits, &cols, false);
                        // dW is fresh output memory: the first packet writes it without reading it
                        // (no read-then-write page faults).
                        let first = b == 0 && k == 0;
                        let out = BlockGrads {
                            dx_rows: &mut cur.dx[..c * d],
                            dx_mode: Accumulate::Add,
                            dw_blk: &mut grads.dw[v0 * d..(v0 + vb) * d],
                            dw_mode: if first { Accumulate::Replace } else { Accumulate::Add },
                            dbias_blk: grads.dbias.as_mut().map(|db| &mut db[v0..v0 + vb]),
                            dx_partial: None,
                        };
                        accumulate_grads(d, logits, tokens, vocab, out, plan.gemm_threads())?;
                    }
                }
            }
            // The changing part moves on (after step P − 1: home).
            if p > 1 {
                send_result(comm, next, &cur, c, d, backward)?;
                credit.sent();
            }
            if k + 1 < p {
                let c_in = plan.token_sub_block((o + p - 1) % p, b).len();
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
                credit.received(comm)?;
                swap(&mut cur, &mut inc);
                continue;
            }
            // Step P − 1: this rank's own block b comes home, complete.
            let home = plan.token_sub_block(r, b);
            let h = home.len();
            match &mut pass {
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
                credit.received(comm)?;
            }
        }
    }
    credit.finish(comm)
}

/// Sends the part of a packet a step changed: the statistics, or the dX accumulator.
fn send_result<C: Communicator + ?Sized>(
    comm: &C,
    next: usize,
    packet: &Packet<'_>,
    c: usize,
    d: usize,
    backward: bool,
) -> Result<()> {
    if backward {
        comm.send(next, &packet.dx[..c * d])?;
    } else {
        comm.send(next, &packet.max[..c])?;
        comm.send(next, &packet.sum[..c])?;
        comm.send(next, &packet.target_logit[..c])?;
        comm.send(next, &packet.logit_sum[..c])?;
    }
    Ok(())
}
