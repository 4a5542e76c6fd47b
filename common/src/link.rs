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
    /// Copies `src` into `dst` (same length) as this link would; returns the time it took.
    pub fn copy<T: Pod>(&self, src: &[T], dst: &mut [T]) -> Duration {
        let start = Instant::now();
        dst.copy_from_slice(src);
        if let Link::Simulated { gbps } = *self {
            let target = Duration::from_secs_f64(std::mem::size_of_val(src) as f64 / (gbps * 1e9));
            let elapsed = start.elapsed();
            if elapsed < target {
                std::thread::sleep(target - elapsed);
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
}
