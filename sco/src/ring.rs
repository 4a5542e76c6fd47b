//! [`SlotRing`]: the accounting of the device slot ring, written once. Both offloaders (the CPU
//! fallback's copy threads, the CUDA streams) ask it every question about slots and boundaries
//! (which slot a boundary gets, which copy to wait for, which boundaries stay resident, whether a
//! call is misuse) and only perform the copies and waits it asks for. It does no I/O and never
//! blocks: where a backend must wait, it says for what ([`Reservation::AwaitD2h`],
//! [`Lend::AwaitH2d`]).
//!
//! Memory bound: at most `plan.slots() = k_keep + max(m, d + 1)` slots are held at once (reserved
//! for a write or holding a boundary), so a backend's device memory for boundaries is
//! `plan.workspace_bytes() = slots·s` whatever the depth; [`SlotRing::high_water_slots`] is the
//! most ever held.

use std::collections::VecDeque;

use crate::error::{Error, Result};
use crate::plan::Plan;

/// Where a copy of one boundary stands.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Transfer {
    #[default]
    None,
    InFlight,
    Landed,
}

/// Where one layer's boundary is, this step.
#[derive(Debug, Clone, Copy, Default)]
struct LayerState {
    offloaded: bool,
    /// Device slot holding (or receiving) the boundary.
    slot: Option<usize>,
    d2h: Transfer,
    h2d: Transfer,
    /// Readers it is lent to ([`SlotRing::lend`]): a boundary fetched twice stays on the device
    /// until both readers are done.
    lent: usize,
    /// Among the k_keep newest: stays resident after its D2H copy lands.
    kept: bool,
    /// Wanted in backward ([`SlotRing::want`]): stays resident until released.
    returned: bool,
}

impl LayerState {
    /// Nothing needs the slot once its copy lands.
    fn evictable_after_d2h(&self) -> bool {
        self.slot.is_some()
            && !self.kept
            && self.lent == 0
            && !self.returned
            && self.h2d != Transfer::InFlight
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotUse {
    Free,
    Reserved,
    Layer(usize),
}

/// A slot handed out by [`SlotRing::reserve`], to be used once: by [`SlotRing::offload`],
/// [`SlotRing::start_h2d`], or given back with [`SlotRing::cancel`]. Not `Clone`, so a slot
/// cannot be handed to two boundaries.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a reserved slot stays held until offloaded, filled or cancelled"]
pub struct Reserved(usize);

impl Reserved {
    /// The slot's index in `0..plan.slots()`.
    pub fn slot(&self) -> usize {
        self.0
    }
}

/// What [`SlotRing::reserve`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Reservation {
    /// A free slot, now reserved for the caller.
    Slot(Reserved),
    /// No slot is free, but this layer's D2H copy frees one when it lands: wait for it, report
    /// [`SlotRing::d2h_landed`], and ask again.
    AwaitD2h(usize),
}

/// What [`SlotRing::lend`] and [`SlotRing::resident`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lend {
    /// The boundary is in this slot and its copy (if any) has landed.
    Ready(usize),
    /// Its H2D copy is in flight: wait for it, report [`SlotRing::h2d_landed`], and ask again.
    AwaitH2d,
}

/// The slot ring's accounting for one [`Plan`]: `plan.slots()` device slots and
/// `plan.layers()` boundaries per step. Pure bookkeeping; see the module docs for the bound.
#[derive(Debug)]
pub struct SlotRing {
    slots: Vec<SlotUse>,
    layers: Vec<LayerState>,
    kept: VecDeque<usize>,
    keep_resident: usize,
    in_use: usize,
    high_water: usize,
}

impl SlotRing {
    /// All slots free, no boundary offloaded.
    pub fn new(plan: &Plan) -> Self {
        Self {
            slots: vec![SlotUse::Free; plan.slots()],
            layers: vec![LayerState::default(); plan.layers()],
            kept: VecDeque::new(),
            keep_resident: plan.config().keep_resident,
            in_use: 0,
            high_water: 0,
        }
    }

    /// [`Error::LayerOutOfRange`] unless `layer < plan.layers()`.
    pub fn check_layer(&self, layer: usize) -> Result<()> {
        if layer < self.layers.len() {
            Ok(())
        } else {
            Err(Error::LayerOutOfRange { layer, layers: self.layers.len() })
        }
    }

    fn state(&self, layer: usize) -> Result<LayerState> {
        self.check_layer(layer)?;
        Ok(self.layers[layer])
    }

    fn offloaded(&self, layer: usize) -> Result<LayerState> {
        let st = self.state(layer)?;
        if st.offloaded { Ok(st) } else { Err(Error::NotOffloaded { layer }) }
    }

