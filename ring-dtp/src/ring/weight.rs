//! The weight ring: W sub-blocks (and, in backward, their fp32 dW accumulators) circulate;
//! every rank's own tokens meet every sub-block once per pass.
//!
//! Step k of sub-block j on rank r holds sub-block j of shard s = (r − k) mod P. The W rows are
//! sent on before the step's GEMMs (they do not change); the dW accumulator follows when the
//! step is done, and after step P − 1 it makes the hop home, so shard s's dW sums the ranks'
//! contributions in the fixed order s, s + 1, …, s + P − 1.

use std::mem::swap;

use flatpeak_common::comm::{Communicator, CommunicatorExt};
use flatpeak_common::gemm::Accumulate;
use flatpeak_common::{DType, Workspace};

use super::{LinkCredit, Pass, Rank, as_matrix, elem_bytes, raw_rows};
use crate::config::Config;
use crate::cpu::{
    BlockGrads, TokenBlock, VocabBlock, accumulate_grads, column_grads, fold, form_logits, gradient,
    resolve_targets, w_rows,
};
use crate::error::Result;
use crate::plan::RingPlan;

/// One ring buffer: a W sub-block in its input dtype, its bias, and the travelling dW/dbias.
struct Slot<'w> {
    w: &'w mut [u8],
    bias: &'w mut [f32],
    dw: &'w mut [f32],
    dbias: &'w mut [f32],
}

impl<'w> Slot<'w> {
    fn carve(ws: &'w Workspace, plan: &RingPlan) -> Result<Self> {
        let (vb, d) = (plan.vocab_block(), plan.d());
        Ok(Self {
            w: ws.take(elem_bytes(plan.dtype()) * vb * d)?,
            dw: ws.take(vb * d)?,
            bias: ws.take(vb)?,
            dbias: ws.take(vb)?,
        })
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
    let (cb, e) = (plan.token_block(), elem_bytes(plan.dtype()));
    let inputs = &rank.local;
    let own = plan.shard(r);
    let has_bias = inputs.bias.is_some();
    let ws = Workspace::new(plan.workspace_bytes());
    let logits = ws.take::<f32>(cb * plan.vocab_block())?;
    let targets = ws.take::<u32>(cb)?;
    let xblk = ws.take::<f32>(cb * d)?;
    let w_up = ws.take::<f32>(if plan.dtype() == DType::F32 { 0 } else { plan.vocab_block() * d })?;
    let (mut cur, mut inc) = (Slot::carve(&ws, plan)?, Slot::carve(&ws, plan)?);
    let mut cols = crate::cpu::ColumnGrads::with_capacity(cb);
    let mut credit = LinkCredit::default();
    for j in 0..plan.blocks() {
        for k in 0..p {
            let s = (r + p - k) % p;
            let rows = plan.vocab_sub_block(s, j);
            let vb = rows.len();
            if k == 0 {
                // The own sub-block enters the ring from the inputs.
                let local = rows.start - own.start..rows.end - own.start;
                cur.w[..e * vb * d].copy_from_slice(raw_rows(&inputs.w, local.clone(), d));
                if let Some(b) = inputs.bias {
                    cur.bias[..vb].copy_from_slice(&b[local]);
                }
                cur.dw[..vb * d].fill(0.0);
                cur.dbias[..vb].fill(0.0);
            }
            let backward = matches!(pass, Pass::Grad { .. });
            if k + 1 < p || (backward && p > 1) {
                credit.before_send(comm)?;
            }
            if k + 1 < p {
                comm.send(next, &cur.w[..e * vb * d])?;
                if has_bias {
                    comm.send(next, &cur.bias[..vb])?;
                }
            }
            let w = w_rows(&as_matrix(&cur.w[..e * vb * d], plan.dtype()), 0, vb, d, w_up);
            let vocab = VocabBlock { w, bias: has_bias.then_some(&cur.bias[..vb]), vb };
            for t0 in (0..inputs.n).step_by(cb.max(1)) {
                let c = cb.min(inputs.n - t0);
                inputs.x.rows_f32(t0..t0 + c, d, xblk);
                resolve_targets(config, inputs, t0, &mut targets[..c]);
                let tokens = TokenBlock { x: &xblk[..c * d], targets: &targets[..c] };
                form_logits(config, d, tokens, vocab, logits, plan.gemm_threads())?;
                match &mut pass {
                    Pass::Fold(stats) => {
                        fold(config, tokens, (rows.start, vb), logits, false, stats.rows_mut(t0, c))
                    }
                    Pass::Grad { coef, lse, dlse, grads } => {
                        let dlse = dlse.map(|g| &g[t0..t0 + c]);
                        column_grads(config, plan.v(), &coef[t0..t0 + c], &lse[t0..t0 + c], dlse, &mut cols);
                        gradient(config, tokens, (rows.start, vb), logits, &cols, false);
                        // dX is fresh output memory: the first step's first sub-block writes it
                        // without reading it (no read-then-write page faults).
                        let first = j == 0 && k == 0;
                        let out = BlockGrads {
                            dx_rows: &mut grads.dx[t0 * d..(t0 + c) * d],
                            dx_mode: if first { Accumulate::Replace } else { Accumulate::Add },
                            dw_blk: &mut cur.dw[..vb * d],
                            dw_mode: Accumulate::Add,
                            dbias_blk: has_bias.then_some(&mut cur.dbias[..vb]),
                            dx_partial: None,
                        };
                        accumulate_grads(d, logits, tokens, vocab, out, plan.gemm_threads())?;
                    }
                }
            }
            let Pass::Grad { grads, .. } = &mut pass else {
                // Forward: W only.
                if k + 1 < p {
                    let vb_in = plan.vocab_sub_block((s + p - 1) % p, j).len();
                    credit.sent();
                    comm.recv(prev, &mut inc.w[..e * vb_in * d])?;
                    if has_bias {
                        comm.recv(prev, &mut inc.bias[..vb_in])?;
                    }
                    credit.received(comm)?;
                    swap(&mut cur, &mut inc);
                }
                continue;
            };
            // Backward: the accumulator moves on (after step P − 1: home).
            if p > 1 {
                comm.send(next, &cur.dw[..vb * d])?;
                if has_bias {
                    comm.send(next, &cur.dbias[..vb])?;
                }
                credit.sent();
            }
            if k + 1 < p {
                let vb_in = plan.vocab_sub_block((s + p - 1) % p, j).len();
                comm.recv(prev, &mut inc.w[..e * vb_in * d])?;
                if has_bias {
                    comm.recv(prev, &mut inc.bias[..vb_in])?;
                }
                comm.recv(prev, &mut inc.dw[..vb_in * d])?;
                if has_bias {
                    comm.recv(prev, &mut inc.dbias[..vb_in])?;
                }
                credit.received(comm)?;
                swap(&mut cur, &mut inc);
                continue;
            }
            // Step P − 1: this rank's own sub-block j comes home, complete, into the outputs.
            let home = plan.vocab_sub_block(r, j);
            let local = home.start - own.start..home.end - own.start;
            let dw_out = &mut grads.dw[local.start * d..local.end * d];
            if p > 1 {
                comm.recv(prev, dw_out)?;
                if let Some(db) = grads.dbias.as_mut() {
                    comm.recv(prev, &mut db[local])?;
                }
                credit.received(comm)?;
            } else {
                dw_out.copy_from_slice(&cur.dw[..vb * d]);
                if let Some(db) = grads.dbias.as_mut() {
                    db[local].copy_from_slice(&cur.dbias[..vb]);
                }
            }
        }
    }
    credit.finish(comm)
}
