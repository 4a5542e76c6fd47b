//! sco's slot ring for `flatpeak.torch.offload_checkpoints`: the accounting of the device slots
//! ([`sco::SlotRing`], written once in the crate) that the Python side asks before every copy of
//! a checkpoint boundary. The Python side only performs the copies (torch tensors, CUDA side
//! streams) and tells the ring when they land; which slot a boundary gets, which copy to wait
//! for, which boundaries stay resident and when a slot frees are the ring's answers.

use std::collections::HashMap;

use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use sco::ring::{Lend, Reservation, Reserved};
use sco::{Budget, Config, Plan, Shape, SlotRing};

use crate::error::to_py;

/// The slot ring of one checkpointed sequence (`flatpeak._flatpeak.SlotRing`).
#[pyclass(name = "SlotRing", module = "flatpeak._flatpeak")]
#[derive(Debug)]
pub struct PySlotRing {
    plan: Plan,
    ring: SlotRing,
    /// Reservations handed to Python by slot index, until used or cancelled.
    reserved: HashMap<usize, Reserved>,
}

impl PySlotRing {
    fn take(&mut self, slot: usize) -> PyResult<Reserved> {
        self.reserved.remove(&slot).ok_or_else(|| {
            PyRuntimeError::new_err(format!("slot {slot} is not reserved (an internal error of flatpeak)"))
        })
    }
}

#[pymethods]
impl PySlotRing {
    /// The ring of sco's plan for `layers` boundaries of `boundary_bytes` bytes:
    /// `keep_resident` newest boundaries stay on the device, `in_flight` forward copies, and
    /// `prefetch_distance` boundaries fetched ahead in backward.
    #[new]
    #[pyo3(signature = (layers, boundary_bytes, *, keep_resident=1, in_flight=2, prefetch_distance=1))]
    fn new(
        layers: usize,
        boundary_bytes: usize,
        keep_resident: usize,
        in_flight: usize,
        prefetch_distance: usize,
    ) -> PyResult<Self> {
        let config = Config::default()
            .keep_resident(keep_resident)
            .in_flight(in_flight)
            .prefetch_distance(prefetch_distance);
        let shape = Shape { layers, boundary_elems: boundary_bytes, element_bytes: 1 };
        let plan = Plan::new(&config, shape, Budget::Unlimited).map_err(to_py)?;
        Ok(Self { ring: SlotRing::new(&plan), plan, reserved: HashMap::new() })
    }

    /// Device slots, `keep_resident + max(in_flight, prefetch_distance + 1)`.
    fn slots(&self) -> usize {
        self.plan.slots()
    }

    /// The device bytes the ring may hold: slots × boundary bytes.
    fn workspace_bytes(&self) -> usize {
        self.plan.workspace_bytes()
    }

    /// Boundaries per step.
    fn layers(&self) -> usize {
        self.plan.layers()
    }

    /// `("slot", s)`: slot s is reserved for the caller; `("await_d2h", layer)`: wait for that
    /// layer's copy to the host, report it, and ask again.
    fn reserve(&mut self) -> PyResult<(&'static str, usize)> {
        match self.ring.reserve().map_err(to_py)? {
            Reservation::Slot(reserved) => {
                let slot = reserved.slot();
                self.reserved.insert(slot, reserved);
                Ok(("slot", slot))
            }
            Reservation::AwaitD2h(layer) => Ok(("await_d2h", layer)),
        }
    }

    /// Gives back a reserved slot that was not used.
    fn cancel(&mut self, slot: usize) -> PyResult<()> {
        let reserved = self.take(slot)?;
        self.ring.cancel(reserved);
        Ok(())
    }

    /// `layer`'s boundary takes the reserved `slot`, its copy to the host in flight.
    fn offload(&mut self, layer: usize, slot: usize) -> PyResult<usize> {
        let reserved = self.take(slot)?;
        self.ring.offload(layer, reserved).map_err(to_py)
    }

    /// `layer`'s copy to the host landed.
    fn d2h_landed(&mut self, layer: usize) {
        self.ring.d2h_landed(layer);
    }

    /// Marks `layer` wanted on the device; whether that needs a copy back.
    fn want(&mut self, layer: usize) -> PyResult<bool> {
        self.ring.want(layer).map_err(to_py)
    }

    /// Records a copy of `layer` back into the reserved `slot`; `None` when it is already back.
    fn start_h2d(&mut self, layer: usize, slot: usize) -> PyResult<Option<usize>> {
        let reserved = self.take(slot)?;
        self.ring.start_h2d(layer, reserved).map_err(to_py)
    }

    /// `layer`'s copy back landed.
    fn h2d_landed(&mut self, layer: usize) {
        self.ring.h2d_landed(layer);
    }

    /// `("ready", slot)`: `layer` is lent from that slot until `unlend`; `("await_h2d", layer)`:
    /// wait for its copy back, report it, and ask again.
    fn lend(&mut self, layer: usize) -> PyResult<(&'static str, usize)> {
        match self.ring.lend(layer).map_err(to_py)? {
            Lend::Ready(slot) => Ok(("ready", slot)),
            Lend::AwaitH2d => Ok(("await_h2d", layer)),
        }
    }

    /// Where `layer` is resident, without lending it (same answers as `lend`).
    fn resident(&self, layer: usize) -> PyResult<(&'static str, usize)> {
        match self.ring.resident(layer).map_err(to_py)? {
            Lend::Ready(slot) => Ok(("ready", slot)),
            Lend::AwaitH2d => Ok(("await_h2d", layer)),
        }
    }

    /// One reader of `layer` is done.
    fn unlend(&mut self, layer: usize) {
        self.ring.unlend(layer);
    }

    /// Backward is done with `layer`.
    fn release(&mut self, layer: usize) -> PyResult<()> {
        self.ring.release(layer).map_err(to_py)
    }

    /// Whether any copy is in flight.
    fn copies_in_flight(&self) -> bool {
        self.ring.copies_in_flight()
    }

    /// Forgets the step's boundaries (every copy must have landed) and any unused reservation.
    fn finish_step(&mut self) {
        for (_, reserved) in self.reserved.drain() {
            self.ring.cancel(reserved);
        }
        self.ring.finish_step();
    }

    /// Each slot's layer (`None`: free or reserved).
    fn slot_holders(&self) -> Vec<Option<usize>> {
        self.ring.slot_holders()
    }

    /// Slots held now.
    fn slots_in_use(&self) -> usize {
        self.ring.slots_in_use()
    }

    /// The most slots ever held at once (at most `slots()`).
    fn high_water_slots(&self) -> usize {
        self.ring.high_water_slots()
    }

    fn __repr__(&self) -> String {
        format!("SlotRing({:?}, in use {})", self.plan, self.ring.slots_in_use())
    }
}