    /// Whether `layer` may be offloaded now: in range and not offloaded yet this step.
    pub fn check_offload(&self, layer: usize) -> Result<()> {
        if self.state(layer)?.offloaded { Err(Error::AlreadyOffloaded { layer }) } else { Ok(()) }
    }

    /// A free slot, or the D2H copy to wait for before one is free, or [`Error::RingFull`] when
    /// every slot is held by something no copy in flight will release.
    pub fn reserve(&mut self) -> Result<Reservation> {
        if let Some(slot) = self.slots.iter().position(|s| *s == SlotUse::Free) {
            self.slots[slot] = SlotUse::Reserved;
            self.in_use += 1;
            self.high_water = self.high_water.max(self.in_use);
            return Ok(Reservation::Slot(Reserved(slot)));
        }
        let frees = |st: &LayerState| st.d2h == Transfer::InFlight && st.evictable_after_d2h();
        match self.layers.iter().position(frees) {
            Some(layer) => Ok(Reservation::AwaitD2h(layer)),
            None => Err(Error::RingFull { slots: self.slots.len(), held: self.held_layers() }),
        }
    }

    /// Gives back a reservation that was not used.
    pub fn cancel(&mut self, reserved: Reserved) {
        self.free(reserved.0);
    }

    fn free(&mut self, slot: usize) {
        if let Some(s) = self.slots.get_mut(slot)
            && *s != SlotUse::Free
        {
            *s = SlotUse::Free;
            self.in_use -= 1;
        }
    }

    /// Records `reserved`'s slot as `layer`'s boundary with its D2H copy in flight, and returns
    /// the slot. The k_keep newest boundaries stay resident; an older one is evicted when its
    /// copy has landed. On error ([`Error::LayerOutOfRange`], [`Error::AlreadyOffloaded`]) the
    /// slot is freed and nothing else changes.
    pub fn offload(&mut self, layer: usize, reserved: Reserved) -> Result<usize> {
        if let Err(e) = self.check_offload(layer) {
            self.cancel(reserved);
            return Err(e);
        }
        let slot = reserved.0;
        self.slots[slot] = SlotUse::Layer(layer);
        self.layers[layer] = LayerState {
            offloaded: true,
            slot: Some(slot),
            d2h: Transfer::InFlight,
            kept: true,
            ..Default::default()
        };
        self.kept.push_back(layer);
        while self.kept.len() > self.keep_resident {
            if let Some(old) = self.kept.pop_front() {
                self.layers[old].kept = false;
                self.maybe_evict(old);
            }
        }
        Ok(slot)
    }

    /// `layer`'s D2H copy landed: the boundary is on the host; its slot is freed unless it is
    /// kept, lent or being refilled.
    pub fn d2h_landed(&mut self, layer: usize) {
        if let Some(st) = self.layers.get_mut(layer)
            && st.d2h == Transfer::InFlight
        {
            st.d2h = Transfer::Landed;
            self.maybe_evict(layer);
        }
    }

    fn maybe_evict(&mut self, layer: usize) {
        let st = self.layers[layer];
        if let Some(slot) = st.slot
            && st.d2h == Transfer::Landed
            && st.evictable_after_d2h()
        {
            self.layers[layer].slot = None;
            self.free(slot);
        }
    }

    /// Marks `layer`'s boundary wanted on the device until [`release`](Self::release) (a resident
    /// boundary that is not among the kept newest stops being evictable), and says whether that
    /// needs an H2D copy (false: it is resident, or on its way). [`Error::NotOffloaded`] for a
    /// boundary never offloaded this step.
    pub fn want(&mut self, layer: usize) -> Result<bool> {
        let st = self.offloaded(layer)?;
        if st.slot.is_some() && !st.kept {
            self.layers[layer].returned = true;
        }
        Ok(st.slot.is_none())
    }

    /// Whether `layer`'s boundary holds a device slot now (resident, or its H2D in flight).
    pub fn on_device(&self, layer: usize) -> bool {
        self.layers.get(layer).is_some_and(|st| st.slot.is_some())
    }

    /// Records an H2D copy of `layer` into `reserved`'s slot and returns the slot to copy into;
    /// `None` (the reservation given back) when another call brought it back meanwhile. The
    /// boundary then stays resident until [`release`](Self::release).
    pub fn start_h2d(&mut self, layer: usize, reserved: Reserved) -> Result<Option<usize>> {
        match self.want(layer) {
            Ok(true) => {}
            other => {
                self.cancel(reserved);
                return other.map(|_| None);
            }
        }
        let slot = reserved.0;
        self.slots[slot] = SlotUse::Layer(layer);
        let st = &mut self.layers[layer];
        st.slot = Some(slot);
        st.h2d = Transfer::InFlight;
        st.returned = true;
        Ok(Some(slot))
    }

