//! The CPU AdamW: an f64 reference of torch's update, and the fast kernel (runtime-dispatched
//! SIMD via `multiversion`, over fixed chunks on the caller's team or rayon's pool). Every operation is an IEEE-rounded f32 op
//! in torch's order with no FMA contraction, except that √v is multiplied by 1/√(1 − β2^t)
//! (rounded once, from f64) where torch divides by √(1 − β2^t); so the result is bitwise the same
//! on AVX-512, AVX2 or scalar code and for any thread count. Also the gradient statistics pass (global ‖g‖₂² and
//! the non-finite check), reduced in a fixed order.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use flatpeak_common::team::for_each_job;
use multiversion::multiversion;

use crate::element::{GradElement, ParamElement};
use crate::hyperparameters::StepScalars;

/// Elements per parallel task (a multiple of the 64-element alignment of buckets).
pub const CHUNK: usize = 1 << 15;
/// Elements per inner tile (widened gradients and narrowed parameters live in stack buffers).
const TILE: usize = 1024;

/// One shard of optimizer state: fp32 master θ, first and second moments, and AMSGrad's max.
#[derive(Debug)]
pub struct StateMut<'a> {
    /// Master parameters θ.
    pub param: &'a mut [f32],
    /// First moment m.
    pub exp_avg: &'a mut [f32],
    /// Second moment v.
    pub exp_avg_sq: &'a mut [f32],
    /// max over steps of v (AMSGrad only; empty otherwise).
    pub max_exp_avg_sq: &'a mut [f32],
}

/// Where the updated parameters are also written (the H2D staging copy), if anywhere.
#[derive(Debug)]
pub enum ParamSink<'a, P> {
    /// Only the master copy is updated.
    None,
    /// Also write θ, converted to `P`, here.
    Copy(&'a mut [P]),
}

#[inline(always)]
fn lerp(start: f32, end: f32, weight: f32) -> f32 {
    // torch's lerp: the two-sided form keeps the result exact at weight 0 and 1.
    let diff = end - start;
    if weight < 0.5 { start + weight * diff } else { end - diff * (1.0 - weight) }
}

// The last line is torch's CPU `param.addcdiv_(exp_avg, denom, value=-step_size)`, which
// evaluates `param + (value · exp_avg) / denom` in that order. The denominator multiplies √v by
// the reciprocal of the bias correction (as DeepSpeed's CPU Adam does) instead of dividing by it:
// on two cores the kernel is bound by the divider (a square root and two divisions per element
// took 1.33x the time of a square root and one, single-threaded on cached data), and the
// reciprocal adds one rounding. No operation is fused: torch's CPU kernels fuse some (its
// vectorized lerp is an FMA, and its compiler may contract addcmul), so results agree with
// torch's to rounding (≤ 1e-6 relative over 20 steps, python/tests), not bitwise; unfused, they
// are bitwise the same on every ISA and thread count.
#[multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
fn update_tile(state: &mut StateMut<'_>, grad: &[f32], s: &StepScalars) {
    let scale = s.grad_scale * s.sign; // the sign flip is exact, so one multiply does both
    let n = grad.len();
    let (p, m, v) = (&mut state.param[..n], &mut state.exp_avg[..n], &mut state.exp_avg_sq[..n]);
    if state.max_exp_avg_sq.is_empty() {
        for i in 0..n {
            let g = grad[i] * scale;
            let theta = p[i] * s.decay;
            m[i] = lerp(m[i], g, s.lerp_weight);
            v[i] = v[i] * s.beta2 + s.one_minus_beta2 * g * g;
            let denom = v[i].sqrt() * s.inv_bias_correction2_sqrt + s.eps;
            p[i] = theta + (-s.step_size * m[i]) / denom;
        }
    } else {
        let vmax = &mut state.max_exp_avg_sq[..n];
        for i in 0..n {
            let g = grad[i] * scale;
            let theta = p[i] * s.decay;
            m[i] = lerp(m[i], g, s.lerp_weight);
            v[i] = v[i] * s.beta2 + s.one_minus_beta2 * g * g;
            vmax[i] = vmax[i].max(v[i]);
            let denom = vmax[i].sqrt() * s.inv_bias_correction2_sqrt + s.eps;
            p[i] = theta + (-s.step_size * m[i]) / denom;
        }
    }
}

