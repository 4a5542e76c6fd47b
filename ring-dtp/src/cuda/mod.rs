//! The CUDA path (feature `cuda`). Per (token block, vocabulary block): one cuBLAS SGEMM forms
//! the raw logits block in a buffer reserved at launch, then `lce_fold` (forward) or
//! `lce_gradient` (backward) applies bias and softcap and folds or differentiates in place, and
//! two SGEMMs project G into dX and dW (`lce_bias_grad` into dbias). f32 inputs run SGEMM with
//! f32 accumulation (cuBLAS's default math mode: no TF32). bf16 inputs under
//! [`Precision::Native`] run every GEMM on the tensor cores
//! (`cublasGemmEx`, bf16 operands read in place, f32 accumulation and output): after dbias is
//! summed from the f32 G, `lce_narrow_rows_bf16` rounds G to bf16 in place, as on the CPU. Under
//! [`Precision::F32`] they are widened per block by
//! `lce_widen_bf16` (exact) and run SGEMM with G in f32. Forward then backward is 4 GEMMs per block pair; `forward_backward`
//! on the full-vocabulary schedule is 3 (each token block's logits folded, finished by
//! `lce_row_lse` and turned into G in place).
//!
//! [`LinearCrossEntropy`](crate::LinearCrossEntropy) on `Device::Cuda` runs the blocked schedule
//! on one device (on its own stream, or a caller's: `LinearCrossEntropy::on_stream`);
//! [`RingLinearCrossEntropy`](crate::RingLinearCrossEntropy) runs the weight and activation rings
//! over P devices through NCCL. Device memory besides inputs and outputs:
//! the logits block `4·C·Vb`, the widened X and W blocks (bf16 under `Precision::F32` only:
//! `4·C·D + 4·Vb·D`), and
//! per-token state (`PER_TOKEN_BYTES` per token plus the resolved targets); cuBLAS's own
//! workspace comes on top. Launches and cuBLAS calls live in `engine.rs` only.

mod caller;
mod engine;
pub(crate) mod ring;
mod tensors;

#[cfg(doc)]
use flatpeak_common::Precision;
use flatpeak_common::cuda::context;
use flatpeak_common::cuda::cudarc::driver::{CudaSlice, CudaStream, CudaView};

use crate::blocks::{BlockAt, BlockOps, GradientInputs, Pass};
use crate::config::Config;
use crate::cpu;
use crate::driver::{self, Call, Saved};
use crate::error::{Error, Result};
use crate::inputs::{Forward, GradOutput, Inputs, Matrix, Upstream};
use crate::kernels::GradientStore;
use crate::loss::{RowStats, Stats};
use crate::plan::Plan;
use engine::{Engine, LogitsBlock, RowViews, StatsViews};
pub(crate) use tensors::rows_f32;
pub use tensors::{
    BlockBuffers, CarvedLayout, DeviceGradients, DeviceGradientsMut, DeviceInputs, DeviceMatrix,
};

/// Host copies of the per-token inputs the loss and the gradient scales need (targets and
/// weights: O(N), like the statistics).
pub(crate) struct HostRows {
    pub targets: Vec<i64>,
    pub weights: Option<Vec<f32>>,
}

impl HostRows {
    /// Resolves `targets` on the device into `resolved` (rows `n`, vocabulary `v`), checking
    /// every target, and copies targets and weights down.
    pub fn resolve(
        e: &Engine,
        config: &Config,
        (targets, weights): (&CudaSlice<i64>, Option<&CudaSlice<f32>>),
        (n, v): (usize, usize),
        resolved: &mut CudaSlice<u32>,
    ) -> Result<Self> {
        let bad = e.resolve(config, &targets.slice(..), (n, v), &mut resolved.slice_mut(..))?;
        let targets = e.download(&targets.slice(..))?;
        if let Some(token) = bad {
            return Err(Error::TargetOutOfRange { token, target: targets[token], vocab: v });
        }
        let weights = weights.map(|w| e.download(&w.slice(..))).transpose()?;
        if let Some(w) = &weights {
            crate::inputs::check_weights(w)?;
        }
        Ok(Self { targets, weights })
    }

