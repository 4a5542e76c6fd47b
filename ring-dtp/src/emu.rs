//! Emulated device path (feature `cuda-emu`): the device schedule of `crate::cuda` — resolve
//! targets, then per (token block, vocabulary block) a raw logits GEMM followed by the fold or
//! the gradient kernel, the dX/dW GEMMs and the bias-gradient kernel — with the `.cu` kernels
//! compiled as host C++ and run by the SIMT emulator under two thread schedules (a race is an
//! error), and the CPU GEMM in place of cuBLAS.

use flatpeak_common::emu::{EmuLaunchConfig, launch, launch_into, race_checked_state};
use flatpeak_common::gemm::{Accumulate, MatMut, MatRef};

use crate::blocks::{BlockAt, BlockOps, GradientInputs, Pass};
use crate::config::Config;
use crate::cpu::{self, gemm};
use crate::driver::{self, Call, Saved};
use crate::error::{Error, Result};
use crate::gradients::{GradientBuffers, Gradients, GradientsMut};
use crate::inputs::{Forward, GradOutput, Inputs, Matrix, Upstream};
use crate::kernels::{GradientStore, NO_TARGET, softcap_arg};
use crate::loss::Stats;
use crate::plan::Plan;

mod ffi {
    unsafe extern "C" {
        pub fn lce_resolve_targets(
            targets: *const i64,
            n_targets: u64,
            n: u64,
            shift: u64,
            ignore_index: i64,
            vocab: u64,
            resolved: *mut u32,
            first_bad: *mut u64,
        );
        pub fn lce_fold(
            logits: *const f32,
            vb: u32,
            v0: u32,
            bias: *const f32,
            softcap: f32,
            targets: *const u32,
            row_max: *mut f32,
            row_sum: *mut f64,
            target_logit: *mut f32,
            logit_sum: *mut f64,
            smoothing: i32,
        );
        pub fn lce_gradient(
            logits: *mut f32,
            vb: u32,
            v0: u32,
            bias: *const f32,
            softcap: f32,
            targets: *const u32,
            coef: *const f32,
            lse: *const f32,
            dlse: *const f32,
            alpha: f32,
            lambda: f32,
            vocab: u64,
            store_bf16: i32,
        );
        pub fn lce_row_lse(row_max: *const f32, row_sum: *const f64, lse: *mut f32, rows: u32);
        pub fn lce_bias_grad(g: *const f32, rows: u32, vb: u32, dbias: *mut f32);
        pub fn lce_widen_bf16(x: *const half::bf16, out: *mut f32, n: u64);
        pub fn lce_narrow_rows_bf16(g: *mut f32, vb: u32);
        pub fn lce_round_bf16(g: *mut f32, n: u64);
    }
}

/// Threads per block of an emulated per-row launch (every CUDA thread is a fiber here; the
/// kernels take any multiple of 32).
const EMU_ROW_THREADS: u32 = 64;
/// Blocks of an emulated grid-stride launch.
const EMU_MAX_BLOCKS: u32 = 4;

fn bytes_of<T: bytemuck::Pod>(parts: &[&[T]]) -> Vec<u8> {
    parts.iter().flat_map(|p| bytemuck::cast_slice::<T, u8>(p).iter().copied()).collect()
}

/// Resolves every row's target (with shift and ignore_index) and checks every target against
/// 0..V: [`Error::TargetOutOfRange`] names the first bad one.
pub fn resolve_targets(config: &Config, inputs: &Inputs<'_>) -> Result<Vec<u32>> {
    let (n, nt) = (inputs.n, inputs.targets.len());
    let cfg = EmuLaunchConfig::grid_stride(n.max(nt), EMU_MAX_BLOCKS);
    let mut state = (vec![NO_TARGET; n], [u64::MAX]);
    race_checked_state(
        "lce_resolve_targets",
        &mut state,
        |(r, b)| [bytes_of(&[r]), bytes_of(&[b])].concat(),
        |schedule, (resolved, first_bad)| {
            let (resolved, first_bad) = (resolved.as_mut_ptr(), first_bad.as_mut_ptr());
            let call = || {
                // SAFETY: `targets` has `nt` entries, `resolved` `n`, `first_bad` one; the kernel
                // touches nothing else (grid-stride over max(n, nt)).
                unsafe {
                    ffi::lce_resolve_targets(
                        inputs.targets.as_ptr(),
                        nt as u64,
                        n as u64,
                        config.shift as u64,
                        config.ignore_index,
                        inputs.v as u64,
                        resolved,
                        first_bad,
                    )
                }
            };
            // SAFETY: see `call`; its blocks are whole warps (LINEAR_THREADS).
            unsafe { launch("lce_resolve_targets", &cfg, schedule, &call) }.map_err(Error::from)
        },
    )?;
    let (resolved, [first_bad]) = state;
    if first_bad != u64::MAX {
        let token = first_bad as usize;
        return Err(Error::TargetOutOfRange { token, target: inputs.targets[token], vocab: inputs.v });
    }
    Ok(resolved)
}