fn update_chunk<G: GradElement, P: ParamElement>(
    state: StateMut<'_>,
    grad: &[G],
    mut sink: ParamSink<'_, P>,
    s: &StepScalars,
) {
    let mut wide = [0f32; TILE];
    let mut start = 0;
    while start < grad.len() {
        let end = (start + TILE).min(grad.len());
        let g = G::widen(&grad[start..end], &mut wide);
        let ams =
            if state.max_exp_avg_sq.is_empty() { &mut [][..] } else { &mut state.max_exp_avg_sq[start..end] };
        let mut tile = StateMut {
            param: &mut state.param[start..end],
            exp_avg: &mut state.exp_avg[start..end],
            exp_avg_sq: &mut state.exp_avg_sq[start..end],
            max_exp_avg_sq: ams,
        };
        update_tile(&mut tile, g, s);
        if let ParamSink::Copy(out) = &mut sink {
            P::narrow(tile.param, &mut out[start..end]);
        }
        start = end;
    }
}

/// One AdamW step over a shard, in parallel on the current rayon pool. Lengths must agree
/// (checked by the callers, which own the buffers); `max_exp_avg_sq` is empty unless AMSGrad.
pub fn adamw_update<G: GradElement, P: ParamElement>(
    state: StateMut<'_>,
    grad: &[G],
    sink: ParamSink<'_, P>,
    scalars: &StepScalars,
) {
    adamw_update_shards(vec![Shard { state, grad, sink, scalars }]);
}

/// One shard of a step: its state, gradient, parameter sink and scalars.
#[derive(Debug)]
pub struct Shard<'a, G, P> {
    /// θ, m, v (and max v with AMSGrad, else empty), each of the gradient's length.
    pub state: StateMut<'a>,
    /// The gradient.
    pub grad: &'a [G],
    /// Where θ is also written.
    pub sink: ParamSink<'a, P>,
    /// The step's scalars for this shard (its group's hyperparameters and its step count).
    pub scalars: &'a StepScalars,
}

/// One AdamW step of every shard, in one parallel pass over all of their [`CHUNK`]-element
/// chunks (so many small parameters cost one fork-join, not one each), on the caller's
/// [`Team`](flatpeak_common::team::Team) or rayon's pool. Each element's update is
/// [`adamw_update`]'s, whatever the split and whoever runs it.
pub fn adamw_update_shards<G: GradElement, P: ParamElement>(shards: Vec<Shard<'_, G, P>>) {
    let chunks: usize = shards.iter().map(|s| s.grad.len().div_ceil(CHUNK)).sum();
    // Each job takes its chunk out once (the lock is uncontended: one job per chunk). The
    // records are the step's only allocation (O(N / CHUNK), bounded in tests/stream_adamw_peak).
    let mut jobs: Vec<Job<'_, G, P>> = Vec::with_capacity(chunks);
    for shard in shards {
        split_into_chunks(shard, &mut jobs);
    }
    for_each_job(jobs.len(), &|i| {
        let chunk = jobs[i].lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(s) = chunk {
            update_chunk(s.state, s.grad, s.sink, s.scalars);
        }
    });
}

/// One chunk of an update pass, taken by the job that runs it.
type Job<'a, G, P> = Mutex<Option<Shard<'a, G, P>>>;

/// Splits `shard` into shards of at most [`CHUNK`] elements, appended to `jobs` in order.
fn split_into_chunks<'a, G, P>(shard: Shard<'a, G, P>, jobs: &mut Vec<Job<'a, G, P>>) {
    let Shard { state: StateMut { param, exp_avg, exp_avg_sq, max_exp_avg_sq }, grad, sink, scalars } = shard;
    let ams = !max_exp_avg_sq.is_empty();
    let (mut p, mut m, mut v, mut vm, mut g) = (param, exp_avg, exp_avg_sq, max_exp_avg_sq, grad);
    let mut out = match sink {
        ParamSink::Copy(o) => Some(o),
        ParamSink::None => None,
    };
    while !g.is_empty() {
        let n = CHUNK.min(g.len());
        let (p0, p1) = std::mem::take(&mut p).split_at_mut(n);
        let (m0, m1) = std::mem::take(&mut m).split_at_mut(n);
        let (v0, v1) = std::mem::take(&mut v).split_at_mut(n);
        let (vm0, vm1) =
            if ams { std::mem::take(&mut vm).split_at_mut(n) } else { (&mut [][..], &mut [][..]) };
        let (g0, g1) = g.split_at(n);
        let sink = match out.take() {
            Some(o) => {
                let (o0, o1) = o.split_at_mut(n);
                out = Some(o1);
                ParamSink::Copy(o0)
            }
            None => ParamSink::None,
        };
        let state = StateMut { param: p0, exp_avg: m0, exp_avg_sq: v0, max_exp_avg_sq: vm0 };
        jobs.push(Mutex::new(Some(Shard { state, grad: g0, sink, scalars })));
        (p, m, v, vm, g) = (p1, m1, v1, vm1, g1);
    }
}

