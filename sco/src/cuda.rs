//! The CUDA offloader (feature `cuda`): the device ring as `slots` separate allocations (so
//! cudarc's per-allocation events order every access to a slot, and nothing else), the host
//! arena as one page-locked allocation of exactly `L·s` bytes, D2H and H2D on their own streams.
//! Which slot a boundary gets, which copy to wait for and what is misuse is the [`SlotRing`]'s,
//! the same accounting the CPU fallback uses; this file issues the copies and the waits.
//! Ordering rules, each the fix for a known offload bug:
//! - a D2H copy starts after the compute that wrote the slot (cudarc's write event on the slot);
//! - an H2D copy into a slot starts after the compute that last read it (its read event) and
//!   after the D2H of that boundary landed (`d2h_done[layer]` waited on by the H2D stream);
//! - compute reading a fetched boundary waits on `h2d_done[layer]` on the compute stream, the
//!   stream that runs the kernels (not the copy stream);
//! - a slot is reused for a new boundary only after its D2H landed (`d2h_done`, host wait, when
//!   the ring asks for it: [`Reservation::AwaitD2h`]).
//!
//! Memory bound: the ring (`plan.workspace_bytes()` of device memory) and the arena
//! (`plan.host_arena_bytes()` pinned) are allocated once, at construction, never on the fly;
//! [`CudaTensors::zeros`](crate::Tensors::zeros) allocates only what a caller (the stack's
//! output and gradients) asks for.

use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use flatpeak_common::Device;
use flatpeak_common::cuda::cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut,
    DeviceRepr, PinnedHostSlice, ValidAsZeroBits, result,
};
use flatpeak_common::cuda::{alloc_error, context, cuda_error, pinned_error};

use crate::error::{Error, Result};
use crate::plan::Plan;
use crate::ring::{Lend, Reservation, Reserved, SlotRing};
use crate::store::{CheckpointStore, Tensors, check_len};

/// Device tensors of `T` on one stream: `CudaView`, `CudaViewMut`, `CudaSlice`, allocated and
/// copied on that stream (the compute stream of the offloader that made it).
pub struct CudaTensors<T> {
    stream: Arc<CudaStream>,
    _elem: PhantomData<fn() -> T>,
}

impl<T> CudaTensors<T> {
    /// The family of tensors on `stream`.
    pub fn new(stream: Arc<CudaStream>) -> Self {
        Self { stream, _elem: PhantomData }
    }
    /// The stream its allocations and copies run on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}
impl<T> Clone for CudaTensors<T> {
    fn clone(&self) -> Self {
        Self::new(Arc::clone(&self.stream))
    }
}
impl<T> fmt::Debug for CudaTensors<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaTensors<{}>({:?})", std::any::type_name::<T>(), self.stream)
    }
}

impl<T: DeviceRepr + ValidAsZeroBits + fmt::Debug + 'static> Tensors for CudaTensors<T> {
    type Elem = T;
    type Ref<'a> = CudaView<'a, T>;
    type Mut<'a> = CudaViewMut<'a, T>;
    type Owned = CudaSlice<T>;

    fn zeros(&self, len: usize) -> Result<CudaSlice<T>> {
        Ok(self
            .stream
            .alloc_zeros::<T>(len)
            .map_err(alloc_error("a step tensor", len * std::mem::size_of::<T>()))?)
    }
    fn copy(&self, src: CudaView<'_, T>, mut dst: CudaViewMut<'_, T>) -> Result<()> {
        check_len("tensor copy (elements)", dst.len(), src.len())?;
        self.stream.memcpy_dtod(&src, &mut dst).map_err(cuda_error("cuMemcpyDtoDAsync"))?;
        Ok(())
    }
    fn view(t: &CudaSlice<T>) -> CudaView<'_, T> {
        t.as_view()
    }
    fn view_mut(t: &mut CudaSlice<T>) -> CudaViewMut<'_, T> {
        t.as_view_mut()
    }
    fn len(t: &CudaView<'_, T>) -> usize {
        t.len()
    }
}

