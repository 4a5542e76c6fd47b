//! The foundation's kernels (`kernels/common.cu`) through one set of test bodies on three
//! backends: the CPU reference, the SIMT emulator (`--features cuda-emu`) and a CUDA device
//! (`--features cuda`, ignored without one).

use flatpeak_common::testing::Backend;
use flatpeak_common::{Result, SplitMix64, test_backends};
use half::bf16;

/// The three kernels, as each backend runs them.
trait CommonKernels {
    fn fill(&self, out: &mut [f32], value: f32) -> Result<()>;
    fn checksum(&self, x: &[f32]) -> Result<f64>;
    fn cast_bf16(&self, x: &[f32]) -> Result<Vec<bf16>>;
}

struct Cpu;
impl CommonKernels for Cpu {
    fn fill(&self, out: &mut [f32], value: f32) -> Result<()> {
        out.fill(value);
        Ok(())
    }
    fn checksum(&self, x: &[f32]) -> Result<f64> {
        Ok(x.iter().map(|&v| v as f64).sum())
    }
    fn cast_bf16(&self, x: &[f32]) -> Result<Vec<bf16>> {
        Ok(x.iter().map(|&v| bf16::from_f32(v)).collect())
    }
}

#[cfg(feature = "cuda-emu")]
struct Emulated;
#[cfg(feature = "cuda-emu")]
impl CommonKernels for Emulated {
    fn fill(&self, out: &mut [f32], value: f32) -> Result<()> {
        flatpeak_common::emu::fill_f32(out, value)
    }
    fn checksum(&self, x: &[f32]) -> Result<f64> {
        flatpeak_common::emu::checksum_f32(x)
    }
    fn cast_bf16(&self, x: &[f32]) -> Result<Vec<bf16>> {
        let mut out = vec![bf16::ZERO; x.len()];
        flatpeak_common::emu::cast_f32_to_bf16(x, &mut out)?;
        Ok(out)
    }
}

#[cfg(feature = "cuda")]
struct Device(flatpeak_common::cuda::KernelCache);
#[cfg(feature = "cuda")]
impl CommonKernels for Device {
    fn fill(&self, out: &mut [f32], value: f32) -> Result<()> {
        let stream = self.0.context().default_stream();
        let mut dev = stream
            .clone_htod(out)
            .map_err(|e| flatpeak_common::Error::Cuda { op: "htod", message: format!("{e:?}") })?;
        flatpeak_common::cuda::fill_f32(&self.0, &stream, &mut dev.slice_mut(..), value)?;
        stream
            .memcpy_dtoh(&dev, out)
            .map_err(|e| flatpeak_common::Error::Cuda { op: "dtoh", message: format!("{e:?}") })
    }
    fn checksum(&self, x: &[f32]) -> Result<f64> {
        let stream = self.0.context().default_stream();
        let dev = stream
            .clone_htod(x)
            .map_err(|e| flatpeak_common::Error::Cuda { op: "htod", message: format!("{e:?}") })?;
        flatpeak_common::cuda::checksum_f32(&self.0, &stream, &dev.slice(..))
    }
    fn cast_bf16(&self, x: &[f32]) -> Result<Vec<bf16>> {
        let stream = self.0.context().default_stream();
        let err = |op| move |e| flatpeak_common::Error::Cuda { op, message: format!("{e:?}") };
        let dev = stream.clone_htod(x).map_err(err("htod"))?;
        let mut out = stream.alloc_zeros::<bf16>(x.len()).map_err(err("alloc"))?;
        flatpeak_common::cuda::cast_f32_to_bf16(&self.0, &stream, &dev.slice(..), &mut out.slice_mut(..))?;
        stream.clone_dtoh(&out).map_err(err("dtoh"))
    }
}

fn kernels(backend: Backend) -> Box<dyn CommonKernels> {
    match backend {
        Backend::Cpu => Box::new(Cpu),
        #[cfg(feature = "cuda-emu")]
        Backend::CudaEmu => Box::new(Emulated),
        #[cfg(feature = "cuda")]
        Backend::Cuda => {
            let ctx = flatpeak_common::cuda::context(0).expect("a CUDA device");
            Box::new(Device(flatpeak_common::cuda::KernelCache::new(ctx).expect("kernel cache")))
        }
        #[allow(unreachable_patterns)]
        other => panic!("{other:?} is not built into this test binary"),
    }
}

/// Lengths around the block size (256) and the emulator's block cap (4 × 256), and ragged ones.
const LENGTHS: [usize; 8] = [1, 31, 255, 256, 257, 1023, 1025, 4099];

fn fill_then_checksum(backend: Backend) {
    let k = kernels(backend);
    for n in LENGTHS {
        let mut buf = vec![7.0f32; n];
        k.fill(&mut buf, 0.25).unwrap();
        assert!(buf.iter().all(|&x| x == 0.25), "n={n}");
        // Dyadic values sum exactly in any order.
        assert_eq!(k.checksum(&buf).unwrap(), 0.25 * n as f64, "n={n}");
    }
    assert_eq!(k.checksum(&[]).unwrap(), 0.0);
}

fn checksum_of_random_data_matches_f64(backend: Backend) {
    let k = kernels(backend);
    for n in LENGTHS {
        let x = SplitMix64::new(n as u64).uniform_f32(n, -1.0, 1.0);
        let want: f64 = x.iter().map(|&v| v as f64).sum();
        let got = k.checksum(&x).unwrap();
        // f64 accumulation of f32 values: only the summation order differs.
        assert!((got - want).abs() <= 1e-12 * (n as f64), "n={n}: {got} vs {want}");
    }
}

fn bf16_cast_rounds_to_nearest_even(backend: Backend) {
    let k = kernels(backend);
    let mut x = SplitMix64::new(9).normal_f32(3000, 0.0, 100.0);
    x.extend([
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        0.0,
        -0.0,
        1.0e-40,
        f32::MAX,
        f32::MIN_POSITIVE,
        f32::from_bits(0x3f80_8000),
        f32::from_bits(0x3f81_8000),
        f32::from_bits(0x7f7f_ffff),
    ]);
    let got = k.cast_bf16(&x).unwrap();
    for (g, &v) in got.iter().zip(&x) {
        let want = bf16::from_f32(v);
        // A GPU's NaN payload may differ (0x7fff); NaN-ness is what must agree.
        assert!(g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()), "{v:e}: {g} vs {want}");
    }
}

test_backends!(fill_and_checksum, fill_then_checksum);
test_backends!(checksum_random, checksum_of_random_data_matches_f64);
test_backends!(bf16_cast, bf16_cast_rounds_to_nearest_even);
