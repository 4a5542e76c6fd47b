//! The CPU fast path: token blocks of C rows, vocabulary blocks of Vb rows; each block's logits
//! (vocabulary-major, Vb×C: the GEMMs need no transposed copies and the fold vectorizes across
//! tokens) are one GEMM into a workspace buffer reserved at launch, folded into per-token
//! (max, sum-exp, target logit, Σz) statistics, and, in backward, turned in place into the
//! logit gradient G, from which `dX_blk += Gᵀ·W_blk` and `dW_blk += G·X_blk`. On the fused
//! full-vocabulary path without a softcap the fold leaves e^(z − max) in place, so the gradient
//! needs no second exponential. Fixed block order and fixed-order reductions: bitwise
//! reproducible run to run, for any thread count.
//!
//! Two things keep the call near the GEMM's own rate: a long vocabulary block's `dX` GEMM is
//! split in two halves of its reduction run side by side (`block::DxPartial`; its k-long,
//! C×D-output shape is the one the CPU GEMM's thread split handles worst), and the fold and
//! gradient row loops are compiled for AVX-512/AVX2 and chosen at run time (`rows.rs`). Both
//! leave results bitwise identical for any thread count and any target.
//!
//! The block kernels live in `block.rs` and are shared with the ring schedules (`crate::ring`).

mod block;
mod exp;
pub mod reference;
mod rows;

#[cfg(feature = "cuda-emu")]
pub(crate) use block::gemm;
pub(crate) use block::{
    BlockGrads, ColumnGrads, DxPartial, NO_TARGET, TokenBlock, VocabBlock, accumulate_grads,
    accumulate_grads_bf16, accumulate_grads_widening, column_grads, fold, form_logits, form_logits_bf16,
    form_logits_widening, gradient, resolve_targets, round_gradient_to_bf16, rounds_gradient,
};

use flatpeak_common::Precision;
use flatpeak_common::Workspace;
use flatpeak_common::gemm::{Accumulate, Threads};
use flatpeak_common::gemm_bf16::{Bf16Gemm, Bf16Kernel};

use crate::blocks::{BlockAt, BlockOps, GradientInputs, Pass};
use crate::config::{Config, Softcap};
use crate::driver::{self, Call, Saved};
use crate::error::{Error, Result};
use crate::gradients::{Gradients, GradientsMut};
use crate::inputs::{Forward, GradOutput, Inputs, Matrix, Upstream};
use crate::loss::Stats;
use crate::plan::Plan;

/// The kernel that forms the logits blocks of bf16 inputs on this CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Path {
    /// AMX tiles (`tdpbf16ps`) on the packed rows, f32 sums.
    Tiles,
    /// bf16 dot products (AVX512-BF16 `vdpbf16ps`) on the packed rows, f32 sums.
    DotProducts,
    /// The rows widened to f32 a sub-block at a time, then the f32 GEMM.
    Widened,
}

/// Which kernel this CPU runs the logits GEMMs of bf16 inputs on under `kernel` (detected at
/// run time for [`Bf16Kernel::Detect`]).
pub fn bf16_path(kernel: Bf16Kernel) -> Bf16Path {
    match kernel.select().map(Bf16Gemm::name) {
        Some("amx") => Bf16Path::Tiles,
        Some(_) => Bf16Path::DotProducts,
        None => Bf16Path::Widened,
    }
}

/// The bf16 GEMM for bf16 X and W, unless the config asks for f32 GEMMs ([`Precision::F32`]).
fn bf16_kernel(config: &Config, inputs: &Inputs<'_>) -> Option<Bf16Gemm> {
    match (inputs.x, inputs.w, config.precision) {
        (_, _, Precision::F32) => None,
        (Matrix::Bf16(_), Matrix::Bf16(_), _) => config.bf16_kernel.select(),
        _ => None,
    }
}

/// The scratch of one call, carved from a workspace reserved at the plan's size.
struct Scratch<'w> {
    logits: &'w mut [f32],
    xblk: &'w mut [f32],
    wblk: &'w mut [f32],
    /// dX's second partial sum ([`DxPartial`]); empty when the plan's GEMMs never split.
    dx_part: &'w mut [f32],
}

impl<'w> Scratch<'w> {
    /// The plan's [`host_regions`](Plan::host_regions), in their layout order.
    fn carve(ws: &'w Workspace, plan: &Plan) -> Result<Self> {
        let [logits, x_block, w_block, dx_partial] = plan.host_regions().lens();
        Ok(Self {
            logits: ws.take(logits)?,
            xblk: ws.take(x_block)?,
            wblk: ws.take(w_block)?,
            dx_part: ws.take(dx_partial)?,
        })
    }
}