/// Offloads L checkpoint boundaries of `T` on a CUDA device through a fixed ring of
/// `plan.slots()` device slots (`plan.workspace_bytes()`) and a pinned arena of
/// `plan.host_arena_bytes()`, both allocated by [`new`](Self::new).
#[derive(Debug)]
pub struct CudaCheckpointOffloader<T: DeviceRepr> {
    plan: Plan,
    ring: SlotRing,
    compute: Arc<CudaStream>,
    d2h: Arc<CudaStream>,
    h2d: Arc<CudaStream>,
    slots: Vec<CudaSlice<T>>,
    arena: PinnedHostSlice<T>,
    d2h_done: Vec<CudaEvent>,
    h2d_done: Vec<CudaEvent>,
    /// The slot [`slot_for`](Self::slot_for) handed out, for the layer it named, until offloaded.
    writing: Option<(usize, Reserved)>,
}

/// `slots[read]` and `slots[write]` at once; `None` when they are the same slot.
fn read_write<T>(
    slots: &mut [CudaSlice<T>],
    read: usize,
    write: usize,
) -> Option<(&CudaSlice<T>, &mut CudaSlice<T>)> {
    let (mut x, mut y) = (None, None);
    for (i, slot) in slots.iter_mut().enumerate() {
        if i == read {
            x = Some(&*slot);
        } else if i == write {
            y = Some(slot);
        }
    }
    Some((x?, y?))
}

impl<T: DeviceRepr + ValidAsZeroBits> CudaCheckpointOffloader<T> {
    /// Allocates the ring on device `ordinal` and the pinned arena now; compute runs on the
    /// context's default stream (see [`CudaCheckpointOffloader::compute_stream`]).
    pub fn new(plan: Plan, ordinal: usize) -> Result<Self> {
        let ctx: Arc<CudaContext> = context(ordinal)?;
        let compute = ctx.default_stream();
        let s = plan.boundary_elems().max(1);
        let slots = (0..plan.slots())
            .map(|_| {
                compute
                    .alloc_zeros::<T>(s)
                    .map_err(alloc_error("a ring slot", s * std::mem::size_of::<T>()))
                    .map_err(Error::from)
            })
            .collect::<Result<Vec<_>>>()?;
        let bytes = plan.host_arena_bytes();
        // SAFETY: the arena is `Pod`-like storage (`ValidAsZeroBits`); every slot of it is
        // written by a D2H copy before an H2D copy reads it (the ring brings back only
        // offloaded boundaries).
        let arena = unsafe { ctx.alloc_pinned_with_flags::<T>(plan.layers() * s, 0) }
            .map_err(pinned_error("the checkpoint arena", bytes))?;
        let event = || ctx.new_event(None).map_err(cuda_error("cuEventCreate")).map_err(Error::from);
        Ok(Self {
            d2h: ctx.new_stream().map_err(cuda_error("cuStreamCreate"))?,
            h2d: ctx.new_stream().map_err(cuda_error("cuStreamCreate"))?,
            d2h_done: (0..plan.layers()).map(|_| event()).collect::<Result<Vec<_>>>()?,
            h2d_done: (0..plan.layers()).map(|_| event()).collect::<Result<Vec<_>>>()?,
            ring: SlotRing::new(&plan),
            writing: None,
            compute,
            slots,
            arena,
            plan,
        })
    }

