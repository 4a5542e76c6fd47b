//! The single-device block schedule, written once. Every backend — the CPU fast path
//! ([`crate::cpu`]), the device schedule under the SIMT emulator (`emu`) and CUDA (`cuda`) —
//! runs this loop through [`BlockOps`]; what differs is only how a backend forms, folds and
//! differentiates one block.
//!
//! For each token block of C rows and each vocabulary block of Vb rows (sizes from the
//! [`Plan`]): the logits block is formed in the working set, then
//! - forward: folded into the per-token statistics (running max, sum of exponentials, target
//!   logit, Σz);
//! - backward: turned in place into the logit gradient G from the saved lse, and projected,
//!   `dX_rows += G·W_blk`, `dW_blk += Gᵀ·X_blk`, `dbias_blk += Σ_rows G`;
//! - fused (full-vocabulary schedule only: one vocabulary block): folded, its rows' lse
//!   finished, then the same logits turned into G and projected — 3 GEMMs instead of 4.
//!
//! A vocabulary block is loaded only when it changes, so on the full-vocabulary schedule W is
//! brought in (widened, for bf16) once per call.

use crate::error::{Error, Result};
use crate::loss::Stats;
use crate::plan::{BlockSchedule, Plan};

/// Where a logits block sits: token rows `t0..t0 + c`, vocabulary rows `v0..v0 + vb`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BlockAt {
    pub t0: usize,
    pub c: usize,
    pub v0: usize,
    pub vb: usize,
}

/// Which passes one call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pass {
    /// Fold every block into the statistics.
    Forward,
    /// Recompute every block, turn it into G from the saved lse, project.
    Backward,
    /// Fold, finish the rows' lse, turn the same logits into G, project.
    Fused,
}

/// What the gradient of a block reads besides its logits, on the host: each row's gradient
/// scale, and the saved lse with its optional upstream gradient (backward; the fused pass
/// finishes its own).
pub(crate) struct GradientInputs<'a> {
    pub coef: &'a [f32],
    pub saved_lse: &'a [f32],
    pub dlse: Option<&'a [f32]>,
}

