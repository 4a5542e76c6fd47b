//! The workspace's CPU GEMM: a checked, typed front to the `gemm` crate (AVX-512 kernels with
//! runtime detection via its `x86-v4` feature).
//!
//! `dst ← scale·(lhs · rhs)` ([`Accumulate::Replace`]) or `dst ← dst + scale·(lhs · rhs)`
//! ([`Accumulate::Add`]) on strided views, so transposes cost nothing. Shapes and strides are
//! checked against the slices before the unsafe call: a bad view is a typed error, never UB.
//!
//! ```
//! use flatpeak_common::gemm::{matmul, MatMut, MatRef, MatmulOptions};
//! let a = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]; // 2×3
//! let b = [1.0f32, 0.0, 0.0, 1.0, 1.0, 1.0]; // 3×2
//! let mut c = [0.0f32; 4];
//! matmul(
//!     MatMut::row_major(&mut c, 2, 2)?,
//!     MatRef::row_major(&a, 2, 3)?,
//!     MatRef::row_major(&b, 3, 2)?,
//!     MatmulOptions::default(),
//! )?;
//! assert_eq!(c, [4.0, 5.0, 10.0, 11.0]);
//! # Ok::<(), flatpeak_common::Error>(())
//! ```

use crate::error::{Error, Result};

/// Scalars the CPU GEMM supports (sealed): f32 and f64.
pub trait GemmScalar: Copy + Send + Sync + 'static + sealed::Sealed {
    /// Additive identity.
    const ZERO: Self;
    /// Multiplicative identity.
    const ONE: Self;
}
impl GemmScalar for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
}
impl GemmScalar for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
}
mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
}

/// Whether the product replaces or is added to the destination.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Accumulate {
    /// `dst ← scale·lhs·rhs`.
    #[default]
    Replace,
    /// `dst ← dst + scale·lhs·rhs`.
    Add,
}

/// How many threads one GEMM may use. The result is bitwise identical for every choice (the
/// `gemm` crate splits output tiles across threads, never the reduction dimension; tested).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Threads {
    /// The calling thread only.
    Single,
    /// Every thread of the current rayon pool.
    #[default]
    All,
    /// Exactly this many rayon threads.
    Exactly(usize),
}

/// Options of [`matmul`].
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub struct MatmulOptions<T = f32> {
    /// Replace or accumulate into `dst`.
    pub accumulate: Accumulate,
    /// Factor applied to the product.
    pub scale: T,
    /// Threading.
    pub threads: Threads,
}

impl<T: GemmScalar> Default for MatmulOptions<T> {
    fn default() -> Self {
        Self { accumulate: Accumulate::Replace, scale: T::ONE, threads: Threads::All }
    }
}

impl<T: GemmScalar> MatmulOptions<T> {
    /// Default options with the given accumulation mode.
    pub fn with_accumulate(accumulate: Accumulate) -> Self {
        Self { accumulate, ..Self::default() }
    }
    crate::setters! {
        /// These options on the given number of threads.
        threads: Threads,
        /// These options with the product scaled by `scale`.
        scale: T,
    }
}

/// Element `(i, j)` lives at `data[i·row_stride + j·col_stride]`.
#[derive(Debug, Clone, Copy)]
pub struct MatRef<'a, T> {
    data: &'a [T],
    layout: Layout,
}

/// Mutable strided view; see [`MatRef`].
#[derive(Debug)]
pub struct MatMut<'a, T> {
    data: &'a mut [T],
    layout: Layout,
}

/// Where a `rows × cols` view's elements live in its slice: `(i, j)` at
/// `i·row_stride + j·col_stride` (in elements).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Layout {
    rows: usize,
    cols: usize,
    row_stride: usize,
    col_stride: usize,
}

impl Layout {
    /// This layout, checked against a slice of `len` elements: every element's index lies
    /// inside it and both strides fit `isize` (what `gemm`'s pointer arithmetic needs).
    fn checked(len: usize, rows: usize, cols: usize, row_stride: usize, col_stride: usize) -> Result<Self> {
        let layout = Self { rows, cols, row_stride, col_stride };
        if layout.is_empty() {
            return Ok(layout);
        }
        let last = (rows - 1)
            .checked_mul(row_stride)
            .and_then(|r| (cols - 1).checked_mul(col_stride).and_then(|c| r.checked_add(c)))
            .ok_or(Error::SizeOverflow { what: "matrix view extent" })?;
        if last >= len || isize::try_from(row_stride).is_err() || isize::try_from(col_stride).is_err() {
            return Err(Error::ShapeMismatch { what: "matrix view extent", expected: last + 1, got: len });
        }
        Ok(layout)
    }

