//! Pure sizing of selective checkpoint offload.
//!
//! With activation checkpointing each layer's input (the boundary, s bytes) lives from its
//! forward to its backward, so plain checkpointing holds `L·s` on the device. SCO keeps the
//! boundaries in a host arena of `L·s` bytes and a fixed device ring of
//! `k_keep + max(m, K)` slots, `K = d + 1`: the k_keep newest boundaries stay resident, up to m
//! forward copies are in flight, and backward holds the boundary in use plus d prefetched ones.
//! Device bytes for boundaries: `(k_keep + max(m, d + 1))·s`, independent of L.

use crate::error::{Error, Result};

/// SCO's ring parameters. Defaults: k_keep = 1, m = 2, d = 1 (3 slots).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct OffloadOptions {
    /// Newest boundaries kept resident after their copy (≥ 1: the last one's backward comes first).
    pub keep_resident: usize,
    /// Forward D2H copies in flight (≥ 1).
    pub in_flight: usize,
    /// Backward prefetch distance d (≥ 0): H2D of boundary i−d starts when layer i's backward does.
    pub prefetch_distance: usize,
}

impl Default for OffloadOptions {
    fn default() -> Self {
        Self { keep_resident: 1, in_flight: 2, prefetch_distance: 1 }
    }
}

impl OffloadOptions {
    /// These options keeping the `n` newest boundaries resident.
    pub fn keep_resident(self, n: usize) -> Self {
        Self { keep_resident: n, ..self }
    }
    /// These options with `m` forward copies in flight.
    pub fn in_flight(self, m: usize) -> Self {
        Self { in_flight: m, ..self }
    }
    /// These options prefetching `d` layers ahead in backward.
    pub fn prefetch_distance(self, d: usize) -> Self {
        Self { prefetch_distance: d, ..self }
    }
}

/// The sizes of one offloaded stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    layers: usize,
    boundary_elems: usize,
    element_bytes: usize,
    options: OffloadOptions,
}

impl Plan {
    /// A plan for `layers` boundaries of `boundary_elems` elements of `element_bytes` each.
    pub fn new(
        layers: usize,
        boundary_elems: usize,
        element_bytes: usize,
        options: OffloadOptions,
    ) -> Result<Self> {
        let check = |name, value: usize, ok: bool, expected| {
            if ok { Ok(()) } else { Err(Error::invalid_config(name, value, expected)) }
        };
        check("keep_resident", options.keep_resident, options.keep_resident >= 1, "at least 1")?;
        check("in_flight", options.in_flight, options.in_flight >= 1, "at least 1")?;
        check("layers", layers, layers >= 1, "at least 1")?;
        Ok(Self { layers, boundary_elems, element_bytes, options })
    }

    /// Depth L.
    pub fn layers(&self) -> usize {
        self.layers
    }
    /// Elements per boundary tensor.
    pub fn boundary_elems(&self) -> usize {
        self.boundary_elems
    }
    /// Bytes per boundary tensor, s.
    pub fn boundary_bytes(&self) -> usize {
        self.boundary_elems * self.element_bytes
    }
    /// The options.
    pub fn options(&self) -> OffloadOptions {
        self.options
    }
    /// Device ring slots: `k_keep + max(m, d + 1)`.
    pub fn slots(&self) -> usize {
        self.options.keep_resident + self.options.in_flight.max(self.options.prefetch_distance + 1)
    }
    /// Device bytes SCO holds for boundaries: `slots·s`.
    pub fn device_bytes(&self) -> usize {
        self.slots() * self.boundary_bytes()
    }
    /// Device bytes plain checkpointing holds for boundaries: `L·s`.
    pub fn plain_device_bytes(&self) -> usize {
        self.layers * self.boundary_bytes()
    }
    /// Host arena bytes: `L·s`, allocated once at exact size.
    pub fn host_arena_bytes(&self) -> usize {
        self.layers * self.boundary_bytes()
    }
    /// The most slots a step of this depth can hold at once: `min(slots, L)`, since a stack of
    /// L layers has only L boundaries.
    pub fn peak_slots(&self) -> usize {
        self.slots().min(self.layers)
    }
}

/// Predicted ratio of a transformer layer's forward compute time to its boundary's D2H copy
/// time (DESIGN.md): compute `(2·S·P + 2·S²·H)/F` against copy `S·H·b/BW`, i.e.
/// `2·BW·(P/H + S)/(b·F)` (= `BW·(P/H + S)/F` for bf16). ≥ 1: the copy hides behind the forward;
/// it grows with S, so long context hides more easily.
///
/// `link_bytes_per_s`: copy bandwidth; `params_per_layer`: P; `hidden`: H; `tokens`: S;
/// `flops_per_s`: sustained compute; `element_bytes`: b.
pub fn hide_ratio(
    link_bytes_per_s: f64,
    params_per_layer: f64,
    hidden: f64,
    tokens: f64,
    flops_per_s: f64,
    element_bytes: f64,
) -> f64 {
    let compute = (2.0 * tokens * params_per_layer + 2.0 * tokens * tokens * hidden) / flops_per_s;
    let copy = tokens * hidden * element_bytes / link_bytes_per_s;
    compute / copy
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_is_flat_in_depth() {
        for layers in [1usize, 4, 32, 1024] {
            let p = Plan::new(layers, 1000, 4, OffloadOptions::default()).unwrap();
            assert_eq!(p.slots(), 3);
            assert_eq!(p.device_bytes(), 12_000);
            assert_eq!(p.plain_device_bytes(), layers * 4000);
            assert_eq!(p.peak_slots(), 3.min(layers));
        }
        let deep =
            Plan::new(32, 10, 4, OffloadOptions { prefetch_distance: 3, ..Default::default() }).unwrap();
        assert_eq!(deep.slots(), 1 + 4);
    }

    #[test]
    fn bad_options() {
        let zero = OffloadOptions { keep_resident: 0, ..Default::default() };
        assert!(matches!(Plan::new(4, 1, 4, zero), Err(Error::InvalidConfig { field: "keep_resident", .. })));
        assert!(matches!(
            Plan::new(0, 1, 4, OffloadOptions::default()),
            Err(Error::InvalidConfig { field: "layers", .. })
        ));
    }

    #[test]
    fn hide_ratio_model() {
        // H = 4096, P = 12·H², S = 8192, 25 GB/s, 400 TFLOP/s, bf16: BW·(P/H + S)/F.
        let h = 4096.0;
        let r = hide_ratio(25e9, 12.0 * h * h, h, 8192.0, 400e12, 2.0);
        assert!((r - 25e9 * (12.0 * h + 8192.0) / 400e12).abs() < 1e-12, "{r}");
    }
}