    /// The stream the layers' kernels run on.
    pub fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }

    /// The plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The device it runs on.
    pub fn device(&self) -> Device {
        Device::Cuda(self.compute.context().ordinal())
    }

    /// A free slot, waiting (on the host) for the D2H copy the ring names if none is free.
    fn reserve(&mut self) -> Result<Reserved> {
        loop {
            match self.ring.reserve()? {
                Reservation::Slot(reserved) => return Ok(reserved),
                Reservation::AwaitD2h(layer) => {
                    self.d2h_done[layer].synchronize().map_err(cuda_error("cuEventSynchronize"))?;
                    self.ring.d2h_landed(layer);
                }
            }
        }
    }

    /// The slot `layer`'s boundary is written into: the one already handed out (a write that
    /// was never offloaded is abandoned), or a newly reserved one.
    fn begin_write(&mut self, layer: usize) -> Result<usize> {
        self.ring.check_offload(layer)?;
        let reserved = match self.writing.take() {
            Some((_, reserved)) => reserved,
            None => self.reserve()?,
        };
        let slot = reserved.slot();
        self.writing = Some((layer, reserved));
        Ok(slot)
    }

    /// A device slot to write `layer`'s boundary into (on the compute stream), then
    /// [`offload`](Self::offload) it. A second call before `offload` hands out the same slot.
    pub fn slot_for(&mut self, layer: usize) -> Result<CudaViewMut<'_, T>> {
        let slot = self.begin_write(layer)?;
        Ok(self.slots[slot].slice_mut(..self.plan.boundary_elems()))
    }

    /// Starts the D2H copy of `layer`'s boundary (written into [`slot_for`](Self::slot_for)'s
    /// slot); [`Error::NotOffloaded`] when no slot was handed out for `layer`.
    pub fn offload(&mut self, layer: usize) -> Result<()> {
        self.ring.check_offload(layer)?;
        let reserved = match self.writing.take() {
            Some((l, reserved)) if l == layer => reserved,
            other => {
                self.writing = other;
                return Err(Error::NotOffloaded { layer });
            }
        };
        if let Err(e) = self.copy_out(layer, reserved.slot()) {
            self.ring.cancel(reserved);
            return Err(e);
        }
        self.ring.offload(layer, reserved)?;
        Ok(())
    }

    fn copy_out(&mut self, layer: usize, slot: usize) -> Result<()> {
        let (src, record_read) = self.slots[slot].device_ptr(&self.d2h);
        let dst = arena_layer_mut(&mut self.arena, &self.plan, layer)?;
        // SAFETY: the arena outlives the copy (it is only freed with `self`, after `finish_step`
        // or drop synchronises); `layer`'s region is not read before `d2h_done[layer]` fires;
        // `src`, a slot, holds at least a boundary's elements, as many as `dst` (the layer's
        // arena region); the d2h stream waits on the slot's write event (cudarc).
        unsafe { result::memcpy_dtoh_async(dst, src, self.d2h.cu_stream()) }
            .map_err(cuda_error("cuMemcpyDtoHAsync"))?;
        drop(record_read);
        self.d2h_done[layer].record(&self.d2h).map_err(cuda_error("cuEventRecord"))?;
        Ok(())
    }

    /// Starts the H2D copy of `layer`'s boundary into a free slot (no-op when resident); it
    /// then stays there until [`CheckpointStore::release`] (one of the k_keep newest: until
    /// then, or until newer boundaries displace it).
    pub fn prefetch(&mut self, layer: usize) -> Result<()> {
        if !self.ring.want(layer)? {
            return Ok(());
        }
        let reserved = self.reserve()?;
        let Some(slot) = self.ring.start_h2d(layer, reserved)? else {
            return Ok(());
        };
        self.h2d.wait(&self.d2h_done[layer]).map_err(cuda_error("cuStreamWaitEvent"))?;
        let (dst, record_write) = self.slots[slot].device_ptr_mut(&self.h2d);
        let src = arena_layer(&self.arena, &self.plan, layer)?;
        // SAFETY: the h2d stream waits on the boundary's D2H (above) and on the slot's last
        // read and write (cudarc's events), so it neither reads a half-written arena region nor
        // overwrites a slot still in use; the arena outlives the copy.
        unsafe { result::memcpy_htod_async(dst, src, self.h2d.cu_stream()) }
            .map_err(cuda_error("cuMemcpyHtoDAsync"))?;
        drop(record_write);
        self.h2d_done[layer].record(&self.h2d).map_err(cuda_error("cuEventRecord"))?;
        Ok(())
    }

    /// Brings `layer` back (prefetching it if needed) and orders the compute stream after its
    /// H2D copy; returns its slot, lent when `lend`.
    fn arrive(&mut self, layer: usize, lend: bool) -> Result<usize> {
        self.prefetch(layer)?;
        loop {
            let state = if lend { self.ring.lend(layer)? } else { self.ring.resident(layer)? };
            match state {
                Lend::Ready(slot) => return Ok(slot),
                Lend::AwaitH2d => {
                    self.compute.wait(&self.h2d_done[layer]).map_err(cuda_error("cuStreamWaitEvent"))?;
                    self.ring.h2d_landed(layer);
                }
            }
        }
    }

    /// `layer`'s boundary on the device for the compute stream (which waits for its H2D copy),
    /// prefetched if needed; it then stays there as after [`prefetch`](Self::prefetch).
    pub fn fetch(&mut self, layer: usize) -> Result<CudaView<'_, T>> {
        let slot = self.arrive(layer, false)?;
        Ok(self.slots[slot].slice(..self.plan.boundary_elems()))
    }
}

