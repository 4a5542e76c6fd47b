//! The CUDA path (feature `cuda`): the blocked schedule on one device. Per (token block,
//! vocabulary block): one cuBLAS SGEMM forms the raw logits block in a buffer reserved at
//! launch, then `lce_fold` (forward) or `lce_gradient` (backward) applies bias and softcap and
//! folds or differentiates in place, and two SGEMMs project G into dX and dW (`lce_bias_grad`
//! into dbias). bf16 inputs are widened per block by `lce_widen_bf16` (exact), so every GEMM is
//! f32 with f32 accumulation (cuBLAS's default math mode: no TF32). Forward + backward is 4
//! GEMMs per block pair.
//!
//! Device memory besides inputs and outputs: the logits block `4·C·Vb`, the widened X and W
//! blocks (bf16 only: `4·C·D + 4·Vb·D`), and per-token state (`PER_TOKEN_BYTES` per token plus
//! the resolved targets); cuBLAS's own workspace comes on top. This is the only file of the
//! crate that launches kernels.

use std::sync::Arc;

use flatpeak_common::cuda::cudarc::cublas::sys::cublasOperation_t;
use flatpeak_common::cuda::cudarc::cublas::{CudaBlas, Gemm, GemmConfig};
use flatpeak_common::cuda::cudarc::driver::{
    CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use flatpeak_common::cuda::{KernelCache, context, fill_f32};
use flatpeak_common::kernels::grid_stride_blocks;
use half::bf16;

use crate::config::LinearCrossEntropy;
use crate::cpu::{self, Stats};
use crate::error::{Error, Result};
use crate::inputs::{Forward, GradOutput, Inputs, Matrix};
use crate::kernels::{LINEAR_THREADS, RING_DTP, ROW_THREADS, softcap_arg};
use crate::plan::Plan;

fn cuda<E: std::fmt::Debug>(op: &'static str) -> impl Fn(E) -> Error {
    move |e| Error::Common(flatpeak_common::Error::Cuda { op, message: format!("{e:?}") })
}

/// A device matrix, row-major, f32 or bf16.
#[derive(Debug, Clone, Copy)]
pub enum DeviceMatrix<'a> {
    /// f32 elements.
    F32(&'a CudaSlice<f32>),
    /// bf16 elements, widened per block.
    Bf16(&'a CudaSlice<bf16>),
}

impl DeviceMatrix<'_> {
    fn len(&self) -> usize {
        match self {
            DeviceMatrix::F32(m) => m.len(),
            DeviceMatrix::Bf16(m) => m.len(),
        }
    }
    fn dtype(&self) -> flatpeak_common::DType {
        match self {
            DeviceMatrix::F32(_) => flatpeak_common::DType::F32,
            DeviceMatrix::Bf16(_) => flatpeak_common::DType::Bf16,
        }
    }
}

/// One call's device inputs: X (N×D), W (V×D), optional bias (V), targets (N, i64) and
/// optional per-token weights (N).
#[derive(Debug, Clone, Copy)]
pub struct DeviceInputs<'a> {
    /// Hidden states.
    pub x: DeviceMatrix<'a>,
    /// Projection.
    pub w: DeviceMatrix<'a>,
    /// Bias.
    pub bias: Option<&'a CudaSlice<f32>>,
    /// Target ids (see `LinearCrossEntropy::shift`).
    pub targets: &'a CudaSlice<i64>,
    /// Per-token weights.
    pub weights: Option<&'a CudaSlice<f32>>,
    /// Tokens N.
    pub n: usize,
    /// Hidden size D.
    pub d: usize,
    /// Vocabulary V.
    pub v: usize,
}

/// Device gradients, f32.
#[derive(Debug)]
pub struct DeviceGradients {
    /// dX, N×D.
    pub dx: CudaSlice<f32>,
    /// dW, V×D.
    pub dw: CudaSlice<f32>,
    /// dbias, V.
    pub dbias: Option<CudaSlice<f32>>,
}

/// The host copies of the per-token inputs the loss and the gradient scales need (targets and
/// weights: O(N), like the statistics).
struct HostRows {
    targets: Vec<i64>,
    weights: Option<Vec<f32>>,
}

