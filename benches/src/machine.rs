//! This machine's ceilings, measured: copy bandwidth and f32 GEMM rate. Components that report
//! a fraction of a ceiling measure it interleaved with their own kernel ([`interleaved_ratio`],
//! [`GemmProbe`]), because this VM's memory bandwidth swings between two levels over seconds
//! and its GEMM rate drifts over minutes (250–360 GFLOP/s within one session).

use std::time::Instant;

use flatpeak_common::gemm::{MatMut, MatRef, MatmulOptions, matmul};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// Measured ceilings; the JSON form is `{"cpus":N,"copy_gbps":x,"gemm_f32_gflops":y}`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MachineInfo {
    /// Threads of the rayon pool (all cores unless RAYON_NUM_THREADS says otherwise).
    pub cpus: usize,
    /// Copy bandwidth in GB/s (10^9 B/s), counting bytes read plus bytes written.
    pub copy_gbps: f64,
    /// f32 GEMM rate in GFLOP/s (2·n³ per n³ product) with the workspace's CPU GEMM.
    pub gemm_f32_gflops: f64,
}

/// Sizes of the ceiling measurements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct MachineOptions {
    /// Bytes of each of the copy's source and destination buffers.
    pub copy_bytes: usize,
    /// GEMM edge n of the n×n×n product.
    pub gemm_n: usize,
    /// Repetitions; the best is kept.
    pub reps: usize,
}

impl Default for MachineOptions {
    /// The `flatpeak machine` settings: 1 GiB buffers, 2048³ GEMM, best of 5.
    fn default() -> Self {
        Self { copy_bytes: 1 << 30, gemm_n: 2048, reps: 5 }
    }
}

impl MachineOptions {
    /// Small sizes for smoke runs and tests (not a ceiling: caches make small copies fast).
    pub fn quick() -> Self {
        Self { copy_bytes: 16 << 20, gemm_n: 256, reps: 2 }
    }
}

/// A reusable copy-bandwidth probe (buffers allocated and faulted in once).
#[derive(Debug)]
pub struct CopyProbe {
    src: Vec<f32>,
    dst: Vec<f32>,
}

/// Elements per fill task while faulting the buffers in.
const FAULT_CHUNK: usize = 1 << 20;

impl CopyProbe {
    /// Allocates and touches two buffers of `bytes` each.
    pub fn new(bytes: usize) -> Self {
        let n = (bytes / 4).max(FAULT_CHUNK);
        let mut src = vec![0f32; n];
        let mut dst = vec![0f32; n];
        src.par_chunks_mut(FAULT_CHUNK).for_each(|c| c.fill(1.0));
        dst.par_chunks_mut(FAULT_CHUNK).for_each(|c| c.fill(2.0));
        Self { src, dst }
    }

    /// One all-core copy, in GB/s counting read + written bytes.
    pub fn gbps(&mut self) -> f64 {
        // One contiguous piece per thread. glibc's memcpy switches to non-temporal stores only
        // above a size threshold (between 128 and 256 MiB per call here); below it every written
        // line is first read (write-allocate), so 4 MiB pieces measured 27 GB/s where whole
        // per-thread pieces measure 43 GB/s on the same machine. The ceiling is the better one.
        let piece = self.src.len().div_ceil(rayon::current_num_threads());
        let start = Instant::now();
        self.dst
            .par_chunks_mut(piece)
            .zip(self.src.par_chunks(piece))
            .for_each(|(d, s)| d.copy_from_slice(s));
        let secs = start.elapsed().as_secs_f64();
        std::hint::black_box(&self.dst);
        (2 * 4 * self.src.len()) as f64 / secs / 1e9
    }
}

/// A reusable f32 GEMM-rate probe: one n×n×n product on all cores with the workspace's CPU
/// GEMM, its operands allocated and faulted in once.
#[derive(Debug)]
pub struct GemmProbe {
    n: usize,
    a: Vec<f32>,
    b: Vec<f32>,
    c: Vec<f32>,
}

impl GemmProbe {
    /// Allocates and fills the three n×n operands.
    pub fn new(n: usize) -> Self {
        let mut rng = flatpeak_common::SplitMix64::new(1);
        let a = rng.uniform_f32(n * n, -1.0, 1.0);
        let b = rng.uniform_f32(n * n, -1.0, 1.0);
        Self { n, a, b, c: vec![1f32; n * n] }
    }

    /// GFLOP/s (2·n³ per product) of the best of `reps` products (0 if the shapes were refused,
    /// which they never are for square operands).
    pub fn gflops(&mut self, reps: usize) -> f64 {
        let n = self.n;
        let mut best = 0f64;
        for _ in 0..reps.max(1) {
            let start = Instant::now();
            let shapes = (
                MatMut::row_major(&mut self.c, n, n),
                MatRef::row_major(&self.a, n, n),
                MatRef::row_major(&self.b, n, n),
            );
            let (Ok(dst), Ok(lhs), Ok(rhs)) = shapes else { return 0.0 };
            if matmul(dst, lhs, rhs, MatmulOptions::default()).is_err() {
                return 0.0;
            }
            best = best.max(2.0 * (n as f64).powi(3) / start.elapsed().as_secs_f64() / 1e9);
        }
        best
    }
}

/// f32 GEMM GFLOP/s for one n×n×n product on all cores, best of `reps`.
pub fn gemm_gflops(n: usize, reps: usize) -> f64 {
    GemmProbe::new(n).gflops(reps)
}

/// Measures the ceilings.
pub fn measure(options: MachineOptions) -> MachineInfo {
    let mut probe = CopyProbe::new(options.copy_bytes);
    let copy_gbps = (0..options.reps.max(1)).map(|_| probe.gbps()).fold(0.0, f64::max);
    drop(probe);
    MachineInfo {
        cpus: rayon::current_num_threads(),
        copy_gbps,
        gemm_f32_gflops: gemm_gflops(options.gemm_n, options.reps),
    }
}

/// Median of per-round ratios `kernel() / ceiling()`, the two measured back to back in each of
/// `rounds` rounds, so a bandwidth level change between rounds cancels out.
pub fn interleaved_ratio(
    rounds: usize,
    mut kernel: impl FnMut() -> f64,
    mut ceiling: impl FnMut() -> f64,
) -> f64 {
    let mut ratios: Vec<f64> = (0..rounds.max(1)).map(|_| kernel() / ceiling()).collect();
    median(&mut ratios)
}

/// Median of a sample (mean of the middle two for even lengths; NaN when empty).
pub fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 { values[mid] } else { 0.5 * (values[mid - 1] + values[mid]) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_interleaving() {
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 2.0, 3.0]), 2.5);
        assert!(median(&mut []).is_nan());
        // The ceiling alternates between two levels; the kernel tracks it at 1.2×.
        let mut level = [48.0, 75.0].into_iter().cycle();
        let current = std::cell::Cell::new(0.0);
        let ratio = interleaved_ratio(
            7,
            || {
                current.set(level.next().unwrap_or(1.0));
                1.2 * current.get()
            },
            || current.get(),
        );
        assert!((ratio - 1.2).abs() < 1e-12);
    }

    #[test]
    fn quick_ceilings_are_positive() {
        let m = measure(MachineOptions::quick());
        assert!(m.cpus >= 1 && m.copy_gbps > 0.0 && m.gemm_f32_gflops > 0.0, "{m:?}");
    }
}
