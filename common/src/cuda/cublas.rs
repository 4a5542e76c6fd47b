//! cuBLAS GEMMs: [`sgemm`] (f32, in the handle's math mode: true f32, or TF32 under
//! [`BlasMath::Tf32`](super::BlasMath)) and [`gemm_bf16`] (bf16 operands on the tensor cores,
//! f32 accumulation), each described by a
//! [`GemmShape`], two [`Operand`]s and an [`Output`]; and the square probes the benches measure a
//! device's GEMM rate with.

use cudarc::cublas::CudaBlas;
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use super::cuda_error;
use crate::error::{Error, Result};

/// The shape of a column-major GEMM `C (m×n) = op_a(A) (m×k) · op_b(B) (k×n) + β·C`, α = 1,
/// where `op` is the identity (`CUBLAS_OP_N`) or the transpose (`CUBLAS_OP_T`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmShape {
    /// How A is read.
    pub op_a: cublasOperation_t,
    /// How B is read.
    pub op_b: cublasOperation_t,
    /// Rows of C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// The inner dimension.
    pub k: usize,
}

/// A GEMM input, A or B: a device buffer and its leading dimension (elements from one column
/// to the next).
#[derive(Debug)]
pub struct Operand<'a, P> {
    /// The buffer.
    pub buf: &'a P,
    /// Its leading dimension.
    pub ld: usize,
}

/// A GEMM's C: a device buffer, its leading dimension, and β (how much of C's old values the
/// result keeps: 0 overwrites, 1 accumulates).
#[derive(Debug)]
pub struct Output<'a, P> {
    /// The buffer.
    pub buf: &'a mut P,
    /// Its leading dimension.
    pub ld: usize,
    /// β.
    pub beta: f32,
}

/// One GEMM call: its shape, its operands and its output.
#[derive(Debug)]
pub struct GemmCall<'a, A, B, C> {
    /// `C = op_a(A)·op_b(B) + β·C`, column-major.
    pub shape: GemmShape,
    /// A.
    pub a: Operand<'a, A>,
    /// B.
    pub b: Operand<'a, B>,
    /// C and β.
    pub c: Output<'a, C>,
}

/// cuBLAS's `i32` dimensions, checked.
struct Dims {
    m: i32,
    n: i32,
    k: i32,
    lda: i32,
    ldb: i32,
    ldc: i32,
}

/// The names a [`Dims`] error gives each dimension: SGEMM's, then `GemmEx`'s.
const SGEMM_DIMS: [&str; 6] = [
    "sgemm m (i32)",
    "sgemm n (i32)",
    "sgemm k (i32)",
    "sgemm lda (i32)",
    "sgemm ldb (i32)",
    "sgemm ldc (i32)",
];
const GEMM_EX_DIMS: [&str; 6] =
    ["gemm m (i32)", "gemm n (i32)", "gemm k (i32)", "gemm lda (i32)", "gemm ldb (i32)", "gemm ldc (i32)"];

impl Dims {
    /// The call's dimensions and leading dimensions (at least 1, as cuBLAS requires even
    /// of an empty operand) as `i32`, or [`Error::ShapeMismatch`] naming (from `names`) the one
    /// that does not fit.
    fn new<A, B, C>(names: [&'static str; 6], call: &GemmCall<'_, A, B, C>) -> Result<Self> {
        let (shape, lda, ldb, ldc) = (&call.shape, call.a.ld, call.b.ld, call.c.ld);
        let [m, n, k, name_lda, name_ldb, name_ldc] = names;
        let fit = |what: &'static str, value: usize| {
            i32::try_from(value).map_err(|_| Error::ShapeMismatch {
                what,
                expected: i32::MAX as usize,
                got: value,
            })
        };
        Ok(Self {
            m: fit(m, shape.m)?,
            n: fit(n, shape.n)?,
            k: fit(k, shape.k)?,
            lda: fit(name_lda, lda.max(1))?,
            ldb: fit(name_ldb, ldb.max(1))?,
            ldc: fit(name_ldc, ldc.max(1))?,
        })
    }
}

