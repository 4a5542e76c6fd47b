//! stream-adamw's AdamW as a candle optimizer.
//!
//! The update is `torch.optim.AdamW`'s (decoupled weight decay, bias corrections in f64,
//! `denom = √v/√(1−β2^t) + ε`, AMSGrad on the raw second moment, maximize), run by stream-adamw's
//! SIMD CPU kernel on each Var's f32 moments, which this optimizer owns (8 B per parameter, 12 B
//! with AMSGrad). Two things candle's `AdamW` does not do:
//! - **A non-finite gradient skips the whole step**, untouched (GradScaler's `found_inf`): the
//!   global Σg² is checked before any Var is written.
//! - **Global-norm clipping** (`Hyperparameters::clip`, `clip_grad_norm_`'s semantics) folds the
//!   clip coefficient into the update, with no pass over the gradients.
//!
//! A Var without a gradient in the `GradStore` is left alone, and its step count does not
//! advance (torch skips parameters whose `.grad` is `None`; candle's `AdamW` does the same).

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use stream_adamw::cpu::StateMut;
use stream_adamw::{
    Hyperparameters, InPlaceGroup, InPlaceParam, StepOptions, StepOutcome, Variant, step_in_place,
};

use crate::error::{Error, Result};
use crate::host;

/// One Var and its moments.
#[derive(Debug)]
struct VarState {
    var: Var,
    exp_avg: Vec<f32>,
    exp_avg_sq: Vec<f32>,
    /// Empty unless AMSGrad.
    max_exp_avg_sq: Vec<f32>,
    /// Steps applied to this Var.
    step: u64,
}

/// What one [`StreamAdamW::step_report`] did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepReport {
    /// Applied, or skipped because a gradient was NaN or infinite.
    pub outcome: StepOutcome,
    /// Global ‖g‖₂ over every Var's gradient, before clipping (non-finite when skipped).
    pub grad_norm: f64,
    /// The clip coefficient applied (1 when not clipping).
    pub clip_coef: f64,
    /// Vars updated (those with a gradient).
    pub updated: usize,
}

/// AdamW over candle `Var`s (f32, CPU) with stream-adamw's update.
///
/// ```
/// use candle_core::{Device, Tensor, Var};
/// use candle_nn::Optimizer;
/// use flatpeak_candle::{Hyperparameters, StreamAdamW};
///
/// let w = Var::new(&[1.0f32, -2.0, 3.0], &Device::Cpu)?;
/// let mut opt = StreamAdamW::new(vec![w.clone()], Hyperparameters::default().lr(0.1))?;
/// let loss = w.as_tensor().sqr()?.sum_all()?;
/// opt.backward_step(&loss)?;
/// let after = w.as_tensor().to_vec1::<f32>()?;
/// assert!(after[0] < 1.0 && after[1] > -2.0);
/// # Ok::<(), candle_core::Error>(())
/// ```
#[derive(Debug)]
pub struct StreamAdamW {
    vars: Vec<VarState>,
    hyperparameters: Hyperparameters,
}

/// Zeroed f32 state of `len` elements, allocated fallibly.
fn zeros(len: usize, index: usize) -> Result<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len)
        .map_err(|_| Error::Var { index, reason: format!("cannot allocate {len} f32 of state") })?;
    v.resize(len, 0.0);
    Ok(v)
}

