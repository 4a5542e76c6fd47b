//! Element types crossing the link: gradients come down as f32, bf16 or f16; parameters go up
//! as f32 or bf16. The optimizer state itself is always f32.

use flatpeak_common::DType;
use half::{bf16, f16};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

/// A gradient element type.
pub trait GradElement: bytemuck::Pod + Send + Sync + flatpeak_common::DeviceElement + sealed::Sealed {
    /// The storage type.
    const DTYPE: DType;
    /// The gradients as f32: `src` itself for f32, else widened (exactly) into `tmp`.
    fn widen<'a>(src: &'a [Self], tmp: &'a mut [f32]) -> &'a [f32];
}

impl GradElement for f32 {
    const DTYPE: DType = DType::F32;
    fn widen<'a>(src: &'a [Self], _tmp: &'a mut [f32]) -> &'a [f32] {
        src
    }
}

impl GradElement for bf16 {
    const DTYPE: DType = DType::Bf16;
    fn widen<'a>(src: &'a [Self], tmp: &'a mut [f32]) -> &'a [f32] {
        let out = &mut tmp[..src.len()];
        for (o, &x) in out.iter_mut().zip(src) {
            *o = f32::from_bits((x.to_bits() as u32) << 16);
        }
        out
    }
}

impl GradElement for f16 {
    const DTYPE: DType = DType::F16;
    fn widen<'a>(src: &'a [Self], tmp: &'a mut [f32]) -> &'a [f32] {
        use half::slice::HalfFloatSliceExt;
        let out = &mut tmp[..src.len()];
        src.convert_to_f32_slice(out);
        out
    }
}

/// A parameter element type for the copy sent back to the device.
pub trait ParamElement:
    bytemuck::Pod + Send + Sync + flatpeak_common::DeviceElement + sealed::Sealed
{
    /// The storage type.
    const DTYPE: DType;
    /// Writes `src` rounded to nearest even into `dst` (same length).
    fn narrow(src: &[f32], dst: &mut [Self]);
}

impl ParamElement for f32 {
    const DTYPE: DType = DType::F32;
    fn narrow(src: &[f32], dst: &mut [Self]) {
        dst.copy_from_slice(src);
    }
}

impl ParamElement for bf16 {
    const DTYPE: DType = DType::Bf16;
    fn narrow(src: &[f32], dst: &mut [Self]) {
        for (d, &x) in dst.iter_mut().zip(src) {
            *d = bf16::from_bits(f32_to_bf16_bits(x));
        }
    }
}

/// Round-to-nearest-even f32 → bf16 bits, branch-free so the loop vectorises; bitwise equal to
/// `half::bf16::from_f32` and CUDA's `__float2bfloat16_rn` (NaN stays a quiet NaN with its sign).
#[inline(always)]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    let is_nan = (bits & 0x7fff_ffff) > 0x7f80_0000;
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
    let quiet_nan = (bits >> 16) | 0x0040;
    (if is_nan { quiet_nan } else { rounded }) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_matches_half_on_edges_and_random_bits() {
        let edges = [
            0.0f32,
            -0.0,
            1.0,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001),
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
            f32::from_bits(0x3f80_8001),
            f32::from_bits(0x0000_0001),
            f32::from_bits(0x807f_ffff),
            f32::from_bits(0x7f7f_ffff),
        ];
        let mut rng = flatpeak_common::SplitMix64::new(11);
        let random = (0..100_000).map(|_| f32::from_bits(rng.next_u64() as u32));
        for x in edges.into_iter().chain(random) {
            assert_eq!(f32_to_bf16_bits(x), bf16::from_f32(x).to_bits(), "{x:e} ({:#x})", x.to_bits());
        }
    }

    #[test]
    fn widening_is_exact() {
        let g: Vec<bf16> = [1.5f32, -3.0e-20, 7.0e30].iter().map(|&x| bf16::from_f32(x)).collect();
        let mut tmp = [0f32; 3];
        let w = bf16::widen(&g, &mut tmp);
        assert!(w.iter().zip(&g).all(|(a, b)| *a == b.to_f32()));
        let h: Vec<f16> = [1.5f32, -2.0e-5, 6.0e4].iter().map(|&x| f16::from_f32(x)).collect();
        let w = f16::widen(&h, &mut tmp);
        assert!(w.iter().zip(&h).all(|(a, b)| *a == b.to_f32()));
    }
}
