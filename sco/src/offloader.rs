//! [`CheckpointOffloader`] on the CPU fallback: a host "device" ring of `plan.slots()` boundary
//! slots (reserved once), a host arena of L slots (reserved once, exact size), and two copy
//! engine threads (D2H, H2D) standing in for the GPU's copy streams. The schedule, the slot
//! accounting and every wait are the ones the CUDA path uses.
//!
//! A boundary's life: `writer()` reserves a free slot (waiting for an in-flight copy to free one);
//! `offload(layer, w)` starts its D2H copy; the k_keep newest stay resident, older ones free their
//! slot when their copy lands. In backward, `prefetch(layer)` starts the H2D copy into a free slot,
//! `fetch(layer)` waits for it and lends the data, `release(layer)` frees the slot.

use std::collections::VecDeque;
use std::ops::{Deref, DerefMut};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::thread::JoinHandle;

use bytemuck::Pod;
use flatpeak_common::Link;

use crate::error::{Error, Result};
use crate::plan::Plan;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
fn read<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|p| p.into_inner())
}
fn write<T>(m: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|p| p.into_inner())
}

/// Where one layer's boundary is, this step.
#[derive(Debug, Clone, Copy, Default)]
struct LayerState {
    offloaded: bool,
    /// Device slot holding (or receiving) the boundary.
    slot: Option<usize>,
    on_host: bool,
    d2h_pending: bool,
    h2d_pending: bool,
    /// Lent out by `fetch`.
    lent: bool,
    /// Among the k_keep newest: not freed when its copy lands.
    kept: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SlotUse {
    Free,
    Writing,
    Layer(usize),
}

#[derive(Debug)]
struct Table {
    layers: Vec<LayerState>,
    slots: Vec<SlotUse>,
    kept: VecDeque<usize>,
    in_use: usize,
    high_water: usize,
    failed: Option<(&'static str, String)>,
}

impl Table {
    fn take_free_slot(&mut self) -> Option<usize> {
        let slot = self.slots.iter().position(|s| *s == SlotUse::Free)?;
        self.slots[slot] = SlotUse::Writing;
        self.in_use += 1;
        self.high_water = self.high_water.max(self.in_use);
        Some(slot)
    }

    fn free_slot(&mut self, slot: usize) {
        self.slots[slot] = SlotUse::Free;
        self.in_use -= 1;
    }

    /// Frees `layer`'s slot if nothing needs it on the device any more.
    fn maybe_evict(&mut self, layer: usize) {
        let st = self.layers[layer];
        if let Some(slot) = st.slot
            && st.on_host
            && !st.d2h_pending
            && !st.h2d_pending
            && !st.lent
            && !st.kept
        {
            self.layers[layer].slot = None;
            self.free_slot(slot);
        }
    }

    /// Whether a pending copy will free a slot without further calls from the schedule.
    fn slot_will_free(&self) -> bool {
        self.layers.iter().any(|l| l.slot.is_some() && l.d2h_pending && !l.kept && !l.lent)
    }
}

#[derive(Debug)]
struct Shared<T> {
    /// Device ring. Readers share (a D2H copy and the layer consuming the boundary run at
    /// once, as on a GPU); writers (a layer's output, an H2D copy) are exclusive.
    slots: Vec<RwLock<Vec<T>>>,
    arena: Vec<RwLock<Vec<T>>>,
    table: Mutex<Table>,
    changed: Condvar,
}

impl<T> Shared<T> {
    /// Waits until `ready` holds, failing when an engine stopped.
    fn wait_until<'a>(
        &'a self,
        mut table: MutexGuard<'a, Table>,
        ready: impl Fn(&Table) -> bool,
    ) -> Result<MutexGuard<'a, Table>> {
        loop {
            if let Some((engine, reason)) = &table.failed {
                return Err(Error::EngineStopped { engine, reason: reason.clone() });
            }
            if ready(&table) {
                return Ok(table);
            }
            table = self.changed.wait(table).unwrap_or_else(|p| p.into_inner());
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Job {
    layer: usize,
    slot: usize,
}

/// Marks the offloader failed if an engine thread unwinds, so waiters get an error, not a hang.
struct EngineGuard<T>(Arc<Shared<T>>, &'static str);

impl<T> Drop for EngineGuard<T> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            lock(&self.0.table).failed = Some((self.1, "panicked".into()));
            self.0.changed.notify_all();
        }
    }
}

/// Offloads L checkpoint boundaries of `plan.boundary_elems()` elements of `T` through a fixed
/// device ring (CPU fallback).
#[derive(Debug)]
pub struct CheckpointOffloader<T: Pod + Send + Sync + 'static> {
    plan: Plan,
    shared: Arc<Shared<T>>,
    d2h: Option<Sender<Job>>,
    h2d: Option<Sender<Job>>,
    engines: Vec<JoinHandle<()>>,
}