/// One backend's operations on one block. Each is called in the order [`run_blocks`] states;
/// a backend keeps the call's inputs, its block buffers, the statistics and the gradients.
pub(crate) trait BlockOps {
    /// Readies `pass` before its first block: fresh per-token statistics for a forward or fused
    /// pass; for a backward or fused pass, the gradients cleared where no block writes them
    /// first, and `gradient` copied to where the backend's kernels read it (a device backend).
    fn begin(&mut self, pass: Pass, gradient: Option<&GradientInputs<'_>>) -> Result<()>;
    /// Makes token rows `t0..t0 + c` of X (and their targets) the current token block.
    fn load_tokens(&mut self, t0: usize, c: usize) -> Result<()>;
    /// Makes vocabulary rows `v0..v0 + vb` of W the current vocabulary block. Called only when
    /// the block changes.
    fn load_vocab(&mut self, v0: usize, vb: usize) -> Result<()>;
    /// Forms the logits of block `at` in the working set.
    fn logits(&mut self, at: BlockAt) -> Result<()>;
    /// Folds the logits of block `at` into the per-token statistics.
    fn fold(&mut self, at: BlockAt) -> Result<()>;
    /// Finishes the lse of rows `at.t0..at.t0 + at.c` from the statistics (fused pass: the
    /// block covered the whole vocabulary).
    fn row_lse(&mut self, at: BlockAt) -> Result<()>;
    /// Turns the logits of block `at` into the logit gradient G in place, from the saved lse
    /// ([`Pass::Backward`]) or from [`row_lse`](BlockOps::row_lse)'s ([`Pass::Fused`]), with
    /// `gradient`'s row scales (a device backend reads the copies [`begin`](BlockOps::begin)
    /// made).
    fn gradient(&mut self, at: BlockAt, pass: Pass, gradient: &GradientInputs<'_>) -> Result<()>;
    /// Projects G of block `at` into dX, dW and dbias.
    fn project(&mut self, at: BlockAt) -> Result<()>;
    /// A backward or fused pass finished token rows `t0..t0 + c` (every vocabulary block
    /// projected): their dX rows are final (a host backend narrows them into bf16 outputs).
    fn token_rows_done(&mut self, t0: usize, c: usize) -> Result<()>;
    /// The per-token statistics a forward or fused pass finished, on the host.
    fn take_stats(&mut self) -> Result<Stats>;
}

/// Runs `pass` over every block of `plan` on `ops`; `gradient` is what a backward or fused
/// pass's gradient reads (none for a forward pass).
pub(crate) fn run_blocks<B: BlockOps + ?Sized>(
    ops: &mut B,
    plan: &Plan,
    pass: Pass,
    gradient: Option<&GradientInputs<'_>>,
) -> Result<()> {
    if pass == Pass::Fused && plan.schedule() != BlockSchedule::FullVocab {
        return Err(Error::internal("a fused pass runs on the full-vocabulary schedule only"));
    }
    let gradient_inputs = match (pass, gradient) {
        (Pass::Forward, _) => None,
        (_, Some(g)) => Some(g),
        (_, None) => return Err(Error::internal("a backward or fused pass has its gradient inputs")),
    };
    ops.begin(pass, gradient)?;
    let (n, v) = (plan.n_tokens(), plan.vocab());
    let (cb, vbmax) = (plan.token_block().max(1), plan.vocab_block().max(1));
    let mut loaded = None;
    for t0 in (0..n).step_by(cb) {
        let c = cb.min(n - t0);
        ops.load_tokens(t0, c)?;
        for v0 in (0..v).step_by(vbmax) {
            let vb = vbmax.min(v - v0);
            if loaded != Some((v0, vb)) {
                ops.load_vocab(v0, vb)?;
                loaded = Some((v0, vb));
            }
            let at = BlockAt { t0, c, v0, vb };
            ops.logits(at)?;
            if pass != Pass::Backward {
                ops.fold(at)?;
            }
            if pass == Pass::Forward {
                continue;
            }
            if pass == Pass::Fused {
                ops.row_lse(at)?;
            }
            if let Some(g) = gradient_inputs {
                ops.gradient(at, pass, g)?;
            }
            ops.project(at)?;
        }
        if pass != Pass::Forward {
            ops.token_rows_done(t0, c)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use flatpeak_common::{Budget, DType};

    use super::*;
    use crate::config::Config;
    use crate::plan::Shape;

    /// Records every call.
    #[derive(Default)]
    struct Trace(Vec<String>);

    impl BlockOps for Trace {
        fn begin(&mut self, pass: Pass, _: Option<&GradientInputs<'_>>) -> Result<()> {
            self.0.push(format!("begin{pass:?}"));
            Ok(())
        }
        fn load_tokens(&mut self, t0: usize, c: usize) -> Result<()> {
            self.0.push(format!("x{t0}+{c}"));
            Ok(())
        }
        fn load_vocab(&mut self, v0: usize, vb: usize) -> Result<()> {
            self.0.push(format!("w{v0}+{vb}"));
            Ok(())
        }
        fn logits(&mut self, _: BlockAt) -> Result<()> {
            self.0.push("z".into());
            Ok(())
        }
        fn fold(&mut self, _: BlockAt) -> Result<()> {
            self.0.push("fold".into());
            Ok(())
        }
        fn row_lse(&mut self, _: BlockAt) -> Result<()> {
            self.0.push("lse".into());
            Ok(())
        }
        fn gradient(&mut self, _: BlockAt, pass: Pass, _: &GradientInputs<'_>) -> Result<()> {
            self.0.push(format!("g{pass:?}"));
            Ok(())
        }
        fn project(&mut self, _: BlockAt) -> Result<()> {
            self.0.push("proj".into());
            Ok(())
        }
        fn token_rows_done(&mut self, t0: usize, c: usize) -> Result<()> {
            self.0.push(format!("done{t0}+{c}"));
            Ok(())
        }
        fn take_stats(&mut self) -> Result<Stats> {
            Ok(Stats::new(0))
        }
    }

    fn trace(plan: &Plan, pass: Pass) -> Result<String> {
        let mut t = Trace::default();
        let gradient = GradientInputs { coef: &[], saved_lse: &[], dlse: None };
        run_blocks(&mut t, plan, pass, (pass != Pass::Forward).then_some(&gradient))?;
        Ok(t.0.join(" "))
    }

    #[test]
    fn every_block_once_and_each_vocabulary_block_loaded_when_it_changes() {
        let config = Config::default();
        let shape = Shape { tokens: 5, hidden: 4, vocab: 7, dtype: DType::F32 };
        let blocked = Plan::with_blocks(&config, shape, (3, 4)).unwrap();
        assert_eq!(
            trace(&blocked, Pass::Forward).unwrap(),
            "beginForward x0+3 w0+4 z fold w4+3 z fold x3+2 w0+4 z fold w4+3 z fold"
        );
        assert_eq!(
            trace(&blocked, Pass::Backward).unwrap(),
            "beginBackward x0+3 w0+4 z gBackward proj w4+3 z gBackward proj done0+3 x3+2 w0+4 z gBackward proj w4+3 z gBackward proj done3+2"
        );
        assert!(matches!(trace(&blocked, Pass::Fused), Err(Error::Internal { .. })));
        let mut t = Trace::default();
        assert!(matches!(run_blocks(&mut t, &blocked, Pass::Backward, None), Err(Error::Internal { .. })));
        assert!(t.0.is_empty(), "nothing ran");
        let full = Plan::with_blocks(&config, shape, (3, 7)).unwrap();
        assert_eq!(
            trace(&full, Pass::Fused).unwrap(),
            "beginFused x0+3 w0+7 z fold lse gFused proj done0+3 x3+2 z fold lse gFused proj done3+2"
        );
        let empty = Plan::new(&config, Shape { tokens: 0, ..shape }, Budget::Unlimited).unwrap();
        assert_eq!(trace(&empty, Pass::Fused).unwrap(), "beginFused");
    }
}