/// `out[..rows·d] = m[rows]` as f32: the bf16 upcast kernel, or a copy of f32 rows.
fn widen_rows(m: &Matrix<'_>, rows: std::ops::Range<usize>, d: usize, out: &mut [f32]) -> Result<()> {
    let len = rows.len() * d;
    let src = match m {
        Matrix::F32(s) => {
            out[..len].copy_from_slice(&s[rows.start * d..rows.end * d]);
            return Ok(());
        }
        Matrix::Bf16(s) => &s[rows.start * d..rows.end * d],
    };
    let cfg = EmuLaunchConfig::grid_stride(len, EMU_MAX_BLOCKS);
    // SAFETY: `src` and `out[..len]` both hold `len` elements; thread i writes out[i] only.
    Ok(unsafe {
        launch_into("lce_widen_bf16", &cfg, &mut out[..len], |dst| {
            ffi::lce_widen_bf16(src.as_ptr(), dst, len as u64)
        })
    }?)
}

/// Raw `logits (c×vb) = X_blk·W_blkᵀ` (the epilogue is in the kernels).
fn raw_logits(x: &[f32], w: &[f32], (c, vb, d): (usize, usize, usize), out: &mut [f32]) -> Result<()> {
    gemm(
        MatMut::row_major(&mut out[..c * vb], c, vb)?,
        MatRef::row_major(&x[..c * d], c, d)?,
        MatRef::row_major(&w[..vb * d], vb, d)?.t(),
        Accumulate::Replace,
    )
}

/// One block's view for the per-row kernels.
struct Block<'a> {
    logits: &'a mut [f32],
    targets: &'a [u32],
    bias: Option<&'a [f32]>,
    v0: usize,
    vb: usize,
}

fn fold_block(config: &Config, b: Block<'_>, stats: &mut Stats, t0: usize) -> Result<()> {
    let c = b.targets.len();
    let cfg = EmuLaunchConfig::linear(c as u32, EMU_ROW_THREADS);
    let mut state = (
        stats.max[t0..t0 + c].to_vec(),
        stats.sum[t0..t0 + c].to_vec(),
        stats.target_logit[t0..t0 + c].to_vec(),
        stats.logit_sum[t0..t0 + c].to_vec(),
    );
    let softcap = softcap_arg(config.softcap);
    let bias = b.bias.map_or(std::ptr::null(), |s| s.as_ptr());
    let logits = &*b.logits;
    race_checked_state(
        "lce_fold",
        &mut state,
        |(m, s, t, z)| [bytes_of(&[m, t]), bytes_of(&[s, z])].concat(),
        |schedule, (m, s, t, z)| {
            let (m, s, t, z) = (m.as_mut_ptr(), s.as_mut_ptr(), t.as_mut_ptr(), z.as_mut_ptr());
            let call = || {
                // SAFETY: `logits` holds c×vb floats, `bias` vb (or is null), `targets` and the
                // four statistics c rows: block k touches row k only.
                unsafe {
                    ffi::lce_fold(
                        logits.as_ptr(),
                        b.vb as u32,
                        b.v0 as u32,
                        bias,
                        softcap,
                        b.targets.as_ptr(),
                        m,
                        s,
                        t,
                        z,
                        (config.label_smoothing != 0.0) as i32,
                    )
                }
            };
            // SAFETY: see `call`; one block per row of EMU_ROW_THREADS (a multiple of 32).
            unsafe { launch("lce_fold", &cfg, schedule, &call) }.map_err(Error::from)
        },
    )?;
    stats.max[t0..t0 + c].copy_from_slice(&state.0);
    stats.sum[t0..t0 + c].copy_from_slice(&state.1);
    stats.target_logit[t0..t0 + c].copy_from_slice(&state.2);
    stats.logit_sum[t0..t0 + c].copy_from_slice(&state.3);
    Ok(())
}

