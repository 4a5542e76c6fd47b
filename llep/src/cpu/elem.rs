//! The host backend's arithmetic over its two element types: f32 (accumulators, gradients,
//! routing weights, and every buffer of an f32 layer) and bf16 (the storage type of a bf16
//! layer: tokens, expert weights, dispatch rows, the expert scratch). Every kernel reads its
//! inputs widened to f32, computes in f32 and rounds once when it stores to a bf16 buffer
//! (round to nearest even, as `__float2bfloat16_rn` on a GPU), so an f32 layer runs exactly the
//! arithmetic it ran before bf16 existed.
//!
//! The GEMM of bf16 operands ([`gemm_bf16`]) multiplies on the CPU's bf16 instructions
//! ([`Bf16Gemm`](flatpeak_common::gemm_bf16::Bf16Gemm): AMX tiles or AVX512-BF16 dot products)
//! with f32 accumulation, or, on a CPU without them (or under [`Bf16Kernel::Widened`]), on f32
//! copies of the operands (each product of two bf16 values is exact in f32, so both paths
//! compute the same sums, in different orders). A bf16 C is computed in f32 in blocks of
//! [`STAGE_ROWS`] rows and rounded once; with [`Accumulate::Add`] the block of C is widened and
//! added before that one rounding.

use bytemuck::Pod;
use flatpeak_common::gemm::{Accumulate, MatMut, MatRef, MatmulOptions, Threads, matmul};
use flatpeak_common::gemm_bf16::Bf16Kernel;
use half::bf16;

use crate::device::{GemmDims, Orientation};
use crate::error::{Error, Result};

/// Rows of a bf16 C computed in f32 at once: the f32 staging of one such GEMM is
/// `STAGE_ROWS × n × 4` bytes, whatever m is.
pub const STAGE_ROWS: usize = 256;

/// An element the host kernels read and write: widened to f32 on load, rounded on store.
pub(crate) trait HostElem: Pod + Send + Sync {
    fn load(self) -> f32;
    fn store(v: f32) -> Self;
}

impl HostElem for f32 {
    #[inline(always)]
    fn load(self) -> f32 {
        self
    }
    #[inline(always)]
    fn store(v: f32) -> Self {
        v
    }
}

impl HostElem for bf16 {
    #[inline(always)]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline(always)]
    fn store(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

/// A host buffer's elements, read-only, by type.
#[derive(Debug, Clone, Copy)]
pub(crate) enum View<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
}

/// A host buffer's elements, writable, by type.
#[derive(Debug)]
pub(crate) enum ViewMut<'a> {
    F32(&'a mut [f32]),
    Bf16(&'a mut [bf16]),
}

impl View<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            View::F32(s) => s.len(),
            View::Bf16(s) => s.len(),
        }
    }
    pub(crate) fn dtype(&self) -> flatpeak_common::DType {
        match self {
            View::F32(_) => flatpeak_common::DType::F32,
            View::Bf16(_) => flatpeak_common::DType::Bf16,
        }
    }
}

/// Two buffers that must hold one type did not: [`Error::DtypeMismatch`].
pub(crate) fn mismatch(
    what: &'static str,
    expected: flatpeak_common::DType,
    found: flatpeak_common::DType,
) -> Error {
    Error::DtypeMismatch { what, expected, found }
}

/// The host index entries of a gather or scatter and its f32 routing-weight scale (none: 1).
pub(crate) type IndexScale<'a> = (&'a [u32], Option<&'a [f32]>);

/// `dst[r] = scale_r·src[index[r]]`, rows of `width` (lengths checked by the caller).
pub(crate) fn gather<T: HostElem>(
    src: &[T],
    index: &[u32],
    scale: Option<&[f32]>,
    width: usize,
    dst: &mut [T],
) {
    for (r, (out, &i)) in dst.chunks_exact_mut(width).zip(index).enumerate() {
        let row = &src[i as usize * width..][..width];
        match scale {
            None => out.copy_from_slice(row),
            Some(s) => {
                let w = s[r];
                out.iter_mut().zip(row).for_each(|(o, v)| *o = T::store(w * v.load()));
            }
        }
    }
}