/// W rows `v0..v1` as f32: a slice of W itself, or upcast into `buf`.
pub(crate) fn w_rows<'a>(w: &Matrix<'a>, v0: usize, v1: usize, d: usize, buf: &'a mut [f32]) -> &'a [f32] {
    match w {
        Matrix::F32(m) => &m[v0 * d..v1 * d],
        Matrix::Bf16(_) => {
            w.rows_f32(v0..v1, d, buf);
            &buf[..(v1 - v0) * d]
        }
    }
}

/// A pass's state (`expected`) read before the pass set it: a bug in the block driver.
fn missing(expected: &'static str) -> Error {
    Error::internal(expected)
}

/// The CPU backend of the block schedule ([`crate::blocks`]): blocks in a workspace reserved at
/// the plan's size, an f32 W read in place and a bf16 W widened `WIDEN_ROWS` rows at a time
/// inside the GEMMs.
struct CpuBlocks<'a, 'w, 'g> {
    config: &'a Config,
    inputs: &'a Inputs<'a>,
    scratch: Scratch<'w>,
    /// Resolved targets of the current token block.
    targets: Vec<u32>,
    /// A fused pass without a softcap: the fold leaves e^(z − max) in place and the gradient
    /// reuses it (one exponential per logit instead of two).
    keep_exp: bool,
    stats: Option<Stats>,
    grads: Option<GradientsMut<'g>>,
    cols: ColumnGrads,
    /// The fused pass's lse of the current token block.
    lse_block: Vec<f32>,
    /// The bf16 dot-product GEMM, for bf16 inputs on a CPU that has it.
    bf16_gemm: Option<Bf16Gemm>,
}

impl<'a, 'w, 'g> CpuBlocks<'a, 'w, 'g> {
    /// Checks the call (every target on the host) and carves the plan's blocks from `ws`;
    /// `grads` receives a backward's gradients.
    fn open(ws: &'w mut Workspace, call: Call<'a>, grads: Option<GradientsMut<'g>>) -> Result<Self> {
        let Call { config, plan, rows: inputs } = call;
        config.check_host_precision(inputs.x.dtype(), "the CPU")?;
        driver::check_call(config, plan, inputs.sizes(), grads.as_ref().map(GradientsMut::lens))?;
        driver::check_rows(inputs)?;
        inputs.check_targets(config)?;
        ws.reset();
        let cb = plan.token_block();
        Ok(Self {
            config,
            inputs,
            scratch: Scratch::carve(ws, plan)?,
            targets: vec![NO_TARGET; cb],
            keep_exp: false,
            stats: None,
            grads,
            cols: ColumnGrads::with_capacity(cb),
            lse_block: vec![0f32; cb],
            bf16_gemm: bf16_kernel(config, inputs),
        })
    }

    /// An f32 W's rows of the block, read in place (`None` for bf16: widened in the GEMMs).
    fn w_f32(&self, at: BlockAt) -> Option<&'a [f32]> {
        let d = self.inputs.d;
        match self.inputs.w {
            Matrix::F32(m) => Some(&m[at.v0 * d..(at.v0 + at.vb) * d]),
            Matrix::Bf16(_) => None,
        }
    }

    fn bias(&self, at: BlockAt) -> Option<&'a [f32]> {
        self.inputs.bias.map(|b| &b[at.v0..at.v0 + at.vb])
    }
}