/// One cuBLAS SGEMM on `blas`'s stream: `C = op_a(A)·op_b(B) + β·C` as `call.shape` describes;
/// a no-op when `m` or `n` is 0. [`Error::ShapeMismatch`] when a dimension does not fit cuBLAS's
/// `i32`.
///
/// # Safety
///
/// `a`, `b` and `c` must hold the column-major extents the shape and leading dimensions imply
/// (`A`: `lda·k` elements for `op_a = N`, `lda·m` for `T`; likewise `B`; `C`: `ldc·n`),
/// belong to `blas`'s context, and be ordered on its stream after every earlier write to them;
/// `c` must not alias `a` or `b`.
pub unsafe fn sgemm<A, B, C>(blas: &CudaBlas, call: GemmCall<'_, A, B, C>) -> Result<()>
where
    A: DevicePtr<f32>,
    B: DevicePtr<f32>,
    C: DevicePtrMut<f32>,
{
    use cudarc::cublas::{Gemm, GemmConfig};
    if call.shape.m == 0 || call.shape.n == 0 {
        return Ok(());
    }
    let d = Dims::new(SGEMM_DIMS, &call)?;
    let GemmCall { shape, a, b, c } = call;
    let cfg = GemmConfig {
        transa: shape.op_a,
        transb: shape.op_b,
        m: d.m,
        n: d.n,
        k: d.k,
        alpha: 1.0f32,
        lda: d.lda,
        ldb: d.ldb,
        beta: c.beta,
        ldc: d.ldc,
    };
    // SAFETY: the caller guarantees the extents, context, stream order and non-aliasing this
    // GEMM needs (this function's `# Safety`); every dimension was checked to fit i32.
    unsafe { blas.gemm(cfg, a.buf, b.buf, c.buf) }.map_err(cuda_error("cublasSgemm"))
}

/// The element type of a [`gemm_bf16`]'s C: f32, or bf16 (the f32 result rounded once, to
/// nearest even; with β = 1 the stored C is widened and added before that rounding). Sealed.
pub trait Bf16GemmOutput: cudarc::driver::DeviceRepr + sealed::Sealed {
    /// cuBLAS's name for it.
    const CUDA_TYPE: cudarc::cublas::sys::cudaDataType_t;
}

impl Bf16GemmOutput for f32 {
    const CUDA_TYPE: cudarc::cublas::sys::cudaDataType_t = cudarc::cublas::sys::cudaDataType_t::CUDA_R_32F;
}

impl Bf16GemmOutput for half::bf16 {
    const CUDA_TYPE: cudarc::cublas::sys::cudaDataType_t = cudarc::cublas::sys::cudaDataType_t::CUDA_R_16BF;
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
}

/// bf16 operands of a [`gemm_bf16`]: cuBLAS `GemmEx` with `CUDA_R_16BF` A and B, a C of f32 or
/// bf16 ([`Bf16GemmOutput`]) and `CUBLAS_COMPUTE_32F` (tensor cores; each bf16 product exact,
/// sums in f32).
///
/// Column-major, as [`sgemm`]: `C = op_a(A)·op_b(B) + β·C` as `call.shape` describes, α = 1; a
/// no-op when `m` or `n` is 0; [`Error::ShapeMismatch`] when a dimension does not fit cuBLAS's
/// `i32`.
///
/// # Safety
///
/// As [`sgemm`] (extents, context, non-aliasing), with `A` and `B` bf16; besides, `blas` must
/// be bound to `stream` (every operand is ordered on it).
pub unsafe fn gemm_bf16<A, B, C, T>(
    blas: &CudaBlas,
    stream: &CudaStream,
    call: GemmCall<'_, A, B, C>,
) -> Result<()>
where
    A: DevicePtr<half::bf16>,
    B: DevicePtr<half::bf16>,
    C: DevicePtrMut<T>,
    T: Bf16GemmOutput,
{
    use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType_t};
    if call.shape.m == 0 || call.shape.n == 0 {
        return Ok(());
    }
    let d = Dims::new(GEMM_EX_DIMS, &call)?;
    let GemmCall { shape, a, b, c } = call;
    let (alpha, beta) = (1.0f32, c.beta);
    // The guards order each operand on `stream` (cudarc's per-buffer events) until they drop,
    // after the call.
    let (a_ptr, _a) = a.buf.device_ptr(stream);
    let (b_ptr, _b) = b.buf.device_ptr(stream);
    let (c_ptr, _c) = c.buf.device_ptr_mut(stream);
    // SAFETY: the caller guarantees the extents, context, stream binding, order and
    // non-aliasing this GEMM needs (this function's `# Safety`); every dimension fits i32, the
    // pointers are live device addresses held by the guards above, and α, β are f32 as
    // `CUBLAS_COMPUTE_32F` reads them.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            shape.op_a,
            shape.op_b,
            d.m,
            d.n,
            d.k,
            (&alpha as *const f32).cast(),
            a_ptr as *const std::ffi::c_void,
            cudaDataType_t::CUDA_R_16BF,
            d.lda,
            b_ptr as *const std::ffi::c_void,
            cudaDataType_t::CUDA_R_16BF,
            d.ldb,
            (&beta as *const f32).cast(),
            c_ptr as *mut std::ffi::c_void,
            T::CUDA_TYPE,
            d.ldc,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(cuda_error("cublasGemmEx(bf16)"))
}