/// Linear cross-entropy on one CUDA device with the plan's block buffers reserved at launch.
#[derive(Debug)]
pub struct CudaLinearCrossEntropy {
    config: LinearCrossEntropy,
    plan: Plan,
    engine: Engine,
    blocks: Blocks,
}

/// Kernels, stream and cuBLAS handle.
#[derive(Debug)]
struct Engine {
    cache: KernelCache,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
}

/// The block buffers reserved at launch.
#[derive(Debug)]
struct Blocks {
    logits: CudaSlice<f32>,
    x_wide: CudaSlice<f32>,
    w_wide: CudaSlice<f32>,
}

/// Column-major SGEMM `C = op(A)·op(B) + beta·C` (see the row-major mappings below).
struct Sgemm {
    ta: cublasOperation_t,
    tb: cublasOperation_t,
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    ldc: usize,
    beta: f32,
}

impl CudaLinearCrossEntropy {
    /// Reserves the plan's block buffers on CUDA device `ordinal` and creates the cuBLAS handle.
    pub fn new(config: LinearCrossEntropy, plan: Plan, ordinal: usize) -> Result<Self> {
        config.validate()?;
        let ctx = context(ordinal)?;
        let stream = ctx.default_stream();
        let (c, vb, d) = (plan.token_block(), plan.vocab_block(), plan.d());
        let wide = plan.dtype() != flatpeak_common::DType::F32;
        let alloc = |len: usize| stream.alloc_zeros::<f32>(len.max(1)).map_err(cuda("cuMemAlloc"));
        let blocks = Blocks {
            logits: alloc(c * vb)?,
            x_wide: alloc(if wide { c * d } else { 0 })?,
            w_wide: alloc(if wide { vb * d } else { 0 })?,
        };
        let engine = Engine {
            blas: CudaBlas::new(stream.clone()).map_err(cuda("cublasCreate"))?,
            cache: KernelCache::new(ctx)?,
            stream,
        };
        Ok(Self { config, plan, engine, blocks })
    }

