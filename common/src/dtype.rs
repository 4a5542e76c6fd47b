//! Element types the schedules accept. Accumulation is always f32 (or f64 in references).

use std::fmt;

/// Storage type of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DType {
    /// IEEE binary32.
    #[default]
    F32,
    /// bfloat16: f32's exponent, 8-bit significand.
    Bf16,
    /// IEEE binary16.
    F16,
}

impl DType {
    /// Bytes per element.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::Bf16 | DType::F16 => 2,
        }
    }

    /// Unit roundoff u = 2^-p of the storage format (p = significand bits incl. the implicit one,
    /// minus one): the scale of one rounding error.
    pub const fn unit_roundoff(self) -> f64 {
        match self {
            DType::F32 => 5.960_464_477_539_063e-8, // 2^-24
            DType::Bf16 => 3.906_25e-3,             // 2^-8
            DType::F16 => 4.882_812_5e-4,           // 2^-11
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::Bf16 => "bf16",
            DType::F16 => "f16",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_roundoff() {
        assert_eq!(DType::Bf16.size_in_bytes(), 2);
        assert_eq!(DType::F32.unit_roundoff(), (f32::EPSILON as f64) / 2.0);
        assert_eq!(DType::F16.unit_roundoff(), f64::from(half::f16::EPSILON) / 2.0);
        assert_eq!(DType::Bf16.unit_roundoff(), f64::from(half::bf16::EPSILON) / 2.0);
        assert_eq!(DType::Bf16.to_string(), "bf16");
    }
}