impl<T: Pod + Send + Sync + 'static> CheckpointOffloader<T> {
    /// Reserves the device ring and the host arena of `plan` now, and starts the copy engines.
    pub fn new(plan: Plan, link: Link) -> Self {
        let s = plan.boundary_elems();
        let shared = Arc::new(Shared {
            slots: (0..plan.slots()).map(|_| RwLock::new(vec![T::zeroed(); s])).collect(),
            arena: (0..plan.layers()).map(|_| RwLock::new(vec![T::zeroed(); s])).collect(),
            table: Mutex::new(Table {
                layers: vec![LayerState::default(); plan.layers()],
                slots: vec![SlotUse::Free; plan.slots()],
                kept: VecDeque::new(),
                in_use: 0,
                high_water: 0,
                failed: None,
            }),
            changed: Condvar::new(),
        });
        let (d2h_tx, d2h_rx) = channel::<Job>();
        let (h2d_tx, h2d_rx) = channel::<Job>();
        let d2h_shared = Arc::clone(&shared);
        let d2h_engine = std::thread::spawn(move || {
            let _guard = EngineGuard(Arc::clone(&d2h_shared), "d2h");
            for Job { layer, slot } in d2h_rx {
                let (src, mut dst) = (read(&d2h_shared.slots[slot]), write(&d2h_shared.arena[layer]));
                link.copy(&src, &mut dst);
                drop((src, dst));
                let mut table = lock(&d2h_shared.table);
                table.layers[layer].d2h_pending = false;
                table.layers[layer].on_host = true;
                table.maybe_evict(layer);
                drop(table);
                d2h_shared.changed.notify_all();
            }
        });
        let h2d_shared = Arc::clone(&shared);
        let h2d_engine = std::thread::spawn(move || {
            let _guard = EngineGuard(Arc::clone(&h2d_shared), "h2d");
            for Job { layer, slot } in h2d_rx {
                let (src, mut dst) = (read(&h2d_shared.arena[layer]), write(&h2d_shared.slots[slot]));
                link.copy(&src, &mut dst);
                drop((src, dst));
                lock(&h2d_shared.table).layers[layer].h2d_pending = false;
                h2d_shared.changed.notify_all();
            }
        });
        Self { plan, shared, d2h: Some(d2h_tx), h2d: Some(h2d_tx), engines: vec![d2h_engine, h2d_engine] }
    }

    /// The plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer < self.plan.layers() {
            Ok(())
        } else {
            Err(Error::LayerOutOfRange { layer, layers: self.plan.layers() })
        }
    }

    fn send(&self, to_device: bool, job: Job) -> Result<()> {
        let (sender, engine) = if to_device { (&self.h2d, "h2d") } else { (&self.d2h, "d2h") };
        sender
            .as_ref()
            .and_then(|s| s.send(job).ok())
            .ok_or(Error::EngineStopped { engine, reason: "its queue is closed".into() })
    }

    /// Reserves a free device slot, waiting for an in-flight copy to free one;
    /// [`Error::RingFull`] when no copy in flight ever will.
    fn reserve(&self) -> Result<usize> {
        let mut table = lock(&self.shared.table);
        loop {
            if let Some(slot) = table.take_free_slot() {
                return Ok(slot);
            }
            if !table.slot_will_free() && table.failed.is_none() {
                let held = table
                    .slots
                    .iter()
                    .filter_map(|s| if let SlotUse::Layer(l) = s { Some(*l) } else { None })
                    .collect();
                return Err(Error::RingFull { slots: self.plan.slots(), held });
            }
            table =
                self.shared.wait_until(table, |t| t.slots.contains(&SlotUse::Free) || !t.slot_will_free())?;
        }
    }

    /// A free device slot to write a new boundary into (a layer's output, or the stack's input).
    pub fn writer(&self) -> Result<SlotWriter<'_, T>> {
        let slot = self.reserve()?;
        Ok(SlotWriter { offloader: self, slot, data: Some(write(&self.shared.slots[slot])) })
    }

    /// Records `writer`'s slot as `layer`'s boundary and starts its D2H copy. The k_keep newest
    /// boundaries stay resident; an older one frees its slot when its copy lands.
    pub fn offload(&self, layer: usize, mut writer: SlotWriter<'_, T>) -> Result<()> {
        self.check_layer(layer)?;
        let slot = writer.slot;
        let mut table = lock(&self.shared.table);
        if table.layers[layer].offloaded {
            return Err(Error::AlreadyOffloaded { layer }); // the writer's drop frees the slot
        }
        drop(writer.data.take()); // the engine locks the slot to copy it
        writer.slot = usize::MAX; // ownership passes to the layer
        table.slots[slot] = SlotUse::Layer(layer);
        table.layers[layer] = LayerState {
            offloaded: true,
            slot: Some(slot),
            d2h_pending: true,
            kept: true,
            ..Default::default()
        };
        table.kept.push_back(layer);
        while table.kept.len() > self.plan.config().keep_resident {
            if let Some(old) = table.kept.pop_front() {
                table.layers[old].kept = false;
                table.maybe_evict(old);
            }
        }
        drop(table);
        self.send(false, Job { layer, slot })
    }

    /// Copies `tensor` into a slot and offloads it as `layer`'s boundary (the raw API for a
    /// framework that hands over its own tensor).
    pub fn offload_copy(&self, layer: usize, tensor: &[T]) -> Result<()> {
        self.check_layer(layer)?;
        if tensor.len() != self.plan.boundary_elems() {
            return Err(Error::ShapeMismatch {
                what: "boundary tensor (elements)",
                expected: self.plan.boundary_elems(),
                got: tensor.len(),
            });
        }
        let mut writer = self.writer()?;
        writer.copy_from_slice(tensor);
        self.offload(layer, writer)
    }

    /// Starts bringing `layer`'s boundary back to the device (a no-op when it is resident).
    pub fn prefetch(&self, layer: usize) -> Result<()> {
        self.check_layer(layer)?;
        {
            let table = lock(&self.shared.table);
            if !table.layers[layer].offloaded {
                return Err(Error::NotOffloaded { layer });
            }
            if table.layers[layer].slot.is_some() {
                return Ok(());
            }
        }
        let slot = self.reserve()?;
        let mut table = lock(&self.shared.table);
        table.slots[slot] = SlotUse::Layer(layer);
        table.layers[layer].slot = Some(slot);
        table.layers[layer].h2d_pending = true;
        drop(table);
        self.send(true, Job { layer, slot })
    }

    /// `layer`'s boundary on the device (prefetching it if needed), once its copy landed.
    pub fn fetch(&self, layer: usize) -> Result<SlotReader<'_, T>> {
        self.prefetch(layer)?;
        let table = lock(&self.shared.table);
        let mut table = self.shared.wait_until(table, |t| !t.layers[layer].h2d_pending)?;
        let slot = table.layers[layer].slot.ok_or(Error::NotOffloaded { layer })?;
        table.layers[layer].lent = true;
        drop(table);
        Ok(SlotReader { offloader: self, layer, data: read(&self.shared.slots[slot]) })
    }

    /// Backward is done with `layer`'s boundary: its device slot may be reused.
    pub fn release(&self, layer: usize) -> Result<()> {
        self.check_layer(layer)?;
        let mut table = lock(&self.shared.table);
        if !table.layers[layer].offloaded {
            return Err(Error::NotOffloaded { layer });
        }
        table.layers[layer].kept = false;
        table.kept.retain(|&l| l != layer);
        table.maybe_evict(layer);
        drop(table);
        self.shared.changed.notify_all();
        Ok(())
    }

    /// Waits for every copy in flight, then forgets this step's boundaries (the ring and the
    /// arena stay reserved for the next step).
    pub fn finish_step(&mut self) -> Result<()> {
        let table = lock(&self.shared.table);
        let mut table =
            self.shared.wait_until(table, |t| t.layers.iter().all(|l| !l.d2h_pending && !l.h2d_pending))?;
        let layers = table.layers.len();
        table.layers = vec![LayerState::default(); layers];
        table.slots.iter_mut().for_each(|s| *s = SlotUse::Free);
        table.kept.clear();
        table.in_use = 0;
        Ok(())
    }

    /// The most device slots ever held at once.
    pub fn high_water_slots(&self) -> usize {
        lock(&self.shared.table).high_water
    }

    /// Device bytes of the most slots ever held at once.
    pub fn high_water_bytes(&self) -> usize {
        self.high_water_slots() * self.plan.boundary_bytes()
    }
}

