//! Pure sizing of selective checkpoint offload.
//!
//! With activation checkpointing each layer's input (the boundary, s bytes) lives from its
//! forward to its backward, so plain checkpointing holds `L·s` on the device. SCO keeps the
//! boundaries in a host arena of `L·s` bytes and a fixed device ring of
//! `k_keep + max(m, K)` slots, `K = d + 1`: the k_keep newest boundaries stay resident, up to m
//! forward copies are in flight, and backward holds the boundary in use plus d prefetched ones.
//! Device bytes for boundaries: `(k_keep + max(m, d + 1))·s`, independent of L.

use flatpeak_common::Budget;

use crate::error::{Error, Result};

/// The largest `keep_resident`, `in_flight` or `prefetch_distance` a plan accepts.
pub const MAX_RING_OPTION: usize = 1024;

/// SCO's ring parameters. Defaults: k_keep = 1, m = 2, d = 1 (3 slots).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Config {
    /// Newest boundaries kept resident after their copy (≥ 1: the last one's backward comes first).
    pub keep_resident: usize,
    /// Forward D2H copies in flight (≥ 1).
    pub in_flight: usize,
    /// Backward prefetch distance d (≥ 0): H2D of boundary i−d starts when layer i's backward does.
    pub prefetch_distance: usize,
    /// The longest any wait of the offloader (for a copy to land, for a slot to free) may take
    /// before it is [`Error::Timeout`]: a stuck copy engine is an error, never a hang. > 0.
    pub wait_timeout: std::time::Duration,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            keep_resident: 1,
            in_flight: 2,
            prefetch_distance: 1,
            wait_timeout: std::time::Duration::from_secs(120),
        }
    }
}

impl Config {
    /// This config keeping the `n` newest boundaries resident.
    pub fn keep_resident(self, n: usize) -> Self {
        Self { keep_resident: n, ..self }
    }
    /// This config with `m` forward copies in flight.
    pub fn in_flight(self, m: usize) -> Self {
        Self { in_flight: m, ..self }
    }
    /// This config prefetching `d` layers ahead in backward.
    pub fn prefetch_distance(self, d: usize) -> Self {
        Self { prefetch_distance: d, ..self }
    }

    /// This config failing any offloader wait that takes longer than `timeout`.
    pub fn wait_timeout(self, timeout: std::time::Duration) -> Self {
        Self { wait_timeout: timeout, ..self }
    }

    /// Checks every field's domain: `keep_resident ≥ 1`, `in_flight ≥ 1`, `wait_timeout > 0`.
    pub fn validate(&self) -> Result<()> {
        if self.wait_timeout.is_zero() {
            return Err(Error::invalid_config("wait_timeout", self.wait_timeout, "longer than zero"));
        }
        if self.keep_resident == 0 {
            return Err(Error::invalid_config("keep_resident", self.keep_resident, "at least 1"));
        }
        if self.in_flight == 0 {
            return Err(Error::invalid_config("in_flight", self.in_flight, "at least 1"));
        }
        Ok(())
    }
}

/// The sizes of one checkpointed stack: L boundaries of `boundary_elems` elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Depth L: checkpoint boundaries per step (≥ 1).
    pub layers: usize,
    /// Elements per boundary tensor (S·H for a transformer layer's input).
    pub boundary_elems: usize,
    /// Bytes per element b.
    pub element_bytes: usize,
}

impl Shape {
    /// L boundaries of `boundary_elems` elements of `T`.
    pub fn of<T>(layers: usize, boundary_elems: usize) -> Self {
        Self { layers, boundary_elems, element_bytes: std::mem::size_of::<T>() }
    }
}

/// The sizes of one offloaded stack.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    shape: Shape,
    config: Config,
}

impl Plan {
    /// Validates `config` and `shape` and checks that the device slot ring,
    /// `(k_keep + max(m, d + 1))·s` bytes, fits `budget` ([`Error::BudgetTooSmall`] otherwise).
    /// Every size product is checked.
    pub fn new(config: &Config, shape: Shape, budget: Budget) -> Result<Self> {
        config.validate()?;
        if shape.layers == 0 {
            return Err(Error::invalid_config("layers", shape.layers, "at least 1"));
        }
        // Bounded so an absurd option (in_flight = 10^7) is a typed error, not a reservation of
        // 10^7 slots: no schedule keeps more boundaries resident, in flight or prefetched.
        let most = MAX_RING_OPTION;
        for (field, value) in [
            ("keep_resident", config.keep_resident),
            ("in_flight", config.in_flight),
            ("prefetch_distance", config.prefetch_distance),
        ] {
            if value > most {
                return Err(Error::invalid_config(field, value, "at most MAX_RING_OPTION = 1024"));
            }
        }
        let plan = Self { shape, config: *config };
        let overflow = |what| Error::Common(flatpeak_common::Error::SizeOverflow { what });
        let boundary =
            shape.boundary_elems.checked_mul(shape.element_bytes).ok_or(overflow("boundary bytes"))?;
        boundary.checked_mul(plan.slots()).ok_or(overflow("device ring bytes"))?;
        boundary.checked_mul(shape.layers).ok_or(overflow("host arena bytes"))?;
        if !budget.admits(plan.workspace_bytes()) {
            return Err(Error::BudgetTooSmall {
                budget: budget.bytes(),
                needed: plan.workspace_bytes(),
                what: "the device slot ring",
            });
        }
        Ok(plan)
    }

