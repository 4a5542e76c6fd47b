//! Reference layers for tests and benches.

use flatpeak_common::SplitMix64;
use flatpeak_common::gemm::{Accumulate, MatMut, MatRef, MatmulOptions, matmul};

use crate::error::Result;
use crate::stack::Layer;

/// A residual MLP block on S tokens of width H: `y = x + relu(x·W1)·W2`, W1: H×I, W2: I×H.
/// Parameter gradient layout: `[dW1 (H·I, row-major), dW2 (I·H, row-major)]`.
#[derive(Debug, Clone)]
pub struct ResidualMlp {
    tokens: usize,
    hidden: usize,
    inner: usize,
    w1: Vec<f32>,
    w2: Vec<f32>,
}

/// `dst (m×n) ← a·b` or `+=`, with a: m×k and b: k×n given as row-major views (or transposes).
fn mm(
    dst: &mut [f32],
    (m, n): (usize, usize),
    a: MatRef<'_, f32>,
    b: MatRef<'_, f32>,
    acc: Accumulate,
) -> Result<()> {
    matmul(MatMut::row_major(dst, m, n)?, a, b, MatmulOptions::with_accumulate(acc))?;
    Ok(())
}

fn view(data: &[f32], rows: usize, cols: usize) -> Result<MatRef<'_, f32>> {
    Ok(MatRef::row_major(data, rows, cols)?)
}

/// Checks a caller's buffer against the length the layer's shape calls for.
fn check(what: &'static str, expected: usize, found: usize) -> Result<()> {
    if expected == found {
        Ok(())
    } else {
        Err(flatpeak_common::Error::ShapeMismatch { what, expected, got: found }.into())
    }
}

impl ResidualMlp {
    /// A block with weights drawn from N(0, 1/fan_in), seeded.
    pub fn new(tokens: usize, hidden: usize, inner: usize, seed: u64) -> Self {
        let mut rng = SplitMix64::new(seed);
        let w1 = rng.normal_f32(hidden * inner, 0.0, (1.0 / hidden.max(1) as f32).sqrt());
        let w2 = rng.normal_f32(inner * hidden, 0.0, (1.0 / inner.max(1) as f32).sqrt());
        Self { tokens, hidden, inner, w1, w2 }
    }

    /// A block with the given weights, W1 (H×I) and W2 (I×H) row-major; a length that is not
    /// H·I is [`flatpeak_common::Error::ShapeMismatch`].
    pub fn from_weights(
        tokens: usize,
        hidden: usize,
        inner: usize,
        w1: Vec<f32>,
        w2: Vec<f32>,
    ) -> Result<Self> {
        check("W1 (H·I)", hidden * inner, w1.len())?;
        check("W2 (I·H)", inner * hidden, w2.len())?;
        Ok(Self { tokens, hidden, inner, w1, w2 })
    }

    /// Forward FLOPs of one call: two GEMMs of 2·S·H·I.
    pub fn forward_flops(&self) -> f64 {
        4.0 * (self.tokens * self.hidden * self.inner) as f64
    }

    fn pre_activation(&self, x: &[f32]) -> Result<Vec<f32>> {
        let (s, h, i) = (self.tokens, self.hidden, self.inner);
        check("layer input x", s * h, x.len())?;
        let mut pre = vec![0f32; s * i];
        mm(&mut pre, (s, i), view(x, s, h)?, view(&self.w1, h, i)?, Accumulate::Replace)?;
        Ok(pre)
    }

    fn finish_forward(&self, x: &[f32], pre: &[f32], y: &mut [f32]) -> Result<()> {
        let (s, h, i) = (self.tokens, self.hidden, self.inner);
        check("layer output y", s * h, y.len())?;
        let act: Vec<f32> = pre.iter().map(|&v| v.max(0.0)).collect();
        y.copy_from_slice(x);
        mm(y, (s, h), view(&act, s, i)?, view(&self.w2, i, h)?, Accumulate::Add)
    }
}

impl Layer for ResidualMlp {
    fn width(&self) -> usize {
        self.tokens * self.hidden
    }

