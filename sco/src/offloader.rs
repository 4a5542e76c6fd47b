//! [`CheckpointOffloader`] on the CPU fallback: a host "device" ring of `plan.slots()` boundary
//! slots (reserved once), a host arena of L slots (reserved once, exact size), and two copy
//! engine threads (D2H, H2D) standing in for the GPU's copy streams. Every decision about slots
//! is the [`SlotRing`]'s, the same accounting the CUDA offloader uses; this file only copies and
//! waits.
//!
//! Memory bound: `plan.workspace_bytes() = slots·s` bytes of ring, `plan.host_arena_bytes() =
//! L·s` of arena, whatever the schedule does.
//!
//! A boundary's life: `writer()` reserves a free slot (waiting for an in-flight copy to free one);
//! `offload(layer, w)` starts its D2H copy; the k_keep newest stay resident, older ones free their
//! slot when their copy lands. In backward, `prefetch(layer)` starts the H2D copy into a free slot
//! (or keeps a resident boundary where it is), `fetch(layer)` waits for it and lends the data,
//! `release(layer)` frees the slot.

use std::ops::{Deref, DerefMut};
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytemuck::Pod;
use flatpeak_common::Link;

use crate::error::{Error, Result};
use crate::plan::Plan;
use crate::ring::{Lend, Reservation, Reserved, SlotRing};
use crate::store::{CheckpointStore, Host, check_len};

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
fn read<T>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|p| p.into_inner())
}
fn write<T>(m: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|p| p.into_inner())
}

#[derive(Debug)]
struct Table {
    ring: SlotRing,
    failed: Option<(&'static str, String)>,
}

#[derive(Debug)]
struct Shared<T> {
    /// Device ring. Readers share (a D2H copy and the layer consuming the boundary run at
    /// once, as on a GPU); writers (a layer's output, an H2D copy) are exclusive.
    slots: Vec<RwLock<Vec<T>>>,
    arena: Vec<RwLock<Vec<T>>>,
    table: Mutex<Table>,
    changed: Condvar,
    /// The longest one wait may take (the config's `wait_timeout`).
    timeout: Duration,
}

impl<T> Shared<T> {
    /// Runs `step` on the table until it returns `Some`, waiting for a copy to land in between;
    /// fails when an engine stopped, and with [`Error::Timeout`] (failing the offloader) when
    /// no copy lands within the timeout.
    fn wait_for<R>(
        &self,
        what: &'static str,
        mut step: impl FnMut(&mut Table) -> Result<Option<R>>,
    ) -> Result<R> {
        let start = Instant::now();
        let mut table = lock(&self.table);
        loop {
            if let Some((engine, reason)) = &table.failed {
                return Err(Error::EngineStopped { engine, reason: reason.clone() });
            }
            if let Some(done) = step(&mut table)? {
                return Ok(done);
            }
            let waited = start.elapsed();
            let Some(left) = self.timeout.checked_sub(waited).filter(|left| !left.is_zero()) else {
                table.failed = Some(("offloader", format!("a wait for {what} timed out after {waited:?}")));
                self.changed.notify_all();
                return Err(Error::Timeout { what, waited });
            };
            table = self.changed.wait_timeout(table, left).unwrap_or_else(|p| p.into_inner()).0;
        }
    }

    /// Updates the table and wakes the waiters.
    fn update<R>(&self, f: impl FnOnce(&mut SlotRing) -> R) -> R {
        let done = f(&mut lock(&self.table).ring);
        self.changed.notify_all();
        done
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
/// device ring (CPU fallback). Holds `plan.workspace_bytes()` of ring and
/// `plan.host_arena_bytes()` of arena from construction to drop, never more.
#[derive(Debug)]
pub struct CheckpointOffloader<T: Pod + Send + Sync + 'static> {
    plan: Plan,
    shared: Arc<Shared<T>>,
    d2h: Option<Sender<Job>>,
    h2d: Option<Sender<Job>>,
    engines: Vec<JoinHandle<()>>,
}

/// A copy engine: copies each job between its slot and the arena and reports it landed.
fn engine<T: Pod + Send + Sync + 'static>(
    shared: Arc<Shared<T>>,
    to_device: bool,
    link: Link,
    jobs: std::sync::mpsc::Receiver<Job>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let _guard = EngineGuard(Arc::clone(&shared), if to_device { "h2d" } else { "d2h" });
        for Job { layer, slot } in jobs {
            if !to_device {
                link.copy(&read(&shared.slots[slot]), &mut write(&shared.arena[layer]));
                shared.update(|ring| ring.d2h_landed(layer));
            } else {
                link.copy(&read(&shared.arena[layer]), &mut write(&shared.slots[slot]));
                shared.update(|ring| ring.h2d_landed(layer));
            }
        }
    })
}

