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
//! [`stage_rows`] rows and rounded once; with [`Accumulate::Add`] the block of C is widened and
//! added before that one rounding.

use bytemuck::Pod;
use flatpeak_common::gemm::{Accumulate, MatMut, MatRef, MatmulOptions, Threads, matmul};
use flatpeak_common::gemm_bf16::Bf16Kernel;
use half::bf16;
use rayon::prelude::*;

use crate::device::{GemmDims, Orientation, PreAt};
use crate::error::{Error, Result};

/// Bytes of f32 staging a GEMM into a bf16 C may use for its rows ([`stage_rows`]).
pub const STAGE_BYTES: usize = 1 << 20;

/// Fewest rows of a bf16 C staged at once, whatever n is.
pub const MIN_STAGE_ROWS: usize = 256;

/// Rows of a bf16 C (`n` columns) computed in f32 at once: as many as [`STAGE_BYTES`] holds,
/// at least [`MIN_STAGE_ROWS`], so the staging of one GEMM is at most
/// `max(STAGE_BYTES, MIN_STAGE_ROWS × n × 4)` bytes whatever m is. Fewer, larger blocks pack B
/// fewer times: the expert GEMMs' n (the intermediate size) is often a few hundred.
pub fn stage_rows(n: usize) -> usize {
    (STAGE_BYTES / (4 * n.max(1))).max(MIN_STAGE_ROWS)
}

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

/// Elements a task of a row operation gets at least: below this, a split costs more than it
/// saves (measured: a rayon task's hand-off is some microseconds, 16K f32 elements of SwiGLU
/// take tens).
const MIN_ELEMENTS_PER_TASK: usize = 1 << 14;

/// Rows per task when `rows` rows of `width` elements are split on `threads`: all of them (one
/// task, on the calling thread) for [`Threads::Single`] or a small operation, else about four
/// tasks per thread ([`Threads::Exactly`]: one per thread), never fewer than
/// [`MIN_ELEMENTS_PER_TASK`] elements each. Each row is computed as it would be alone, so the
/// split never changes a result.
pub(crate) fn rows_per_task(threads: Threads, rows: usize, width: usize) -> usize {
    let tasks = match threads {
        Threads::Single => 1,
        Threads::All => 4 * rayon::current_num_threads(),
        Threads::Exactly(t) => t.max(1),
    };
    let min_rows = MIN_ELEMENTS_PER_TASK.div_ceil(width.max(1));
    rows.div_ceil(tasks).max(min_rows).max(1)
}

/// `dst[r] = scale_r·src[index[r]]` for the first `index.len()` rows of `width` (lengths
/// checked by the caller), the rows split on `threads` ([`rows_per_task`]).
pub(crate) fn gather<T: HostElem>(
    src: &[T],
    index: &[u32],
    scale: Option<&[f32]>,
    width: usize,
    dst: &mut [T],
    threads: Threads,
) {
    let rows = index.len().min(dst.len() / width.max(1));
    let per = rows_per_task(threads, rows, width);
    if per >= rows {
        return gather_rows(src, index, scale, width, dst);
    }
    let dst = &mut dst[..rows * width];
    dst.par_chunks_mut(per * width).enumerate().for_each(|(t, dst)| {
        let r = t * per..(t * per + dst.len() / width);
        gather_rows(src, &index[r.clone()], scale.map(|s| &s[r]), width, dst)
    });
}