    /// A host view of the per-token inputs (X and W are not read by the loss and scale formulas).
    pub fn inputs(&self, (n, d, v): (usize, usize, usize)) -> Inputs<'_> {
        let (x, w) = (Matrix::F32(&[]), Matrix::F32(&[]));
        let mut inputs = Inputs::new(x, w, &self.targets, d);
        (inputs.weights, inputs.n, inputs.v) = (self.weights.as_deref(), n, v);
        inputs
    }
}

/// Device statistics of N rows.
pub(crate) type DeviceStats = RowStats<CudaSlice<f32>, CudaSlice<f64>>;

impl DeviceStats {
    pub fn new(e: &Engine, n: usize) -> Result<Self> {
        let mut max = e.zeros::<f32>(n)?;
        e.fill_neg_inf(&mut max.slice_mut(..))?;
        Ok(Self { max, sum: e.zeros(n)?, target_logit: e.zeros(n)?, logit_sum: e.zeros(n)? })
    }
    pub fn rows(&mut self, t0: usize, c: usize) -> StatsViews<'_> {
        StatsViews {
            max: self.max.slice_mut(t0..t0 + c),
            sum: self.sum.slice_mut(t0..t0 + c),
            target_logit: self.target_logit.slice_mut(t0..t0 + c),
            logit_sum: self.logit_sum.slice_mut(t0..t0 + c),
        }
    }
    pub fn download(&self, e: &Engine, n: usize) -> Result<Stats> {
        Ok(Stats {
            max: e.download(&self.max.slice(0..n))?,
            sum: e.download(&self.sum.slice(0..n))?,
            target_logit: e.download(&self.target_logit.slice(0..n))?,
            logit_sum: e.download(&self.logit_sum.slice(0..n))?,
        })
    }
}

/// Linear cross-entropy on one CUDA device with the plan's block buffers reserved at launch
/// ([`new`](Self::new)), or handed in by the caller per call ([`on_stream`](Self::on_stream)
/// and the `*_with` methods): the backend of [`LinearCrossEntropy`](crate::LinearCrossEntropy)
/// on a GPU.
#[derive(Debug)]
pub(crate) struct CudaLinearCrossEntropy {
    config: Config,
    plan: Plan,
    engine: Engine,
    /// Its own block buffers (empty for [`on_stream`](Self::on_stream)).
    buffers: BlockBuffers,
}

impl CudaLinearCrossEntropy {
    /// Reserves the plan's block buffers on CUDA device `ordinal` and creates the cuBLAS handle.
    pub fn new(plan: Plan, ordinal: usize) -> Result<Self> {
        let config = *plan.config();
        config.check_cuda_precision(plan.dtype())?;
        let ctx = context(ordinal)?;
        let engine = Engine::new(ctx.default_stream(), config.precision)?;
        let buffers = BlockBuffers::zeros(&engine, &plan)?;
        Ok(Self { buffers, engine, config, plan })
    }

    /// An executor that runs on `stream` (a framework's current stream: its work is ordered
    /// with the framework's, no synchronisation added) and reserves no block buffers: calls
    /// pass them ([`forward_with`](Self::forward_with), [`backward_into_with`](Self::backward_into_with)),
    /// so the working set comes from the caller's allocator. Kernels compile once per executor.
    pub fn on_stream(plan: Plan, stream: std::sync::Arc<CudaStream>) -> Result<Self> {
        let config = *plan.config();
        config.check_cuda_precision(plan.dtype())?;
        let engine = Engine::new(stream, config.precision)?;
        let empty = |e: &Engine| e.zeros::<f32>(0);
        let buffers =
            BlockBuffers { logits: empty(&engine)?, x_wide: empty(&engine)?, w_wide: empty(&engine)? };
        Ok(Self { buffers, engine, config, plan })
    }

    /// The stream every launch and copy of this object runs on.
    pub fn stream(&self) -> &std::sync::Arc<flatpeak_common::cuda::cudarc::driver::CudaStream> {
        &self.engine.stream
    }