/// Per-row inputs of the gradient kernel.
struct RowGrad<'a> {
    coef: &'a [f32],
    lse: &'a [f32],
    dlse: Option<&'a [f32]>,
    vocab: usize,
}

fn gradient_block(config: &Config, b: Block<'_>, rows: RowGrad<'_>, store: GradientStore) -> Result<()> {
    let c = b.targets.len();
    let cfg = EmuLaunchConfig::linear(c as u32, EMU_ROW_THREADS);
    let softcap = softcap_arg(config.softcap);
    let bias = b.bias.map_or(std::ptr::null(), |s| s.as_ptr());
    let dlse = rows.dlse.map_or(std::ptr::null(), |s| s.as_ptr());
    // SAFETY: the logits hold c×vb floats, `bias` vb (or null), `targets`, `coef`, `lse` and
    // `dlse` (or null) c rows: block k touches row k only (f32, or bf16 in its first half), and
    // writes only the logits.
    Ok(unsafe {
        launch_into("lce_gradient", &cfg, &mut b.logits[..c * b.vb], |g| {
            ffi::lce_gradient(
                g,
                b.vb as u32,
                b.v0 as u32,
                bias,
                softcap,
                b.targets.as_ptr(),
                rows.coef.as_ptr(),
                rows.lse.as_ptr(),
                dlse,
                config.label_smoothing,
                config.z_loss,
                rows.vocab as u64,
                store.arg(),
            )
        })
    }?)
}

/// `lse[k] = M_k + ln S_k` of a token block's finished statistics (`lce_row_lse`).
fn row_lse(stats: &Stats, t0: usize, lse: &mut [f32]) -> Result<()> {
    let rows = lse.len();
    let cfg = EmuLaunchConfig::grid_stride(rows, EMU_MAX_BLOCKS);
    let (max, sum) = (&stats.max[t0..t0 + rows], &stats.sum[t0..t0 + rows]);
    // SAFETY: `max`, `sum` and `lse` hold `rows` entries; thread k writes lse[k] only.
    Ok(unsafe {
        launch_into("lce_row_lse", &cfg, lse, |out| {
            ffi::lce_row_lse(max.as_ptr(), sum.as_ptr(), out, rows as u32)
        })
    }?)
}

fn bias_grad(g: &[f32], (c, vb): (usize, usize), dbias: &mut [f32]) -> Result<()> {
    let cfg = EmuLaunchConfig::grid_stride(vb, EMU_MAX_BLOCKS);
    // SAFETY: `g` holds c×vb floats, `dbias[..vb]` vb; thread j writes column j only.
    Ok(unsafe {
        launch_into("lce_bias_grad", &cfg, &mut dbias[..vb], |db| {
            ffi::lce_bias_grad(g.as_ptr(), c as u32, vb as u32, db)
        })
    }?)
}

/// Block buffers of the device schedule: the plan's logits block ([`Plan::device_regions`]),
/// and X and W blocks as f32 for the CPU GEMM standing in for cuBLAS (which reads f32 and bf16
/// inputs in place, or the widened blocks).
struct Buffers {
    logits: Vec<f32>,
    x: Vec<f32>,
    w: Vec<f32>,
}

impl Buffers {
    fn new(plan: &Plan) -> Self {
        let (c, vb, d) = (plan.token_block(), plan.vocab_block(), plan.hidden());
        Self { logits: vec![0.0; plan.device_regions().logits], x: vec![0.0; c * d], w: vec![0.0; vb * d] }
    }
}

/// The device schedule under the emulator, as a backend of the block schedule
/// ([`crate::blocks`]): X and W blocks widened by the widening kernel, raw logits by a CPU GEMM
/// standing in for cuBLAS, then the fold, row-lse, gradient and bias-gradient kernels.
struct EmuBlocks<'a, 'g> {
    config: &'a Config,
    inputs: &'a Inputs<'a>,
    targets: Vec<u32>,
    buf: Buffers,
    stats: Option<Stats>,
    /// The fused pass's lse of every row.
    lse: Vec<f32>,
    grads: Option<GradientsMut<'g>>,
}