    /// The stream every launch and copy of this object runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.engine.stream
    }

    fn check(&self, inputs: &DeviceInputs<'_>) -> Result<()> {
        let p = &self.plan;
        for (what, expected, found) in [
            ("n", p.n(), inputs.n),
            ("d", p.d(), inputs.d),
            ("v", p.v(), inputs.v),
            ("x (n·d)", inputs.n * inputs.d, inputs.x.len()),
            ("w (v·d)", inputs.v * inputs.d, inputs.w.len()),
            ("targets (n)", inputs.n, inputs.targets.len()),
        ] {
            if expected != found {
                return Err(Error::ShapeMismatch { what, expected, found });
            }
        }
        if inputs.x.dtype() != inputs.w.dtype() || inputs.x.dtype() != p.dtype() {
            return Err(Error::DtypeMismatch { x: inputs.x.dtype(), w: inputs.w.dtype() });
        }
        if let Some(b) = inputs.bias.filter(|b| b.len() != inputs.v) {
            return Err(Error::ShapeMismatch { what: "bias (v)", expected: inputs.v, found: b.len() });
        }
        if let Some(w) = inputs.weights.filter(|w| w.len() != inputs.n) {
            return Err(Error::ShapeMismatch { what: "weights (n)", expected: inputs.n, found: w.len() });
        }
        Ok(())
    }

    /// The loss and per-row lse (on the host): per block, the logits SGEMM and `lce_fold`.
    pub fn forward(&mut self, inputs: &DeviceInputs<'_>) -> Result<Forward> {
        self.check(inputs)?;
        let Self { config, plan, engine: e, blocks } = self;
        let (resolved, host) = e.resolve(config, inputs)?;
        let (n, d, v) = (inputs.n, inputs.d, inputs.v);
        let (cb, vbmax) = (plan.token_block(), plan.vocab_block());
        let alloc = |len: usize| e.stream.alloc_zeros::<f64>(len.max(1)).map_err(cuda("cuMemAlloc"));
        let (mut sum, mut logit_sum) = (alloc(n)?, alloc(n)?);
        let mut max = e.stream.alloc_zeros::<f32>(n.max(1)).map_err(cuda("cuMemAlloc"))?;
        fill_f32(&e.cache, &e.stream, &mut max.slice_mut(..), f32::NEG_INFINITY)?;
        let mut target_logit = e.stream.alloc_zeros::<f32>(n.max(1)).map_err(cuda("cuMemAlloc"))?;
        let fold = e.cache.function(&RING_DTP, "lce_fold")?;
        let (softcap, smoothing) = (softcap_arg(config.softcap), (config.label_smoothing != 0.0) as i32);
        let null = 0u64;
        let Blocks { logits, x_wide, w_wide } = blocks;
        for t0 in (0..n).step_by(cb.max(1)) {
            let c = cb.min(n - t0);
            let x = e.rows(&inputs.x, t0..t0 + c, d, x_wide)?;
            for v0 in (0..v).step_by(vbmax.max(1)) {
                let vb = vbmax.min(v - v0);
                let w = e.rows(&inputs.w, v0..v0 + vb, d, w_wide)?;
                // Row-major logits (c×vb) = X·Wᵀ is column-major (vb×c) = Wᵀ·X with W and
                // X read as column-major d×vb and d×c: lengths d·vb, d·c, vb·c.
                let g = Sgemm {
                    ta: cublasOperation_t::CUBLAS_OP_T,
                    tb: cublasOperation_t::CUBLAS_OP_N,
                    m: vb,
                    n: c,
                    k: d,
                    lda: d,
                    ldb: d,
                    ldc: vb,
                    beta: 0.0,
                };
                e.sgemm(g, &w, &x, &mut *logits)?;
                if c == 0 || vb == 0 {
                    continue;
                }
                let bias = inputs.bias.map(|b| b.slice(v0..v0 + vb));
                let (vb32, v032) = (vb as u32, v0 as u32);
                let targets = resolved.slice(t0..t0 + c);
                let (mut m, mut s) = (max.slice_mut(t0..t0 + c), sum.slice_mut(t0..t0 + c));
                let (mut zt, mut zs) = (target_logit.slice_mut(t0..t0 + c), logit_sum.slice_mut(t0..t0 + c));
                let mut l = e.stream.launch_builder(&fold);
                l.arg(&*logits).arg(&vb32).arg(&v032);
                match &bias {
                    Some(b) => l.arg(b),
                    None => l.arg(&null),
                };
                l.arg(&softcap)
                    .arg(&targets)
                    .arg(&mut m)
                    .arg(&mut s)
                    .arg(&mut zt)
                    .arg(&mut zs)
                    .arg(&smoothing);
                let cfg = LaunchConfig {
                    grid_dim: (c as u32, 1, 1),
                    block_dim: (ROW_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: `lce_fold(const float*, u32, u32, const float*, float, const u32*,
                // float*, double*, float*, double*, int)` matches the arguments in order
                // (a null bias is a zero pointer); block k reads logits row k (c×vb written by
                // the SGEMM above), bias[0..vb), targets[k] and updates row k of the four
                // statistics views (c rows each); 256 threads, a multiple of 32.
                unsafe { l.launch(cfg) }.map_err(cuda("cuLaunchKernel(lce_fold)"))?;
            }
        }
        let stats = Stats {
            max: e.stream.clone_dtoh(&max.slice(0..n)).map_err(cuda("cuMemcpyDtoH"))?,
            sum: e.stream.clone_dtoh(&sum.slice(0..n)).map_err(cuda("cuMemcpyDtoH"))?,
            target_logit: e.stream.clone_dtoh(&target_logit.slice(0..n)).map_err(cuda("cuMemcpyDtoH"))?,
            logit_sum: e.stream.clone_dtoh(&logit_sum.slice(0..n)).map_err(cuda("cuMemcpyDtoH"))?,
        };
        let shadow = host_inputs(&host, inputs);
        let (per_token, lse) = cpu::per_token_losses(config, &shadow, v, &stats);
        let total: f64 = per_token.iter().map(|&x| x as f64).sum();
        let loss = cpu::reduce_loss(config, per_token, total, shadow.valid_weight(config));
        Ok(Forward { loss, lse })
    }

    /// dX, dW (and dbias) on the device from forward's lse: per block, the logits SGEMM again,
    /// `lce_gradient`, `dX += G·W_blk`, `dW_blk += Gᵀ·X_blk` and `lce_bias_grad`.
    pub fn backward(
        &mut self,
        inputs: &DeviceInputs<'_>,
        forward: &Forward,
        grad: GradOutput<'_>,
        dlse: Option<&[f32]>,
    ) -> Result<DeviceGradients> {
        self.check(inputs)?;
        let (n, d, v) = (inputs.n, inputs.d, inputs.v);
        if forward.lse.len() != n {
            return Err(Error::ShapeMismatch { what: "lse (n)", expected: n, found: forward.lse.len() });
        }
        if let Some(g) = dlse.filter(|g| g.len() != n) {
            return Err(Error::ShapeMismatch { what: "dlse (n)", expected: n, found: g.len() });
        }
        let Self { config, plan, engine: e, blocks } = self;
        let (resolved, host) = e.resolve(config, inputs)?;
        let shadow = host_inputs(&host, inputs);
        let coef = cpu::coefficients(config, &shadow, grad, shadow.valid_weight(config))?;
        let upload = |h: &[f32]| e.stream.clone_htod(h).map_err(cuda("cuMemcpyHtoD"));
        let (coef, lse) = (upload(&pad(&coef))?, upload(&pad(&forward.lse))?);
        let dlse = dlse.map(|g| upload(&pad(g))).transpose()?;
        let zeros = |len: usize| e.stream.alloc_zeros::<f32>(len.max(1)).map_err(cuda("cuMemAlloc"));
        let mut grads = DeviceGradients {
            dx: zeros(n * d)?,
            dw: zeros(v * d)?,
            dbias: inputs.bias.map(|_| zeros(v)).transpose()?,
        };
        let gradient = e.cache.function(&RING_DTP, "lce_gradient")?;
        let bias_grad = e.cache.function(&RING_DTP, "lce_bias_grad")?;
        let (softcap, alpha, lambda, vocab) =
            (softcap_arg(config.softcap), config.label_smoothing, config.z_loss, v as u64);
        let (cb, vbmax) = (plan.token_block(), plan.vocab_block());
        let null = 0u64;
        let Blocks { logits, x_wide, w_wide } = blocks;
        for t0 in (0..n).step_by(cb.max(1)) {
            let c = cb.min(n - t0);
            let x = e.rows(&inputs.x, t0..t0 + c, d, x_wide)?;
            for v0 in (0..v).step_by(vbmax.max(1)) {
                let vb = vbmax.min(v - v0);
                let w = e.rows(&inputs.w, v0..v0 + vb, d, w_wide)?;
                let g = Sgemm {
                    ta: cublasOperation_t::CUBLAS_OP_T,
                    tb: cublasOperation_t::CUBLAS_OP_N,
                    m: vb,
                    n: c,
                    k: d,
                    lda: d,
                    ldb: d,
                    ldc: vb,
                    beta: 0.0,
                };
                e.sgemm(g, &w, &x, &mut *logits)?;
                if c == 0 || vb == 0 {
                    continue;
                }
                let bias = inputs.bias.map(|b| b.slice(v0..v0 + vb));
                let (vb32, v032) = (vb as u32, v0 as u32);
                let (targets, cf, ls) =
                    (resolved.slice(t0..t0 + c), coef.slice(t0..t0 + c), lse.slice(t0..t0 + c));
                let dl = dlse.as_ref().map(|g| g.slice(t0..t0 + c));
                let mut l = e.stream.launch_builder(&gradient);
                l.arg(&mut *logits).arg(&vb32).arg(&v032);
                match &bias {
                    Some(b) => l.arg(b),
                    None => l.arg(&null),
                };
                l.arg(&softcap).arg(&targets).arg(&cf).arg(&ls);
                match &dl {
                    Some(g) => l.arg(g),
                    None => l.arg(&null),
                };
                l.arg(&alpha).arg(&lambda).arg(&vocab);
                let cfg = LaunchConfig {
                    grid_dim: (c as u32, 1, 1),
                    block_dim: (ROW_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                // SAFETY: `lce_gradient(float*, u32, u32, const float*, float, const u32*,
                // const float*, const float*, const float*, float, float, u64)` matches the
                // arguments (null bias/dlse are zero pointers); block k rewrites logits row k
                // and reads row k of targets, coef, lse, dlse (c rows each); 256 threads.
                unsafe { l.launch(cfg) }.map_err(cuda("cuLaunchKernel(lce_gradient)"))?;
                // dX rows (row-major c×d) += G (c×vb)·W_blk (vb×d): column-major
                // dXᵀ (d×c) += Wᵀ (d×vb)·Gᵀ (vb×c); lengths d·vb, vb·c, d·c.
                let mut dx = grads.dx.slice_mut(t0 * d..(t0 + c) * d);
                let g = Sgemm {
                    ta: cublasOperation_t::CUBLAS_OP_N,
                    tb: cublasOperation_t::CUBLAS_OP_N,
                    m: d,
                    n: c,
                    k: vb,
                    lda: d,
                    ldb: vb,
                    ldc: d,
                    beta: 1.0,
                };
                e.sgemm(g, &w, &*logits, &mut dx)?;
                // dW_blk (row-major vb×d) += Gᵀ (vb×c)·X (c×d): column-major
                // dWᵀ (d×vb) += Xᵀ (d×c)·G (c×vb); lengths d·c, vb·c, d·vb.
                let mut dw = grads.dw.slice_mut(v0 * d..(v0 + vb) * d);
                let g = Sgemm {
                    ta: cublasOperation_t::CUBLAS_OP_N,
                    tb: cublasOperation_t::CUBLAS_OP_T,
                    m: d,
                    n: vb,
                    k: c,
                    lda: d,
                    ldb: vb,
                    ldc: d,
                    beta: 1.0,
                };
                e.sgemm(g, &x, &*logits, &mut dw)?;
                if let Some(db) = grads.dbias.as_mut() {
                    let mut db = db.slice_mut(v0..v0 + vb);
                    let c32 = c as u32;
                    let mut l = e.stream.launch_builder(&bias_grad);
                    l.arg(&*logits).arg(&c32).arg(&vb32).arg(&mut db);
                    let blocks = grid_stride_blocks(vb, LINEAR_THREADS, 1024);
                    let cfg = LaunchConfig {
                        grid_dim: (blocks, 1, 1),
                        block_dim: (LINEAR_THREADS, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    // SAFETY: `lce_bias_grad(const float*, u32, u32, float*)` matches; it reads
                    // G (c×vb) and updates db[0..vb) (grid-stride over columns).
                    unsafe { l.launch(cfg) }.map_err(cuda("cuLaunchKernel(lce_bias_grad)"))?;
                }
            }
        }
        Ok(grads)
    }
}

impl Engine {
    /// Resolves every row's target on the device (shift, ignore_index) and checks every target:
    /// [`Error::TargetOutOfRange`] names the first bad one. Also copies targets and weights down.
    fn resolve(
        &self,
        config: &LinearCrossEntropy,
        inputs: &DeviceInputs<'_>,
    ) -> Result<(CudaSlice<u32>, HostRows)> {
        let (n, nt) = (inputs.n, inputs.targets.len());
        let mut resolved = self.stream.alloc_zeros::<u32>(n.max(1)).map_err(cuda("cuMemAlloc"))?;
        let mut first_bad = self.stream.clone_htod(&[u64::MAX]).map_err(cuda("cuMemcpyHtoD"))?;
        let f = self.cache.function(&RING_DTP, "lce_resolve_targets")?;
        let (nt64, n64, shift, ignore, vocab) =
            (nt as u64, n as u64, config.shift as u64, config.ignore_index, inputs.v as u64);
        let blocks = grid_stride_blocks(n.max(nt), LINEAR_THREADS, 1024);
        let cfg =
            LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (LINEAR_THREADS, 1, 1), shared_mem_bytes: 0 };
        let mut b = self.stream.launch_builder(&f);
        b.arg(inputs.targets).arg(&nt64).arg(&n64).arg(&shift).arg(&ignore).arg(&vocab);
        b.arg(&mut resolved).arg(&mut first_bad);
        // SAFETY: `lce_resolve_targets(const i64*, u64, u64, u64, i64, u64, u32*, u64*)` matches
        // the arguments in order; it reads `targets[0..nt)`, writes `resolved[0..n)` (the
        // allocation holds max(n, 1)) and `first_bad[0]` (grid-stride over max(n, nt)).
        unsafe { b.launch(cfg) }.map_err(cuda("cuLaunchKernel(lce_resolve_targets)"))?;
        let bad = self.stream.clone_dtoh(&first_bad).map_err(cuda("cuMemcpyDtoH"))?[0];
        let targets = self.stream.clone_dtoh(inputs.targets).map_err(cuda("cuMemcpyDtoH"))?;
        if bad != u64::MAX {
            let token = bad as usize;
            return Err(Error::TargetOutOfRange { token, target: targets[token], vocab: inputs.v });
        }
        let weights = match inputs.weights {
            Some(w) => Some(self.stream.clone_dtoh(w).map_err(cuda("cuMemcpyDtoH"))?),
            None => None,
        };
        Ok((resolved, HostRows { targets, weights }))
    }

    fn sgemm<A: DevicePtr<f32>, B: DevicePtr<f32>, C: DevicePtrMut<f32>>(
        &self,
        g: Sgemm,
        a: &A,
        b: &B,
        c: &mut C,
    ) -> Result<()> {
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        let cfg = GemmConfig {
            transa: g.ta,
            transb: g.tb,
            m: g.m as i32,
            n: g.n as i32,
            k: g.k as i32,
            alpha: 1.0f32,
            lda: g.lda as i32,
            ldb: g.ldb as i32,
            beta: g.beta,
            ldc: g.ldc as i32,
        };
        // SAFETY: the callers pass operands whose lengths cover the column-major extents of
        // `cfg` (documented at each mapping below), all on `self.stream`.
        unsafe { self.blas.gemm(cfg, a, b, c) }.map_err(cuda("cublasSgemm"))
    }

    /// Rows `rows` of `m` as f32 on the device: a view of an f32 matrix, or widened into `buf`.
    fn rows<'s>(
        &self,
        m: &DeviceMatrix<'s>,
        rows: std::ops::Range<usize>,
        d: usize,
        buf: &'s mut CudaSlice<f32>,
    ) -> Result<CudaView<'s, f32>> {
        let (a, b) = (rows.start * d, rows.end * d);
        match *m {
            DeviceMatrix::F32(s) => Ok(s.slice(a..b)),
            DeviceMatrix::Bf16(s) => {
                let f = self.cache.function(&RING_DTP, "lce_widen_bf16")?;
                let len = (b - a) as u64;
                let src = s.slice(a..b);
                let blocks = grid_stride_blocks(b - a, LINEAR_THREADS, 4096);
                let cfg = LaunchConfig {
                    grid_dim: (blocks, 1, 1),
                    block_dim: (LINEAR_THREADS, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut l = self.stream.launch_builder(&f);
                l.arg(&src).arg(&mut *buf).arg(&len);
                // SAFETY: `lce_widen_bf16(const bf16*, float*, u64)` matches; it reads `src[0..len)`
                // and writes `buf[0..len)`, and `buf` holds a block of the plan's rows (≥ len).
                unsafe { l.launch(cfg) }.map_err(cuda("cuLaunchKernel(lce_widen_bf16)"))?;
                Ok(buf.slice(0..b - a))
            }
        }
    }
}

/// A slice, or one zero when empty (device allocations are never empty).
fn pad(h: &[f32]) -> Vec<f32> {
    if h.is_empty() { vec![0.0] } else { h.to_vec() }
}

/// Host view of the per-token inputs (X and W are not read by the loss and scale formulas).
fn host_inputs<'a>(host: &'a HostRows, inputs: &DeviceInputs<'_>) -> Inputs<'a> {
    let mut i = Inputs::new(Matrix::F32(&[]), Matrix::F32(&[]), &host.targets, inputs.n, inputs.d, inputs.v);
    if let Some(w) = &host.weights {
        i = i.with_weights(w);
    }
    i
}
