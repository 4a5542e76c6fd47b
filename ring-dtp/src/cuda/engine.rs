//! The device block operations every CUDA schedule is made of — target resolution, the logits
//! SGEMM, the fold and gradient kernels, the dX/dW SGEMMs, the bias gradient and the bf16
//! widening — as safe methods that check their operands' lengths. This is the only file of the
//! crate that launches kernels or calls cuBLAS.

use std::sync::Arc;

use flatpeak_common::Precision;
use flatpeak_common::cuda::cudarc::cublas::CudaBlas;
use flatpeak_common::cuda::cudarc::cublas::sys::cublasOperation_t;
use flatpeak_common::cuda::cudarc::driver::{
    CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig,
    PushKernelArg,
};
use flatpeak_common::cuda::{
    BlasMath, GemmCall, GemmShape, KernelCache, Operand, Output, SharedBlas, alloc_error, cuda_error,
    fill_f32, gemm_bf16, linear_launch, per_row_launch, sgemm,
};
use half::bf16;

use crate::config::Config;
use crate::error::{Error, Result};
use crate::kernels::{GradientStore, RING_DTP, ROW_THREADS, softcap_arg};
use crate::loss::RowStats;

fn linear(n: usize, max_blocks: u32) -> LaunchConfig {
    linear_launch(n, max_blocks)
}

fn per_row(rows: usize) -> Result<LaunchConfig> {
    Ok(per_row_launch(rows, ROW_THREADS)?)
}

fn need(what: &'static str, expected: usize, found: usize) -> Result<()> {
    if found >= expected { Ok(()) } else { Err(Error::ShapeMismatch { what, expected, got: found }) }
}

/// The element of a block GEMM's X and W operands: f32 (SGEMM in the handle's math mode) or
/// bf16 (`cublasGemmEx` on the tensor cores); accumulation and output are f32 either way.
pub(crate) trait GemmElement: DeviceRepr + Sized {
    /// The `c×vb` f32 gradient block `g` as this element's GEMM operand, with its leading
    /// dimension: the f32 values (`vb`), or for bf16 the rows `lce_narrow_rows_bf16` left in
    /// the first half of each row's bytes (`2·vb`).
    fn gradient_operand(g: &CudaSlice<f32>, dims: (usize, usize)) -> Result<(CudaView<'_, Self>, usize)>;

    /// `C = op(A)·op(B) + β·C`, f32 C.
    ///
    /// # Safety
    /// As `flatpeak_common::cuda::sgemm`: a, b and c hold the column-major extents of the
    /// product, `c` is distinct from a and b, and every operand is ordered on `stream`, the
    /// handle's stream.
    unsafe fn gemm<A: DevicePtr<Self>, B: DevicePtr<Self>, C: DevicePtrMut<f32>>(
        blas: &CudaBlas,
        stream: &CudaStream,
        call: GemmCall<'_, A, B, C>,
    ) -> Result<()>;
}

impl GemmElement for f32 {
    fn gradient_operand(g: &CudaSlice<f32>, (c, vb): (usize, usize)) -> Result<(CudaView<'_, f32>, usize)> {
        need("gradient block (c·vb)", c * vb, g.len())?;
        Ok((g.slice(0..c * vb), vb))
    }

    unsafe fn gemm<A: DevicePtr<f32>, B: DevicePtr<f32>, C: DevicePtrMut<f32>>(
        blas: &CudaBlas,
        _stream: &CudaStream,
        call: GemmCall<'_, A, B, C>,
    ) -> Result<()> {
        // SAFETY: this function's contract is `sgemm`'s; the handle runs on its own stream.
        Ok(unsafe { sgemm(blas, call) }?)
    }
}

impl GemmElement for bf16 {
    fn gradient_operand(g: &CudaSlice<f32>, (c, vb): (usize, usize)) -> Result<(CudaView<'_, bf16>, usize)> {
        need("gradient block (c·vb)", c * vb, g.len())?;
        // SAFETY: every bit pattern is a valid bf16, and 2·c·vb bf16 are the bytes of the
        // c·vb floats checked above.
        let narrowed = unsafe { g.transmute::<bf16>(2 * c * vb) }.ok_or(Error::ShapeMismatch {
            what: "narrowed gradient block (2·c·vb bf16)",
            expected: 2 * c * vb,
            got: 2 * g.len(),
        })?;
        Ok((narrowed, 2 * vb))
    }

