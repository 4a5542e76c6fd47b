//! [`Link`]: the CPU fallback's copy engine. On a GPU, host↔device copies are DMA over PCIe;
//! on the CPU fallback the "device" is host memory and a copy is a memcpy, optionally paced to a
//! declared link bandwidth so schedules can be studied at a given copy/compute ratio.

use std::time::{Duration, Instant};

use bytemuck::Pod;

/// A simulated host↔device link, one direction at a time.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum Link {
    /// Copies run at host memcpy speed.
    #[default]
    Memcpy,
    /// Each copy takes at least `bytes / (gbps·10⁹)` seconds (it copies, then waits out the
    /// rest), like a DMA engine on a link of that bandwidth per direction.
    Simulated {
        /// Bandwidth per direction in GB/s (10⁹ B/s): PCIe Gen4 x16 ≈ 25, Gen5 x16 ≈ 50.
        gbps: f64,
    },
}

impl Link {
    /// Checks a simulated bandwidth is finite and > 0 ([`Error::InvalidConfig`](crate::Error::InvalidConfig) otherwise).
    pub fn validate(&self) -> crate::Result<()> {
        match *self {
            Link::Simulated { gbps } if !(gbps.is_finite() && gbps > 0.0) => {
                Err(crate::Error::invalid_config("link gbps", gbps, "a finite bandwidth > 0"))
            }
            _ => Ok(()),
        }
    }

    /// Copies `src` into `dst` (same length) as this link would; returns the time it took.
    /// Never panics on the bandwidth: one that [`validate`](Self::validate) refuses, or one so
    /// small the pacing would not fit a `Duration`, copies unpaced.
    pub fn copy<T: Pod>(&self, src: &[T], dst: &mut [T]) -> Duration {
        let start = Instant::now();
        dst.copy_from_slice(src);
        if let Link::Simulated { gbps } = *self {
            let seconds = std::mem::size_of_val(src) as f64 / (gbps * 1e9);
            if let Ok(target) = Duration::try_from_secs_f64(seconds) {
                let elapsed = start.elapsed();
                if elapsed < target {
                    std::thread::sleep(target - elapsed);
                }
            }
        }
        start.elapsed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_and_paces() {
        let src = vec![1u32; 1 << 16];
        let mut dst = vec![0u32; 1 << 16];
        Link::Memcpy.copy(&src, &mut dst);
        assert_eq!(src, dst);
        // 256 KiB at 0.1 GB/s takes at least 2.6 ms.
        let took = Link::Simulated { gbps: 0.1 }.copy(&src, &mut dst);
        assert!(took >= Duration::from_micros(2600), "{took:?}");
    }

    #[test]
    fn a_bad_bandwidth_is_refused_by_validate_and_never_panics_a_copy() {
        let (src, mut dst) = ([7u8; 64], [0u8; 64]);
        for gbps in [0.0, -1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let link = Link::Simulated { gbps };
            assert!(matches!(link.validate(), Err(crate::Error::InvalidConfig { .. })), "{gbps}");
            link.copy(&src, &mut dst);
            assert_eq!(src, dst);
        }
        // So slow the pacing would overflow a Duration: copied unpaced, not a panic or a hang.
        Link::Simulated { gbps: 1e-300 }.copy(&src, &mut dst);
        assert!(Link::Simulated { gbps: 25.0 }.validate().is_ok() && Link::Memcpy.validate().is_ok());
    }
}