impl BlockOps for CpuBlocks<'_, '_, '_> {
    fn begin(&mut self, pass: Pass, _gradient: Option<&GradientInputs<'_>>) -> Result<()> {
        // A fused pass runs on the full-vocabulary schedule only (`run_blocks` checks).
        self.keep_exp = pass == Pass::Fused && self.config.softcap == Softcap::Off;
        self.stats = (pass != Pass::Backward).then(|| Stats::new(self.inputs.n));
        if pass != Pass::Forward {
            let g = self.grads.as_mut().ok_or_else(|| missing("gradients"))?;
            // Every block writes its first touch of dX and dW without reading it, so with at
            // least one block only dbias, which the blocks add into, starts at zero here
            // (zeroing dX and dW too would cost a pass over V·D + N·D floats). A shape with no
            // block (N = 0 or V = 0) touches nothing: the caller's buffers start at zero then.
            // A skipped gradient's buffer is empty (or absent): nothing of it is zeroed or
            // written.
            match self.inputs.n == 0 || self.inputs.v == 0 {
                true => g.fill_zero(),
                false => g.zero_dbias(),
            }
        }
        Ok(())
    }

    fn load_tokens(&mut self, t0: usize, c: usize) -> Result<()> {
        self.inputs.x.rows_f32(t0..t0 + c, self.inputs.d, self.scratch.xblk);
        resolve_targets(self.config, self.inputs, t0, &mut self.targets[..c]);
        Ok(())
    }

    fn load_vocab(&mut self, _v0: usize, _vb: usize) -> Result<()> {
        // An f32 W is read in place and a bf16 W widened a sub-block at a time inside the GEMMs.
        Ok(())
    }

    fn logits(&mut self, at: BlockAt) -> Result<()> {
        let (d, c) = (self.inputs.d, at.c);
        let (bias, w_f32) = (self.bias(at), self.w_f32(at));
        let Scratch { logits, xblk, wblk, .. } = &mut self.scratch;
        let tokens = TokenBlock { x: &xblk[..c * d], targets: &self.targets[..c] };
        match (w_f32, self.inputs.x, self.inputs.w, self.bf16_gemm) {
            (Some(w), ..) => {
                form_logits(self.config, d, tokens, VocabBlock { w, bias, vb: at.vb }, logits, Threads::All)
            }
            (None, Matrix::Bf16(x), Matrix::Bf16(w), Some(gemm)) => form_logits_bf16(
                self.config,
                d,
                (&x[at.t0 * d..], c),
                (&w[at.v0 * d..], at.vb, bias),
                logits,
                gemm,
            ),
            (None, ..) => form_logits_widening(
                self.config,
                d,
                tokens,
                (&self.inputs.w, at.v0, at.vb, bias),
                wblk,
                logits,
            ),
        }
    }

    fn fold(&mut self, at: BlockAt) -> Result<()> {
        let (d, c) = (self.inputs.d, at.c);
        let st = self.stats.as_mut().ok_or_else(|| missing("fold stats"))?;
        let tokens = TokenBlock { x: &self.scratch.xblk[..c * d], targets: &self.targets[..c] };
        fold(self.config, tokens, (at.v0, at.vb), self.scratch.logits, self.keep_exp, st.rows_mut(at.t0, c));
        Ok(())
    }

    fn row_lse(&mut self, at: BlockAt) -> Result<()> {
        let st = self.stats.as_ref().ok_or_else(|| missing("fold stats"))?;
        for (k, l) in self.lse_block[..at.c].iter_mut().enumerate() {
            *l = st.lse(at.t0 + k) as f32;
        }
        Ok(())
    }

    fn gradient(&mut self, at: BlockAt, pass: Pass, inputs: &GradientInputs<'_>) -> Result<()> {
        let (d, t0, c) = (self.inputs.d, at.t0, at.c);
        let (lse, dlse) = match pass {
            Pass::Fused => (&self.lse_block[..c], None),
            _ => (&inputs.saved_lse[t0..t0 + c], inputs.dlse.map(|g| &g[t0..t0 + c])),
        };
        column_grads(self.config, self.inputs.v, &inputs.coef[t0..t0 + c], lse, dlse, &mut self.cols);
        if self.keep_exp {
            let st = self.stats.as_ref().ok_or_else(|| missing("fold stats"))?;
            for (k, inv) in self.cols.inv_sum.iter_mut().enumerate() {
                *inv = (1.0 / st.sum[t0 + k]) as f32;
            }
        }
        let tokens = TokenBlock { x: &self.scratch.xblk[..c * d], targets: &self.targets[..c] };
        gradient(self.config, tokens, (at.v0, at.vb), self.scratch.logits, &self.cols, self.keep_exp);
        Ok(())
    }

    fn project(&mut self, at: BlockAt) -> Result<()> {
        let BlockAt { t0, c, v0, vb } = at;
        let d = self.inputs.d;
        let (bias, w_f32) = (self.bias(at), self.w_f32(at));
        let g = self.grads.as_mut().ok_or_else(|| missing("gradients"))?;
        let Scratch { logits, xblk, wblk, dx_part } = &mut self.scratch;
        let tokens = TokenBlock { x: &xblk[..c * d], targets: &self.targets[..c] };
        // The first block to touch a slice of dX or dW writes it without reading it.
        let first = |is_first: bool| if is_first { Accumulate::Replace } else { Accumulate::Add };
        // A skipped gradient has no slice: its GEMM is not run (its buffer is empty).
        let (dx, dw) = (g.wanted.dx.is_computed(), g.wanted.dw.is_computed());
        let out = BlockGrads {
            dx_rows: dx.then(|| &mut g.dx[t0 * d..(t0 + c) * d]),
            dx_mode: first(v0 == 0),
            dw_blk: dw.then(|| &mut g.dw[v0 * d..(v0 + vb) * d]),
            dw_mode: first(t0 == 0),
            dbias_blk: g.dbias.as_mut().map(|b| &mut b[v0..v0 + vb]),
            dx_partial: (!dx_part.is_empty()).then(|| DxPartial::new(&mut dx_part[..])),
        };
        match (w_f32, self.inputs.x, self.config.precision) {
            (Some(w), ..) => {
                accumulate_grads(d, logits, tokens, VocabBlock { w, bias, vb }, out, Threads::All)
            }
            (None, Matrix::Bf16(x), p) if p != Precision::F32 => accumulate_grads_bf16(
                d,
                logits,
                (tokens, &x[t0 * d..(t0 + c) * d]),
                (&self.inputs.w, v0, vb),
                (wblk, out),
                self.bf16_gemm,
            ),
            (None, ..) => accumulate_grads_widening(d, logits, tokens, (&self.inputs.w, v0, vb), wblk, out),
        }
    }

    fn token_rows_done(&mut self, t0: usize, c: usize) -> Result<()> {
        self.grads.as_mut().ok_or_else(|| missing("gradients"))?.token_rows_done(t0, c)
    }

    fn take_stats(&mut self) -> Result<Stats> {
        self.stats.take().ok_or_else(|| missing("fold stats"))
    }
}