    /// This layout, if no two of its elements share an address (a destination's must not:
    /// they would race across threads), i.e. the larger stride steps over a whole run of the
    /// smaller.
    fn disjoint(self) -> Result<Self> {
        let Self { rows, cols, row_stride: rs, col_stride: cs } = self;
        let (inner, inner_len, outer, outer_len) =
            if cs <= rs { (cs, cols, rs, rows) } else { (rs, rows, cs, cols) };
        let inner_ok = inner_len <= 1 || inner >= 1;
        let outer_ok = outer_len <= 1 || outer >= inner.max(1) * inner_len;
        if self.is_empty() || (inner_ok && outer_ok) {
            Ok(self)
        } else {
            Err(Error::ShapeMismatch {
                what: "non-overlapping destination stride",
                expected: inner.max(1) * inner_len,
                got: outer,
            })
        }
    }

    fn is_empty(self) -> bool {
        self.rows == 0 || self.cols == 0
    }

    fn transposed(self) -> Self {
        Self { rows: self.cols, cols: self.rows, row_stride: self.col_stride, col_stride: self.row_stride }
    }
}

impl<'a, T> MatRef<'a, T> {
    /// A view with explicit strides (in elements).
    pub fn strided(
        data: &'a [T],
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Result<Self> {
        let layout = Layout::checked(data.len(), rows, cols, row_stride, col_stride)?;
        Ok(Self { data, layout })
    }
    /// A dense row-major `rows × cols` view.
    pub fn row_major(data: &'a [T], rows: usize, cols: usize) -> Result<Self> {
        Self::strided(data, rows, cols, cols, 1)
    }
    /// A dense column-major `rows × cols` view.
    pub fn col_major(data: &'a [T], rows: usize, cols: usize) -> Result<Self> {
        Self::strided(data, rows, cols, 1, rows)
    }
    /// The transpose, as a view (no copy).
    pub fn t(self) -> Self {
        Self { layout: self.layout.transposed(), ..self }
    }
    /// Rows.
    pub fn rows(&self) -> usize {
        self.layout.rows
    }
    /// Columns.
    pub fn cols(&self) -> usize {
        self.layout.cols
    }
    /// Rows `range` of this view, as a view of the same data (no copy).
    ///
    /// Errors with [`Error::ShapeMismatch`] unless `range.start ≤ range.end ≤ rows`.
    pub fn row_range(&self, range: std::ops::Range<usize>) -> Result<Self> {
        let Layout { rows, cols, row_stride, col_stride } = self.layout;
        if range.start > range.end || range.end > rows {
            return Err(Error::ShapeMismatch {
                what: "row range (start ≤ end ≤ rows)",
                expected: rows,
                got: range.end.max(range.start),
            });
        }
        let data = self.data.get(range.start * row_stride..).unwrap_or(&[]);
        Self::strided(data, range.len(), cols, row_stride, col_stride)
    }
    /// The checked view's parts: `(data, rows, cols, row_stride, col_stride)`.
    pub(crate) fn parts(&self) -> (&'a [T], usize, usize, usize, usize) {
        let Layout { rows, cols, row_stride, col_stride } = self.layout;
        (self.data, rows, cols, row_stride, col_stride)
    }
}

impl<'a, T> MatMut<'a, T> {
    /// A view with explicit strides (in elements).
    pub fn strided(
        data: &'a mut [T],
        rows: usize,
        cols: usize,
        row_stride: usize,
        col_stride: usize,
    ) -> Result<Self> {
        let layout = Layout::checked(data.len(), rows, cols, row_stride, col_stride)?.disjoint()?;
        Ok(Self { data, layout })
    }
    /// A dense row-major `rows × cols` view.
    pub fn row_major(data: &'a mut [T], rows: usize, cols: usize) -> Result<Self> {
        Self::strided(data, rows, cols, cols, 1)
    }
    /// A dense column-major `rows × cols` view.
    pub fn col_major(data: &'a mut [T], rows: usize, cols: usize) -> Result<Self> {
        Self::strided(data, rows, cols, 1, rows)
    }
    /// `(rows, cols)`.
    pub(crate) fn shape(&self) -> (usize, usize) {
        (self.layout.rows, self.layout.cols)
    }
    /// The checked view's parts: `(data, rows, cols, row_stride, col_stride)`.
    pub(crate) fn into_parts(self) -> (&'a mut [T], usize, usize, usize, usize) {
        let Layout { rows, cols, row_stride, col_stride } = self.layout;
        (self.data, rows, cols, row_stride, col_stride)
    }
}

/// `dst ← scale·lhs·rhs` or `dst += scale·lhs·rhs` (see [`MatmulOptions`]).
///
/// Errors with [`Error::ShapeMismatch`] unless `lhs` is m×k, `rhs` k×n and `dst` m×n.
pub fn matmul<T: GemmScalar>(
    dst: MatMut<'_, T>,
    lhs: MatRef<'_, T>,
    rhs: MatRef<'_, T>,
    options: MatmulOptions<T>,
) -> Result<()> {
    let (l, r, o) = (lhs.layout, rhs.layout, dst.layout);
    let (m, k, n) = (l.rows, l.cols, r.cols);
    for (what, expected, found) in
        [("rhs rows (k)", k, r.rows), ("dst rows (m)", m, o.rows), ("dst cols (n)", n, o.cols)]
    {
        if expected != found {
            return Err(Error::ShapeMismatch { what, expected, got: found });
        }
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if options.accumulate == Accumulate::Replace {
            for i in 0..m {
                for j in 0..n {
                    dst.data[i * o.row_stride + j * o.col_stride] = T::ZERO;
                }
            }
        }
        return Ok(());
    }
    let parallelism = match options.threads {
        Threads::Single | Threads::Exactly(0 | 1) => gemm::Parallelism::None,
        Threads::All => gemm::Parallelism::Rayon(rayon::current_num_threads()),
        Threads::Exactly(n) => gemm::Parallelism::Rayon(n),
    };
    let read_dst = options.accumulate == Accumulate::Add;
    // SAFETY: `Layout::checked` proved every index `i·rs + j·cs` of all three views lies inside
    // its slice and that the strides fit `isize`; the shapes agree (checked above); `dst` is a
    // unique borrow whose layout is `disjoint`, so no two output elements alias and it cannot
    // alias `lhs` or `rhs`. `gemm` computes `dst = alpha·dst + beta·lhs·rhs` (its argument order is
    // the reverse of BLAS), reading `dst` only when `read_dst`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.data.as_mut_ptr(),
            o.col_stride as isize,
            o.row_stride as isize,
            read_dst,
            lhs.data.as_ptr(),
            l.col_stride as isize,
            l.row_stride as isize,
            rhs.data.as_ptr(),
            r.col_stride as isize,
            r.row_stride as isize,
            T::ONE,
            options.scale,
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(m: usize, n: usize, k: usize, a: &[f64], b: &[f64]) -> Vec<f64> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| a[i * k + p] * b[p * n + j]).sum();
            }
        }
        c
    }

    fn data(len: usize, seed: u64) -> Vec<f32> {
        crate::rng::SplitMix64::new(seed).uniform_f32(len, -1.0, 1.0)
    }

    #[test]
    fn matches_naive_on_edge_shapes() {
        // Tails of the micro-kernel, empty and degenerate shapes, as gemm's own tests do.
        for &(m, n, k) in &[
            (1, 1, 1),
            (0, 5, 3),
            (4, 0, 3),
            (3, 4, 0),
            (63, 1, 10),
            (1, 63, 10),
            (17, 15, 33),
            (65, 67, 129),
        ] {
            let (a, b) = (data(m * k, 1), data(k * n, 2));
            let want = naive(
                m,
                n,
                k,
                &a.iter().map(|&x| x as f64).collect::<Vec<_>>(),
                &b.iter().map(|&x| x as f64).collect::<Vec<_>>(),
            );
            for acc in [Accumulate::Replace, Accumulate::Add] {
                let mut c = vec![0.5f32; m * n];
                let opts = MatmulOptions::with_accumulate(acc).scale(2.0);
                matmul(
                    MatMut::row_major(&mut c, m, n).unwrap(),
                    MatRef::row_major(&a, m, k).unwrap(),
                    MatRef::row_major(&b, k, n).unwrap(),
                    opts,
                )
                .unwrap();
                let base = if acc == Accumulate::Add { 0.5 } else { 0.0 };
                for (got, w) in c.iter().zip(&want) {
                    let exp = base + 2.0 * w;
                    assert!(
                        (*got as f64 - exp).abs() <= 1e-5 * (1.0 + exp.abs()) * (k as f64).sqrt().max(1.0),
                        "{m}x{n}x{k}: {got} vs {exp}"
                    );
                }
            }
        }
    }

    #[test]
    fn transposed_views_cost_no_copy() {
        let (m, n, k) = (5, 7, 3);
        let a = data(m * k, 3); // m×k row-major
        let b = data(k * n, 4); // k×n row-major
        let at = {
            let mut t = vec![0.0; k * m];
            for i in 0..m {
                for p in 0..k {
                    t[p * m + i] = a[i * k + p];
                }
            }
            t
        };
        let mut direct = vec![0.0f32; m * n];
        let mut via_t = vec![0.0f32; m * n];
        matmul(
            MatMut::row_major(&mut direct, m, n).unwrap(),
            MatRef::row_major(&a, m, k).unwrap(),
            MatRef::row_major(&b, k, n).unwrap(),
            MatmulOptions::default(),
        )
        .unwrap();
        matmul(
            MatMut::row_major(&mut via_t, m, n).unwrap(),
            MatRef::row_major(&at, k, m).unwrap().t(),
            MatRef::row_major(&b, k, n).unwrap(),
            MatmulOptions::default(),
        )
        .unwrap();
        assert_eq!(direct, via_t);
    }

    #[test]
    fn thread_count_does_not_change_bits() {
        let (m, n, k) = (257, 129, 515);
        let (a, b) = (data(m * k, 5), data(k * n, 6));
        let run = |threads| {
            let mut c = vec![0.0f32; m * n];
            matmul(
                MatMut::row_major(&mut c, m, n).unwrap(),
                MatRef::row_major(&a, m, k).unwrap(),
                MatRef::row_major(&b, k, n).unwrap(),
                MatmulOptions::default().threads(threads),
            )
            .unwrap();
            c
        };
        let single = run(Threads::Single);
        for t in [Threads::Exactly(2), Threads::Exactly(3), Threads::All] {
            assert!(single.iter().zip(run(t)).all(|(x, y)| x.to_bits() == y.to_bits()), "{t:?}");
        }
    }

    #[test]
    fn bad_views_are_typed_errors() {
        let a = vec![0.0f32; 6];
        assert!(matches!(MatRef::row_major(&a, 2, 4), Err(Error::ShapeMismatch { expected: 8, got: 6, .. })));
        let mut c = vec![0.0f32; 4];
        let err = matmul(
            MatMut::row_major(&mut c, 2, 2).unwrap(),
            MatRef::row_major(&a, 2, 3).unwrap(),
            MatRef::row_major(&a, 2, 3).unwrap(),
            MatmulOptions::default(),
        );
        assert_eq!(err.unwrap_err(), Error::ShapeMismatch { what: "rhs rows (k)", expected: 3, got: 2 });
        assert!(MatMut::strided(&mut c, 2, 2, 0, 1).is_err());
        let mut d = vec![0.0f32; 9];
        assert!(MatMut::strided(&mut d, 3, 3, 2, 1).is_err()); // (0,2) and (1,0) share an address
        assert!(MatMut::strided(&mut d, 3, 3, 1, 3).is_ok());
        assert!(MatMut::strided(&mut d, 1, 9, 0, 1).is_ok());
        assert!(MatRef::strided(&a, 2, 2, usize::MAX, 1).is_err());
    }

    #[test]
    fn row_ranges_are_views_of_the_same_elements() {
        let a: Vec<f32> = (0..24).map(|i| i as f32).collect();
        // 4 × 3, every other column of a 4 × 6 buffer.
        let view = MatRef::strided(&a, 4, 3, 6, 2).unwrap();
        let mid = view.row_range(1..3).unwrap();
        let (data, rows, cols, rs, cs) = mid.parts();
        assert_eq!((rows, cols, rs, cs), (2, 3, 6, 2));
        assert_eq!([data[0], data[2 * cs], data[rs + cs]], [6.0, 10.0, 14.0]);
        assert_eq!(view.t().row_range(2..3).unwrap().parts().0[0], 4.0);
        assert_eq!(view.row_range(4..4).unwrap().rows(), 0);
        let err = view.row_range(2..5).unwrap_err();
        assert_eq!(err, Error::ShapeMismatch { what: "row range (start ≤ end ≤ rows)", expected: 4, got: 5 });
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = view.row_range(3..1);
        assert!(reversed.is_err());
    }
}