impl<'a, 'g> EmuBlocks<'a, 'g> {
    /// Checks the call, resolving every target by the kernel (as on the device); `grads`
    /// receives a backward's gradients.
    fn open(call: Call<'a>, grads: Option<GradientsMut<'g>>) -> Result<Self> {
        let Call { config, plan, rows: inputs } = call;
        config.check_host_precision(inputs.x.dtype(), "the emulated device")?;
        driver::check_call(config, plan, inputs.sizes(), grads.as_ref().map(GradientsMut::lens))?;
        driver::check_rows(inputs)?;
        let targets = resolve_targets(config, inputs)?;
        Ok(Self { config, inputs, targets, buf: Buffers::new(plan), stats: None, lse: Vec::new(), grads })
    }

    /// Whether the GEMMs the CPU's stand in for are bf16 ones (G rounded to bf16 first).
    fn bf16_gemms(&self) -> bool {
        let (x, w) = (self.inputs.x.dtype(), self.inputs.w.dtype());
        x == w && cpu::rounds_gradient(self.config, x)
    }

    /// How the gradient kernel stores G, as the CUDA path chooses it.
    fn gradient_store(&self) -> GradientStore {
        GradientStore::for_block(self.bf16_gemms(), self.grads.as_ref().is_some_and(|g| g.dbias.is_some()))
    }
}

/// Block `at`'s view for the per-row kernels.
fn block<'b>(logits: &'b mut [f32], targets: &'b [u32], inputs: &Inputs<'b>, at: BlockAt) -> Block<'b> {
    Block {
        logits,
        targets: &targets[at.t0..at.t0 + at.c],
        bias: inputs.bias.map(|b| &b[at.v0..at.v0 + at.vb]),
        v0: at.v0,
        vb: at.vb,
    }
}

/// A pass's state (`what`) read before the pass set it: a bug in the block driver.
fn missing(what: &'static str) -> Error {
    Error::internal(what)
}

impl BlockOps for EmuBlocks<'_, '_> {
    fn begin(&mut self, pass: Pass, _gradient: Option<&GradientInputs<'_>>) -> Result<()> {
        let n = self.inputs.n;
        self.stats = (pass != Pass::Backward).then(|| Stats::new(n));
        self.lse = vec![0.0; if pass == Pass::Fused { n } else { 0 }];
        if pass != Pass::Forward {
            // The GEMMs and the bias-gradient kernel add into the gradients.
            self.grads.as_mut().ok_or_else(|| missing("gradients"))?.fill_zero();
        }
        Ok(())
    }

    fn load_tokens(&mut self, t0: usize, c: usize) -> Result<()> {
        widen_rows(&self.inputs.x, t0..t0 + c, self.inputs.d, &mut self.buf.x)
    }

    fn load_vocab(&mut self, v0: usize, vb: usize) -> Result<()> {
        widen_rows(&self.inputs.w, v0..v0 + vb, self.inputs.d, &mut self.buf.w)
    }

    fn logits(&mut self, at: BlockAt) -> Result<()> {
        raw_logits(&self.buf.x, &self.buf.w, (at.c, at.vb, self.inputs.d), &mut self.buf.logits)
    }

    fn fold(&mut self, at: BlockAt) -> Result<()> {
        let Self { config, inputs, targets, buf, stats, .. } = self;
        let stats = stats.as_mut().ok_or_else(|| missing("fold stats"))?;
        fold_block(config, block(&mut buf.logits, targets, inputs, at), stats, at.t0)
    }

    fn row_lse(&mut self, at: BlockAt) -> Result<()> {
        let stats = self.stats.as_ref().ok_or_else(|| missing("fold stats"))?;
        row_lse(stats, at.t0, &mut self.lse[at.t0..at.t0 + at.c])
    }

    fn gradient(&mut self, at: BlockAt, pass: Pass, g: &GradientInputs<'_>) -> Result<()> {
        let (t0, c) = (at.t0, at.c);
        let store = self.gradient_store();
        let Self { config, inputs, targets, buf, lse, .. } = self;
        let rows = RowGrad {
            coef: &g.coef[t0..t0 + c],
            lse: if pass == Pass::Fused { &lse[t0..t0 + c] } else { &g.saved_lse[t0..t0 + c] },
            dlse: if pass == Pass::Fused { None } else { g.dlse.map(|g| &g[t0..t0 + c]) },
            vocab: inputs.v,
        };
        gradient_block(config, block(&mut buf.logits, targets, inputs, at), rows, store)
    }