/// A workspace of the plan's size, reserved for one call of the free functions below (the
/// [`LinearCrossEntropy`](crate::LinearCrossEntropy) executor reserves one for all its calls).
fn call_workspace(plan: &Plan) -> Result<Workspace> {
    plan.check_host()?;
    Ok(Workspace::new(plan.workspace_bytes())?)
}

/// The loss and per-row lse, one GEMM per block, under the plan's config.
pub fn forward(plan: &Plan, inputs: &Inputs<'_>) -> Result<Forward> {
    forward_in(&mut call_workspace(plan)?, Call::new(plan, inputs))
}

/// [`forward`] with the blocks carved from `ws` (at least the plan's bytes).
pub(crate) fn forward_in(ws: &mut Workspace, call: Call<'_>) -> Result<Forward> {
    driver::forward(&mut CpuBlocks::open(ws, call, None)?, call)
}

/// dX, dW (and dbias) from forward's lse, recomputing each block's logits (so forward +
/// backward cost 4 GEMMs), for the upstream gradients of the loss and, optionally, the lse.
pub fn backward(
    plan: &Plan,
    inputs: &Inputs<'_>,
    forward: &Forward,
    upstream: Upstream<'_>,
) -> Result<Gradients> {
    let call = Call::new(plan, inputs);
    let saved = Saved::of(&forward.lse, upstream);
    let ((), grads) = driver::with_gradients(plan, inputs, |out| {
        backward_into(&mut call_workspace(plan)?, call, saved, out)
    })?;
    Ok(grads)
}

/// [`backward`] into caller-owned gradient buffers (overwritten; checked against the shapes),
/// with the blocks carved from `ws`.
pub(crate) fn backward_into(
    ws: &mut Workspace,
    call: Call<'_>,
    saved: Saved<'_>,
    out: GradientsMut<'_>,
) -> Result<()> {
    driver::backward(&mut CpuBlocks::open(ws, call, Some(out))?, call, saved)
}

/// Forward and backward in one pass when the loss is the last op (its upstream gradient is
/// known): on the full-vocabulary schedule each block's logits serve both (3 GEMMs); on the
/// blocked schedule it runs `forward` then `backward`.
pub fn forward_backward(
    plan: &Plan,
    inputs: &Inputs<'_>,
    grad: GradOutput<'_>,
) -> Result<(Forward, Gradients)> {
    let call = Call::new(plan, inputs);
    driver::with_gradients(plan, inputs, |out| {
        forward_backward_into(&mut call_workspace(plan)?, call, grad, out)
    })
}

/// [`forward_backward`] writing dX, dW (and dbias) into `out`, which is overwritten, with the
/// blocks carved from `ws`.
pub(crate) fn forward_backward_into(
    ws: &mut Workspace,
    call: Call<'_>,
    grad: GradOutput<'_>,
    out: GradientsMut<'_>,
) -> Result<Forward> {
    driver::forward_backward(&mut CpuBlocks::open(ws, call, Some(out))?, call, grad)
}