/// `acc[index[r]] += scale_r·src[r]` for r in order, rows of `width`.
pub(crate) fn scatter_add<S: HostElem, A: HostElem>(
    src: &[S],
    index: &[u32],
    scale: Option<&[f32]>,
    width: usize,
    acc: &mut [A],
) {
    for (r, (row, &i)) in src.chunks_exact(width).zip(index).enumerate() {
        let out = &mut acc[i as usize * width..][..width];
        match scale {
            None => out.iter_mut().zip(row).for_each(|(o, v)| *o = A::store(o.load() + v.load())),
            Some(s) => {
                let w = s[r];
                out.iter_mut().zip(row).for_each(|(o, v)| *o = A::store(o.load() + w * v.load()));
            }
        }
    }
}

fn sigmoid(g: f32) -> f32 {
    1.0 / (1.0 + (-g).exp())
}

/// `h = silu(g) ⊙ u`.
pub(crate) fn swiglu<T: HostElem>(gate: &[T], up: &[T], h: &mut [T]) {
    for ((o, g), u) in h.iter_mut().zip(gate).zip(up) {
        let (g, u) = (g.load(), u.load());
        *o = T::store(g * sigmoid(g) * u);
    }
}

/// In place: `gate ← dh ⊙ up ⊙ silu'(gate)`, `up ← dh ⊙ silu(gate)`.
pub(crate) fn swiglu_backward<T: HostElem>(gate: &mut [T], up: &mut [T], dh: &[T]) {
    for ((g, u), d) in gate.iter_mut().zip(up.iter_mut()).zip(dh) {
        let (gv, uv, d) = (g.load(), u.load(), d.load());
        let s = sigmoid(gv);
        *g = T::store(d * uv * (s * (1.0 + gv * (1.0 - s))));
        *u = T::store(d * (gv * s));
    }
}

/// `out[r] = ⟨a_r, b_r⟩` in f64 partials, rows of `width`.
pub(crate) fn row_dot<T: HostElem>(a: &[T], b: &[T], width: usize, out: &mut [f32]) {
    for (r, o) in out.iter_mut().enumerate() {
        let (x, y) = (&a[r * width..][..width], &b[r * width..][..width]);
        *o = x.iter().zip(y).map(|(p, q)| p.load() as f64 * q.load() as f64).sum::<f64>() as f32;
    }
}

/// A GEMM operand on the host: storage, first element, orientation.
pub(crate) type Operand<'a, T> = (&'a [T], usize, Orientation);

/// Rows `r0..r0 + rows` of `op(A)` (`op(A)` is `m × k`, stored as `m × k` or, transposed, as
/// `k × m`), as a view.
fn op_rows<'a, T>(
    what: &'static str,
    (data, offset, orientation): Operand<'a, T>,
    (m, k): (usize, usize),
    (r0, rows): (usize, usize),
) -> Result<MatRef<'a, T>> {
    let stored = span(what, data, offset, m * k)?;
    Ok(match orientation {
        Orientation::AsStored => MatRef::row_major(&stored[r0 * k..(r0 + rows) * k], rows, k)?,
        Orientation::Transposed => MatRef::strided(&stored[r0..], rows, k, 1, m)?,
    })
}

/// Rows `r0..r0 + rows` of `op(X)` (`m × k`, as [`op_rows`]) widened into `out`, row-major
/// `rows × k`. The caller checked the extent with [`op_rows`].
fn widen_rows(
    (data, offset, orientation): Operand<'_, bf16>,
    (m, k): (usize, usize),
    (r0, rows): (usize, usize),
    out: &mut Vec<f32>,
) {
    out.clear();
    for i in r0..r0 + rows {
        match orientation {
            Orientation::AsStored => out.extend(data[offset + i * k..][..k].iter().map(|v| v.to_f32())),
            Orientation::Transposed => out.extend((0..k).map(|p| data[offset + p * m + i].to_f32())),
        }
    }
}

