//! The CUDA offloader (feature `cuda`): the device ring as `slots` separate allocations (so
//! cudarc's per-allocation events order every access to a slot, and nothing else), the host
//! arena as one page-locked allocation of exactly `L·s` bytes, D2H and H2D on their own streams.
//! Ordering rules, each the fix for a known offload bug:
//! - a D2H copy starts after the compute that wrote the slot (cudarc's write event on the slot);
//! - an H2D copy into a slot starts after the compute that last read it (its read event) and
//!   after the D2H of that boundary landed (`d2h_done[layer]` waited on by the H2D stream);
//! - compute reading a fetched boundary waits on `h2d_done[layer]` on the compute stream, the
//!   stream that runs the kernels (not the copy stream);
//! - a slot is reused for a new boundary only after its D2H landed (`d2h_done`, host wait).
//!
//! The arena and the ring are allocated once, at construction, never on the fly.

use std::sync::Arc;

use flatpeak_common::cuda::cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
    DeviceRepr, PinnedHostSlice, ValidAsZeroBits, result,
};
use flatpeak_common::cuda::{context, cuda_error};

use crate::error::{Error, Result};
use crate::plan::Plan;

#[derive(Debug, Clone, Copy, Default)]
struct LayerState {
    offloaded: bool,
    slot: Option<usize>,
    /// D2H issued (its event is `d2h_done[layer]`).
    d2h_issued: bool,
    /// H2D issued this step (its event is `h2d_done[layer]`).
    h2d_issued: bool,
    kept: bool,
}

/// Offloads L checkpoint boundaries of `T` on a CUDA device through a fixed ring.
#[derive(Debug)]
pub struct CudaCheckpointOffloader<T: DeviceRepr> {
    plan: Plan,
    compute: Arc<CudaStream>,
    d2h: Arc<CudaStream>,
    h2d: Arc<CudaStream>,
    ring: Vec<CudaSlice<T>>,
    arena: PinnedHostSlice<T>,
    d2h_done: Vec<CudaEvent>,
    h2d_done: Vec<CudaEvent>,
    layers: Vec<LayerState>,
    slot_owner: Vec<Option<usize>>,
    kept: std::collections::VecDeque<usize>,
    high_water: usize,
}

impl<T: DeviceRepr + ValidAsZeroBits> CudaCheckpointOffloader<T> {
    /// Allocates the ring on device `ordinal` and the pinned arena now; compute runs on the
    /// context's default stream (see [`CudaCheckpointOffloader::compute_stream`]).
    pub fn new(plan: Plan, ordinal: usize) -> Result<Self> {
        let ctx: Arc<CudaContext> = context(ordinal)?;
        let compute = ctx.default_stream();
        let s = plan.boundary_elems().max(1);
        let ring = (0..plan.slots())
            .map(|_| compute.alloc_zeros::<T>(s).map_err(cuda_error("cuMemAlloc")).map_err(Error::from))
            .collect::<Result<Vec<_>>>()?;
        let bytes = plan.host_arena_bytes();
        // SAFETY: the arena is `Pod`-like storage (`ValidAsZeroBits`); every slot of it is
        // written by a D2H copy before an H2D copy reads it (`offloaded` is checked).
        let arena = unsafe { ctx.alloc_pinned_with_flags::<T>(plan.layers() * s, 0) }
            .map_err(|e| Error::PinnedAlloc { bytes, reason: format!("{e:?}") })?;
        let event = || ctx.new_event(None).map_err(cuda_error("cuEventCreate")).map_err(Error::from);
        Ok(Self {
            d2h: ctx.new_stream().map_err(cuda_error("cuStreamCreate"))?,
            h2d: ctx.new_stream().map_err(cuda_error("cuStreamCreate"))?,
            d2h_done: (0..plan.layers()).map(|_| event()).collect::<Result<Vec<_>>>()?,
            h2d_done: (0..plan.layers()).map(|_| event()).collect::<Result<Vec<_>>>()?,
            layers: vec![LayerState::default(); plan.layers()],
            slot_owner: vec![None; plan.slots()],
            kept: Default::default(),
            high_water: 0,
            compute,
            ring,
            arena,
            plan,
        })
    }