fn gather_rows<T: HostElem>(src: &[T], index: &[u32], scale: Option<&[f32]>, width: usize, dst: &mut [T]) {
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

/// `acc[index[r]] += scale_r·src[r]` for r in order, rows of `width`. On `threads` the rows of
/// `acc` are split into blocks, each task adding (in the order of r) the source rows whose
/// index falls in its block: every row of `acc` receives its additions in the same order as
/// on one thread, so the sums are bitwise the same.
pub(crate) fn scatter_add<S: HostElem, A: HostElem>(
    src: &[S],
    index: &[u32],
    scale: Option<&[f32]>,
    width: usize,
    acc: &mut [A],
    threads: Threads,
) {
    let (rows, acc_rows) = (index.len().min(src.len() / width.max(1)), acc.len() / width.max(1));
    let per = rows_per_task(threads, acc_rows, width);
    if per >= acc_rows || rows_per_task(threads, rows, width) >= rows {
        return scatter_add_rows(src, index, scale, width, acc, 0);
    }
    let acc = &mut acc[..acc_rows * width];
    acc.par_chunks_mut(per * width)
        .enumerate()
        .for_each(|(t, block)| scatter_add_rows(src, &index[..rows], scale, width, block, t * per));
}

/// [`scatter_add`] into the rows `first..` of `acc` that `block` holds: the additions of the
/// source rows whose index falls there, in order (every index was checked below the number of
/// rows of `acc` by the caller).
fn scatter_add_rows<S: HostElem, A: HostElem>(
    src: &[S],
    index: &[u32],
    scale: Option<&[f32]>,
    width: usize,
    block: &mut [A],
    first: usize,
) {
    let held = first..first + block.len() / width.max(1);
    for (r, (row, &i)) in src.chunks_exact(width).zip(index).enumerate() {
        if !held.contains(&(i as usize)) {
            continue;
        }
        let out = &mut block[(i as usize - first) * width..][..width];
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

/// `h = silu(g) ⊙ u`, element by element (split on `threads`).
pub(crate) fn swiglu<T: HostElem>(gate: &[T], up: &[T], h: &mut [T], threads: Threads) {
    let per = rows_per_task(threads, h.len(), 1);
    if per >= h.len() {
        return swiglu_elements(gate, up, h);
    }
    h.par_chunks_mut(per)
        .zip(gate.par_chunks(per))
        .zip(up.par_chunks(per))
        .for_each(|((h, gate), up)| swiglu_elements(gate, up, h));
}

fn swiglu_elements<T: HostElem>(gate: &[T], up: &[T], h: &mut [T]) {
    for ((o, g), u) in h.iter_mut().zip(gate).zip(up) {
        let (g, u) = (g.load(), u.load());
        *o = T::store(g * sigmoid(g) * u);
    }
}

/// In place: `gate ← dh ⊙ up ⊙ silu'(gate)`, `up ← dh ⊙ silu(gate)`, element by element
/// (split on `threads`).
pub(crate) fn swiglu_backward<T: HostElem>(gate: &mut [T], up: &mut [T], dh: &[T], threads: Threads) {
    let per = rows_per_task(threads, dh.len(), 1);
    if per >= dh.len() {
        return swiglu_backward_elements(gate, up, dh);
    }
    gate.par_chunks_mut(per)
        .zip(up.par_chunks_mut(per))
        .zip(dh.par_chunks(per))
        .for_each(|((gate, up), dh)| swiglu_backward_elements(gate, up, dh));
}

fn swiglu_backward_elements<T: HostElem>(gate: &mut [T], up: &mut [T], dh: &[T]) {
    for ((g, u), d) in gate.iter_mut().zip(up.iter_mut()).zip(dh) {
        let (gv, uv, d) = (g.load(), u.load(), d.load());
        let s = sigmoid(gv);
        *g = T::store(d * uv * (s * (1.0 + gv * (1.0 - s))));
        *u = T::store(d * (gv * s));
    }
}

/// `h = silu(gate) ⊙ up` over the `h.len()` pre-activations of `gu` at `at` (checked by the
/// caller: [`PreAt::check`]), split on `threads`.
pub(crate) fn swiglu_at<T: HostElem>(gu: &[T], at: PreAt, h: &mut [T], threads: Threads) {
    let n = h.len();
    match at {
        PreAt::Split { gate, up } => swiglu(&gu[gate..gate + n], &gu[up..up + n], h, threads),
        PreAt::Fused { width } => {
            let per = rows_per_task(threads, n / width, width);
            h.par_chunks_mut(per * width).zip(gu.par_chunks(2 * per * width)).for_each(|(h, gu)| {
                for (h, row) in h.chunks_mut(width).zip(gu.chunks(2 * width)) {
                    let (gate, up) = row.split_at(width);
                    swiglu_elements(gate, up, h);
                }
            });
        }
    }
}

/// In place over the `dh.len()` pre-activations of `gu` at `at` (checked by the caller:
/// [`PreAt::check`]): `gate ← dh ⊙ up ⊙ silu'(gate)`, `up ← dh ⊙ silu(gate)`, split on
/// `threads`.
pub(crate) fn swiglu_backward_at<T: HostElem>(gu: &mut [T], at: PreAt, dh: &[T], threads: Threads) {
    let n = dh.len();
    match at {
        PreAt::Split { gate, up } => {
            let (gate, up) = if gate < up {
                let (a, b) = gu.split_at_mut(up);
                (&mut a[gate..gate + n], &mut b[..n])
            } else {
                let (a, b) = gu.split_at_mut(gate);
                (&mut b[..n], &mut a[up..up + n])
            };
            swiglu_backward(gate, up, dh, threads)
        }
        PreAt::Fused { width } => {
            let per = rows_per_task(threads, n / width, width);
            gu[..2 * n].par_chunks_mut(2 * per * width).zip(dh.par_chunks(per * width)).for_each(
                |(gu, dh)| {
                    for (row, dh) in gu.chunks_mut(2 * width).zip(dh.chunks(width)) {
                        let (gate, up) = row.split_at_mut(width);
                        swiglu_backward_elements(gate, up, dh);
                    }
                },
            );
        }
    }
}

/// `out[r] = ⟨a_r, b_r⟩` in f64 partials, rows of `width` (split on `threads`).
pub(crate) fn row_dot<T: HostElem>(a: &[T], b: &[T], width: usize, out: &mut [f32], threads: Threads) {
    let per = rows_per_task(threads, out.len(), width);
    if per >= out.len() {
        return row_dots(a, b, width, out);
    }
    out.par_chunks_mut(per).enumerate().for_each(|(t, out)| {
        let rows = t * per * width..(t * per + out.len()) * width;
        row_dots(&a[rows.clone()], &b[rows], width, out)
    });
}

fn row_dots<T: HostElem>(a: &[T], b: &[T], width: usize, out: &mut [f32]) {
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
            let stage_rows = stage_rows(n);
            let mut stage = vec![0f32; stage_rows.min(m) * n];
            for r0 in (0..m).step_by(stage_rows) {
                let rows = stage_rows.min(m - r0);
                let (block, stage) = (&mut c[r0 * n..(r0 + rows) * n], &mut stage[..rows * n]);
                let per = rows_per_task(threads, rows, n) * n;
                if accumulate == Accumulate::Add {
                    convert(&mut *stage, &*block, per, |s, v| *s = v.to_f32());
                }
                run(MatMut::row_major(stage, rows, n)?, (r0, rows), options)?;
                convert(block, &*stage, per, |v, s| *v = bf16::from_f32(*s));
            }
            Ok(())
        }
    }
}

/// `f(dst[e], src[e])` for every element, in pieces of `per` elements side by side (one piece:
/// on the calling thread).
fn convert<D: Send, S: Sync>(dst: &mut [D], src: &[S], per: usize, f: impl Fn(&mut D, &S) + Send + Sync) {
    if per >= dst.len() {
        dst.iter_mut().zip(src).for_each(|(d, s)| f(d, s));
    } else {
        dst.par_chunks_mut(per)
            .zip(src.par_chunks(per))
            .for_each(|(d, s)| d.iter_mut().zip(s).for_each(|(d, s)| f(d, s)));
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-2, 2) (bf16-exact: multiples of 1/64).
    fn values<T: HostElem>(n: usize, seed: u32) -> Vec<T> {
        (0..n as u32)
            .map(|i| {
                T::store(((i.wrapping_mul(2654435761).wrapping_add(seed) >> 7) % 256) as f32 / 64.0 - 2.0)
            })
            .collect()
    }

    fn bits<T: HostElem>(v: &[T]) -> Vec<u8> {
        bytemuck::cast_slice(v).to_vec()
    }

    /// Every row operation split on several threads is bitwise what it is on one (the sizes
    /// are past [`MIN_ELEMENTS_PER_TASK`], so the splits happen; the scatter's index repeats
    /// rows, so the order of its additions matters).
    fn split_matches_single<T: HostElem>() {
        let (rows, width, acc_rows) = (700, 96, 300);
        let src: Vec<T> = values(rows * width, 1);
        let index: Vec<u32> = (0..rows as u32).map(|r| r.wrapping_mul(7919) % acc_rows as u32).collect();
        let scale: Vec<f32> = values::<f32>(rows, 2);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        for threads in [Threads::All, Threads::Exactly(3), Threads::Exactly(5)] {
            pool.install(|| {
                assert!(rows_per_task(threads, rows, width) < rows, "{threads:?} splits");
                for s in [None, Some(&scale[..])] {
                    let gathered = |t| {
                        let mut dst = vec![T::store(0.0); rows * width];
                        gather(&src[..acc_rows * width], &index, s, width, &mut dst, t);
                        bits(&dst)
                    };
                    assert_eq!(gathered(threads), gathered(Threads::Single));
                    let scattered = |t| {
                        let mut acc: Vec<T> = values(acc_rows * width, 3);
                        scatter_add(&src, &index, s, width, &mut acc, t);
                        bits(&acc)
                    };
                    assert_eq!(scattered(threads), scattered(Threads::Single));
                }
                let (gate, up): (Vec<T>, Vec<T>) = (values(rows * width, 4), values(rows * width, 5));
                let swiglu_of = |t| {
                    let mut h = vec![T::store(0.0); rows * width];
                    swiglu(&gate, &up, &mut h, t);
                    bits(&h)
                };
                assert_eq!(swiglu_of(threads), swiglu_of(Threads::Single));
                let backward_of = |t| {
                    let (mut g, mut u) = (gate.clone(), up.clone());
                    swiglu_backward(&mut g, &mut u, &src, t);
                    (bits(&g), bits(&u))
                };
                assert_eq!(backward_of(threads), backward_of(Threads::Single));
                let dots = |t| {
                    let mut out = vec![0f32; rows];
                    row_dot(&gate, &up, width, &mut out, t);
                    bits(&out)
                };
                assert_eq!(dots(threads), dots(Threads::Single));
            });
        }
    }

    #[test]
    fn row_operations_split_bitwise_f32() {
        split_matches_single::<f32>();
    }

    #[test]
    fn row_operations_split_bitwise_bf16() {
        split_matches_single::<bf16>();
    }

    #[test]
    fn single_thread_and_small_operations_are_one_task() {
        assert_eq!(rows_per_task(Threads::Single, 10_000, 512), 10_000);
        assert_eq!(rows_per_task(Threads::Exactly(8), 16, 64), 256);
        assert_eq!(rows_per_task(Threads::Exactly(4), 4096, 512), 1024);
    }
}
