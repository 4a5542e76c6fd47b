//! What a call asks of a GPU, counted without one ([`DeviceCounts`]: kernel launches by entry
//! point, cuBLAS GEMMs with their shapes, host copies and waits, the bytes the custom kernels
//! move), and the time those counts imply at a GPU's published ceilings ([`Ceilings`],
//! [`DeviceCounts::predict`]). Each crate fills the counts by running its own device schedule
//! through a counting backend; this module is the shared vocabulary and the one time model.
//!
//! The model is a roofline with fixed costs, a lower bound rather than a forecast:
//! `t = Σ_gemm max(flops / (peak · GEMM_EFFICIENCY), bytes / bandwidth) + kernel bytes /
//! bandwidth + launches · launch + host waits · wait + uploads · upload`. It does not see a
//! small GEMM's lost occupancy (a grouped or batched call's reason to exist), caches, or overlap
//! between streams.

use std::collections::BTreeMap;

use crate::DType;

/// One GEMM: `C (m×n) (+)= A (m×k) · B (k×n)`, inputs of `dtype`, C of `out`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemmCall {
    /// Rows of C.
    pub m: usize,
    /// Columns of C.
    pub n: usize,
    /// The contracted dimension.
    pub k: usize,
    /// The inputs' element type.
    pub dtype: DType,
    /// C's element type.
    pub out: DType,
    /// Whether it adds into C (β = 1: C is read too).
    pub accumulate: bool,
}

impl GemmCall {
    /// 2·m·n·k.
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }
    /// The bytes it moves at least: A and B read, C written (and read when accumulating).
    pub fn bytes(&self) -> f64 {
        let (m, n, k) = (self.m as f64, self.n as f64, self.k as f64);
        let (inp, out) = (self.dtype.size_in_bytes() as f64, self.out.size_in_bytes() as f64);
        (m * k + k * n) * inp + m * n * out * if self.accumulate { 2.0 } else { 1.0 }
    }
}

/// What a call asked of the device.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeviceCounts {
    /// Kernel launches by entry point (`memset` for a zeroing).
    pub launches: BTreeMap<&'static str, usize>,
    /// Bytes the custom kernels (and memsets and device copies) read plus write.
    pub kernel_bytes: u64,
    /// The GEMMs, in issue order.
    pub gemms: Vec<GemmCall>,
    /// The calls that ran them: one per GEMM, fewer where one grouped call runs several.
    pub gemm_launches: usize,
    /// Host-to-device copies.
    pub uploads: usize,
    /// Their bytes.
    pub upload_bytes: u64,
    /// Device-to-host copies the host waits for.
    pub host_syncs: usize,
    /// Exchanges between ranks (all-to-all).
    pub exchanges: usize,
    /// Device-to-device copies.
    pub copies: usize,
    /// Buffers reserved.
    pub allocations: usize,
    /// Their bytes.
    pub allocated_bytes: u64,
    /// Their bytes carved from one lent buffer: each at least one element, rounded up to 256.
    pub arena_bytes: u64,
}

impl DeviceCounts {
    /// Kernel launches of every kind, memsets included.
    pub fn total_launches(&self) -> usize {
        self.launches.values().sum()
    }
    /// Σ GEMM flops.
    pub fn gemm_flops(&self) -> f64 {
        self.gemms.iter().map(GemmCall::flops).sum()
    }
    /// Counts one launch of `name` moving `bytes`.
    pub fn launch(&mut self, name: &'static str, bytes: usize) {
        *self.launches.entry(name).or_default() += 1;
        self.kernel_bytes = self.kernel_bytes.saturating_add(bytes as u64);
    }
    /// Counts one host-to-device copy of `bytes`.
    pub fn upload(&mut self, bytes: usize) {
        self.uploads += 1;
        self.upload_bytes = self.upload_bytes.saturating_add(bytes as u64);
    }
    /// Counts one GEMM, in a call of its own.
    pub fn gemm(&mut self, call: GemmCall) {
        self.gemms.push(call);
        self.gemm_launches += 1;
    }
    /// Counts one grouped call running `calls`.
    pub fn grouped_gemm(&mut self, calls: &[GemmCall]) {
        self.gemms.extend_from_slice(calls);
        self.gemm_launches += 1;
    }
    /// These counts and `other`'s (two passes of one step).
    pub fn plus(&self, other: &DeviceCounts) -> DeviceCounts {
        let mut out = self.clone();
        for (name, n) in &other.launches {
            *out.launches.entry(name).or_default() += n;
        }
        out.kernel_bytes += other.kernel_bytes;
        out.gemms.extend_from_slice(&other.gemms);
        out.gemm_launches += other.gemm_launches;
        out.uploads += other.uploads;
        out.upload_bytes += other.upload_bytes;
        out.host_syncs += other.host_syncs;
        out.exchanges += other.exchanges;
        out.copies += other.copies;
        out.allocations += other.allocations;
        out.allocated_bytes += other.allocated_bytes;
        out.arena_bytes += other.arena_bytes;
        out
    }

