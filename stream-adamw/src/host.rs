//! The CPU fallback's "device": gradients and parameters in host memory behind a simulated
//! link, and copy engines that are threads. It runs the very schedule the CUDA path runs, so the
//! pipeline is tested end to end without a GPU.

pub use flatpeak_common::Link;

use crate::element::{GradElement, ParamElement};

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