    /// The stream the layers' kernels run on.
    pub fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer < self.plan.layers() {
            Ok(())
        } else {
            Err(Error::LayerOutOfRange { layer, layers: self.plan.layers() })
        }
    }

    /// A free slot, waiting for the oldest evictable boundary's D2H to land if needed.
    fn reserve(&mut self, for_layer: usize) -> Result<usize> {
        if let Some(slot) = self.slot_owner.iter().position(Option::is_none) {
            return Ok(self.claim(slot, for_layer));
        }
        let victim = (0..self.layers.len()).find(|&l| {
            let st = self.layers[l];
            st.slot.is_some() && st.d2h_issued && !st.kept
        });
        let Some(victim) = victim else {
            let held = self.slot_owner.iter().flatten().copied().collect();
            return Err(Error::RingFull { slots: self.plan.slots(), held });
        };
        self.d2h_done[victim].synchronize().map_err(cuda_error("cuEventSynchronize"))?;
        let slot = self.layers[victim].slot.take().ok_or(Error::NotOffloaded { layer: victim })?;
        Ok(self.claim(slot, for_layer))
    }

    fn claim(&mut self, slot: usize, layer: usize) -> usize {
        self.slot_owner[slot] = Some(layer);
        self.high_water = self.high_water.max(self.slot_owner.iter().flatten().count());
        slot
    }

    /// A device slot to write `layer`'s boundary into (on the compute stream), then
    /// [`offload`](Self::offload) it.
    pub fn slot_for(&mut self, layer: usize) -> Result<CudaViewMut<'_, T>> {
        self.check_layer(layer)?;
        if self.layers[layer].offloaded {
            return Err(Error::AlreadyOffloaded { layer });
        }
        let slot = self.reserve(layer)?;
        self.layers[layer].slot = Some(slot);
        Ok(self.ring[slot].slice_mut(..))
    }

    /// Starts the D2H copy of `layer`'s boundary (written into [`slot_for`](Self::slot_for)'s slot).
    pub fn offload(&mut self, layer: usize) -> Result<()> {
        self.check_layer(layer)?;
        let st = self.layers[layer];
        if st.offloaded {
            return Err(Error::AlreadyOffloaded { layer });
        }
        let slot = st.slot.ok_or(Error::NotOffloaded { layer })?;
        let s = self.plan.boundary_elems();
        let (src, record_read) = self.ring[slot].device_ptr(&self.d2h);
        let arena = self.arena.as_mut_slice().map_err(cuda_error("cuEventSynchronize"))?;
        // SAFETY: the arena outlives the copy (it is only freed with `self`, after `finish_step`
        // or drop synchronises); `layer`'s region is not read before `d2h_done[layer]` fires;
        // `src` holds `s` elements; the d2h stream waits on the slot's write event (cudarc).
        unsafe {
            result::memcpy_dtoh_async(&mut arena[layer * s..(layer + 1) * s], src, self.d2h.cu_stream())
        }
        .map_err(cuda_error("cuMemcpyDtoHAsync"))?;
        drop(record_read);
        self.d2h_done[layer].record(&self.d2h).map_err(cuda_error("cuEventRecord"))?;
        self.layers[layer] =
            LayerState { offloaded: true, slot: Some(slot), d2h_issued: true, kept: true, h2d_issued: false };
        self.kept.push_back(layer);
        while self.kept.len() > self.plan.config().keep_resident {
            if let Some(old) = self.kept.pop_front() {
                self.layers[old].kept = false;
            }
        }
        Ok(())
    }

    /// Starts the H2D copy of `layer`'s boundary into a free slot (no-op when resident).
    pub fn prefetch(&mut self, layer: usize) -> Result<()> {
        self.check_layer(layer)?;
        if !self.layers[layer].offloaded {
            return Err(Error::NotOffloaded { layer });
        }
        if self.layers[layer].slot.is_some() {
            return Ok(());
        }
        let slot = self.reserve(layer)?;
        self.layers[layer].slot = Some(slot);
        let s = self.plan.boundary_elems();
        self.h2d.wait(&self.d2h_done[layer]).map_err(cuda_error("cuStreamWaitEvent"))?;
        let (dst, record_write) = self.ring[slot].device_ptr_mut(&self.h2d);
        let arena = self.arena.as_slice().map_err(cuda_error("cuEventSynchronize"))?;
        // SAFETY: the h2d stream waits on the boundary's D2H (above) and on the slot's last
        // read and write (cudarc's events), so it neither reads a half-written arena region nor
        // overwrites a slot still in use; the arena outlives the copy.
        unsafe { result::memcpy_htod_async(dst, &arena[layer * s..(layer + 1) * s], self.h2d.cu_stream()) }
            .map_err(cuda_error("cuMemcpyHtoDAsync"))?;
        drop(record_write);
        self.h2d_done[layer].record(&self.h2d).map_err(cuda_error("cuEventRecord"))?;
        self.layers[layer].h2d_issued = true;
        Ok(())
    }

    /// `layer`'s boundary on the device for the compute stream (which waits for its H2D copy).
    pub fn fetch(&mut self, layer: usize) -> Result<CudaView<'_, T>> {
        self.prefetch(layer)?;
        let slot = self.layers[layer].slot.ok_or(Error::NotOffloaded { layer })?;
        if self.layers[layer].h2d_issued {
            self.compute.wait(&self.h2d_done[layer]).map_err(cuda_error("cuStreamWaitEvent"))?;
        }
        Ok(self.ring[slot].slice(..))
    }

    /// Backward is done with `layer`'s boundary; its slot may be reused (after the compute
    /// stream's reads, which cudarc's slot events order).
    pub fn release(&mut self, layer: usize) -> Result<()> {
        self.check_layer(layer)?;
        if !self.layers[layer].offloaded {
            return Err(Error::NotOffloaded { layer });
        }
        self.kept.retain(|&l| l != layer);
        self.layers[layer].kept = false;
        if let Some(slot) = self.layers[layer].slot.take() {
            self.d2h_done[layer].synchronize().map_err(cuda_error("cuEventSynchronize"))?;
            self.slot_owner[slot] = None;
        }
        Ok(())
    }

    /// Waits for every copy and forgets this step's boundaries; ring and arena stay reserved.
    pub fn finish_step(&mut self) -> Result<()> {
        for stream in [&self.d2h, &self.h2d, &self.compute] {
            stream.synchronize().map_err(cuda_error("cuStreamSynchronize"))?;
        }
        self.layers.iter_mut().for_each(|l| *l = LayerState::default());
        self.slot_owner.iter_mut().for_each(|s| *s = None);
        self.kept.clear();
        Ok(())
    }

    /// Device bytes of the most slots ever held at once.
    pub fn high_water_bytes(&self) -> usize {
        self.high_water * self.plan.boundary_bytes()
    }
}