    /// `layer`'s H2D copy landed.
    pub fn h2d_landed(&mut self, layer: usize) {
        if let Some(st) = self.layers.get_mut(layer)
            && st.h2d == Transfer::InFlight
        {
            st.h2d = Transfer::Landed;
            self.maybe_evict(layer);
        }
    }

    /// Where `layer`'s boundary is on the device, without lending it. [`Error::NotOffloaded`]
    /// when it was never offloaded, or is not resident (prefetch it first).
    pub fn resident(&self, layer: usize) -> Result<Lend> {
        let st = self.offloaded(layer)?;
        match (st.slot, st.h2d) {
            (None, _) => Err(Error::NotOffloaded { layer }),
            (Some(_), Transfer::InFlight) => Ok(Lend::AwaitH2d),
            (Some(slot), _) => Ok(Lend::Ready(slot)),
        }
    }

    /// As [`resident`](Self::resident), and when ready lends the boundary: its slot is not
    /// reused until [`unlend`](Self::unlend).
    pub fn lend(&mut self, layer: usize) -> Result<Lend> {
        let found = self.resident(layer)?;
        if let Lend::Ready(_) = found {
            self.layers[layer].lent += 1;
        }
        Ok(found)
    }

    /// One reader of `layer`'s boundary is done (its slot may be freed once the last one is).
    pub fn unlend(&mut self, layer: usize) {
        if let Some(st) = self.layers.get_mut(layer) {
            st.lent = st.lent.saturating_sub(1);
            self.maybe_evict(layer);
        }
    }

    /// Backward is done with `layer`'s boundary: its slot is freed once its D2H copy has landed
    /// and no reader holds it.
    pub fn release(&mut self, layer: usize) -> Result<()> {
        self.offloaded(layer)?;
        self.layers[layer].kept = false;
        self.layers[layer].returned = false;
        self.kept.retain(|&l| l != layer);
        self.maybe_evict(layer);
        Ok(())
    }

    /// Whether any copy is in flight.
    pub fn copies_in_flight(&self) -> bool {
        self.layers.iter().any(|l| l.d2h == Transfer::InFlight || l.h2d == Transfer::InFlight)
    }

    /// Forgets this step's boundaries and frees their slots; call once every copy has landed.
    /// Outstanding reservations stay reserved (and valid); the high-water mark is kept.
    pub fn finish_step(&mut self) {
        self.layers.iter_mut().for_each(|l| *l = LayerState::default());
        for s in &mut self.slots {
            if let SlotUse::Layer(_) = s {
                *s = SlotUse::Free;
            }
        }
        self.kept.clear();
        self.in_use = self.slots.iter().filter(|s| **s == SlotUse::Reserved).count();
    }

    /// Slots held now (reserved or holding a boundary).
    pub fn slots_in_use(&self) -> usize {
        self.in_use
    }

    /// The most slots ever held at once; at most `plan.slots()`.
    pub fn high_water_slots(&self) -> usize {
        self.high_water
    }

    /// The layers whose boundaries hold a slot, by slot.
    pub fn held_layers(&self) -> Vec<usize> {
        self.slots.iter().filter_map(|s| if let SlotUse::Layer(l) = s { Some(*l) } else { None }).collect()
    }

    /// Each slot's boundary: `Some(layer)` for a slot holding one, `None` for a free or a reserved
    /// slot. A backend that keeps its own handle per slot (a binding's tensor) drops the handle of
    /// a slot whose layer changed.
    pub fn slot_holders(&self) -> Vec<Option<usize>> {
        self.slots.iter().map(|s| if let SlotUse::Layer(l) = s { Some(*l) } else { None }).collect()
    }
}

#[cfg(test)]
mod tests {
    use flatpeak_common::{Budget, SplitMix64};

    use super::*;
    use crate::plan::{Config, Shape};

    fn ring(layers: usize, config: Config) -> SlotRing {
        SlotRing::new(&Plan::new(&config, Shape::of::<f32>(layers, 4), Budget::Unlimited).unwrap())
    }

    fn slot(r: Result<Reservation>) -> Reserved {
        match r {
            Ok(Reservation::Slot(s)) => s,
            other => panic!("expected a free slot, got {other:?}"),
        }
    }