    unsafe fn gemm<A: DevicePtr<bf16>, B: DevicePtr<bf16>, C: DevicePtrMut<f32>>(
        blas: &CudaBlas,
        stream: &CudaStream,
        call: GemmCall<'_, A, B, C>,
    ) -> Result<()> {
        // SAFETY: this function's contract is `gemm_bf16`'s, `stream` the handle's.
        Ok(unsafe { gemm_bf16(blas, stream, call) }?)
    }
}

/// Per-row statistics of a token block on the device (fold state).
pub(crate) type StatsViews<'a> = RowStats<CudaViewMut<'a, f32>, CudaViewMut<'a, f64>>;

/// Per-row inputs of the gradient kernel.
#[derive(Debug)]
pub(crate) struct RowViews<'a> {
    pub coef: CudaView<'a, f32>,
    pub lse: CudaView<'a, f32>,
    pub dlse: Option<CudaView<'a, f32>>,
}

/// A logits block and what the per-row kernels read besides it.
#[derive(Debug)]
pub(crate) struct LogitsBlock<'a, 'b> {
    /// `rows × vb` raw logits (row-major), rewritten in place by the gradient kernel.
    pub logits: &'b mut CudaSlice<f32>,
    pub rows: usize,
    pub vb: usize,
    /// Global vocabulary index of the block's first column.
    pub v0: usize,
    pub bias: Option<CudaView<'a, f32>>,
    pub targets: CudaView<'a, u32>,
}

/// The kernels and cuBLAS handle of one device (shared by every engine on it) and the stream
/// this engine issues on.
#[derive(Debug)]
pub(crate) struct Engine {
    pub cache: Arc<KernelCache>,
    pub stream: Arc<CudaStream>,
    blas: Arc<SharedBlas>,
    math: BlasMath,
}

impl Engine {
    /// The device's kernels and cuBLAS handle, compiled and created once per device
    /// ([`KernelCache::shared`], [`SharedBlas`]), issuing on `stream`, whose f32 GEMMs run in
    /// `precision`: SGEMM (f32 with f32 accumulation, no TF32) unless it is
    /// [`Precision::Tf32`] (TF32 tensor-op math).
    pub fn new(stream: Arc<CudaStream>, precision: Precision) -> Result<Self> {
        let ctx = stream.context();
        let (cache, blas) = (KernelCache::shared(ctx)?, SharedBlas::of(ctx)?);
        let math = if precision == Precision::Tf32 { BlasMath::Tf32 } else { BlasMath::Default };
        Ok(Self { cache, stream, blas, math })
    }

