//! [`LossBudget`]: the working-set budget a loss call is planned within, and the default policy
//! per device that every caller of the crate shares (the PyTorch and candle bindings, the CLI).

use flatpeak_common::{Budget, Device};

/// The default budget on a CPU: 128 MiB. At N=8192, D=1024, V=32768 it gives 512-token blocks
/// over the whole vocabulary, which ran forward + backward 5% (f32) and 13% (bf16) faster than
/// the 256-token blocks of 64 MiB on a 2-core AVX-512 machine; an eighth of the logits' bytes
/// there.
pub const DEFAULT_CPU_BUDGET_BYTES: usize = 128 << 20;

/// The default budget on a GPU: 640 MiB, 1024-token blocks of f32 logits over a vocabulary of
/// up to 160K rows in a device's block buffers ([`Target::Device`](crate::plan::Target)). A
/// GPU's GEMMs need wide blocks: each block's `dW += Gᵀ·X` reads and writes the whole f32 dW, so
/// below several hundred tokens per block it is bound by memory, not arithmetic (on an H200,
/// 256-token blocks over a 32K vocabulary ran at 0.79 of the SGEMM rate, 1024-token blocks at
/// 0.92: `docs/gpu.md`). At N=16384, D=4096, V=131072 the 512 MiB it then takes beside the f32
/// dW stays near a tenth of what torch's eager call allocates.
pub const DEFAULT_CUDA_BUDGET_BYTES: usize = 640 << 20;

/// The budget of a loss call's plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LossBudget {
    /// The device's default: [`DEFAULT_CPU_BUDGET_BYTES`] on a CPU,
    /// [`DEFAULT_CUDA_BUDGET_BYTES`] on a GPU.
    #[default]
    Default,
    /// At most this many bytes (per rank, for a ring).
    Bytes(usize),
}

impl LossBudget {
    /// The budget a caller gives as optional bytes: `None` is [`LossBudget::Default`]; zero
    /// bytes is [`Error::InvalidConfig`](crate::Error::InvalidConfig) (`budget_bytes`).
    pub fn checked(bytes: Option<usize>) -> crate::Result<Self> {
        match bytes {
            None => Ok(LossBudget::Default),
            Some(0) => {
                Err(crate::Error::invalid_config("budget_bytes", 0usize, "a positive number of bytes"))
            }
            Some(bytes) => Ok(LossBudget::Bytes(bytes)),
        }
    }

    /// The budget on `device`.
    pub fn of(self, device: Device) -> Budget {
        Budget::Bytes(match (self, device) {
            (LossBudget::Bytes(bytes), _) => bytes,
            (LossBudget::Default, Device::Cpu) => DEFAULT_CPU_BUDGET_BYTES,
            (LossBudget::Default, Device::Cuda(_)) => DEFAULT_CUDA_BUDGET_BYTES,
        })
    }

    /// A digest ranks compare: the same policy, or the same bytes.
    pub(crate) fn digest(self) -> u64 {
        match self {
            LossBudget::Default => u64::MAX,
            LossBudget::Bytes(bytes) => bytes as u64,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_follows_the_device_and_bytes_are_bytes() {
        assert_eq!(LossBudget::Default.of(Device::Cpu), Budget::Bytes(128 << 20));
        assert_eq!(LossBudget::Default.of(Device::Cuda(3)), Budget::Bytes(640 << 20));
        assert_eq!(LossBudget::Bytes(7).of(Device::Cuda(0)), Budget::Bytes(7));
        assert_ne!(LossBudget::Default.digest(), LossBudget::Bytes(128 << 20).digest());
        assert_eq!(LossBudget::checked(None), Ok(LossBudget::Default));
        assert_eq!(LossBudget::checked(Some(5)), Ok(LossBudget::Bytes(5)));
        assert!(matches!(
            LossBudget::checked(Some(0)),
            Err(crate::Error::InvalidConfig { field: "budget_bytes", .. })
        ));
    }
}
