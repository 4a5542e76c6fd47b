//! [`Budget`]: how many bytes a plan's working set may take.
//!
//! Every flatpeak plan is made as `Plan::new(&Config, Shape, Budget)`. Where a schedule has a
//! free granularity (ring-dtp's blocks, llep's pair cap), the plan picks the largest that fits
//! the budget; where it has none (sco's slot ring, stream-adamw's staging), the plan checks that
//! the working set its config implies fits, and says `BudgetTooSmall` with both numbers when
//! it does not.
//!
//! ```
//! use flatpeak_common::Budget;
//! assert!(Budget::Bytes(1 << 20).admits(4096));
//! assert!(!Budget::Bytes(100).admits(4096));
//! assert!(Budget::Unlimited.admits(usize::MAX));
//! assert_eq!(Budget::mib(64), Budget::Bytes(64 << 20));
//! ```

use std::fmt;

/// The most bytes a plan's working set may take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Budget {
    /// No bound: the plan takes the coarsest granularity its shape allows (for ring-dtp, the
    /// materialized `tokens × vocabulary` logits; for llep, one round).
    Unlimited,
    /// At most this many bytes.
    Bytes(usize),
}

impl Budget {
    /// `n` MiB.
    pub const fn mib(n: usize) -> Self {
        Self::Bytes(n << 20)
    }

    /// The bound in bytes, `usize::MAX` when unlimited.
    pub const fn bytes(self) -> usize {
        match self {
            Self::Unlimited => usize::MAX,
            Self::Bytes(b) => b,
        }
    }

    /// Whether a working set of `bytes` fits.
    pub const fn admits(self, bytes: usize) -> bool {
        bytes <= self.bytes()
    }
}

impl fmt::Display for Budget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unlimited => write!(f, "unlimited"),
            Self::Bytes(b) => write!(f, "{b} B"),
        }
    }
}
