//! Test helpers (feature `testing`): the tolerance table, a proptest config that honours
//! `PROPTEST_CASES`, and seeded inputs (re-exported [`SplitMix64`]). Tests never run on zeros.

use crate::dtype::DType;
pub use crate::rng::SplitMix64;

/// Where a test body runs its kernels: the same body for all three (see [`test_backends!`](crate::test_backends)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The CPU reference / fast path.
    Cpu,
    /// The `.cu` kernels compiled as host C++ and run by the SIMT emulator (feature `cuda-emu`);
    /// any GEMM between kernels is the CPU GEMM (cuBLAS has no emulation).
    CudaEmu,
    /// The kernels on a CUDA device (feature `cuda`; ignored without a device).
    Cuda,
}

/// Expands one test body `fn(Backend)` into a module of tests, one per backend: `cpu` always,
/// `cuda_emu` under the calling crate's `cuda-emu` feature, `cuda` under its `cuda` feature
/// (`#[ignore = "needs a CUDA device"]`). Write `test_backends!(name, body, cpu_gemm)` when the
/// body runs GEMMs, so the emulated test is named `cuda_emu_with_cpu_gemm` and says so, and
/// `test_backends!(name, body, cpu_gemm, host_only)` for a body whose CUDA counterpart is
/// another test's (no `cuda` test is emitted).
#[macro_export]
macro_rules! test_backends {
    ($name:ident, $body:ident) => {
        $crate::test_backends!(@emit $name, $body, cuda_emu);
    };
    ($name:ident, $body:ident, cpu_gemm) => {
        $crate::test_backends!(@emit $name, $body, cuda_emu_with_cpu_gemm);
    };
    ($name:ident, $body:ident, cpu_gemm, host_only) => {
        mod $name {
            $crate::test_backends!(@host $body, cuda_emu_with_cpu_gemm);
        }
    };
    (@emit $name:ident, $body:ident, $emu:ident) => {
        mod $name {
            $crate::test_backends!(@host $body, $emu);
            #[cfg(feature = "cuda")]
            #[test]
            #[ignore = "needs a CUDA device"]
            fn cuda() {
                super::$body($crate::testing::Backend::Cuda)
            }
        }
    };
    (@host $body:ident, $emu:ident) => {
        #[test]
        fn cpu() {
            super::$body($crate::testing::Backend::Cpu)
        }
        #[cfg(feature = "cuda-emu")]
        #[test]
        fn $emu() {
            super::$body($crate::testing::Backend::CudaEmu)
        }
    };
}

/// A norm-wise relative tolerance and why it is what it is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Tolerance {
    /// Bound on [`relative_error`](crate::relative_error).
    pub rel: f64,
    /// The reasoning behind the number.
    pub reason: &'static str,
}

/// The per-dtype tolerance table (`docs/design.md`, exactness).
pub const TOLERANCES: &[(DType, Tolerance)] = &[
    (
        DType::F32,
        Tolerance {
            rel: 1e-5,
            reason: "f32 inputs, f32 accumulation in blocks against an f64 oracle: a blocked sum of \
                     n terms errs by about u·log2(n)·cond, far below 1e-5 for the well-conditioned \
                     inputs tests draw",
        },
    ),
    (
        DType::Bf16,
        Tolerance {
            rel: 1.6e-2,
            reason: "bf16 storage (u = 2^-8) of inputs and outputs with f32 accumulation: outputs \
                     carry one bf16 rounding (≤ u ≈ 3.9e-3 each, ~u/√3 norm-wise) on top of the \
                     inputs' roundings; 4u leaves room for both, as Cut Cross-Entropy's rule \
                     (error ≤ naive same-dtype error + tol) allows",
        },
    ),
    (
        DType::F16,
        Tolerance { rel: 2e-3, reason: "f16 storage (u = 2^-11) with f32 accumulation: 4u, as for bf16" },
    ),
];

/// Tolerance for one weight gradient summed over ≥ 64k tokens in one f32 accumulator, whose
/// error grows like u·√N (`docs/design.md`, exactness).
pub const LARGE_SUM_F32: Tolerance = Tolerance {
    rel: 1e-4,
    reason: "f32 gradient summed over ≥ 64k tokens: one accumulator errs by about u·√N ≈ 1.5e-5, \
             with room for cancellation",
};

/// The tolerance for outputs computed from `dtype` inputs.
pub fn tolerance(dtype: DType) -> Tolerance {
    TOLERANCES.iter().find(|(d, _)| *d == dtype).map(|(_, t)| *t).unwrap_or(TOLERANCES[0].1)
}