    /// The loss and per-row lse (on the host): per block, the logits SGEMM and `lce_fold`.
    pub fn forward(&mut self, inputs: &DeviceInputs<'_>) -> Result<Forward> {
        let Self { config, plan, engine, buffers } = self;
        run(engine, (config, plan, buffers), inputs, None, |ops, call| driver::forward(ops, call))
    }

    /// [`forward`](Self::forward) with the caller's block buffers (at least
    /// [`BlockBuffers::lens`] each).
    pub fn forward_with(&mut self, buffers: &mut BlockBuffers, inputs: &DeviceInputs<'_>) -> Result<Forward> {
        let Self { config, plan, engine, .. } = self;
        run(engine, (config, plan, buffers), inputs, None, |ops, call| driver::forward(ops, call))
    }

    /// [`backward`](Self::backward) from forward's per-row `lse` with the caller's block
    /// buffers, writing dX, dW (and dbias) into the caller's device buffers `out` (overwritten).
    pub fn backward_into_with(
        &mut self,
        buffers: &mut BlockBuffers,
        inputs: &DeviceInputs<'_>,
        lse: &[f32],
        upstream: Upstream<'_>,
        out: DeviceGradientsMut<'_>,
    ) -> Result<()> {
        let Self { config, plan, engine, .. } = self;
        let saved = Saved::of(lse, upstream);
        run(engine, (config, plan, buffers), inputs, Some(out), |ops, call| {
            driver::backward(ops, call, saved)
        })
    }

    /// dX, dW (and dbias) on the device from forward's lse: per block, the logits SGEMM again,
    /// `lce_gradient`, `dX += G·W_blk`, `dW_blk += Gᵀ·X_blk` and `lce_bias_grad`.
    pub fn backward(
        &mut self,
        inputs: &DeviceInputs<'_>,
        forward: &Forward,
        upstream: Upstream<'_>,
    ) -> Result<DeviceGradients> {
        let Self { config, plan, engine, buffers } = self;
        let mut grads = DeviceGradients::zeros(engine, plan, inputs)?;
        let saved = Saved::of(&forward.lse, upstream);
        let out = Some(grads.as_mut());
        run(engine, (config, plan, buffers), inputs, out, |ops, call| driver::backward(ops, call, saved))?;
        Ok(grads)
    }

    /// Forward and backward in one pass when the loss is the last op (its upstream gradient is
    /// known). On [`BlockSchedule::FullVocab`] each token block's logits serve both: the logits
    /// SGEMM, `lce_fold` over the whole vocabulary, `lce_row_lse`, then `lce_gradient` and the
    /// dX/dW SGEMMs — 3 GEMMs instead of 4, no host round trip inside the loop; W (widened once
    /// for bf16) serves every token block. On the blocked schedule it runs forward then
    /// backward.
    ///
    /// [`BlockSchedule::FullVocab`]: crate::plan::BlockSchedule::FullVocab
    pub fn forward_backward(
        &mut self,
        inputs: &DeviceInputs<'_>,
        grad: GradOutput<'_>,
    ) -> Result<(Forward, DeviceGradients)> {
        let Self { config, plan, engine, buffers } = self;
        let mut grads = DeviceGradients::zeros(engine, plan, inputs)?;
        let out = Some(grads.as_mut());
        let forward = run(engine, (config, plan, buffers), inputs, out, |ops, call| {
            driver::forward_backward(ops, call, grad)
        })?;
        Ok((forward, grads))
    }

    /// [`forward_backward`](Self::forward_backward) with the caller's block buffers, writing
    /// the gradients its selection wants into the caller's device buffers `out` (overwritten).
    pub fn forward_backward_into_with(
        &mut self,
        buffers: &mut BlockBuffers,
        inputs: &DeviceInputs<'_>,
        grad: GradOutput<'_>,
        out: DeviceGradientsMut<'_>,
    ) -> Result<Forward> {
        let Self { config, plan, engine, .. } = self;
        run(engine, (config, plan, buffers), inputs, Some(out), |ops, call| {
            driver::forward_backward(ops, call, grad)
        })
    }
}

