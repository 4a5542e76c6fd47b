//! The single-device driver, written once for every backend (the CPU fast path, the device
//! schedule under the SIMT emulator, CUDA): the checks every call makes, the gradient scales,
//! the choice between the fused pass and forward-then-backward, and the loss from the finished
//! statistics. A backend contributes only its [`BlockOps`] (how it forms, folds and
//! differentiates one block) and its view of the per-token rows on the host.
//!
//! - forward: every block folded into the statistics (1 GEMM per block), then the loss;
//! - backward: the saved lse checked, the row scales `c_i` from the reduction and the upstream
//!   gradient, every block recomputed, turned into G and projected (3 GEMMs per block);
//! - forward + backward: on [`BlockSchedule::FullVocab`] one fused pass (3 GEMMs per block: the
//!   same logits folded, finished and differentiated), otherwise forward then backward (4).

use crate::blocks::{BlockOps, GradientInputs, Pass, run_blocks};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::gradients::{GradientLens, Gradients, GradientsMut};
use crate::inputs::{CallSizes, Forward, GradOutput, Inputs, Upstream, check_weights};
use crate::loss::{self, Stats};
use crate::plan::{BlockSchedule, Plan};

/// One call as the driver sees it: the config and plan it runs, and the per-token rows on the
/// host (targets, weights and N, D, V: what the loss and the gradient scales read; X and W need
/// not be there).
#[derive(Clone, Copy)]
pub(crate) struct Call<'c> {
    pub config: &'c Config,
    pub plan: &'c Plan,
    pub rows: &'c Inputs<'c>,
}

impl<'c> Call<'c> {
    /// A call of `rows` under `plan` and the config it was made from.
    pub fn new(plan: &'c Plan, rows: &'c Inputs<'c>) -> Self {
        Self { config: plan.config(), plan, rows }
    }
}

/// What backward reads besides the inputs: forward's per-row lse, the loss's upstream gradient,
/// and an optional upstream gradient of the lse.
#[derive(Clone, Copy)]
pub(crate) struct Saved<'s> {
    pub lse: &'s [f32],
    pub grad: GradOutput<'s>,
    pub dlse: Option<&'s [f32]>,
}

impl<'s> Saved<'s> {
    /// Forward's `lse` with the call's upstream gradients.
    pub fn of(lse: &'s [f32], upstream: Upstream<'s>) -> Self {
        Self { lse, grad: upstream.grad, dlse: upstream.dlse }
    }
}

/// The checks every backend makes before it touches a tensor: the config's domains, the
/// tensors' sizes and dtypes against each other and against the plan, and the gradient
/// buffers' lengths against the gradients they select (`gradients`, for a call that writes
/// them). Targets are checked where they
/// are resolved (on the host, or by the device's kernel), weights by [`check_rows`].
pub(crate) fn check_call(
    config: &Config,
    plan: &Plan,
    sizes: CallSizes,
    gradients: Option<GradientLens>,
) -> Result<()> {
    config.validate()?;
    sizes.check_plan(plan)?;
    if let Some(lens) = gradients {
        crate::gradients::check_gradient_lens(sizes.dims, sizes.bias.is_some(), lens)?;
    }
    Ok(())
}

/// The per-token weights of the host rows: each finite and ≥ 0.
pub(crate) fn check_rows(rows: &Inputs<'_>) -> Result<()> {
    rows.weights.map_or(Ok(()), check_weights)
}

/// The gradients of a call's host inputs, zeroed once their sizes are checked against the plan
/// (so N·D and V·D are sizes the plan accepted), then written by `write`: how an entry point
/// that returns new gradients runs its `_into` form. Returns what `write` returned, with them.
pub(crate) fn with_gradients<T>(
    plan: &Plan,
    inputs: &Inputs<'_>,
    write: impl FnOnce(GradientsMut<'_>) -> Result<T>,
) -> Result<(T, Gradients)> {
    inputs.sizes().check_plan(plan)?;
    let mut grads = Gradients::zeros(inputs);
    let written = write(grads.as_mut())?;
    Ok((written, grads))
}

/// Forward's lse and the optional dlse, one per row of `n`.
pub(crate) fn check_saved(n: usize, lse: &[f32], dlse: Option<&[f32]>) -> Result<()> {
    if lse.len() != n {
        return Err(Error::ShapeMismatch { what: "lse (n)", expected: n, got: lse.len() });
    }
    match dlse {
        Some(g) if g.len() != n => Err(Error::ShapeMismatch { what: "dlse (n)", expected: n, got: g.len() }),
        _ => Ok(()),
    }
}

/// The loss and per-row lse: every block folded, then the loss from the statistics.
pub(crate) fn forward<B: BlockOps + ?Sized>(ops: &mut B, call: Call<'_>) -> Result<Forward> {
    run_blocks(ops, call.plan, Pass::Forward, None)?;
    let stats = ops.take_stats()?;
    Ok(finish_forward(call, &stats))
}

/// dX, dW (and dbias) from forward's lse, into the gradients `ops` writes (those its buffers'
/// selection computes).
pub(crate) fn backward<B: BlockOps + ?Sized>(ops: &mut B, call: Call<'_>, saved: Saved<'_>) -> Result<()> {
    check_saved(call.rows.n, saved.lse, saved.dlse)?;
    let coef = scales(call, saved.grad)?;
    run_backward(ops, call, &coef, saved)
}

/// Forward and backward when the loss is the last op (its upstream gradient is known): the
/// fused pass on the full-vocabulary schedule, forward then backward on the blocked one. The
/// upstream gradient is checked before any block runs, on either schedule.
pub(crate) fn forward_backward<B: BlockOps + ?Sized>(
    ops: &mut B,
    call: Call<'_>,
    grad: GradOutput<'_>,
) -> Result<Forward> {
    let coef = scales(call, grad)?;
    if call.plan.schedule() == BlockSchedule::VocabBlocked {
        let fwd = forward(ops, call)?;
        run_backward(ops, call, &coef, Saved { lse: &fwd.lse, grad, dlse: None })?;
        return Ok(fwd);
    }
    let gradient = GradientInputs { coef: &coef, saved_lse: &[], dlse: None };
    run_blocks(ops, call.plan, Pass::Fused, Some(&gradient))?;
    let stats = ops.take_stats()?;
    Ok(finish_forward(call, &stats))
}

/// The backward pass with its row scales computed.
fn run_backward<B: BlockOps + ?Sized>(
    ops: &mut B,
    call: Call<'_>,
    coef: &[f32],
    saved: Saved<'_>,
) -> Result<()> {
    let gradient = GradientInputs { coef, saved_lse: saved.lse, dlse: saved.dlse };
    run_blocks(ops, call.plan, Pass::Backward, Some(&gradient))
}

/// Each row's gradient scale c_i for this device's rows (the mean over its own rows).
fn scales(call: Call<'_>, grad: GradOutput<'_>) -> Result<Vec<f32>> {
    loss::coefficients(call.config, call.rows, grad, call.rows.valid_weight(call.config))
}

/// The loss and lse of the rows from finished statistics over the whole vocabulary.
fn finish_forward(call: Call<'_>, stats: &Stats) -> Forward {
    let Call { config, rows, .. } = call;
    let (per_token, lse) = loss::per_token_losses(config, rows, rows.v, stats);
    let total: f64 = per_token.iter().map(|&x| x as f64).sum();
    let loss = loss::reduce_loss(config, per_token, total, rows.valid_weight(config));
    Forward { loss, lse }
}