impl<T: DeviceRepr + ValidAsZeroBits + fmt::Debug + 'static> CheckpointStore for CudaCheckpointOffloader<T> {
    type Tensors = CudaTensors<T>;

    fn plan(&self) -> &Plan {
        &self.plan
    }
    fn tensors(&self) -> CudaTensors<T> {
        CudaTensors::new(Arc::clone(&self.compute))
    }
    fn offload_from(&mut self, layer: usize, tensor: CudaView<'_, T>) -> Result<()> {
        check_len("boundary tensor (elements)", self.plan.boundary_elems(), tensor.len())?;
        let stream = Arc::clone(&self.compute);
        let mut slot = self.slot_for(layer)?;
        stream.memcpy_dtod(&tensor, &mut slot).map_err(cuda_error("cuMemcpyDtoDAsync"))?;
        self.offload(layer)
    }
    fn forward_into<R>(
        &mut self,
        layer: usize,
        f: impl FnOnce(CudaView<'_, T>, CudaViewMut<'_, T>) -> Result<R>,
    ) -> Result<R> {
        let next = layer.saturating_add(1);
        self.ring.check_offload(next)?;
        let read = self.arrive(layer, true)?;
        let done = match self.begin_write(next) {
            Ok(write) => {
                let s = self.plan.boundary_elems();
                match read_write(&mut self.slots, read, write) {
                    Some((x, y)) => f(x.slice(..s), y.slice_mut(..s)),
                    // The ring never hands out a lent slot.
                    None => Err(Error::RingFull { slots: self.plan.slots(), held: self.ring.held_layers() }),
                }
            }
            Err(e) => Err(e),
        };
        self.ring.unlend(layer);
        match done {
            Ok(done) => self.offload(next).map(|()| done),
            Err(e) => {
                if let Some((_, reserved)) = self.writing.take() {
                    self.ring.cancel(reserved);
                }
                Err(e)
            }
        }
    }
    fn prefetch(&mut self, layer: usize) -> Result<()> {
        CudaCheckpointOffloader::prefetch(self, layer)
    }
    fn fetch_with<R>(&mut self, layer: usize, f: impl FnOnce(CudaView<'_, T>) -> Result<R>) -> Result<R> {
        f(self.fetch(layer)?)
    }
    /// Its slot may be reused once its D2H landed (after the compute stream's reads, which
    /// cudarc's slot events order).
    fn release(&mut self, layer: usize) -> Result<()> {
        self.ring.release(layer)
    }
    /// Waits for every copy and forgets this step's boundaries; ring and arena stay reserved.
    fn finish_step(&mut self) -> Result<()> {
        for stream in [&self.d2h, &self.h2d, &self.compute] {
            stream.synchronize().map_err(cuda_error("cuStreamSynchronize"))?;
        }
        if let Some((_, reserved)) = self.writing.take() {
            self.ring.cancel(reserved);
        }
        self.ring.finish_step();
        Ok(())
    }
    /// Device bytes of the most slots ever held at once.
    fn high_water_bytes(&self) -> usize {
        self.ring.high_water_slots() * self.plan.boundary_bytes()
    }
}