    fn project(&mut self, at: BlockAt) -> Result<()> {
        let rounding = match self.gradient_store() {
            // The gradient kernel left bf16 rows: widened back for the CPU GEMM.
            GradientStore::Bf16Rows => Rounding::Widen,
            GradientStore::F32 if self.bf16_gemms() => Rounding::NarrowAfterBias,
            GradientStore::F32 => Rounding::None,
        };
        let grads = self.grads.as_mut().ok_or_else(|| missing("gradients"))?;
        project_block(&mut self.buf, (at.t0, at.c, at.v0, at.vb, self.inputs.d), grads, rounding)
    }

    fn token_rows_done(&mut self, t0: usize, c: usize) -> Result<()> {
        self.grads.as_mut().ok_or_else(|| missing("gradients"))?.token_rows_done(t0, c)
    }

    fn take_stats(&mut self) -> Result<Stats> {
        self.stats.take().ok_or_else(|| missing("fold stats"))
    }
}

/// The loss and per-row lse by the device schedule (fold kernel per block).
pub fn forward(plan: &Plan, inputs: &Inputs<'_>) -> Result<Forward> {
    let call = Call::new(plan, inputs);
    driver::forward(&mut EmuBlocks::open(call, None)?, call)
}

/// dX, dW (and dbias) by the device schedule from forward's per-row `lse`, into caller-owned
/// buffers `out` (overwritten; fp32 or bf16): recompute each block's raw logits, the gradient
/// kernel, then `dX += G·W_blk`, `dW_blk += Gᵀ·X_blk` and the bias-gradient kernel. Only the
/// gradients `out`'s selection wants are computed: a skipped dX or dW has no GEMM.
pub fn backward_into(
    plan: &Plan,
    inputs: &Inputs<'_>,
    lse: &[f32],
    upstream: Upstream<'_>,
    out: impl GradientBuffers,
) -> Result<()> {
    let call = Call::new(plan, inputs);
    let saved = Saved::of(lse, upstream);
    out.write_f32((inputs.n, inputs.d, inputs.v), inputs.bias.is_some(), |out| {
        driver::backward(&mut EmuBlocks::open(call, Some(out))?, call, saved)
    })
}

/// How a block's G reaches the bf16 GEMMs the CPU GEMM stands in for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rounding {
    /// f32 GEMMs: G as the gradient kernel left it.
    None,
    /// The gradient kernel stored bf16 rows ([`GradientStore::Bf16Rows`]): widened in place.
    Widen,
    /// f32 G summed into dbias, then rounded by `lce_narrow_rows_bf16`.
    NarrowAfterBias,
}

/// `dX_rows += G·W_blk`, `dW_blk += Gᵀ·X_blk` and the bias-gradient kernel, G being the
/// gradient block in `buf.logits`; each only for a gradient `grads` computes.
fn project_block(
    buf: &mut Buffers,
    (t0, c, v0, vb, d): (usize, usize, usize, usize, usize),
    grads: &mut GradientsMut<'_>,
    rounding: Rounding,
) -> Result<()> {
    // dbias sums the f32 G; bf16 inputs then narrow G to bf16 (unless Precision::F32), as the
    // CUDA path does before its bf16 GEMMs.
    if let Some(db) = grads.dbias.as_mut() {
        bias_grad(&buf.logits, (c, vb), &mut db[v0..v0 + vb])?;
    }
    match rounding {
        Rounding::None => {}
        Rounding::Widen => widen_bf16_rows(&mut buf.logits, (c, vb)),
        Rounding::NarrowAfterBias => narrow_rows(&mut buf.logits, (c, vb))?,
    }
    let g = MatRef::row_major(&buf.logits[..c * vb], c, vb)?;
    if grads.wanted.dx.is_computed() {
        let w_blk = MatRef::row_major(&buf.w[..vb * d], vb, d)?;
        gemm(MatMut::row_major(&mut grads.dx[t0 * d..(t0 + c) * d], c, d)?, g, w_blk, Accumulate::Add)?;
    }
    if grads.wanted.dw.is_computed() {
        let x_blk = MatRef::row_major(&buf.x[..c * d], c, d)?;
        let dw = MatMut::row_major(&mut grads.dw[v0 * d..(v0 + vb) * d], vb, d)?;
        gemm(dw, g.t(), x_blk, Accumulate::Add)?;
    }
    Ok(())
}

