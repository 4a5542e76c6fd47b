//! The weight ring on CUDA devices: W sub-blocks (and, in backward, their fp32 dW accumulators)
//! circulate; see [`crate::ring`] for the schedule and [`super`] for the streams.

use flatpeak_common::cuda::cudarc::driver::CudaSlice;
use flatpeak_common::nccl::DeviceCommunicator;

use super::{Buffers, CudaRing, DeviceRankInputs, Pass, dtod, exchange_raw, ring_peers, zero};
use crate::cuda::engine::{LogitsBlock, RowViews};
use crate::cuda::rows_f32;
use crate::error::{Error, Result};

impl<C: DeviceCommunicator> CudaRing<C> {
    /// The weight ring: sub-block j of shard s = (r − k) mod P at step k; the dW accumulator
    /// travels with it and makes the hop home after step P − 1.
    pub(super) fn weight_ring(
        &mut self,
        inputs: &DeviceRankInputs<'_>,
        resolved: &CudaSlice<u32>,
        mut pass: Pass<'_>,
    ) -> Result<()> {
        let Self { config, plan, comm, engine: e, logits, x_wide, w_wide, buffers } = self;
        let Buffers::Weight(slots) = buffers else {
            return Err(Error::invalid_config("ring buffers", "of another ring", "weight-ring slots"));
        };
        let [a, b] = &mut **slots;
        let (mut cur, mut inc) = (a, b);
        let (p, r, d) = (plan.world(), comm.rank(), plan.d());
        let (next, prev) = ring_peers(comm);
        let (own, n, cb) = (plan.shard(r), plan.tokens(r).len(), plan.token_block());
        let has_bias = inputs.bias_shard.is_some();
        let backward = matches!(pass, Pass::Grad { .. });
        for j in 0..plan.blocks() {
            for k in 0..p {
                let s = (r + p - k) % p;
                let rows = plan.vocab_sub_block(s, j);
                let vb = rows.len();
                if k == 0 {
                    let local = rows.start - own.start..rows.end - own.start;
                    cur.w.load(e, &inputs.w_shard, local.start * d..local.end * d)?;
                    if let Some(bias) = inputs.bias_shard {
                        dtod(e, &bias.slice(local), &mut cur.bias.slice_mut(..vb))?;
                    }
                    if backward {
                        zero(e, &mut cur.dw.slice_mut(..vb * d))?;
                        zero(e, &mut cur.dbias.slice_mut(..vb))?;
                    }
                }
                // Early: the W rows and bias travel on while this step's GEMMs read them.
                let vb_in = plan.vocab_sub_block((s + p - 1) % p, j).len();
                if k + 1 < p {
                    exchange_raw(comm, (&cur.w, vb * d), (&mut inc.w, vb_in * d))?;
                    if has_bias {
                        comm.exchange(
                            &[cur.bias.slice(..vb)],
                            next,
                            &mut [inc.bias.slice_mut(..vb_in)],
                            prev,
                        )?;
                    }
                }
                let w = cur.w.f32(e, vb * d, w_wide)?;
                for t0 in (0..n).step_by(cb.max(1)) {
                    let c = cb.min(n - t0);
                    let x = rows_f32(e, &inputs.x, t0..t0 + c, d, x_wide)?;
                    e.logits(&w, &x, (c, vb, d), logits)?;
                    let block = LogitsBlock {
                        logits,
                        rows: c,
                        vb,
                        v0: rows.start,
                        bias: has_bias.then(|| cur.bias.slice(..vb)),
                        targets: resolved.slice(t0..t0 + c),
                    };
                    match &mut pass {
                        Pass::Fold(stats) => e.fold(config, block, stats.rows(t0, c))?,
                        Pass::Grad { coef, lse, dlse, grads } => {
                            let rv = RowViews {
                                coef: coef.slice(t0..t0 + c),
                                lse: lse.slice(t0..t0 + c),
                                dlse: dlse.map(|g| g.slice(t0..t0 + c)),
                            };
                            e.gradient(config, plan.v(), block, rv)?;
                            e.dx(&w, logits, (c, vb, d), &mut grads.dx.slice_mut(t0 * d..(t0 + c) * d))?;
                            e.dw(&x, logits, (c, vb, d), &mut cur.dw.slice_mut(..vb * d))?;
                            if has_bias {
                                e.bias_grad(logits, (c, vb), &mut cur.dbias.slice_mut(..vb))?;
                            }
                        }
                    }
                }
                if k + 1 < p {
                    // Late: the accumulators follow once the step's GEMMs are done.
                    if backward {
                        let mut send = vec![cur.dw.slice(..vb * d)];
                        let mut recv = vec![inc.dw.slice_mut(..vb_in * d)];
                        if has_bias {
                            send.push(cur.dbias.slice(..vb));
                            recv.push(inc.dbias.slice_mut(..vb_in));
                        }
                        comm.exchange(&send, next, &mut recv, prev)?;
                    }
                    std::mem::swap(&mut cur, &mut inc);
                    continue;
                }
                // Step P − 1: this rank's own sub-block j comes home, complete, into the outputs.
                let Pass::Grad { grads, .. } = &mut pass else { continue };
                let home = plan.vocab_sub_block(r, j);
                let local = home.start - own.start..home.end - own.start;
                let mut dw_out = grads.dw.slice_mut(local.start * d..local.end * d);
                let mut db_out = grads.dbias.as_mut().map(|db| db.slice_mut(local.clone()));
                if p > 1 {
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
            }
        }
        Ok(())
    }
}