/// The executor's fixed parts for one call: its config, its plan and the block buffers.
type Fixed<'s> = (&'s Config, &'s Plan, &'s mut BlockBuffers);

/// Runs one call of the driver (`pass`) on the device: the call checked, every target resolved
/// on the device (checked against 0..V) and the per-token inputs copied down for the loss and
/// the gradient scales; `grads` receives a backward's gradients.
fn run<'s, R>(
    e: &'s Engine,
    (config, plan, buffers): Fixed<'s>,
    inputs: &'s DeviceInputs<'_>,
    grads: Option<DeviceGradientsMut<'s>>,
    pass: impl FnOnce(&mut CudaBlocks<'s, '_>, Call<'_>) -> Result<R>,
) -> Result<R> {
    driver::check_call(config, plan, inputs.sizes(), grads.as_ref().map(DeviceGradientsMut::lens))?;
    buffers.check(plan)?;
    let (n, d, v) = (inputs.n, inputs.d, inputs.v);
    let mut resolved = e.zeros::<u32>(n)?;
    let host = HostRows::resolve(e, config, (inputs.targets, inputs.weights), (n, v), &mut resolved)?;
    // `HostRows::resolve` checked the weights it copied down.
    let rows = host.inputs((n, d, v));
    let BlockBuffers { logits, x_wide, w_wide } = buffers;
    let mut ops = CudaBlocks {
        e,
        config,
        inputs,
        logits,
        x_wide,
        w_wide,
        native_bf16: native_bf16(config, inputs.x.dtype()),
        resolved,
        stats: None,
        lse: None,
        grads,
        gradient: None,
    };
    pass(&mut ops, Call { config, plan, rows: &rows })
}

/// A pass's state (`what`) read before the pass set it: a bug in the block driver.
fn missing(what: &'static str) -> Error {
    Error::internal(what)
}

/// Whether a call on inputs of `dtype` runs its GEMMs on bf16 operands (tensor cores) rather
/// than widened f32 ones: bf16 inputs under any precision but [`Precision::F32`].
fn native_bf16(config: &Config, dtype: flatpeak_common::DType) -> bool {
    cpu::rounds_gradient(config, dtype)
}

/// What the gradient kernel of every block reads besides its logits, on the device: each row's
/// gradient scale, and the saved lse with its optional upstream gradient (backward; the fused
/// pass finishes its own lse).
struct DeviceGradientInputs {
    coef: CudaSlice<f32>,
    saved_lse: Option<CudaSlice<f32>>,
    dlse: Option<CudaSlice<f32>>,
}

/// The CUDA backend of the block schedule ([`crate::blocks`]) on one device: the plan's block
/// buffers, the resolved targets, and the call's statistics and gradients.
struct CudaBlocks<'s, 'i> {
    e: &'s Engine,
    config: &'s Config,
    inputs: &'s DeviceInputs<'i>,
    logits: &'s mut CudaSlice<f32>,
    x_wide: &'s mut CudaSlice<f32>,
    w_wide: &'s mut CudaSlice<f32>,
    /// bf16 inputs under [`Precision::Native`]: every GEMM on the tensor cores with the inputs
    /// read in place, G narrowed to bf16 in place (nothing is widened).
    native_bf16: bool,
    resolved: CudaSlice<u32>,
    stats: Option<DeviceStats>,
    /// The fused pass's lse of every row.
    lse: Option<CudaSlice<f32>>,
    grads: Option<DeviceGradientsMut<'s>>,
    gradient: Option<DeviceGradientInputs>,
}

/// Rows `r0..r0 + rows` (width `d`) of `m` as f32: a view of an f32 matrix, or of `wide`, where
/// the backend's load widened them.
fn block_rows<'r>(
    m: &DeviceMatrix<'r>,
    wide: &'r CudaSlice<f32>,
    r0: usize,
    rows: usize,
    d: usize,
) -> CudaView<'r, f32> {
    match *m {
        DeviceMatrix::F32(s) => s.slice(r0 * d..(r0 + rows) * d),
        DeviceMatrix::Bf16(_) => wide.slice(0..rows * d),
    }
}