/// Rounds each row of the `c×vb` gradient block to bf16 in place by `lce_narrow_rows_bf16`
/// (row r's bf16 at bf16 element `2·vb·r`), then widens it back into the block's f32 layout:
/// the values the CUDA path's bf16 GEMMs read, for the CPU GEMM standing in for them (each
/// bf16 product is exact in f32 either way).
fn narrow_rows(g: &mut [f32], (c, vb): (usize, usize)) -> Result<()> {
    let cfg = EmuLaunchConfig::linear(c as u32, EMU_ROW_THREADS);
    let mut narrowed = g[..c * vb].to_vec();
    // SAFETY: `narrowed` holds c×vb floats; block r rewrites row r only.
    unsafe {
        launch_into("lce_narrow_rows_bf16", &cfg, &mut narrowed, |data| {
            ffi::lce_narrow_rows_bf16(data, vb as u32)
        })?
    };
    g[..c * vb].copy_from_slice(&narrowed);
    widen_bf16_rows(g, (c, vb));
    Ok(())
}

/// Each row of a `c×vb` block holding bf16 rows (row r's at bf16 element `2·vb·r`) widened in
/// place back into the block's f32 layout.
fn widen_bf16_rows(g: &mut [f32], (c, vb): (usize, usize)) {
    let narrowed: Vec<half::bf16> = bytemuck::cast_slice(&g[..c * vb]).to_vec();
    for (r, row) in g[..c * vb].chunks_exact_mut(vb).enumerate() {
        for (out, v) in row.iter_mut().zip(&narrowed[2 * vb * r..2 * vb * r + vb]) {
            *out = v.to_f32();
        }
    }
}

/// `g = f32(bf16(g))` in place (round to nearest even) by `lce_round_bf16`: what the CUDA
/// rings do to the logit gradient of bf16 inputs before their f32 GEMMs.
pub fn round_bf16(g: &mut [f32]) -> Result<()> {
    let len = g.len();
    let cfg = EmuLaunchConfig::grid_stride(len, EMU_MAX_BLOCKS);
    // SAFETY: `g` holds `len` floats; each thread rewrites its own elements only.
    Ok(unsafe { launch_into("lce_round_bf16", &cfg, g, |data| ffi::lce_round_bf16(data, len as u64)) }?)
}

/// Forward and backward in one pass, as on the device: on [`BlockSchedule::FullVocab`] each
/// token block's logits are folded, `lce_row_lse` finishes the rows, and the same block becomes
/// G (3 GEMMs); on the blocked schedule, forward then backward (4 GEMMs).
///
/// [`BlockSchedule::FullVocab`]: crate::plan::BlockSchedule::FullVocab
pub fn forward_backward(
    plan: &Plan,
    inputs: &Inputs<'_>,
    grad: GradOutput<'_>,
) -> Result<(Forward, Gradients)> {
    driver::with_gradients(plan, inputs, |out| forward_backward_into(plan, inputs, grad, out))
}

/// [`forward_backward`] writing the gradients `out` selects into it (overwritten; fp32 or
/// bf16); returns the loss and lse.
pub fn forward_backward_into(
    plan: &Plan,
    inputs: &Inputs<'_>,
    grad: GradOutput<'_>,
    out: impl GradientBuffers,
) -> Result<Forward> {
    let call = Call::new(plan, inputs);
    out.write_f32((inputs.n, inputs.d, inputs.v), inputs.bias.is_some(), |out| {
        driver::forward_backward(&mut EmuBlocks::open(call, Some(out))?, call, grad)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounding_to_bf16_matches_the_cpu_bit_for_bit() {
        // Ties to even both ways, the largest finite values, denormals, infinities and NaN.
        let mut g: Vec<f32> = vec![
            1.0 + f32::EPSILON * 64.0,
            1.0 + f32::EPSILON * 192.0,
            -3.140625,
            f32::MAX,
            -f32::MAX,
            f32::MIN_POSITIVE / 3.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            0.0,
            -0.0,
        ];
        g.extend((0..4000).map(|i| ((i as f32) * 0.7311).sin() * 1e3 / (1 + i % 37) as f32));
        let want: Vec<u32> = g.iter().map(|&x| half::bf16::from_f32(x).to_f32().to_bits()).collect();
        round_bf16(&mut g).unwrap();
        let got: Vec<u32> = g.iter().map(|x| x.to_bits()).collect();
        assert_eq!(got, want);
    }
}
