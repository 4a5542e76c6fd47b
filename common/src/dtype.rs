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

/// The names a message gives dtypes: Rust's (`f32`, `bf16`, `f16`, as [`DType`] displays
/// them) or torch's (`torch.float32`, `torch.bfloat16`, `torch.float16`), as the caller who
/// reads the message writes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum DTypeNames {
    /// `f32`, `bf16`, `f16`.
    #[default]
    Rust,
    /// `torch.float32`, `torch.bfloat16`, `torch.float16`.
    Torch,
}

impl DType {
    /// The name of this dtype in `names`.
    pub const fn name(self, names: DTypeNames) -> &'static str {
        match (names, self) {
            (DTypeNames::Rust, DType::F32) => "f32",
            (DTypeNames::Rust, DType::Bf16) => "bf16",
            (DTypeNames::Rust, DType::F16) => "f16",
            (DTypeNames::Torch, DType::F32) => "torch.float32",
            (DTypeNames::Torch, DType::Bf16) => "torch.bfloat16",
            (DTypeNames::Torch, DType::F16) => "torch.float16",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name(DTypeNames::Rust))
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
        assert_eq!(DType::Bf16.name(DTypeNames::Torch), "torch.bfloat16");
    }
}