/// `C[c_offset..] (m×n) = op(A)·op(B)` (or `+=`) for bf16 `A`, `B`, C f32 or bf16, f32
/// accumulation, on `kernel`'s choice of bf16 GEMM: see the module docs.
pub(crate) fn gemm_bf16(
    GemmDims { m, n, k }: GemmDims,
    (a, b): (Operand<'_, bf16>, Operand<'_, bf16>),
    (c, c_offset): (ViewMut<'_>, usize),
    accumulate: Accumulate,
    (threads, kernel): (Threads, Bf16Kernel),
) -> Result<()> {
    if m == 0 || n == 0 {
        return Ok(());
    }
    let b_view = op_rows("gemm B (k·n)", b, (k, n), (0, k))?;
    op_rows("gemm A (m·k)", a, (m, k), (0, m))?;
    let options = MatmulOptions::with_accumulate(accumulate).threads(threads);
    let fast = kernel.select();
    // The fallback's f32 copy of B, made once per call.
    let b_wide: Vec<f32> = match fast {
        Some(_) => Vec::new(),
        None => {
            let mut v = Vec::with_capacity(k * n);
            widen_rows(b, (k, n), (0, k), &mut v);
            v
        }
    };
    let mut a_wide = Vec::new();
    // One block of f32 rows of C: the whole C when it is f32.
    let mut run =
        |dst: MatMut<'_, f32>, (r0, rows): (usize, usize), options: MatmulOptions<f32>| -> Result<()> {
            match fast {
                Some(gemm) => {
                    let a_rows = op_rows("gemm A (m·k)", a, (m, k), (r0, rows))?;
                    Ok(gemm.matmul(dst, a_rows, b_view, options)?)
                }
                None => {
                    widen_rows(a, (m, k), (r0, rows), &mut a_wide);
                    let a_rows = MatRef::row_major(&a_wide, rows, k)?;
                    Ok(matmul(dst, a_rows, MatRef::row_major(&b_wide, k, n)?, options)?)
                }
            }
        };
    match c {
        ViewMut::F32(c) => {
            let c = span_mut("gemm C (m·n)", c, c_offset, m * n)?;
            run(MatMut::row_major(c, m, n)?, (0, m), options)
        }
        ViewMut::Bf16(c) => {
            let c = span_mut("gemm C (m·n)", c, c_offset, m * n)?;
            let mut stage = vec![0f32; STAGE_ROWS.min(m) * n];
            for r0 in (0..m).step_by(STAGE_ROWS) {
                let rows = STAGE_ROWS.min(m - r0);
                let (block, stage) = (&mut c[r0 * n..(r0 + rows) * n], &mut stage[..rows * n]);
                if accumulate == Accumulate::Add {
                    stage.iter_mut().zip(block.iter()).for_each(|(s, v)| *s = v.to_f32());
                }
                run(MatMut::row_major(stage, rows, n)?, (r0, rows), options)?;
                block.iter_mut().zip(stage.iter()).for_each(|(v, s)| *v = bf16::from_f32(*s));
            }
            Ok(())
        }
    }
}

/// `v[at..at + len]`, or [`Error::ShapeMismatch`].
pub(crate) fn span<'a, T>(what: &'static str, v: &'a [T], at: usize, len: usize) -> Result<&'a [T]> {
    v.get(at..at + len).ok_or(Error::ShapeMismatch { what, expected: at + len, got: v.len() })
}

/// `v[at..at + len]` mutably, or [`Error::ShapeMismatch`].
pub(crate) fn span_mut<'a, T>(
    what: &'static str,
    v: &'a mut [T],
    at: usize,
    len: usize,
) -> Result<&'a mut [T]> {
    let found = v.len();
    v.get_mut(at..at + len).ok_or(Error::ShapeMismatch { what, expected: at + len, got: found })
}