    /// The shape planned for.
    pub fn shape(&self) -> Shape {
        self.shape
    }
    /// Depth L.
    pub fn layers(&self) -> usize {
        self.shape.layers
    }
    /// Elements per boundary tensor.
    pub fn boundary_elems(&self) -> usize {
        self.shape.boundary_elems
    }
    /// Bytes per boundary tensor, s.
    pub fn boundary_bytes(&self) -> usize {
        self.shape.boundary_elems * self.shape.element_bytes
    }
    /// The config.
    pub fn config(&self) -> Config {
        self.config
    }
    /// Device ring slots: `k_keep + max(m, d + 1)`.
    pub fn slots(&self) -> usize {
        let c = &self.config;
        c.keep_resident + c.in_flight.max(c.prefetch_distance + 1)
    }
    /// The device working set: the slot ring, `slots·s` bytes, independent of L.
    pub fn workspace_bytes(&self) -> usize {
        self.slots() * self.boundary_bytes()
    }
    /// Device bytes plain checkpointing holds for boundaries: `L·s`.
    pub fn plain_device_bytes(&self) -> usize {
        self.shape.layers * self.boundary_bytes()
    }
    /// Host arena bytes: `L·s`, allocated once at exact size.
    pub fn host_arena_bytes(&self) -> usize {
        self.shape.layers * self.boundary_bytes()
    }
    /// The most slots a step of this depth can hold at once: `min(slots, L)`, since a stack of
    /// L layers has only L boundaries.
    pub fn peak_slots(&self) -> usize {
        self.slots().min(self.shape.layers)
    }
}

/// Predicted ratio of a transformer layer's forward compute time to its boundary's D2H copy
/// time (`docs/design.md`, sco): compute `(2·S·P + 2·S²·H)/F` against copy `S·H·b/BW`, i.e.
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

    fn plan(layers: usize, elems: usize, config: Config) -> Result<Plan> {
        Plan::new(&config, Shape::of::<f32>(layers, elems), Budget::Unlimited)
    }

    #[test]
    fn ring_is_flat_in_depth() {
        for layers in [1usize, 4, 32, 1024] {
            let p = plan(layers, 1000, Config::default()).unwrap();
            assert_eq!(p.slots(), 3);
            assert_eq!(p.workspace_bytes(), 12_000);
            assert_eq!(p.plain_device_bytes(), layers * 4000);
            assert_eq!(p.peak_slots(), 3.min(layers));
        }
        let deep = plan(32, 10, Config::default().prefetch_distance(3)).unwrap();
        assert_eq!(deep.slots(), 1 + 4);
    }

    #[test]
    fn bad_config_shape_and_budget() {
        let zero = Config::default().keep_resident(0);
        assert!(matches!(plan(4, 1, zero), Err(Error::InvalidConfig { field: "keep_resident", .. })));
        assert!(matches!(plan(0, 1, Config::default()), Err(Error::InvalidConfig { field: "layers", .. })));
        let deep = Config::default().in_flight(10_000_000);
        assert!(matches!(plan(4, 1, deep), Err(Error::InvalidConfig { field: "in_flight", .. })));
        assert!(
            plan(4, 1, Config::default().in_flight(1024).prefetch_distance(1024).keep_resident(1024)).is_ok()
        );
        let shape = Shape::of::<f32>(4, 1000);
        assert!(Plan::new(&Config::default(), shape, Budget::Bytes(12_000)).is_ok());
        assert_eq!(
            Plan::new(&Config::default(), shape, Budget::Bytes(11_999)),
            Err(Error::BudgetTooSmall { budget: 11_999, needed: 12_000, what: "the device slot ring" })
        );
        let huge = Shape { layers: 2, boundary_elems: usize::MAX / 2, element_bytes: 4 };
        assert!(matches!(
            Plan::new(&Config::default(), huge, Budget::Unlimited),
            Err(Error::Common(flatpeak_common::Error::SizeOverflow { .. }))
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