    /// The seconds these counts take at `ceilings`, by part ([`Prediction`]).
    pub fn predict(&self, ceilings: &Ceilings) -> Prediction {
        let bw = ceilings.hbm_bytes_per_s;
        let gemm = self
            .gemms
            .iter()
            .map(|g| {
                let peak = if g.dtype == DType::F32 { ceilings.f32_flops } else { ceilings.bf16_flops };
                (g.flops() / (peak * GEMM_EFFICIENCY)).max(g.bytes() / bw)
            })
            .sum();
        Prediction {
            gemm,
            kernels: self.kernel_bytes as f64 / bw,
            fixed: self.total_launches() as f64 * ceilings.launch_s
                + self.gemm_launches as f64 * ceilings.launch_s
                + self.host_syncs as f64 * ceilings.host_wait_s
                + self.uploads as f64 * ceilings.upload_s
                + self.upload_bytes as f64 / ceilings.pcie_bytes_per_s,
        }
    }
}

/// The share of a GPU's dense peak a large GEMM reaches in the model (cuBLAS's best on Hopper
/// runs at 70–80% of it; the fused losses of the prior art at 72–75%).
pub const GEMM_EFFICIENCY: f64 = 0.7;

/// A GPU's ceilings for [`DeviceCounts::predict`]: the published dense peaks and memory
/// bandwidth, and the fixed costs of a launch, a host wait and a small pageable upload.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ceilings {
    /// The GPU's name.
    pub name: &'static str,
    /// Dense bf16 tensor-core peak, FLOP/s.
    pub bf16_flops: f64,
    /// f32 peak without TF32, FLOP/s.
    pub f32_flops: f64,
    /// HBM bandwidth, bytes/s.
    pub hbm_bytes_per_s: f64,
    /// Host-to-device bandwidth, bytes/s.
    pub pcie_bytes_per_s: f64,
    /// Seconds a kernel or GEMM launch costs the stream when the host issues it.
    pub launch_s: f64,
    /// Seconds the host loses waiting for a device-to-host copy (the stream drains).
    pub host_wait_s: f64,
    /// Seconds one small pageable host-to-device copy costs.
    pub upload_s: f64,
}

/// NVIDIA H100 SXM: 989 TFLOP/s dense bf16, 67 TFLOP/s f32, 3.35 TB/s HBM3, PCIe Gen5.
pub const H100: Ceilings = Ceilings {
    name: "H100 SXM",
    bf16_flops: 989e12,
    f32_flops: 67e12,
    hbm_bytes_per_s: 3.35e12,
    pcie_bytes_per_s: 50e9,
    launch_s: 4e-6,
    host_wait_s: 20e-6,
    upload_s: 10e-6,
};

/// NVIDIA H200: the H100's compute with 4.8 TB/s of HBM3e.
pub const H200: Ceilings = Ceilings { name: "H200", hbm_bytes_per_s: 4.8e12, ..H100 };

/// Seconds by part of a [`DeviceCounts::predict`].
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Prediction {
    /// The GEMMs at their roofline.
    pub gemm: f64,
    /// The custom kernels' bytes at HBM bandwidth.
    pub kernels: f64,
    /// Launches, host waits and uploads.
    pub fixed: f64,
}

impl Prediction {
    /// The whole call.
    pub fn total(&self) -> f64 {
        self.gemm + self.kernels + self.fixed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gemm_is_bound_by_its_arithmetic_or_its_bytes() {
        let big =
            GemmCall { m: 8192, n: 8192, k: 8192, dtype: DType::Bf16, out: DType::F32, accumulate: false };
        let mut c = DeviceCounts::default();
        c.gemm(big);
        let p = c.predict(&H100);
        assert!((p.gemm - big.flops() / (989e12 * GEMM_EFFICIENCY)).abs() < 1e-12);
        assert_eq!(p.fixed, H100.launch_s);
        // A rank-1 update is bound by its bytes: C read and written in f32.
        let thin = GemmCall { m: 8192, n: 8192, k: 1, dtype: DType::Bf16, out: DType::F32, accumulate: true };
        let mut t = DeviceCounts::default();
        t.gemm(thin);
        assert!((t.predict(&H200).gemm - thin.bytes() / 4.8e12).abs() < 1e-15);
        assert!(t.predict(&H200).gemm < t.predict(&H100).gemm);
        // Two passes add.
        let both = c.plus(&t);
        assert_eq!((both.gemms.len(), both.gemm_launches), (2, 2));
        let mut grouped = DeviceCounts::default();
        grouped.grouped_gemm(&[big, big, big]);
        assert_eq!((grouped.gemms.len(), grouped.gemm_launches), (3, 1));
        assert_eq!(grouped.predict(&H100).fixed, H100.launch_s);
        c.launch("k", 100);
        c.launch("k", 50);
        assert_eq!((c.launches["k"], c.kernel_bytes, c.total_launches()), (2, 150, 2));
    }
}
