//! The CPU fallback's "device": gradients and parameters in host memory behind a simulated
//! link, and copy engines that are threads. It runs the very schedule the CUDA path runs, so the
//! pipeline is tested end to end without a GPU.

use std::time::{Duration, Instant};

use bytemuck::Pod;

use crate::element::{GradElement, ParamElement};

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

/// Gradients and parameters "on the device", for the CPU fallback.
#[derive(Debug, Clone)]
pub struct HostDevice<G, P> {
    /// Gradients produced by backward (read by the D2H engine).
    pub grads: Vec<G>,
    /// Parameters the next forward reads (written by the H2D engine).
    pub params: Vec<P>,
    /// The link both copy engines use.
    pub link: Link,
}

impl<G: GradElement, P: ParamElement> HostDevice<G, P> {
    /// A device holding `grads` and `params` behind `link`.
    pub fn new(grads: Vec<G>, params: Vec<P>, link: Link) -> Self {
        Self { grads, params, link }
    }
}