/// Block `at`'s logits and what the per-row kernels read besides them.
fn logits_block<'a, 'b>(
    logits: &'b mut CudaSlice<f32>,
    inputs: &DeviceInputs<'a>,
    resolved: &'a CudaSlice<u32>,
    at: BlockAt,
) -> LogitsBlock<'a, 'b> {
    LogitsBlock {
        logits,
        rows: at.c,
        vb: at.vb,
        v0: at.v0,
        bias: inputs.bias.map(|b| b.slice(at.v0..at.v0 + at.vb)),
        targets: resolved.slice(at.t0..at.t0 + at.c),
    }
}

impl CudaBlocks<'_, '_> {
    /// How the gradient kernel stores G: bf16 rows when the bf16 GEMMs read it and no bias
    /// gradient sums the f32 G first.
    fn gradient_store(&self) -> GradientStore {
        let bf16_gemms = matches!(
            (self.native_bf16, self.inputs.x, self.inputs.w),
            (true, DeviceMatrix::Bf16(_), DeviceMatrix::Bf16(_))
        );
        GradientStore::for_block(bf16_gemms, self.grads.as_ref().is_some_and(|g| g.dbias.is_some()))
    }
}

impl BlockOps for CudaBlocks<'_, '_> {
    fn begin(&mut self, pass: Pass, gradient: Option<&GradientInputs<'_>>) -> Result<()> {
        let (e, n) = (self.e, self.inputs.n);
        self.stats = (pass != Pass::Backward).then(|| DeviceStats::new(e, n)).transpose()?;
        self.lse = (pass == Pass::Fused).then(|| e.zeros::<f32>(n)).transpose()?;
        if pass == Pass::Forward {
            return Ok(());
        }
        // The GEMMs and the bias-gradient kernel add into the gradients.
        self.grads.as_mut().ok_or_else(|| missing("gradients"))?.fill_zero(e)?;
        let g = gradient.ok_or_else(|| missing("gradient scales"))?;
        let saved = (pass == Pass::Backward).then_some(g.saved_lse);
        self.gradient = Some(DeviceGradientInputs {
            coef: e.upload(g.coef)?,
            saved_lse: saved.map(|l| e.upload(l)).transpose()?,
            dlse: g.dlse.map(|l| e.upload(l)).transpose()?,
        });
        Ok(())
    }

    fn take_stats(&mut self) -> Result<Stats> {
        self.stats.take().ok_or_else(|| missing("fold stats"))?.download(self.e, self.inputs.n)
    }

    fn token_rows_done(&mut self, _t0: usize, _c: usize) -> Result<()> {
        // The device gradients are fp32 buffers the caller narrows, if it wants bf16.
        Ok(())
    }

    fn load_tokens(&mut self, t0: usize, c: usize) -> Result<()> {
        if self.native_bf16 {
            return Ok(());
        }
        self.inputs.x.widen_rows(self.e, t0..t0 + c, self.inputs.d, self.x_wide)
    }

    fn load_vocab(&mut self, v0: usize, vb: usize) -> Result<()> {
        if self.native_bf16 {
            return Ok(());
        }
        self.inputs.w.widen_rows(self.e, v0..v0 + vb, self.inputs.d, self.w_wide)
    }

    fn logits(&mut self, at: BlockAt) -> Result<()> {
        let d = self.inputs.d;
        if let (true, DeviceMatrix::Bf16(x), DeviceMatrix::Bf16(w)) =
            (self.native_bf16, self.inputs.x, self.inputs.w)
        {
            let (x, w) = (x.slice(at.t0 * d..(at.t0 + at.c) * d), w.slice(at.v0 * d..(at.v0 + at.vb) * d));
            return self.e.logits(&w, &x, (at.c, at.vb, d), self.logits);
        }
        let x = block_rows(&self.inputs.x, self.x_wide, at.t0, at.c, d);
        let w = block_rows(&self.inputs.w, self.w_wide, at.v0, at.vb, d);
        self.e.logits(&w, &x, (at.c, at.vb, d), self.logits)
    }