    fn param_count(&self) -> usize {
        2 * self.hidden * self.inner
    }

    fn forward(&self, x: &[f32], y: &mut [f32]) -> Result<()> {
        let pre = self.pre_activation(x)?;
        self.finish_forward(x, &pre, y)
    }

    fn forward_saving(&self, x: &[f32], y: &mut [f32]) -> Result<Vec<f32>> {
        let pre = self.pre_activation(x)?;
        self.finish_forward(x, &pre, y)?;
        Ok(pre)
    }

    fn backward(
        &self,
        x: &[f32],
        saved: Option<&[f32]>,
        dy: &[f32],
        dx: &mut [f32],
        dparams: &mut [f32],
    ) -> Result<()> {
        let (s, h, i) = (self.tokens, self.hidden, self.inner);
        for (what, found) in [("layer dy", dy.len()), ("layer dx", dx.len())] {
            check(what, s * h, found)?;
        }
        check("layer dparams", self.param_count(), dparams.len())?;
        let recomputed;
        let pre = match saved {
            Some(p) => {
                check("saved internals", s * i, p.len())?;
                p
            }
            None => {
                recomputed = self.pre_activation(x)?;
                &recomputed
            }
        };
        let act: Vec<f32> = pre.iter().map(|&v| v.max(0.0)).collect();
        // d(act) = dy·W2ᵀ, then through the ReLU.
        let mut dpre = vec![0f32; s * i];
        mm(&mut dpre, (s, i), view(dy, s, h)?, view(&self.w2, i, h)?.t(), Accumulate::Replace)?;
        dpre.iter_mut().zip(pre).for_each(|(d, &p)| *d = if p > 0.0 { *d } else { 0.0 });
        // dx = dy + dpre·W1ᵀ (the residual passes dy through).
        dx.copy_from_slice(dy);
        mm(dx, (s, h), view(&dpre, s, i)?, view(&self.w1, h, i)?.t(), Accumulate::Add)?;
        let (dw1, dw2) = dparams.split_at_mut(h * i);
        mm(dw1, (h, i), view(x, s, h)?.t(), view(&dpre, s, i)?, Accumulate::Replace)?;
        mm(dw2, (i, h), view(&act, s, i)?.t(), view(dy, s, h)?, Accumulate::Replace)
    }
}

/// A layer with no compute to speak of, `y = x + 1`, for stressing the copies: its backward
/// checks that the boundary it was handed is the one forward saw (`x[j] = input[j] + layer`),
/// and counts a mismatch into its parameter gradient.
#[derive(Debug, Clone)]
pub struct AddOne {
    width: usize,
    index: usize,
}

impl AddOne {
    /// Layer `index` of a stack of width `width`.
    pub fn new(width: usize, index: usize) -> Self {
        Self { width, index }
    }
}

impl Layer for AddOne {
    fn width(&self) -> usize {
        self.width
    }
    fn param_count(&self) -> usize {
        1
    }
    fn forward(&self, x: &[f32], y: &mut [f32]) -> Result<()> {
        check("layer input x", self.width, x.len())?;
        check("layer output y", self.width, y.len())?;
        y.iter_mut().zip(x).for_each(|(y, &x)| *y = x + 1.0);
        Ok(())
    }
    fn forward_saving(&self, x: &[f32], y: &mut [f32]) -> Result<Vec<f32>> {
        self.forward(x, y)?;
        Ok(Vec::new())
    }
    fn backward(
        &self,
        x: &[f32],
        _saved: Option<&[f32]>,
        dy: &[f32],
        dx: &mut [f32],
        dparams: &mut [f32],
    ) -> Result<()> {
        for (what, found) in [("layer input x", x.len()), ("layer dy", dy.len()), ("layer dx", dx.len())] {
            check(what, self.width, found)?;
        }
        check("layer dparams", 1, dparams.len())?;
        // The stack's input is j (as f32) at element j, so x[j] must be j + index.
        let wrong = x.iter().enumerate().filter(|&(j, &v)| v != (j + self.index) as f32).count();
        dparams[0] = wrong as f32;
        dx.copy_from_slice(dy);
        Ok(())
    }
}