/// `layer`'s boundary in the pinned host arena (`s` elements at `layer·s`), once the arena's
/// last recorded use has completed.
fn arena_layer<'a, T: flatpeak_common::DeviceElement>(
    arena: &'a PinnedHostSlice<T>,
    plan: &Plan,
    layer: usize,
) -> Result<&'a [T]> {
    let range = arena_range(plan, layer);
    let all = arena.as_slice().map_err(cuda_error("cuEventSynchronize"))?;
    all.get(range).ok_or(Error::LayerOutOfRange { layer, layers: plan.layers() })
}

/// [`arena_layer`], writable.
fn arena_layer_mut<'a, T: flatpeak_common::DeviceElement>(
    arena: &'a mut PinnedHostSlice<T>,
    plan: &Plan,
    layer: usize,
) -> Result<&'a mut [T]> {
    let range = arena_range(plan, layer);
    let all = arena.as_mut_slice().map_err(cuda_error("cuEventSynchronize"))?;
    all.get_mut(range).ok_or(Error::LayerOutOfRange { layer, layers: plan.layers() })
}

/// The elements of `layer`'s boundary in the arena (saturating: a layer past the end is then
/// out of range of the arena).
fn arena_range(plan: &Plan, layer: usize) -> std::ops::Range<usize> {
    let s = plan.boundary_elems();
    layer.saturating_mul(s)..layer.saturating_add(1).saturating_mul(s)
}

#[cfg(test)]
mod tests {
    use flatpeak_common::Budget;

    use super::*;
    use crate::plan::{Config, Shape};
    use crate::stack::{CheckpointedStack, Layer};

    /// `y = x` on the device; backward counts the elements of its boundary that are not the
    /// stack's input (`x[j] = j`) into its one parameter gradient and passes `dy` through.
    #[derive(Debug)]
    struct Echo {
        stream: Arc<CudaStream>,
        width: usize,
    }

    impl Layer<CudaTensors<f32>> for Echo {
        fn width(&self) -> usize {
            self.width
        }
        fn param_count(&self) -> usize {
            1
        }
        fn forward(&self, x: CudaView<'_, f32>, mut y: CudaViewMut<'_, f32>) -> Result<()> {
            Ok(self.stream.memcpy_dtod(&x, &mut y).map_err(cuda_error("cuMemcpyDtoDAsync"))?)
        }
        fn forward_saving(&self, x: CudaView<'_, f32>, y: CudaViewMut<'_, f32>) -> Result<CudaSlice<f32>> {
            self.forward(x, y)?;
            Ok(self.stream.alloc_zeros::<f32>(1).map_err(cuda_error("cuMemAlloc"))?)
        }
        fn backward(
            &self,
            x: CudaView<'_, f32>,
            _saved: Option<CudaView<'_, f32>>,
            dy: CudaView<'_, f32>,
            mut dx: CudaViewMut<'_, f32>,
            mut dparams: CudaViewMut<'_, f32>,
        ) -> Result<()> {
            let seen = self.stream.clone_dtoh(&x).map_err(cuda_error("cuMemcpyDtoH"))?;
            let wrong = seen.iter().enumerate().filter(|&(j, &v)| v != j as f32).count();
            self.stream.memcpy_htod(&[wrong as f32], &mut dparams).map_err(cuda_error("cuMemcpyHtoD"))?;
            Ok(self.stream.memcpy_dtod(&dy, &mut dx).map_err(cuda_error("cuMemcpyDtoDAsync"))?)
        }
    }

