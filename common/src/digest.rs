//! [`Digest`]: a 64-bit digest of typed fields (FNV-1a over their little-endian bytes), the same
//! in every process, build and platform. Ranks compare digests of their options and plans
//! before they exchange anything ([`comm::agree_records`](crate::comm::agree_records)), so a
//! digest is taken over a value's fields, one by one, never over its `Debug` text (which a new
//! field or a changed formatting would change without the value changing).
//!
//! ```
//! use flatpeak_common::Digest;
//!
//! let a = Digest::new().str("scheme").u64(3).f64(0.5).finish();
//! let b = Digest::new().str("scheme").u64(3).f64(0.5).finish();
//! assert_eq!(a, b);
//! assert_ne!(a, Digest::new().str("scheme").u64(3).f64(0.25).finish());
//! // Each field is framed: ("ab", "c") and ("a", "bc") differ.
//! assert_ne!(Digest::new().str("ab").str("c").finish(), Digest::new().str("a").str("bc").finish());
//! ```

/// An FNV-1a digest being built, field by field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Digest(u64);

impl Default for Digest {
    fn default() -> Self {
        Self::new()
    }
}

impl Digest {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0100_0000_01b3;

    /// The empty digest.
    pub const fn new() -> Self {
        Self(Self::OFFSET)
    }

    fn bytes(self, bytes: &[u8]) -> Self {
        Self(bytes.iter().fold(self.0, |h, &b| (h ^ u64::from(b)).wrapping_mul(Self::PRIME)))
    }

    /// A whole number.
    pub fn u64(self, value: u64) -> Self {
        self.bytes(&value.to_le_bytes())
    }

    /// A size.
    pub fn usize(self, value: usize) -> Self {
        self.u64(value as u64)
    }

    /// A signed number.
    pub fn i64(self, value: i64) -> Self {
        self.bytes(&value.to_le_bytes())
    }

    /// A float, by its bits (`0.0` and `-0.0` differ; every NaN is its own bits).
    pub fn f64(self, value: f64) -> Self {
        self.u64(value.to_bits())
    }

    /// A string, framed by its length.
    pub fn str(self, value: &str) -> Self {
        self.usize(value.len()).bytes(value.as_bytes())
    }

    /// An optional value: a tag, then the value's own fields.
    pub fn option<T>(self, value: Option<T>, field: impl FnOnce(Self, T) -> Self) -> Self {
        match value {
            None => self.u64(0),
            Some(v) => field(self.u64(1), v),
        }
    }

    /// The digest.
    pub const fn finish(self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_fnv1a_and_stable() {
        // FNV-1a's published test vector for "a" (one byte), and the fixed value of a framed
        // field list: a change here changes every digest ranks compare.
        assert_eq!(Digest::new().bytes(b"a").finish(), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(Digest::new().str("ring").u64(7).f64(-0.0).finish(), 0x4bba_e560_d87b_7050);
        assert_ne!(Digest::new().option(None::<u64>, Digest::u64).finish(), Digest::new().u64(1).finish());
        assert_ne!(Digest::new().f64(0.0).finish(), Digest::new().f64(-0.0).finish());
    }
}
