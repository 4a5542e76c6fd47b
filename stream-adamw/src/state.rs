//! Optimizer state: fp32 master parameters, moments and step count, with a state-dict
//! export/import that round-trips exactly.

use crate::cpu::StateMut;
use crate::error::{Error, Result};
use crate::hyperparameters::Variant;

/// The optimizer's state over all N parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerState {
    pub(crate) param: Vec<f32>,
    pub(crate) exp_avg: Vec<f32>,
    pub(crate) exp_avg_sq: Vec<f32>,
    /// Empty unless AMSGrad.
    pub(crate) max_exp_avg_sq: Vec<f32>,
    pub(crate) step: u64,
}

/// A plain copy of the state, like torch's `optimizer.state_dict()` for one flat group.
#[derive(Debug, Clone, PartialEq)]
pub struct StateDict {
    /// Steps applied so far (skipped steps do not count).
    pub step: u64,
    /// fp32 master parameters θ.
    pub param: Vec<f32>,
    /// First moment m.
    pub exp_avg: Vec<f32>,
    /// Second moment v.
    pub exp_avg_sq: Vec<f32>,
    /// AMSGrad's running max of v; `None` for plain Adam.
    pub max_exp_avg_sq: Option<Vec<f32>>,
}

impl flatpeak_common::HeapSize for OptimizerState {
    fn heap_bytes(&self) -> usize {
        self.param.heap_bytes()
            + self.exp_avg.heap_bytes()
            + self.exp_avg_sq.heap_bytes()
            + self.max_exp_avg_sq.heap_bytes()
    }
}

impl OptimizerState {
    /// Fresh state: θ from `param`, m = v = 0, step 0.
    pub fn new(param: Vec<f32>, variant: Variant) -> Self {
        let n = param.len();
        let max_len = if variant == Variant::AmsGrad { n } else { 0 };
        Self {
            param,
            exp_avg: vec![0.0; n],
            exp_avg_sq: vec![0.0; n],
            max_exp_avg_sq: vec![0.0; max_len],
            step: 0,
        }
    }

    /// Number of parameters.
    pub fn len(&self) -> usize {
        self.param.len()
    }
    /// True when there is no parameter.
    pub fn is_empty(&self) -> bool {
        self.param.is_empty()
    }
    /// Steps applied so far.
    pub fn step(&self) -> u64 {
        self.step
    }
    /// The fp32 master parameters.
    pub fn param(&self) -> &[f32] {
        &self.param
    }

    /// Mutable views of the elements in `range`.
    pub(crate) fn view(&mut self, range: std::ops::Range<usize>) -> StateMut<'_> {
        let ams = if self.max_exp_avg_sq.is_empty() {
            &mut [][..]
        } else {
            &mut self.max_exp_avg_sq[range.clone()]
        };
        StateMut {
            param: &mut self.param[range.clone()],
            exp_avg: &mut self.exp_avg[range.clone()],
            exp_avg_sq: &mut self.exp_avg_sq[range],
            max_exp_avg_sq: ams,
        }
    }

    /// Copies elements `range` of every buffer of `from` into this state (a journal's save, or
    /// its restore); the two have the same length and variant.
    pub(crate) fn copy_range_from(&mut self, from: &OptimizerState, range: std::ops::Range<usize>) {
        self.param[range.clone()].copy_from_slice(&from.param[range.clone()]);
        self.exp_avg[range.clone()].copy_from_slice(&from.exp_avg[range.clone()]);
        self.exp_avg_sq[range.clone()].copy_from_slice(&from.exp_avg_sq[range.clone()]);
        if !self.max_exp_avg_sq.is_empty() {
            self.max_exp_avg_sq[range.clone()].copy_from_slice(&from.max_exp_avg_sq[range]);
        }
    }

    /// A copy of the state.
    pub fn export(&self) -> StateDict {
        StateDict {
            step: self.step,
            param: self.param.clone(),
            exp_avg: self.exp_avg.clone(),
            exp_avg_sq: self.exp_avg_sq.clone(),
            max_exp_avg_sq: (!self.max_exp_avg_sq.is_empty()).then(|| self.max_exp_avg_sq.clone()),
        }
    }

    /// Replaces the state with `dict`, after checking it fits: same length everywhere, second
    /// moments finite and ≥ 0, and a max-v buffer exactly when the variant is AMSGrad. On error
    /// nothing changes.
    pub fn import(&mut self, dict: StateDict, variant: Variant) -> Result<()> {
        let n = self.param.len();
        for (what, len) in [
            ("param", dict.param.len()),
            ("exp_avg", dict.exp_avg.len()),
            ("exp_avg_sq", dict.exp_avg_sq.len()),
        ] {
            if len != n {
                return Err(Error::ShapeMismatch { what, expected: n, got: len });
            }
        }
        let second_moments =
            [("exp_avg_sq", Some(&dict.exp_avg_sq)), ("max_exp_avg_sq", dict.max_exp_avg_sq.as_ref())];
        for (what, buf) in second_moments {
            if let Some(index) = buf.and_then(|v| v.iter().position(|x| !(x.is_finite() && *x >= 0.0))) {
                let value = buf.map_or(0.0, |v| v[index]);
                return Err(Error::InvalidState { what, index, value });
            }
        }
        let max = match (variant, dict.max_exp_avg_sq) {
            (Variant::AmsGrad, Some(v)) if v.len() == n => v,
            (Variant::AmsGrad, Some(v)) => {
                return Err(Error::ShapeMismatch { what: "max_exp_avg_sq", expected: n, got: v.len() });
            }
            (Variant::AmsGrad, None) if n == 0 => Vec::new(),
            (Variant::AmsGrad, None) => {
                return Err(Error::StateMismatch {
                    reason: "AMSGrad needs max_exp_avg_sq, the state has none".into(),
                });
            }
            (Variant::Adam, None) => Vec::new(),
            (Variant::Adam, Some(_)) => {
                return Err(Error::StateMismatch {
                    reason: "the state has max_exp_avg_sq but the optimizer is plain Adam".into(),
                });
            }
        };
        *self = Self {
            param: dict.param,
            exp_avg: dict.exp_avg,
            exp_avg_sq: dict.exp_avg_sq,
            max_exp_avg_sq: max,
            step: dict.step,
        };
        Ok(())
    }
}