    /// A backend whose copies land in random order, driven with the stack's schedule.
    struct Sim {
        ring: SlotRing,
        d2h: Vec<usize>,
        h2d: Vec<usize>,
        rng: SplitMix64,
        slots: usize,
    }

    impl Sim {
        fn check(&self) {
            assert!(self.ring.slots_in_use() <= self.slots);
            assert!(self.ring.high_water_slots() <= self.slots);
        }
        /// Lands some copies in flight, at random.
        fn progress(&mut self) {
            while !self.d2h.is_empty() && self.rng.below(3) == 0 {
                let l = self.d2h.remove(self.rng.below(self.d2h.len() as u64) as usize);
                self.ring.d2h_landed(l);
            }
            while !self.h2d.is_empty() && self.rng.below(3) == 0 {
                let l = self.h2d.remove(self.rng.below(self.h2d.len() as u64) as usize);
                self.ring.h2d_landed(l);
            }
            self.check();
        }
        fn reserve(&mut self) -> Reserved {
            loop {
                match self.ring.reserve().expect("the plan's slots suffice") {
                    Reservation::Slot(r) => return r,
                    Reservation::AwaitD2h(l) => {
                        assert!(self.d2h.contains(&l), "layer {l}'s D2H is in flight");
                        self.d2h.retain(|&x| x != l);
                        self.ring.d2h_landed(l);
                    }
                }
            }
        }
        fn offload(&mut self, layer: usize, r: Reserved) {
            self.ring.offload(layer, r).expect("offload");
            self.d2h.push(layer);
            self.progress();
        }
        fn prefetch(&mut self, layer: usize) {
            if self.ring.want(layer).expect("offloaded") {
                let r = self.reserve();
                if self.ring.start_h2d(layer, r).expect("start").is_some() {
                    self.h2d.push(layer);
                }
            }
            self.progress();
        }
        fn lend(&mut self, layer: usize) {
            self.prefetch(layer);
            while self.ring.lend(layer).expect("lend") == Lend::AwaitH2d {
                self.h2d.retain(|&x| x != layer);
                self.ring.h2d_landed(layer);
            }
            self.check();
        }
    }

    #[test]
    fn the_stack_schedule_stays_in_the_plans_slots_whatever_the_copy_timing() {
        let configs = [(1, 2, 1), (1, 1, 0), (2, 2, 1), (1, 2, 3), (3, 1, 2), (2, 4, 0)];
        for (seed, (k, m, d)) in configs.into_iter().enumerate() {
            let config = Config::default().keep_resident(k).in_flight(m).prefetch_distance(d);
            for layers in [1usize, 2, 3, 7, 20] {
                let ring = ring(layers, config);
                let slots = k + m.max(d + 1);
                let rng = SplitMix64::new(seed as u64 * 100 + layers as u64);
                let mut sim = Sim { ring, d2h: Vec::new(), h2d: Vec::new(), rng, slots };
                for _step in 0..3 {
                    let r = sim.reserve();
                    sim.offload(0, r);
                    for i in 0..layers {
                        sim.lend(i);
                        if i + 1 < layers {
                            let r = sim.reserve();
                            sim.ring.unlend(i);
                            sim.offload(i + 1, r);
                        } else {
                            sim.ring.unlend(i);
                        }
                    }
                    for i in (0..layers).rev() {
                        if d > 0 && i >= d {
                            sim.prefetch(i - d);
                        }
                        sim.lend(i);
                        sim.ring.unlend(i);
                        sim.ring.release(i).expect("release");
                        sim.progress();
                    }
                    for l in std::mem::take(&mut sim.d2h) {
                        sim.ring.d2h_landed(l);
                    }
                    for l in std::mem::take(&mut sim.h2d) {
                        sim.ring.h2d_landed(l);
                    }
                    assert!(!sim.ring.copies_in_flight());
                    assert_eq!(sim.ring.slots_in_use(), 0, "every slot freed by the end of backward");
                    sim.ring.finish_step();
                }
                assert!(sim.ring.high_water_slots() <= slots.min(layers), "{config:?} L={layers}");
            }
        }
    }