impl StreamAdamW {
    fn build(vars: Vec<Var>, hyperparameters: Hyperparameters) -> Result<Self> {
        hyperparameters.validate()?;
        let amsgrad = hyperparameters.variant == Variant::AmsGrad;
        let vars = vars
            .into_iter()
            .enumerate()
            .map(|(index, var)| {
                if var.dtype() != DType::F32 {
                    return Err(Error::Var {
                        index,
                        reason: format!("dtype {:?}: this optimizer updates f32 Vars", var.dtype()),
                    });
                }
                if !var.device().is_cpu() {
                    return Err(Error::Var {
                        index,
                        reason: format!("on {:?}: this optimizer updates CPU Vars", var.device()),
                    });
                }
                let len = var.elem_count();
                Ok(VarState {
                    exp_avg: zeros(len, index)?,
                    exp_avg_sq: zeros(len, index)?,
                    max_exp_avg_sq: if amsgrad { zeros(len, index)? } else { Vec::new() },
                    var,
                    step: 0,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { vars, hyperparameters })
    }

    /// The hyperparameters the next step uses.
    pub fn hyperparameters(&self) -> &Hyperparameters {
        &self.hyperparameters
    }

    /// Replaces the hyperparameters (checked; the variant cannot change, since AMSGrad's
    /// `max_exp_avg_sq` would be missing or stale).
    pub fn set_hyperparameters(&mut self, hyperparameters: Hyperparameters) -> Result<()> {
        hyperparameters.validate()?;
        if hyperparameters.variant != self.hyperparameters.variant {
            return Err(Error::Var {
                index: 0,
                reason: format!(
                    "the variant is fixed at construction ({:?}), got {:?}",
                    self.hyperparameters.variant, hyperparameters.variant
                ),
            });
        }
        self.hyperparameters = hyperparameters;
        Ok(())
    }

    /// The Vars, in order.
    pub fn vars(&self) -> impl Iterator<Item = &Var> {
        self.vars.iter().map(|s| &s.var)
    }

    /// Each Var's step count, in order.
    pub fn steps(&self) -> impl Iterator<Item = u64> + '_ {
        self.vars.iter().map(|s| s.step)
    }

    /// One step from `grads`: every gradient is checked (dtype, shape, device) and the global
    /// Σg² is computed before any Var is written, so a bad or non-finite gradient leaves every
    /// Var and every moment untouched. The decision (skip, clip coefficient), the update and
    /// the step counts are stream-adamw's ([`step_in_place`]); this finds the buffers.
    pub fn step_report(&mut self, grads: &GradStore) -> Result<StepReport> {
        self.hyperparameters.validate()?;
        let hp = self.hyperparameters;
        // Gradients, checked, as host tensors (CPU f32, contiguous: no copy when they are).
        let mut present = Vec::with_capacity(self.vars.len());
        for (index, state) in self.vars.iter().enumerate() {
            let Some(grad) = grads.get(state.var.as_tensor()) else { continue };
            if grad.dims() != state.var.dims() {
                return Err(Error::Var {
                    index,
                    reason: format!("gradient shape {:?}, Var shape {:?}", grad.dims(), state.var.dims()),
                });
            }
            present.push((index, grad.contiguous()?));
        }
        let guards: Vec<_> = present.iter().map(|(_, grad)| grad.storage_and_layout()).collect();
        let grad_slices = guards
            .iter()
            .map(|(storage, layout)| host::f32_slice(storage, layout, "gradient"))
            .collect::<Result<Vec<_>>>()?;
        // θ on the host (candle's Var is written whole after the step).
        let mut params = present
            .iter()
            .map(|(index, _)| Ok(self.vars[*index].var.as_tensor().flatten_all()?.to_vec1::<f32>()?))
            .collect::<Result<Vec<_>>>()?;
        let mut updated = Vec::with_capacity(present.len());
        let report = {
            let states =
                self.vars.iter_mut().enumerate().filter(|(i, _)| present.iter().any(|(p, _)| p == i));
            let params =
                states.zip(params.iter_mut()).zip(&grad_slices).map(|(((_, state), param), grad)| {
                    InPlaceParam {
                        state: StateMut {
                            param,
                            exp_avg: &mut state.exp_avg,
                            exp_avg_sq: &mut state.exp_avg_sq,
                            max_exp_avg_sq: &mut state.max_exp_avg_sq,
                        },
                        grad: (*grad).into(),
                        bf16_param: None,
                        step: state.step,
                    }
                });
            let mut groups = [InPlaceGroup { hyperparameters: hp, params: params.collect() }];
            let report = step_in_place(&mut groups, StepOptions::default())?;
            updated.extend(groups[0].params.iter().map(|p| p.step));
            report
        };
        drop(guards);
        if report.outcome == StepOutcome::Applied {
            for (((index, _), param), step) in present.iter().zip(params).zip(updated) {
                let state = &mut self.vars[*index];
                state.var.set(&Tensor::from_vec(param, state.var.shape(), state.var.device())?)?;
                state.step = step;
            }
        }
        let updated = if report.outcome == StepOutcome::Applied { present.len() } else { 0 };
        Ok(StepReport {
            outcome: report.outcome,
            grad_norm: report.grad_norm,
            clip_coef: report.clip_coef,
            updated,
        })
    }
}

impl candle_nn::Optimizer for StreamAdamW {
    type Config = Hyperparameters;

    fn new(vars: Vec<Var>, config: Hyperparameters) -> candle_core::Result<Self> {
        Ok(Self::build(vars, config)?)
    }

    fn step(&mut self, grads: &GradStore) -> candle_core::Result<()> {
        self.step_report(grads)?;
        Ok(())
    }

    fn learning_rate(&self) -> f64 {
        self.hyperparameters.lr
    }

    /// Takes effect at the next step, where it is checked (a negative or NaN rate fails that
    /// step with an error, touching nothing).
    fn set_learning_rate(&mut self, lr: f64) {
        self.hyperparameters = self.hyperparameters.lr(lr);
    }
}