impl<T: Pod + Send + Sync + 'static> Drop for CheckpointOffloader<T> {
    fn drop(&mut self) {
        self.d2h.take();
        self.h2d.take();
        for engine in self.engines.drain(..) {
            let _ = engine.join();
        }
    }
}

/// A reserved device slot being written; hand it to [`CheckpointOffloader::offload`]. Dropped
/// without being offloaded, it frees the slot.
#[derive(Debug)]
pub struct SlotWriter<'a, T: Pod + Send + Sync + 'static> {
    offloader: &'a CheckpointOffloader<T>,
    slot: usize,
    data: Option<RwLockWriteGuard<'a, Vec<T>>>,
}

impl<T: Pod + Send + Sync + 'static> Deref for SlotWriter<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        self.data.as_deref().map_or(&[], |v| v.as_slice())
    }
}

impl<T: Pod + Send + Sync + 'static> DerefMut for SlotWriter<'_, T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.data.as_deref_mut().map_or(&mut [], |v| v.as_mut_slice())
    }
}

impl<T: Pod + Send + Sync + 'static> Drop for SlotWriter<'_, T> {
    fn drop(&mut self) {
        self.data.take();
        if self.slot != usize::MAX {
            let shared = &self.offloader.shared;
            lock(&shared.table).free_slot(self.slot);
            shared.changed.notify_all();
        }
    }
}

/// A boundary lent by [`CheckpointOffloader::fetch`].
#[derive(Debug)]
pub struct SlotReader<'a, T: Pod + Send + Sync + 'static> {
    offloader: &'a CheckpointOffloader<T>,
    layer: usize,
    data: RwLockReadGuard<'a, Vec<T>>,
}

impl<T: Pod + Send + Sync + 'static> Deref for SlotReader<'_, T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.data
    }
}

impl<T: Pod + Send + Sync + 'static> Drop for SlotReader<'_, T> {
    fn drop(&mut self) {
        let shared = &self.offloader.shared;
        let mut table = lock(&shared.table);
        table.layers[self.layer].lent = false;
        table.maybe_evict(self.layer);
        drop(table);
        shared.changed.notify_all();
    }
}