/// Independent f64 accumulators of [`sum_sq_tile`]: four AVX-512 registers (eight AVX2 ones),
/// so the adds of consecutive elements do not wait on each other (one 8-lane accumulator left
/// the pass bound by the add's latency, at about half the machine's read bandwidth).
const LANES: usize = 32;

#[multiversion(targets("x86_64+avx512f+avx512vl+avx2+fma", "x86_64+avx2+fma"))]
fn sum_sq_tile(x: &[f32]) -> f64 {
    // LANES independent f64 lanes, combined in a fixed order: vectorisable and deterministic.
    let mut lanes = [0f64; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            let v = v as f64;
            *l += v * v;
        }
    }
    for (l, &v) in lanes.iter_mut().zip(chunks.remainder()) {
        *l += (v as f64) * (v as f64);
    }
    // A fixed pairwise tree: lane i with lane i + width/2, halving the width.
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            lanes[i] += lanes[i + width];
        }
    }
    lanes[0]
}

/// Σ g² over all gradients, in f64, reduced over fixed chunks in index order (thread-count
/// independent). A NaN or infinity anywhere makes the result non-finite: that is the
/// non-finite check.
pub fn grad_sq_sum<G: GradElement>(grad: &[G]) -> f64 {
    grad_sq_sums(&[grad])[0]
}

/// [`grad_sq_sum`] of each gradient, in one parallel pass over all of their chunks (one
/// fork-join for many small gradients); each sum is reduced in the same fixed order as alone.
pub fn grad_sq_sums<G: GradElement>(grads: &[&[G]]) -> Vec<f64> {
    let chunks: Vec<&[G]> = grads.iter().flat_map(|g| g.chunks(CHUNK)).collect();
    let partials: Vec<AtomicU64> = chunks.iter().map(|_| AtomicU64::new(0)).collect();
    for_each_job(chunks.len(), &|i| {
        let mut wide = [0f32; TILE];
        let sum = chunks[i].chunks(TILE).map(|t| sum_sq_tile(G::widen(t, &mut wide))).sum::<f64>();
        partials[i].store(sum.to_bits(), Ordering::Relaxed);
    });
    // Read after the pass returned (its jobs have ended): combined in chunk order.
    let mut partials = partials.into_iter().map(|p| f64::from_bits(p.into_inner()));
    grads.iter().map(|g| partials.by_ref().take(g.len().div_ceil(CHUNK)).sum()).collect()
}

/// The f64 reference of one torch AdamW step on f64 copies of the state (the test oracle).
/// `grad_scale` multiplies each gradient (clip coefficient / loss scale), in f64.
pub mod reference {
    use crate::hyperparameters::{Hyperparameters, Objective, Variant};

    /// f64 optimizer state, with the magnitudes each recurrence sums (for error normalisation:
    /// a forward error of a few ulps *of the magnitudes* is all any f32 implementation can
    /// promise when a sum cancels, e.g. m of gradients that change sign).
    #[derive(Debug, Clone, PartialEq)]
    pub struct State {
        /// θ.
        pub param: Vec<f64>,
        /// m.
        pub exp_avg: Vec<f64>,
        /// v.
        pub exp_avg_sq: Vec<f64>,
        /// max v (AMSGrad).
        pub max_exp_avg_sq: Vec<f64>,
        /// Steps taken.
        pub step: u64,
        /// Σ of the magnitudes θ's recurrence adds: |θ₀|·Π decay + Σ |update| (≥ |θ|).
        pub param_scale: Vec<f64>,
        /// m's recurrence on |g| (≥ |m|).
        pub exp_avg_scale: Vec<f64>,
    }