/// Checks `relative_error(got, want) ≤ tol.rel`, with a message naming the numbers and reason.
pub fn check_close(what: &str, got: &[f32], want: &[f64], tol: Tolerance) -> Result<(), String> {
    let err = crate::numerics::relative_error(got, want);
    if err <= tol.rel {
        Ok(())
    } else {
        Err(format!("{what}: relative error {err:.3e} > {:.1e} ({})", tol.rel, tol.reason))
    }
}

/// A proptest config with `default_cases` cases unless `PROPTEST_CASES` is set (which
/// `ProptestConfig::with_cases` would ignore), shrinking capped so failures report quickly, and
/// a fixed seed ([`FIXED_PROPTEST_SEED`]) unless `PROPTEST_RNG_SEED` is set.
pub fn proptest_config(default_cases: u32) -> proptest::test_runner::Config {
    use proptest::test_runner::{Config, RngSeed};
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(default_cases);
    // The same inputs on every run unless `PROPTEST_RNG_SEED` asks for others: a CI run is
    // reproducible, and a new seed is explored on purpose, not by chance.
    let rng_seed = match std::env::var_os("PROPTEST_RNG_SEED") {
        Some(_) => Config::default().rng_seed,
        None => RngSeed::Fixed(FIXED_PROPTEST_SEED),
    };
    Config { cases, max_shrink_iters: 256, rng_seed, ..Config::default() }
}

/// The proptest seed of a run that sets no `PROPTEST_RNG_SEED`.
pub const FIXED_PROPTEST_SEED: u64 = 0x5EED_F1A7_9EAC;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_dtype_has_a_reasoned_tolerance() {
        for dtype in [DType::F32, DType::Bf16, DType::F16] {
            let t = tolerance(dtype);
            assert!(t.rel > dtype.unit_roundoff() && !t.reason.is_empty(), "{dtype}");
        }
        assert!(
            check_close("x", &[1.0], &[1.0 + 1e-3], tolerance(DType::F32)).unwrap_err().contains("1.0e-5")
        );
        assert!(check_close("x", &[1.0], &[1.0 + 1e-3], tolerance(DType::Bf16)).is_ok());
    }

    #[test]
    fn proptest_config_honours_the_environment() {
        // The variable is read at call time; CI does not set it for this crate's unit tests.
        let expected = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(7);
        assert_eq!(proptest_config(7).cases, expected);
    }
}

/// A communicator that fails its `fail_at`-th operation (counting from 0) and every one after
/// with a typed error: fault injection for the schedules that run over a [`Communicator`](crate::Communicator) (a
/// rank dying at a chosen step of a ring or a dispatch round). Dropping it drops the wrapped
/// endpoint, so the peers learn at once that this rank is gone.
#[derive(Debug)]
pub struct FaultyComm<C> {
    inner: C,
    ops: std::sync::atomic::AtomicUsize,
    fail_at: usize,
}

impl<C: crate::Communicator> FaultyComm<C> {
    /// `inner`, failing from its `fail_at`-th operation on (`usize::MAX`: never).
    pub fn new(inner: C, fail_at: usize) -> Self {
        Self { inner, ops: std::sync::atomic::AtomicUsize::new(0), fail_at }
    }

    /// Operations attempted so far (failed ones included).
    pub fn ops(&self) -> usize {
        self.ops.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn next(&self) -> crate::Result<()> {
        let op = self.ops.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if op >= self.fail_at {
            return Err(crate::Error::invalid_config(
                "injected fault",
                op,
                "a communicator operation that succeeds",
            ));
        }
        Ok(())
    }
}

impl<C: crate::Communicator> crate::Communicator for FaultyComm<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn send_bytes(&self, peer: usize, data: &[u8]) -> crate::Result<()> {
        self.next()?;
        self.inner.send_bytes(peer, data)
    }
    fn recv_bytes(&self, peer: usize, out: &mut [u8]) -> crate::Result<()> {
        self.next()?;
        self.inner.recv_bytes(peer, out)
    }
    fn all_to_all_v_bytes(
        &self,
        send: crate::comm::Parts<'_>,
        recv: crate::comm::PartsMut<'_>,
    ) -> crate::Result<()> {
        self.next()?;
        self.inner.all_to_all_v_bytes(send, recv)
    }
    fn all_reduce_f32(&self, buf: &mut [f32], op: crate::ReduceOp) -> crate::Result<()> {
        self.next()?;
        self.inner.all_reduce_f32(buf, op)
    }
    fn barrier(&self) -> crate::Result<()> {
        self.next()?;
        self.inner.barrier()
    }
}