impl<T: Pod + Send + Sync + 'static> CheckpointOffloader<T> {
    /// Reserves the device ring and the host arena of `plan` now, and starts the copy engines.
    /// A reservation the system refuses is `Common(HostAlloc)` with its size (never an abort);
    /// a bad link bandwidth is `Common(InvalidConfig)`.
    pub fn new(plan: Plan, link: Link) -> Result<Self> {
        link.validate()?;
        let s = plan.boundary_elems();
        let buffers = |what: &'static str, count: usize| -> Result<Vec<RwLock<Vec<T>>>> {
            let refused = || flatpeak_common::Error::HostAlloc { what, bytes: plan.boundary_bytes() };
            let mut all = Vec::new();
            all.try_reserve_exact(count).map_err(|_| refused())?;
            for _ in 0..count {
                let mut buffer = Vec::new();
                buffer.try_reserve_exact(s).map_err(|_| refused())?;
                buffer.resize(s, T::zeroed());
                all.push(RwLock::new(buffer));
            }
            Ok(all)
        };
        let shared = Arc::new(Shared {
            slots: buffers("a device-ring slot", plan.slots())?,
            arena: buffers("a host-arena slot", plan.layers())?,
            table: Mutex::new(Table { ring: SlotRing::new(&plan), failed: None }),
            changed: Condvar::new(),
            timeout: plan.config().wait_timeout,
        });
        let (d2h_tx, d2h_rx) = channel::<Job>();
        let (h2d_tx, h2d_rx) = channel::<Job>();
        let engines = vec![
            engine(Arc::clone(&shared), false, link, d2h_rx),
            engine(Arc::clone(&shared), true, link, h2d_rx),
        ];
        Ok(Self { plan, shared, d2h: Some(d2h_tx), h2d: Some(h2d_tx), engines })
    }

    /// The plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
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
    fn reserve(&self) -> Result<Reserved> {
        self.shared.wait_for("a free device slot", |table| match table.ring.reserve()? {
            Reservation::Slot(reserved) => Ok(Some(reserved)),
            Reservation::AwaitD2h(_) => Ok(None),
        })
    }

    /// A free device slot to write a new boundary into (a layer's output, or the stack's input).
    pub fn writer(&self) -> Result<SlotWriter<'_, T>> {
        let reserved = self.reserve()?;
        let data = write(&self.shared.slots[reserved.slot()]);
        Ok(SlotWriter { offloader: self, reserved: Some(reserved), data: Some(data) })
    }

    /// Records `writer`'s slot as `layer`'s boundary and starts its D2H copy. The k_keep newest
    /// boundaries stay resident; an older one frees its slot when its copy lands.
    pub fn offload(&self, layer: usize, mut writer: SlotWriter<'_, T>) -> Result<()> {
        drop(writer.data.take()); // the engine locks the slot to copy it
        // Always there: only `offload` (which consumes the writer) and the drop take it.
        let reserved = writer.reserved.take().ok_or(Error::AlreadyOffloaded { layer })?;
        let slot = self.shared.update(|ring| ring.offload(layer, reserved))?;
        self.send(false, Job { layer, slot })
    }

    /// Copies `tensor` into a slot and offloads it as `layer`'s boundary (the raw API for a
    /// framework that hands over its own tensor).
    pub fn offload_copy(&self, layer: usize, tensor: &[T]) -> Result<()> {
        lock(&self.shared.table).ring.check_layer(layer)?;
        check_len("boundary tensor (elements)", self.plan.boundary_elems(), tensor.len())?;
        let mut writer = self.writer()?;
        writer.copy_from_slice(tensor);
        self.offload(layer, writer)
    }

    /// Starts bringing `layer`'s boundary back to the device (a no-op when it is resident); it
    /// then stays there until [`release`](Self::release) (one of the k_keep newest: until then,
    /// or until newer boundaries displace it).
    pub fn prefetch(&self, layer: usize) -> Result<()> {
        if !lock(&self.shared.table).ring.want(layer)? {
            return Ok(());
        }
        let reserved = self.reserve()?;
        match self.shared.update(|ring| ring.start_h2d(layer, reserved))? {
            Some(slot) => self.send(true, Job { layer, slot }),
            None => Ok(()),
        }
    }

    /// `layer`'s boundary on the device (prefetching it if needed), once its copy landed; it
    /// then stays there as after [`prefetch`](Self::prefetch).
    pub fn fetch(&self, layer: usize) -> Result<SlotReader<'_, T>> {
        self.prefetch(layer)?;
        let slot =
            self.shared.wait_for("a boundary's H2D copy", |table| match table.ring.lend(layer)? {
                Lend::Ready(slot) => Ok(Some(slot)),
                Lend::AwaitH2d => Ok(None),
            })?;
        Ok(SlotReader { offloader: self, layer, data: read(&self.shared.slots[slot]) })
    }

    /// Backward is done with `layer`'s boundary: its device slot may be reused.
    pub fn release(&self, layer: usize) -> Result<()> {
        self.shared.update(|ring| ring.release(layer))
    }

    /// Waits for every copy in flight, then forgets this step's boundaries (the ring and the
    /// arena stay reserved for the next step).
    pub fn finish_step(&mut self) -> Result<()> {
        self.shared.wait_for("every copy in flight", |table| {
            let done = !table.ring.copies_in_flight();
            if done {
                table.ring.finish_step();
            }
            Ok(done.then_some(()))
        })
    }

    /// The most device slots ever held at once.
    pub fn high_water_slots(&self) -> usize {
        lock(&self.shared.table).ring.high_water_slots()
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

impl<T: Pod + Send + Sync + std::fmt::Debug + 'static> CheckpointStore for CheckpointOffloader<T> {
    type Tensors = Host<T>;

    fn plan(&self) -> &Plan {
        &self.plan
    }
    fn tensors(&self) -> Host<T> {
        Host::new()
    }
    fn offload_from(&mut self, layer: usize, tensor: &[T]) -> Result<()> {
        self.offload_copy(layer, tensor)
    }
    fn forward_into<R>(&mut self, layer: usize, f: impl FnOnce(&[T], &mut [T]) -> Result<R>) -> Result<R> {
        let next = layer.saturating_add(1);
        lock(&self.shared.table).ring.check_offload(next)?;
        let x = self.fetch(layer)?;
        let mut y = self.writer()?;
        let done = f(&x, &mut y)?; // on error, dropping `y` gives its slot back
        drop(x);
        self.offload(next, y)?;
        Ok(done)
    }
    fn prefetch(&mut self, layer: usize) -> Result<()> {
        CheckpointOffloader::prefetch(self, layer)
    }
    fn fetch_with<R>(&mut self, layer: usize, f: impl FnOnce(&[T]) -> Result<R>) -> Result<R> {
        f(&self.fetch(layer)?)
    }
    fn release(&mut self, layer: usize) -> Result<()> {
        CheckpointOffloader::release(self, layer)
    }
    fn finish_step(&mut self) -> Result<()> {
        CheckpointOffloader::finish_step(self)
    }
    fn high_water_bytes(&self) -> usize {
        CheckpointOffloader::high_water_bytes(self)
    }
}

/// A reserved device slot being written; hand it to [`CheckpointOffloader::offload`]. Dropped
/// without being offloaded, it frees the slot.
#[derive(Debug)]
pub struct SlotWriter<'a, T: Pod + Send + Sync + 'static> {
    offloader: &'a CheckpointOffloader<T>,
    reserved: Option<Reserved>,
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
        if let Some(reserved) = self.reserved.take() {
            self.offloader.shared.update(|ring| ring.cancel(reserved));
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
        let layer = self.layer;
        self.offloader.shared.update(|ring| ring.unlend(layer));
    }
}