    pub fn zeros<
        T: flatpeak_common::cuda::cudarc::driver::DeviceRepr
            + flatpeak_common::cuda::cudarc::driver::ValidAsZeroBits,
    >(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>> {
        self.stream
            .alloc_zeros::<T>(len.max(1))
            .map_err(alloc_error("a ring-dtp buffer", len.max(1) * std::mem::size_of::<T>()))
            .map_err(Error::from)
    }

    pub fn upload<T: flatpeak_common::cuda::cudarc::driver::DeviceRepr + Copy + Default>(
        &self,
        host: &[T],
    ) -> Result<CudaSlice<T>> {
        if host.is_empty() {
            return self
                .stream
                .clone_htod(&[T::default()])
                .map_err(cuda_error("cuMemcpyHtoD"))
                .map_err(Error::from);
        }
        self.stream.clone_htod(host).map_err(cuda_error("cuMemcpyHtoD")).map_err(Error::from)
    }

    pub fn download<T: flatpeak_common::cuda::cudarc::driver::DeviceRepr + Default + Copy>(
        &self,
        dev: &CudaView<'_, T>,
    ) -> Result<Vec<T>> {
        self.stream.clone_dtoh(dev).map_err(cuda_error("cuMemcpyDtoH")).map_err(Error::from)
    }

    /// `out = -inf` (the fold's initial maximum).
    pub fn fill_neg_inf(&self, out: &mut CudaViewMut<'_, f32>) -> Result<()> {
        Ok(fill_f32(&self.cache, &self.stream, out, f32::NEG_INFINITY)?)
    }

    /// Resolves the targets of `n` rows (shift, ignore_index) into `resolved` and checks every
    /// target; the index of the first one outside 0..V that is not ignore_index, if any.
    pub fn resolve(
        &self,
        config: &Config,
        targets: &CudaView<'_, i64>,
        (n, vocab): (usize, usize),
        resolved: &mut CudaViewMut<'_, u32>,
    ) -> Result<Option<usize>> {
        need("resolved targets (n)", n, resolved.len())?;
        let nt = targets.len();
        let mut first_bad = self.stream.clone_htod(&[u64::MAX]).map_err(cuda_error("cuMemcpyHtoD"))?;
        let f = self.cache.function(&RING_DTP, "lce_resolve_targets")?;
        let (nt64, n64, shift, ignore, v64) =
            (nt as u64, n as u64, config.shift as u64, config.ignore_index, vocab as u64);
        let mut b = self.stream.launch_builder(&f);
        b.arg(targets)
            .arg(&nt64)
            .arg(&n64)
            .arg(&shift)
            .arg(&ignore)
            .arg(&v64)
            .arg(resolved)
            .arg(&mut first_bad);
        if n.max(nt) > 0 {
            // SAFETY: `lce_resolve_targets(const i64*, u64, u64, u64, i64, u64, u32*, u64*)`
            // matches the arguments in order; it reads `targets[0..nt)`, writes `resolved[0..n)`
            // (checked above) and `first_bad[0]`, grid-stride over max(n, nt).
            unsafe { b.launch(linear(n.max(nt), 1024)) }
                .map_err(cuda_error("cuLaunchKernel(lce_resolve_targets)"))?;
        }
        let bad = self.stream.clone_dtoh(&first_bad).map_err(cuda_error("cuMemcpyDtoH"))?[0];
        Ok((bad != u64::MAX).then_some(bad as usize))
    }

    /// `out[..x.len()] = f32(x)` (exact).
    pub fn widen(&self, x: &CudaView<'_, bf16>, out: &mut CudaSlice<f32>) -> Result<()> {
        let len = x.len();
        need("widened block", len, out.len())?;
        if len == 0 {
            return Ok(());
        }
        let f = self.cache.function(&RING_DTP, "lce_widen_bf16")?;
        let len64 = len as u64;
        let mut l = self.stream.launch_builder(&f);
        l.arg(x).arg(&mut *out).arg(&len64);
        // SAFETY: `lce_widen_bf16(const bf16*, float*, u64)` matches; it reads `x[0..len)` and
        // writes `out[0..len)`, which holds at least `len` (checked above).
        unsafe { l.launch(linear(len, 4096)) }.map_err(cuda_error("cuLaunchKernel(lce_widen_bf16)"))?;
        Ok(())
    }

    /// `g[..len] = f32(bf16(g))` in place (round to nearest even): the logit gradient of bf16
    /// inputs before its GEMMs under [`Precision::Native`](flatpeak_common::Precision::Native).
    pub fn round_bf16(&self, g: &mut CudaSlice<f32>, len: usize) -> Result<()> {
        need("gradient block", len, g.len())?;
        if len == 0 {
            return Ok(());
        }
        let f = self.cache.function(&RING_DTP, "lce_round_bf16")?;
        let len64 = len as u64;
        let mut l = self.stream.launch_builder(&f);
        l.arg(&mut *g).arg(&len64);
        // SAFETY: `lce_round_bf16(float*, u64)` matches; it rewrites `g[0..len)` element by
        // element (no element read by another thread), and `g` holds at least `len` (checked).
        unsafe { l.launch(linear(len, 4096)) }.map_err(cuda_error("cuLaunchKernel(lce_round_bf16)"))?;
        Ok(())
    }

    /// `C = op(A)·op(B) + β·C` on this engine's cuBLAS handle and stream, with f32
    /// accumulation and output, for operands of element `T` (column-major, leading dimensions
    /// given).
    fn gemm<T: GemmElement, A: DevicePtr<T>, B: DevicePtr<T>, C: DevicePtrMut<f32>>(
        &self,
        call: GemmCall<'_, A, B, C>,
    ) -> Result<()> {
        let blas = self.blas.bind(&self.stream, self.math)?;
        // SAFETY: every public caller checks that a, b and c hold the column-major extents of
        // the product (lda·cols etc., stated at each call) and passes a `c` distinct from a and
        // b; the GEMM runs on `self.stream`, the stream `blas` is bound to while it lives, after
        // every earlier write to a, b or c (issued on this stream, or on another stream of the
        // context and ordered by cudarc's per-buffer events).
        unsafe { T::gemm(&blas, &self.stream, call) }
    }

    /// Raw `logits (c×vb, row-major) = X_blk·W_blkᵀ`: column-major `(vb×c) = Wᵀ·X` with W and X
    /// read as column-major `d×vb` and `d×c`. f32 operands run SGEMM, bf16 operands the tensor
    /// cores (f32 accumulation and output), read in place.
    pub fn logits<T: GemmElement>(
        &self,
        w: &CudaView<'_, T>,
        x: &CudaView<'_, T>,
        (c, vb, d): (usize, usize, usize),
        out: &mut CudaSlice<f32>,
    ) -> Result<()> {
        need("w block (vb·d)", vb * d, w.len())?;
        need("x block (c·d)", c * d, x.len())?;
        need("logits block (c·vb)", c * vb, out.len())?;
        let (t, n) = (cublasOperation_t::CUBLAS_OP_T, cublasOperation_t::CUBLAS_OP_N);
        self.gemm(GemmCall {
            shape: GemmShape { op_a: t, op_b: n, m: vb, n: c, k: d },
            a: Operand { buf: w, ld: d },
            b: Operand { buf: x, ld: d },
            c: Output { buf: out, ld: vb, beta: 0.0 },
        })
    }

    /// Rounds each row of the `rows×vb` gradient block `g` to bf16 in place
    /// (`lce_narrow_rows_bf16`): row r's bf16 then starts at bf16 element `2·vb·r` of the buffer.
    pub fn narrow_rows(&self, g: &mut CudaSlice<f32>, (rows, vb): (usize, usize)) -> Result<()> {
        need("gradient block (c·vb)", rows * vb, g.len())?;
        if rows == 0 || vb == 0 {
            return Ok(());
        }
        let vb32 = u32::try_from(vb).map_err(|_| Error::ShapeMismatch {
            what: "vocab block (u32)",
            expected: u32::MAX as usize,
            got: vb,
        })?;
        let f = self.cache.function(&RING_DTP, "lce_narrow_rows_bf16")?;
        let mut l = self.stream.launch_builder(&f);
        l.arg(&mut *g).arg(&vb32);
        // SAFETY: `lce_narrow_rows_bf16(float*, u32)` matches; block r rewrites only row r of
        // `g` (`vb` floats from `r·vb`), and `g` holds `rows·vb` (checked above).
        unsafe { l.launch(per_row(rows)?) }.map_err(cuda_error("cuLaunchKernel(lce_narrow_rows_bf16)"))?;
        Ok(())
    }

    /// `dX_rows (c×d) += G (c×vb)·W_blk (vb×d)`: column-major `dXᵀ (d×c) += Wᵀ (d×vb)·Gᵀ (vb×c)`.
    /// With bf16 W, G is read as the bf16 rows [`narrow_rows`](Self::narrow_rows) left.
    pub fn dx<T: GemmElement>(
        &self,
        w: &CudaView<'_, T>,
        g: &CudaSlice<f32>,
        (c, vb, d): (usize, usize, usize),
        dx: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        need("w block (vb·d)", vb * d, w.len())?;
        need("dx rows (c·d)", c * d, dx.len())?;
        let (g, ldg) = T::gradient_operand(g, (c, vb))?;
        let n = cublasOperation_t::CUBLAS_OP_N;
        self.gemm(GemmCall {
            shape: GemmShape { op_a: n, op_b: n, m: d, n: c, k: vb },
            a: Operand { buf: w, ld: d },
            b: Operand { buf: &g, ld: ldg },
            c: Output { buf: dx, ld: d, beta: 1.0 },
        })
    }

    /// `dW_blk (vb×d) += Gᵀ (vb×c)·X_blk (c×d)`: column-major `dWᵀ (d×vb) += Xᵀ (d×c)·G (c×vb)`.
    /// With bf16 X, G is read as the bf16 rows [`narrow_rows`](Self::narrow_rows) left.
    pub fn dw<T: GemmElement>(
        &self,
        x: &CudaView<'_, T>,
        g: &CudaSlice<f32>,
        (c, vb, d): (usize, usize, usize),
        dw: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        need("x block (c·d)", c * d, x.len())?;
        need("dw rows (vb·d)", vb * d, dw.len())?;
        let (g, ldg) = T::gradient_operand(g, (c, vb))?;
        let (n, t) = (cublasOperation_t::CUBLAS_OP_N, cublasOperation_t::CUBLAS_OP_T);
        self.gemm(GemmCall {
            shape: GemmShape { op_a: n, op_b: t, m: d, n: vb, k: c },
            a: Operand { buf: x, ld: d },
            b: Operand { buf: &g, ld: ldg },
            c: Output { buf: dw, ld: d, beta: 1.0 },
        })
    }

    fn check_block(b: &LogitsBlock<'_, '_>) -> Result<()> {
        need("logits block (c·vb)", b.rows * b.vb, b.logits.len())?;
        need("targets (c)", b.rows, b.targets.len())?;
        if let Some(bias) = &b.bias {
            need("bias block (vb)", b.vb, bias.len())?;
        }
        Ok(())
    }

    /// Folds a raw logits block into the rows' statistics (`lce_fold`, one block per row).
    pub fn fold(&self, config: &Config, b: LogitsBlock<'_, '_>, mut s: StatsViews<'_>) -> Result<()> {
        Self::check_block(&b)?;
        for (what, len) in [("max", s.max.len()), ("target logit", s.target_logit.len())] {
            need(what, b.rows, len)?;
        }
        need("sum", b.rows, s.sum.len())?;
        need("logit sum", b.rows, s.logit_sum.len())?;
        if b.rows == 0 || b.vb == 0 {
            return Ok(());
        }
        let f = self.cache.function(&RING_DTP, "lce_fold")?;
        let (vb, v0, softcap) = (b.vb as u32, b.v0 as u32, softcap_arg(config.softcap));
        let smoothing = (config.label_smoothing != 0.0) as i32;
        let null = 0u64;
        let mut l = self.stream.launch_builder(&f);
        l.arg(&*b.logits).arg(&vb).arg(&v0);
        match &b.bias {
            Some(bias) => l.arg(bias),
            None => l.arg(&null),
        };
        l.arg(&softcap).arg(&b.targets).arg(&mut s.max).arg(&mut s.sum).arg(&mut s.target_logit);
        l.arg(&mut s.logit_sum).arg(&smoothing);
        let grid = per_row(b.rows)?;
        // SAFETY: `lce_fold(const float*, u32, u32, const float*, float, const u32*, float*,
        // double*, float*, double*, int)` matches the arguments in order (a null bias is a zero
        // pointer); block k reads logits row k, bias[0..vb), targets[k] and updates row k of the
        // statistics — all lengths checked above; 256 threads per block, a multiple of 32.
        unsafe { l.launch(grid) }.map_err(cuda_error("cuLaunchKernel(lce_fold)"))?;
        Ok(())
    }

    /// `lse[k] = M_k + ln S_k` of a token block's finished statistics (`lce_row_lse`).
    pub fn row_lse(
        &self,
        max: &CudaView<'_, f32>,
        sum: &CudaView<'_, f64>,
        lse: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let rows = lse.len();
        need("max (rows)", rows, max.len())?;
        need("sum (rows)", rows, sum.len())?;
        if rows == 0 {
            return Ok(());
        }
        let f = self.cache.function(&RING_DTP, "lce_row_lse")?;
        let rows32 = rows as u32;
        let mut l = self.stream.launch_builder(&f);
        l.arg(max).arg(sum).arg(&mut *lse).arg(&rows32);
        // SAFETY: `lce_row_lse(const float*, const double*, float*, u32)` matches; thread k reads
        // max[k] and sum[k] and writes lse[k] for k < rows, each at least `rows` long (checked).
        unsafe { l.launch(linear(rows, 1024)) }.map_err(cuda_error("cuLaunchKernel(lce_row_lse)"))?;
        Ok(())
    }

    /// Turns a raw logits block into its gradient in place (`lce_gradient`, one block per row),
    /// stored as `store` says.
    pub fn gradient(
        &self,
        (config, vocab): (&Config, usize),
        b: LogitsBlock<'_, '_>,
        rows: RowViews<'_>,
        store: GradientStore,
    ) -> Result<()> {
        Self::check_block(&b)?;
        need("coef (c)", b.rows, rows.coef.len())?;
        need("lse (c)", b.rows, rows.lse.len())?;
        if let Some(g) = &rows.dlse {
            need("dlse (c)", b.rows, g.len())?;
        }
        if b.rows == 0 || b.vb == 0 {
            return Ok(());
        }
        let f = self.cache.function(&RING_DTP, "lce_gradient")?;
        let (vb, v0, softcap) = (b.vb as u32, b.v0 as u32, softcap_arg(config.softcap));
        let (alpha, lambda, v64) = (config.label_smoothing, config.z_loss, vocab as u64);
        let null = 0u64;
        let mut l = self.stream.launch_builder(&f);
        l.arg(&mut *b.logits).arg(&vb).arg(&v0);
        match &b.bias {
            Some(bias) => l.arg(bias),
            None => l.arg(&null),
        };
        l.arg(&softcap).arg(&b.targets).arg(&rows.coef).arg(&rows.lse);
        match &rows.dlse {
            Some(g) => l.arg(g),
            None => l.arg(&null),
        };
        let store_bf16 = store.arg();
        l.arg(&alpha).arg(&lambda).arg(&v64).arg(&store_bf16);
        let grid = per_row(b.rows)?;
        // SAFETY: `lce_gradient(float*, u32, u32, const float*, float, const u32*, const float*,
        // const float*, const float*, float, float, u64, int)` matches the arguments (null bias
        // and dlse are zero pointers); block k rewrites logits row k only (as f32, or as bf16 in
        // the row's first half) and reads row k of targets, coef, lse and dlse — lengths checked
        // above; 256 threads per block.
        unsafe { l.launch(grid) }.map_err(cuda_error("cuLaunchKernel(lce_gradient)"))?;
        Ok(())
    }

    /// `dbias[0..vb) += Σ_k G[k][·]` over the block's rows, in row order.
    pub fn bias_grad(
        &self,
        g: &CudaSlice<f32>,
        (c, vb): (usize, usize),
        dbias: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        need("gradient block (c·vb)", c * vb, g.len())?;
        need("dbias block (vb)", vb, dbias.len())?;
        if vb == 0 {
            return Ok(());
        }
        let f = self.cache.function(&RING_DTP, "lce_bias_grad")?;
        let (c32, vb32) = (c as u32, vb as u32);
        let mut l = self.stream.launch_builder(&f);
        l.arg(g).arg(&c32).arg(&vb32).arg(dbias);
        // SAFETY: `lce_bias_grad(const float*, u32, u32, float*)` matches; it reads G (c×vb) and
        // updates dbias[0..vb) (grid-stride over columns) — lengths checked above.
        unsafe { l.launch(linear(vb, 1024)) }.map_err(cuda_error("cuLaunchKernel(lce_bias_grad)"))?;
        Ok(())
    }
}