    /// On a GPU: a stack driven through the CUDA offloader brings every boundary back intact
    /// and holds at most the plan's slots. Ignored without a device.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn a_stack_runs_through_the_cuda_offloader() {
        let (layers, width) = (12, 1 << 16);
        let plan = Plan::new(&Config::default(), Shape::of::<f32>(layers, width), Budget::Unlimited).unwrap();
        let off = CudaCheckpointOffloader::<f32>::new(plan, 0).expect("a CUDA device");
        let stream = Arc::clone(off.compute_stream());
        let echo = (0..layers).map(|_| Echo { stream: Arc::clone(&stream), width }).collect();
        let mut stack = CheckpointedStack::with_store(echo, off).unwrap();
        let input: Vec<f32> = (0..width).map(|j| j as f32).collect();
        let input = stream.clone_htod(&input).unwrap();
        for _ in 0..3 {
            let out = stack.step(input.as_view(), |y| Ok(stream.clone_dtod(&y).unwrap())).unwrap();
            for g in &out.param_grads {
                assert_eq!(stream.clone_dtoh(g).unwrap(), vec![0.0], "a boundary came back wrong");
            }
            assert_eq!(stream.clone_dtoh(&out.output).unwrap(), stream.clone_dtoh(&input).unwrap());
            assert!(out.boundary_high_water_bytes <= plan.workspace_bytes());
        }
    }

    /// On a GPU: the one `Offloader` type on `Device::Cuda(0)` runs a CUDA layer through
    /// `OnCuda` like the CUDA offloader does, and a host layer handed its device tensors is
    /// `WrongDevice`. Ignored without a device.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn the_offloader_on_a_cuda_device_lends_device_tensors() {
        use crate::device_tensors::{DeviceRef, DeviceTensor, OnCuda, OnHost};
        use crate::executor::Offloader;
        let (layers, width) = (6, 1 << 12);
        let plan = Plan::new(&Config::default(), Shape::of::<f32>(layers, width), Budget::Unlimited).unwrap();
        let stream = flatpeak_common::cuda::context(0).expect("a CUDA device").default_stream();
        let input = stream.clone_htod(&(0..width).map(|j| j as f32).collect::<Vec<_>>()).unwrap();
        let echo = (0..layers).map(|_| OnCuda(Echo { stream: Arc::clone(&stream), width })).collect();
        let off = Offloader::<f32>::new(plan, Device::Cuda(0)).expect("a CUDA device");
        let mut stack = CheckpointedStack::with_store(echo, off).unwrap();
        let copy = |y: DeviceRef<'_, f32>| match y {
            DeviceRef::Cuda(y) => Ok(DeviceTensor::Cuda(stream.clone_dtod(&y).unwrap())),
            other => Err(crate::Error::WrongDevice { executor: Device::Cuda(0), inputs: other.device() }),
        };
        let out = stack.step(DeviceRef::Cuda(input.as_view()), copy).unwrap();
        for g in out.param_grads {
            let DeviceTensor::Cuda(g) = g else { panic!("a host gradient from a CUDA stack") };
            assert_eq!(stream.clone_dtoh(&g).unwrap(), vec![0.0], "a boundary came back wrong");
        }
        let off = Offloader::<f32>::new(plan, Device::Cuda(0)).expect("a CUDA device");
        let host = (0..layers).map(|l| OnHost(crate::layers::AddOne::new(width, l))).collect();
        let mut stack = CheckpointedStack::with_store(host, off).unwrap();
        match stack.step(DeviceRef::Cuda(input.as_view()), copy) {
            Err(crate::Error::WrongDevice { executor: Device::Cpu, inputs: Device::Cuda(0) }) => {}
            other => panic!("expected WrongDevice, got {:?}", other.map(|_| ())),
        }
    }
}
