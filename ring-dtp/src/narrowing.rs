//! f32 gradients narrowed to bf16 as they finish, their f32 pages given back behind: how a
//! backward with bf16 outputs ([`Bf16GradientsMut`](crate::Bf16GradientsMut)) accumulates in
//! f32 without holding an f32 copy of both gradients next to the bf16 ones. A leaf of the
//! crate: the gradient buffers use it, it uses none of them.
//!
//! Rounding is to nearest even (`half::bf16::from_f32`), the rounding of torch's
//! `.to(torch.bfloat16)`, of the CUDA kernels' `__float2bfloat16_rn` and of the CPU's own
//! rounding of the logit gradient, so a bf16 output holds exactly `bf16(f32 gradient)`.

use std::sync::atomic::{AtomicUsize, Ordering};

use flatpeak_common::release_pages;
use half::bf16;
use rayon::prelude::*;

use crate::error::{Error, Result};

/// Elements one task narrows.
const NARROW_TASK: usize = 1 << 16;

/// Elements of dW narrowed at a time (4 MiB of f32), each chunk's f32 pages given back before
/// the next chunk of the bf16 output is written: narrowing never holds more than one chunk
/// beyond the accumulator it empties.
pub const DW_NARROW_CHUNK: usize = 1 << 20;

/// `out[i] = bf16(src[i])`, rounded to nearest even.
pub(crate) fn narrow(src: &[f32], out: &mut [bf16]) {
    out.par_chunks_mut(NARROW_TASK)
        .zip(src.par_chunks(NARROW_TASK))
        .for_each(|(o, s)| o.iter_mut().zip(s).for_each(|(o, &s)| *o = bf16::from_f32(s)));
}

/// Gives back the pages of `acc[..end]` that were not given back yet. `released` is where the
/// last call stopped (the start of the partial page its `end` fell in) and moves on to this
/// call's, so each page is given back once, whatever the blocks' sizes.
fn release_through(acc: &mut [f32], released: &mut usize, end: usize) {
    if end <= *released {
        return;
    }
    release_pages(&mut acc[*released..end]);
    // Elements of the partial page `end` falls in stay until a later call covers that page.
    let end_addr = acc.as_ptr() as usize + end * size_of::<f32>();
    let on_partial_page = (end_addr % flatpeak_common::page_bytes()) / size_of::<f32>();
    *released = end.saturating_sub(on_partial_page).max(*released);
}

/// dX's bf16 output, filled token block by token block as a backward finishes each block's rows
/// (in order), the f32 rows' pages given back behind: with blocks of C tokens, the f32
/// accumulator holds at most about one block of rows (C·D·4 bytes, and a page) at a time
/// instead of N·D·4.
#[derive(Debug)]
pub(crate) struct DxNarrowing<'a> {
    out: &'a mut [bf16],
    width: usize,
    /// Rows narrowed so far, read back by the caller once the backward returns.
    rows_done: &'a AtomicUsize,
    released: usize,
}

impl<'a> DxNarrowing<'a> {
    /// Narrowing into `out` (rows of `width`), counting the rows done in `rows_done` (from 0).
    pub(crate) fn new(out: &'a mut [bf16], width: usize, rows_done: &'a AtomicUsize) -> Self {
        rows_done.store(0, Ordering::Relaxed);
        Self { out, width, rows_done, released: 0 }
    }

    /// Rows `t0..t0 + c` of the f32 accumulator `acc` are final: narrowed into the output and
    /// their pages given back. Blocks come in order; one out of order is a driver bug.
    pub(crate) fn rows_done(&mut self, acc: &mut [f32], t0: usize, c: usize) -> Result<()> {
        let done = self.rows_done.load(Ordering::Relaxed);
        let (a, b) = (t0 * self.width, (t0 + c) * self.width);
        if t0 != done || b > acc.len() || b > self.out.len() {
            return Err(Error::internal("dX rows narrowed out of order or past the buffers"));
        }
        narrow(&acc[a..b], &mut self.out[a..b]);
        release_through(acc, &mut self.released, b);
        self.rows_done.store(t0 + c, Ordering::Relaxed);
        Ok(())
    }
}

/// `out = bf16(acc)`, [`DW_NARROW_CHUNK`] elements at a time, each chunk's f32 pages given back
/// as soon as it is narrowed: the accumulator shrinks in the resident set as the output grows.
pub(crate) fn narrow_releasing(acc: &mut [f32], out: &mut [bf16]) -> Result<()> {
    if acc.len() != out.len() {
        return Err(Error::internal("a narrowed gradient's accumulator and output differ in length"));
    }
    let mut released = 0;
    for start in (0..acc.len()).step_by(DW_NARROW_CHUNK) {
        let end = (start + DW_NARROW_CHUNK).min(acc.len());
        narrow(&acc[start..end], &mut out[start..end]);
        release_through(acc, &mut released, end);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize) -> Vec<f32> {
        let mut v: Vec<f32> =
            (0..n).map(|i| ((i as f32) * 0.7311).sin() * 1e3 / (1 + i % 37) as f32).collect();
        v[..5].copy_from_slice(&[
            1.0 + f32::EPSILON * 64.0,
            -f32::MAX,
            f32::INFINITY,
            f32::MIN_POSITIVE / 3.0,
            -0.0,
        ]);
        v
    }

    #[test]
    fn narrowing_rounds_each_value_to_nearest_even() {
        let src = values(200_003);
        let mut out = vec![bf16::ZERO; src.len()];
        narrow(&src, &mut out);
        assert!(out.iter().zip(&src).all(|(o, s)| o.to_bits() == bf16::from_f32(*s).to_bits()));
    }

    #[test]
    fn rows_narrow_in_order_once_each_and_refuse_any_other_order() {
        let (n, d) = (37, 300);
        let want = values(n * d);
        let mut acc = want.clone();
        let mut out = vec![bf16::ZERO; n * d];
        let done = AtomicUsize::new(99);
        let mut rows = DxNarrowing::new(&mut out, d, &done);
        for t0 in (0..n).step_by(8) {
            rows.rows_done(&mut acc, t0, 8.min(n - t0)).unwrap();
        }
        assert!(matches!(rows.rows_done(&mut acc, 0, 1), Err(Error::Internal { .. })));
        assert!(matches!(rows.rows_done(&mut acc, n, 1), Err(Error::Internal { .. })));
        assert_eq!(done.load(Ordering::Relaxed), n);
        assert!(out.iter().zip(&want).all(|(o, s)| o.to_bits() == bf16::from_f32(*s).to_bits()));
    }

    #[test]
    fn chunked_narrowing_covers_every_element_and_checks_lengths() {
        let want = values(DW_NARROW_CHUNK * 2 + 12_345);
        let mut acc = want.clone();
        let mut out = vec![bf16::ZERO; want.len()];
        narrow_releasing(&mut acc, &mut out).unwrap();
        assert!(out.iter().zip(&want).all(|(o, s)| o.to_bits() == bf16::from_f32(*s).to_bits()));
        assert!(matches!(narrow_releasing(&mut acc, &mut out[1..]), Err(Error::Internal { .. })));
    }
}