    #[test]
    fn misuse_is_a_typed_error_and_changes_nothing() {
        let mut ring = ring(4, Config::default());
        assert_eq!(ring.want(1), Err(Error::NotOffloaded { layer: 1 }));
        assert_eq!(ring.lend(1), Err(Error::NotOffloaded { layer: 1 }));
        assert_eq!(ring.release(0), Err(Error::NotOffloaded { layer: 0 }));
        assert_eq!(ring.want(4), Err(Error::LayerOutOfRange { layer: 4, layers: 4 }));
        let r = slot(ring.reserve());
        assert_eq!(ring.offload(4, r), Err(Error::LayerOutOfRange { layer: 4, layers: 4 }));
        assert_eq!(ring.slots_in_use(), 0, "the failed offload gave its slot back");
        let r = slot(ring.reserve());
        let first = ring.offload(1, r).unwrap();
        let r = slot(ring.reserve());
        assert_eq!(ring.offload(1, r), Err(Error::AlreadyOffloaded { layer: 1 }));
        assert_eq!(ring.check_offload(1), Err(Error::AlreadyOffloaded { layer: 1 }));
        assert_eq!((ring.slots_in_use(), ring.lend(1)), (1, Ok(Lend::Ready(first))));
        // An H2D into a slot for a boundary that is resident: the reservation comes back.
        let r = slot(ring.reserve());
        assert_eq!(ring.start_h2d(1, r), Ok(None));
        let r = slot(ring.reserve());
        assert_eq!(ring.start_h2d(2, r), Err(Error::NotOffloaded { layer: 2 }));
        assert_eq!(ring.slots_in_use(), 1);
    }

    #[test]
    fn a_full_ring_names_the_copy_to_wait_for_or_is_an_error() {
        let mut ring = ring(8, Config::default()); // 3 slots, the newest kept
        for layer in 0..3 {
            let r = slot(ring.reserve());
            ring.offload(layer, r).unwrap();
        }
        // Layers 0 and 1 are no longer kept; their copies are in flight.
        assert_eq!(ring.reserve(), Ok(Reservation::AwaitD2h(0)));
        // Wanted for backward: layer 1 stays resident until released.
        assert_eq!(ring.want(1), Ok(false));
        ring.d2h_landed(0);
        assert!(!ring.on_device(0), "evicted once its copy landed");
        let held = slot(ring.reserve());
        // Lent and kept boundaries are never waited for: 1 is lent, 2 is kept, the third slot
        // is reserved.
        assert_eq!(ring.lend(1), Ok(Lend::Ready(1)));
        assert_eq!(ring.reserve(), Err(Error::RingFull { slots: 3, held: vec![1, 2] }));
        ring.unlend(1);
        assert!(matches!(ring.reserve(), Err(Error::RingFull { .. })), "1 is wanted until released");
        ring.release(1).unwrap();
        assert_eq!(ring.reserve(), Ok(Reservation::AwaitD2h(1)));
        ring.cancel(held);
        assert!(matches!(ring.reserve(), Ok(Reservation::Slot(_))));
        assert_eq!(ring.high_water_slots(), 3);
    }

    #[test]
    fn kept_lent_and_released_boundaries() {
        let mut ring = ring(4, Config::default().keep_resident(2));
        let r = slot(ring.reserve());
        ring.offload(0, r).unwrap();
        ring.d2h_landed(0);
        assert!(ring.on_device(0), "kept: resident after its copy");
        let r = slot(ring.reserve());
        ring.offload(1, r).unwrap();
        let r = slot(ring.reserve());
        ring.offload(2, r).unwrap();
        assert!(!ring.on_device(0), "no longer among the 2 newest: evicted");
        // Released while lent and in flight: freed only once both are over.
        assert_eq!(ring.lend(2), Ok(Lend::Ready(2)));
        ring.release(2).unwrap();
        ring.d2h_landed(2);
        assert!(ring.on_device(2), "lent");
        ring.unlend(2);
        assert!(!ring.on_device(2));
        // Brought back: not ready until its H2D lands.
        let r = slot(ring.reserve());
        let s = ring.start_h2d(2, r).unwrap().unwrap();
        assert_eq!(ring.lend(2), Ok(Lend::AwaitH2d));
        ring.h2d_landed(2);
        assert_eq!(ring.lend(2), Ok(Lend::Ready(s)));
        ring.unlend(2);
        assert!(ring.on_device(2), "brought back: resident until released");
        ring.release(2).unwrap();
        assert!(!ring.on_device(2));
        assert!(ring.copies_in_flight(), "layer 1's D2H");
        ring.d2h_landed(1);
        assert!(!ring.copies_in_flight());
        let pending = slot(ring.reserve());
        ring.finish_step();
        assert_eq!((ring.slots_in_use(), ring.held_layers()), (1, vec![]), "the reservation survives");
        ring.cancel(pending);
        assert_eq!(ring.slots_in_use(), 0);
        assert_eq!(ring.want(2), Err(Error::NotOffloaded { layer: 2 }));
        assert_eq!(ring.high_water_slots(), 3, "the high-water mark outlives the step");
    }
}