    impl State {
        /// Fresh state (m = v = 0) from parameters.
        pub fn new(param: &[f32]) -> Self {
            let n = param.len();
            Self {
                param: param.iter().map(|&x| x as f64).collect(),
                exp_avg: vec![0.0; n],
                exp_avg_sq: vec![0.0; n],
                max_exp_avg_sq: vec![0.0; n],
                step: 0,
                param_scale: param.iter().map(|&x| (x as f64).abs()).collect(),
                exp_avg_scale: vec![0.0; n],
            }
        }
    }

    /// One step of `torch.optim.AdamW` in f64.
    pub fn step(state: &mut State, grad: &[f64], config: &Hyperparameters, grad_scale: f64) {
        state.step += 1;
        let t = state.step as i32;
        let bc1 = 1.0 - config.beta1.powi(t);
        let bc2_sqrt = (1.0 - config.beta2.powi(t)).sqrt();
        let sign = if config.objective == Objective::Maximize { -1.0 } else { 1.0 };
        for (i, &raw) in grad.iter().enumerate() {
            let g = sign * raw * grad_scale;
            let decay = 1.0 - config.lr * config.weight_decay;
            state.param[i] *= decay;
            state.param_scale[i] *= decay.abs();
            state.exp_avg[i] += (1.0 - config.beta1) * (g - state.exp_avg[i]);
            state.exp_avg_scale[i] = config.beta1 * state.exp_avg_scale[i] + (1.0 - config.beta1) * g.abs();
            state.exp_avg_sq[i] = config.beta2 * state.exp_avg_sq[i] + (1.0 - config.beta2) * g * g;
            let v = match config.variant {
                Variant::Adam => state.exp_avg_sq[i],
                Variant::AmsGrad => {
                    state.max_exp_avg_sq[i] = state.max_exp_avg_sq[i].max(state.exp_avg_sq[i]);
                    state.max_exp_avg_sq[i]
                }
            };
            let denom = v.sqrt() / bc2_sqrt + config.eps;
            let update = config.lr / bc1 * state.exp_avg[i] / denom;
            state.param[i] -= update;
            state.param_scale[i] += update.abs();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hyperparameters::Hyperparameters;

    #[test]
    fn grad_norm_is_order_fixed_and_flags_non_finite() {
        let mut rng = flatpeak_common::SplitMix64::new(5);
        let g = rng.uniform_f32(3 * CHUNK + 17, -1.0, 1.0);
        let want: f64 = g.iter().map(|&x| (x as f64) * (x as f64)).sum();
        let got = grad_sq_sum(&g);
        assert!((got - want).abs() < 1e-9 * want);
        let pool = rayon::ThreadPoolBuilder::new().num_threads(3).build().unwrap();
        assert_eq!(pool.install(|| grad_sq_sum(&g)).to_bits(), got.to_bits());
        let mut bad = g.clone();
        bad[CHUNK + 3] = f32::NAN;
        assert!(!grad_sq_sum(&bad).is_finite());
        bad[CHUNK + 3] = f32::INFINITY;
        assert!(!grad_sq_sum(&bad).is_finite());
        assert_eq!(grad_sq_sum::<f32>(&[]), 0.0);
    }

    /// Runs the jobs last to first on three threads (each takes every third).
    struct Backwards;
    impl flatpeak_common::team::Team for Backwards {
        fn run(&self, jobs: usize, job: &(dyn Fn(usize) + Sync)) {
            std::thread::scope(|s| {
                for t in 0..3 {
                    s.spawn(move || (0..jobs).rev().skip(t).step_by(3).for_each(job));
                }
            });
        }
    }

    #[test]
    fn a_callers_team_gives_the_bits_of_rayons_pool() {
        use flatpeak_common::team::with_team;
        let mut rng = flatpeak_common::SplitMix64::new(17);
        let n = 5 * CHUNK + 33;
        let g = rng.uniform_f32(n, -1.0, 1.0);
        assert_eq!(with_team(&Backwards, || grad_sq_sum(&g)).to_bits(), grad_sq_sum(&g).to_bits());
        let scalars = StepScalars::new(&Hyperparameters::default(), 3, 0.5);
        let start = rng.normal_f32(n, 0.0, 1.0);
        let run = |team: Option<&Backwards>| {
            let (mut p, mut m, mut v) = (start.clone(), vec![0.1f32; n], vec![0.2f32; n]);
            let mut out = vec![half::bf16::ZERO; n];
            let mut step = || {
                let state =
                    StateMut { param: &mut p, exp_avg: &mut m, exp_avg_sq: &mut v, max_exp_avg_sq: &mut [] };
                adamw_update::<f32, half::bf16>(state, &g, ParamSink::Copy(&mut out), &scalars);
            };
            match team {
                Some(team) => with_team(team, step),
                None => step(),
            }
            (p, m, v, out)
        };
        assert_eq!(run(Some(&Backwards)), run(None));
    }

    #[test]
    fn many_gradients_in_one_pass_equal_each_alone() {
        let mut rng = flatpeak_common::SplitMix64::new(11);
        let lens = [0, 5, CHUNK, CHUNK + 1, 3 * CHUNK + 17];
        let grads: Vec<Vec<f32>> = lens.iter().map(|&n| rng.uniform_f32(n, -1.0, 1.0)).collect();
        let views: Vec<&[f32]> = grads.iter().map(Vec::as_slice).collect();
        let each: Vec<u64> = views.iter().map(|g| grad_sq_sum(g).to_bits()).collect();
        let together: Vec<u64> = grad_sq_sums(&views).iter().map(|s| s.to_bits()).collect();
        assert_eq!(each, together);

        // Every shard of one update_shards call ends as it would alone, each with its scalars.
        let scalars: Vec<StepScalars> =
            (1..=lens.len() as u64).map(|t| StepScalars::new(&Hyperparameters::default(), t, 1.0)).collect();
        let params: Vec<Vec<f32>> = lens.iter().map(|&n| rng.normal_f32(n, 0.0, 1.0)).collect();
        let mut alone = params.clone();
        let mut moments = vec![(Vec::new(), Vec::new()); lens.len()];
        for (k, p) in alone.iter_mut().enumerate() {
            moments[k] = (vec![0.1f32; p.len()], vec![0.2f32; p.len()]);
            let (m, v) = &mut moments[k];
            let state = StateMut { param: p, exp_avg: m, exp_avg_sq: v, max_exp_avg_sq: &mut [] };
            adamw_update::<f32, f32>(state, &grads[k], ParamSink::None, &scalars[k]);
        }
        let mut batched = params.clone();
        let mut batched_moments: Vec<(Vec<f32>, Vec<f32>)> =
            lens.iter().map(|&n| (vec![0.1f32; n], vec![0.2f32; n])).collect();
        let shards = batched
            .iter_mut()
            .zip(&mut batched_moments)
            .zip(&grads)
            .zip(&scalars)
            .map(|(((p, (m, v)), g), s)| Shard {
                state: StateMut { param: p, exp_avg: m, exp_avg_sq: v, max_exp_avg_sq: &mut [] },
                grad: g.as_slice(),
                sink: ParamSink::<f32>::None,
                scalars: s,
            })
            .collect();
        adamw_update_shards(shards);
        assert_eq!((alone, moments), (batched, batched_moments));
    }

    #[test]
    fn one_step_matches_the_reference() {
        let n = 2 * CHUNK + 5;
        let mut rng = flatpeak_common::SplitMix64::new(8);
        let param = rng.normal_f32(n, 0.0, 1.0);
        let grad = rng.normal_f32(n, 0.0, 0.1);
        let cfg = Hyperparameters::default();
        let (mut p, mut m, mut v) = (param.clone(), vec![0f32; n], vec![0f32; n]);
        let mut out = vec![half::bf16::ZERO; n];
        let s = StepScalars::new(&cfg, 1, 1.0);
        let st = StateMut { param: &mut p, exp_avg: &mut m, exp_avg_sq: &mut v, max_exp_avg_sq: &mut [] };
        adamw_update(st, &grad, ParamSink::Copy(&mut out), &s);
        let mut r = reference::State::new(&param);
        reference::step(&mut r, &grad.iter().map(|&x| x as f64).collect::<Vec<_>>(), &cfg, 1.0);
        assert!(flatpeak_common::relative_error(&p, &r.param) < 1e-7);
        assert!(out.iter().zip(&p).all(|(o, x)| *o == half::bf16::from_f32(*x)));
    }
}