/// An `n×n` square product's operands, the GEMM rate probes' input.
#[derive(Debug)]
pub struct SquareOperands<'a, T> {
    /// A, `n·n` elements.
    pub a: &'a CudaSlice<T>,
    /// B, `n·n` elements.
    pub b: &'a CudaSlice<T>,
}

/// `C = A·B` for `n×n` matrices with leading dimensions `n`, after checking that the three
/// buffers hold `n·n` elements each (a shortfall names the buffer by `names`: A, B, C).
fn square_call<'a, T, U>(
    names: [&'static str; 3],
    n: usize,
    ab: SquareOperands<'a, T>,
    c: &'a mut CudaSlice<U>,
) -> Result<GemmCall<'a, CudaSlice<T>, CudaSlice<T>, CudaSlice<U>>> {
    for (what, len) in names.into_iter().zip([ab.a.len(), ab.b.len(), c.len()]) {
        if Some(len) != n.checked_mul(n) {
            return Err(Error::ShapeMismatch { what, expected: n.saturating_mul(n), got: len });
        }
    }
    let op = cublasOperation_t::CUBLAS_OP_N;
    Ok(GemmCall {
        shape: GemmShape { op_a: op, op_b: op, m: n, n, k: n },
        a: Operand { buf: ab.a, ld: n },
        b: Operand { buf: ab.b, ld: n },
        c: Output { buf: c, ld: n, beta: 0.0 },
    })
}

/// `c = a·b` for `n×n` bf16 matrices into an f32 `c` with [`gemm_bf16`] (tensor cores, f32
/// accumulation): the bf16 counterpart of [`sgemm_square`], the ceiling a bf16 path's
/// `gemm_efficiency` is measured against on a GPU (2n³ FLOPs per call).
///
/// # Safety
///
/// `blas` must be bound to `stream` (created on it), and the three buffers belong to its context.
pub unsafe fn gemm_bf16_square(
    blas: &CudaBlas,
    stream: &CudaStream,
    n: usize,
    ab: SquareOperands<'_, half::bf16>,
    c: &mut CudaSlice<f32>,
) -> Result<()> {
    let call = square_call(["gemm a (n·n)", "gemm b (n·n)", "gemm c (n·n)"], n, ab, c)?;
    // SAFETY: a, b and c each hold exactly n·n elements (checked by `square_call`), the column-major
    // extents of an n×n×n product with leading dimensions n; `c` is a `&mut` borrow distinct
    // from `a` and `b`; the binding of `blas` to `stream` and the context are the caller's.
    unsafe { gemm_bf16(blas, stream, call) }
}

/// `c = a·b` for `n×n` f32 matrices with cuBLAS SGEMM on `blas`'s stream, in cuBLAS's default
/// math mode (true f32, no TF32): the device's GEMM rate probe, the ceiling `gemm_efficiency`
/// is measured against on a GPU (2n³ FLOPs per call).
pub fn sgemm_square(
    blas: &CudaBlas,
    n: usize,
    ab: SquareOperands<'_, f32>,
    c: &mut CudaSlice<f32>,
) -> Result<()> {
    let call = square_call(["sgemm a (n·n)", "sgemm b (n·n)", "sgemm c (n·n)"], n, ab, c)?;
    // SAFETY: a, b and c each hold exactly n·n floats (checked by `square_call`), the column-major extents
    // of an n×n×n product with leading dimensions n; all three belong to `blas`'s context, and
    // `c` is a `&mut` borrow distinct from `a` and `b`.
    unsafe { sgemm(blas, call) }
}
