//! Where a schedule runs: [`Device`], and a CUDA probe that never panics.
//!
//! cudarc loads libcuda and libnvrtc on first use and *panics* when they are missing, so every
//! entry point here first asks `is_culib_present()` and turns absence into
//! [`Error::CudaUnavailable`] with a reason a user can act on.

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// The device a schedule runs on. Parsed from `cpu` or `cuda:N` (`cuda` means `cuda:0`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Device {
    /// The CPU fallback: the same schedule with host buffers and threads.
    #[default]
    Cpu,
    /// CUDA device by ordinal.
    Cuda(usize),
}

impl Device {
    /// Checks the device can be used here: always for `Cpu`; for `Cuda(n)` the `cuda` feature,
    /// the driver library and a device with ordinal `n` must all be present.
    pub fn ensure_available(self) -> Result<Self> {
        match self {
            Device::Cpu => Ok(self),
            Device::Cuda(ordinal) => {
                let count = cuda_device_count()?;
                if ordinal < count {
                    Ok(self)
                } else {
                    Err(Error::CudaUnavailable {
                        reason: format!("device ordinal {ordinal} requested, {count} visible"),
                    })
                }
            }
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for Device {
    type Err = Error;
    fn from_str(spec: &str) -> Result<Self> {
        let invalid = || Error::InvalidDevice { spec: spec.to_string() };
        match spec.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            s => {
                let n = s.strip_prefix("cuda:").ok_or_else(invalid)?;
                n.parse().map(Device::Cuda).map_err(|_| invalid())
            }
        }
    }
}

/// Number of visible CUDA devices, or why there are none to use. Never panics.
pub fn cuda_device_count() -> Result<usize> {
    imp::cuda_device_count()
}

/// True when at least one CUDA device can be used.
pub fn cuda_available() -> bool {
    matches!(cuda_device_count(), Ok(n) if n > 0)
}

/// Whether the NVRTC library can be loaded (needed to compile kernels, not to run on the CPU).
pub fn nvrtc_available() -> bool {
    imp::nvrtc_available()
}

#[cfg(feature = "cuda")]
mod imp {
    use super::*;

    /// Whether the CUDA driver library can be used: a dlopen probe when cudarc loads the
    /// libraries at run time; always true when they are linked (`cuda-linked`), since the
    /// program would not have started without them.
    fn driver_present() -> bool {
        #[cfg(not(feature = "cuda-linked"))]
        // SAFETY: `is_culib_present` only tries to dlopen the library names cudarc would use;
        // it runs no CUDA code and has no preconditions.
        let present = unsafe { cudarc::driver::sys::is_culib_present() };
        #[cfg(feature = "cuda-linked")]
        let present = true;
        present
    }

    pub fn cuda_device_count() -> Result<usize> {
        if !driver_present() {
            return Err(Error::CudaUnavailable {
                reason: "the CUDA driver library (libcuda.so) is not installed or not on the \
                         loader path"
                    .into(),
            });
        }
        match cudarc::driver::CudaContext::device_count() {
            Ok(n) if n > 0 => Ok(n as usize),
            Ok(_) => Err(Error::CudaUnavailable { reason: "the driver reports no device".into() }),
            Err(e) => Err(Error::CudaUnavailable { reason: format!("driver error: {e:?}") }),
        }
    }

    pub fn nvrtc_available() -> bool {
        #[cfg(not(feature = "cuda-linked"))]
        // SAFETY: as above, a dlopen probe with no preconditions.
        let present = unsafe { cudarc::nvrtc::sys::is_culib_present() };
        #[cfg(feature = "cuda-linked")]
        let present = true;
        present
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use super::*;

    pub fn cuda_device_count() -> Result<usize> {
        Err(Error::CudaUnavailable {
            reason: "flatpeak was built without the `cuda` feature (rebuild with --features cuda)".into(),
        })
    }

    pub fn nvrtc_available() -> bool {
        false
    }
}

/// What an element of a device buffer needs: with feature `cuda`, that cudarc can copy it and
/// zero it (`DeviceRepr`, `ValidAsZeroBits`: every float and integer type can); without it,
/// nothing. The bound every crate's device-generic code states once.
#[cfg(feature = "cuda")]
pub trait DeviceElement: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits {}
#[cfg(feature = "cuda")]
impl<T> DeviceElement for T where T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits {}
/// What an element of a device buffer needs: with feature `cuda`, that cudarc can copy it and
/// zero it (`DeviceRepr`, `ValidAsZeroBits`: every float and integer type can); without it,
/// nothing. The bound every crate's device-generic code states once.
#[cfg(not(feature = "cuda"))]
pub trait DeviceElement {}
#[cfg(not(feature = "cuda"))]
impl<T> DeviceElement for T {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_device_specs() {
        assert_eq!("cpu".parse::<Device>().unwrap(), Device::Cpu);
        assert_eq!("CUDA:3".parse::<Device>().unwrap(), Device::Cuda(3));
        assert_eq!("cuda".parse::<Device>().unwrap(), Device::Cuda(0));
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
        for bad in ["gpu", "cuda:", "cuda:-1", "cuda:x", ""] {
            assert_eq!(bad.parse::<Device>().unwrap_err(), Error::InvalidDevice { spec: bad.to_string() });
        }
    }

    #[test]
    fn cpu_is_always_available() {
        assert_eq!(Device::Cpu.ensure_available().unwrap(), Device::Cpu);
    }

    #[test]
    fn cuda_without_a_device_is_an_error_that_says_why() {
        // No machine that runs CI has a GPU; on a GPU host this asserts the happy path instead.
        match Device::Cuda(0).ensure_available() {
            Ok(_) => assert!(cuda_available()),
            Err(Error::CudaUnavailable { reason }) => {
                assert!(!reason.is_empty());
                assert!(!cuda_available());
            }
            Err(other) => panic!("unexpected error {other:?}"),
        }
        assert!(matches!(Device::Cuda(1 << 20).ensure_available(), Err(Error::CudaUnavailable { .. })));
    }
}