    fn fold(&mut self, at: BlockAt) -> Result<()> {
        let Self { e, config, inputs, logits, resolved, stats, .. } = self;
        let stats = stats.as_mut().ok_or_else(|| missing("fold stats"))?;
        e.fold(config, logits_block(logits, inputs, resolved, at), stats.rows(at.t0, at.c))
    }

    fn row_lse(&mut self, at: BlockAt) -> Result<()> {
        let (t0, c) = (at.t0, at.c);
        let stats = self.stats.as_ref().ok_or_else(|| missing("fold stats"))?;
        let lse = self.lse.as_mut().ok_or_else(|| missing("fused lse"))?;
        self.e.row_lse(
            &stats.max.slice(t0..t0 + c),
            &stats.sum.slice(t0..t0 + c),
            &mut lse.slice_mut(t0..t0 + c),
        )
    }

    fn gradient(&mut self, at: BlockAt, pass: Pass, _host: &GradientInputs<'_>) -> Result<()> {
        // The kernel reads the copies `begin` uploaded.
        let (t0, c) = (at.t0, at.c);
        let store = self.gradient_store();
        let Self { e, config, inputs, logits, resolved, lse, gradient, .. } = self;
        let g = gradient.as_ref().ok_or_else(|| missing("gradient scales"))?;
        let (lse, dlse) = match pass {
            Pass::Fused => (lse.as_ref(), None),
            _ => (g.saved_lse.as_ref(), g.dlse.as_ref()),
        };
        let lse = lse.ok_or_else(|| missing("lse"))?;
        let rows = RowViews {
            coef: g.coef.slice(t0..t0 + c),
            lse: lse.slice(t0..t0 + c),
            dlse: dlse.map(|g| g.slice(t0..t0 + c)),
        };
        e.gradient((config, inputs.v), logits_block(logits, inputs, resolved, at), rows, store)
    }

    fn project(&mut self, at: BlockAt) -> Result<()> {
        let BlockAt { t0, c, v0, vb } = at;
        let (d, store) = (self.inputs.d, self.gradient_store());
        let grads = self.grads.as_mut().ok_or_else(|| missing("gradients"))?;
        // dbias sums the f32 G, before bf16 inputs narrow it.
        if let Some(db) = grads.dbias.as_mut() {
            self.e.bias_grad(self.logits, (c, vb), &mut db.slice_mut(v0..v0 + vb))?;
        }
        let (want_dx, want_dw) = (grads.wanted.dx.is_computed(), grads.wanted.dw.is_computed());
        if let (true, DeviceMatrix::Bf16(x), DeviceMatrix::Bf16(w)) =
            (self.native_bf16, self.inputs.x, self.inputs.w)
        {
            // Rounded to bf16 by the gradient kernel itself unless dbias read the f32 G first.
            if (want_dx || want_dw) && store == GradientStore::F32 {
                self.e.narrow_rows(self.logits, (c, vb))?;
            }
            let (x, w) = (x.slice(t0 * d..(t0 + c) * d), w.slice(v0 * d..(v0 + vb) * d));
            if want_dx {
                self.e.dx(&w, self.logits, (c, vb, d), &mut grads.dx.slice_mut(t0 * d..(t0 + c) * d))?;
            }
            if want_dw {
                self.e.dw(&x, self.logits, (c, vb, d), &mut grads.dw.slice_mut(v0 * d..(v0 + vb) * d))?;
            }
            return Ok(());
        }
        // A skipped gradient's GEMM is not launched (its buffer is empty).
        if want_dx {
            let w = block_rows(&self.inputs.w, self.w_wide, v0, vb, d);
            self.e.dx(&w, self.logits, (c, vb, d), &mut grads.dx.slice_mut(t0 * d..(t0 + c) * d))?;
        }
        if want_dw {
            let x = block_rows(&self.inputs.x, self.x_wide, t0, c, d);
            self.e.dw(&x, self.logits, (c, vb, d), &mut grads.dw.slice_mut(v0 * d..(v0 + vb) * d))?;
        }
        Ok(())
    }
}
