//! The CUDA path (feature `cuda`): device gradients come down and updated parameters go up
//! through pinned staging slots on two copy streams (PCIe is full duplex), while the calling
//! thread runs the CPU AdamW of the bucket in between. The statistics pass runs on the device.
//!
//! Pinned memory: gradient slots are ordinary page-locked memory (the CPU reads them);
//! parameter slots are write-combined (the CPU only writes them, sequentially). Both are
//! allocated once, at [`CudaOffload::new`], at the plan's exact size.

use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use flatpeak_common::cuda::cudarc::driver::{
    CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig,
    PinnedHostSlice, PushKernelArg, result, sys,
};
use flatpeak_common::cuda::{KernelCache, alloc_error, context, cuda_error, pinned_error};
use flatpeak_common::kernels::grid_stride_blocks;

use crate::element::{GradElement, ParamElement};
use crate::error::{Error, Result};
use crate::hyperparameters::StepScalars;
use crate::kernels::{STATS_THREADS, STREAM_ADAMW, grad_sq_entry};
use crate::pipeline::{CopyEngines, FaultPoints, Staged, StepState, injected, run_step};
use crate::plan::Plan;
use crate::step::StageTimes;

/// Gradients and parameters in device memory.
#[derive(Debug)]
pub struct CudaDevice<G: DeviceRepr, P: DeviceRepr> {
    /// Gradients produced by backward.
    pub grads: CudaSlice<G>,
    /// Parameters the next forward reads.
    pub params: CudaSlice<P>,
}

impl<G: GradElement, P: ParamElement> CudaDevice<G, P> {
    /// Rewrites `params[range]` as the narrowing of `master` (a rollback), on the parameters'
    /// stream, and waits for it.
    pub(crate) fn restore_params(&mut self, range: Range<usize>, master: &[f32]) -> Result<()> {
        let mut narrowed = vec![P::zeroed(); range.len()];
        P::narrow(master, &mut narrowed);
        let stream = self.params.stream().clone();
        stream
            .memcpy_htod(&narrowed, &mut self.params.slice_mut(range))
            .map_err(cuda_error("cuMemcpyHtoD (rollback)"))?;
        stream.synchronize().map_err(cuda_error("cuStreamSynchronize (rollback)"))?;
        Ok(())
    }
}

/// Streams, events and pinned staging of one optimizer on one device.
#[derive(Debug)]
pub struct CudaOffload<G: DeviceRepr, P: DeviceRepr> {
    cache: Arc<KernelCache>,
    compute: Arc<CudaStream>,
    d2h: Arc<CudaStream>,
    h2d: Arc<CudaStream>,
    grad_slots: Vec<PinnedHostSlice<G>>,
    param_slots: Vec<PinnedHostSlice<P>>,
    d2h_done: Vec<CudaEvent>,
    h2d_done: Vec<CudaEvent>,
}

impl<G: GradElement, P: ParamElement> CudaOffload<G, P> {
    /// Streams, events and the plan's pinned staging on CUDA device `ordinal`. A pinned
    /// allocation the OS refuses is `Common(PinnedAlloc)`, naming the memlock limit.
    pub fn new(plan: &Plan, ordinal: usize) -> Result<Self> {
        let ctx: Arc<CudaContext> = context(ordinal)?;
        let (slots, elems) = (plan.staged_slots(), plan.slot_elems().max(1));
        let mut grad_slots = Vec::with_capacity(slots);
        let mut param_slots = Vec::with_capacity(slots);
        for _ in 0..slots {
            // SAFETY: the slots are plain `Pod` storage; every element is written (by a D2H copy
            // or by the Adam kernel) before it is read.
            let g = unsafe { ctx.alloc_pinned_with_flags::<G>(elems, 0) }
                .map_err(pinned_error("the gradient staging", elems * std::mem::size_of::<G>()))?;
            // SAFETY: as above; write-combined suits memory the CPU only writes.
            let p = unsafe { ctx.alloc_pinned_with_flags::<P>(elems, sys::CU_MEMHOSTALLOC_WRITECOMBINED) }
                .map_err(pinned_error("the parameter staging", elems * std::mem::size_of::<P>()))?;
            grad_slots.push(g);
            param_slots.push(p);
        }
        let event = || ctx.new_event(None).map_err(cuda_error("cuEventCreate")).map_err(Error::from);
        let d2h_done = (0..slots).map(|_| event()).collect::<Result<Vec<_>>>()?;
        let h2d_done = (0..slots).map(|_| event()).collect::<Result<Vec<_>>>()?;
        Ok(Self {
            compute: ctx.default_stream(),
            d2h: ctx.new_stream().map_err(cuda_error("cuStreamCreate"))?,
            h2d: ctx.new_stream().map_err(cuda_error("cuStreamCreate"))?,
            cache: KernelCache::shared(&ctx)?,
            grad_slots,
            param_slots,
            d2h_done,
            h2d_done,
        })
    }

    /// The context, to allocate device buffers in.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.cache.context()
    }

    /// The stream the statistics kernel runs on (the context's default stream).
    pub fn compute_stream(&self) -> &Arc<CudaStream> {
        &self.compute
    }

    /// Σ g² over the device gradients: per-block f64 partials on the device, summed on the host
    /// in block order.
    pub fn grad_sq_sum(&self, grads: &CudaSlice<G>) -> Result<f64> {
        let n = grads.len();
        let blocks = grid_stride_blocks(n, STATS_THREADS, 1024);
        let f = self.cache.function(&STREAM_ADAMW, grad_sq_entry(G::DTYPE))?;
        let mut partial = self
            .compute
            .alloc_zeros::<f64>(blocks as usize)
            .map_err(alloc_error("the gradient statistics", blocks as usize * 8))?;
        let n64 = n as u64;
        let mut builder = self.compute.launch_builder(&f);
        builder.arg(grads).arg(&n64).arg(&mut partial);
        let cfg =
            LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (STATS_THREADS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: `grad_sq_partial_<dtype>(const G*, u64, double*)` matches the arguments (the
        // entry is chosen by `G::DTYPE`); it reads `grads[0..n)` and writes `partial[blockIdx.x]`
        // for `gridDim.x = partial.len()` blocks of 256 threads (a multiple of 32, as required).
        unsafe { builder.launch(cfg) }.map_err(cuda_error("cuLaunchKernel(grad_sq_partial)"))?;
        let partial = self.compute.clone_dtoh(&partial).map_err(cuda_error("cuMemcpyDtoH"))?;
        Ok(partial.iter().sum())
    }

    /// Runs the plan's schedule ([`crate::pipeline`], the one the CPU fallback runs) with this
    /// device's copy streams as its engines.
    /// An injected `fault` (feature `testing`) fails its stage when the stage is issued.
    pub(crate) fn run(
        &mut self,
        plan: &Plan,
        faults: &FaultPoints,
        state: StepState<'_>,
        device: &mut CudaDevice<G, P>,
        scalars: &StepScalars,
        times: &mut StageTimes,
    ) -> Result<()> {
        let mut engines = CudaEngines { offload: self, device, waited: [Duration::ZERO; 2], faults };
        let ran = run_step(&mut engines, plan, faults, state, scalars, times);
        // On an error the copies already issued still land before the step returns.
        let drained = engines.drain();
        ran.and(drained)
    }
}

/// A device's copy engines for one step: the D2H and H2D streams with an event per slot. The
/// engines' times are what the host waited for them.
struct CudaEngines<'a, G: DeviceRepr, P: DeviceRepr> {
    offload: &'a mut CudaOffload<G, P>,
    device: &'a mut CudaDevice<G, P>,
    waited: [Duration; 2],
    faults: &'a FaultPoints,
}

impl<G: DeviceRepr, P: DeviceRepr> CudaEngines<'_, G, P> {
    /// Waits for both copy streams (a failed step's copies must land before its buffers are
    /// handed back).
    fn drain(&mut self) -> Result<()> {
        self.offload.d2h.synchronize().map_err(cuda_error("cuStreamSynchronize"))?;
        self.offload.h2d.synchronize().map_err(cuda_error("cuStreamSynchronize"))?;
        Ok(())
    }
}

/// Blocks until `event` fires, adding the time the host waited to `waited`.
fn timed_wait(event: &CudaEvent, waited: &mut Duration) -> Result<()> {
    let start = Instant::now();
    event.synchronize().map_err(cuda_error("cuEventSynchronize"))?;
    *waited += start.elapsed();
    Ok(())
}

impl<G: GradElement, P: ParamElement> CopyEngines for CudaEngines<'_, G, P> {
    type Grad = G;
    type Param = P;

    /// D2H of the bucket's gradients into its grad slot on the D2H stream; records the slot's
    /// `d2h_done`.
    fn start_d2h(&mut self, bucket: Staged) -> Result<()> {
        let Staged { elements: range, slot } = bucket;
        injected("d2h", self.faults.d2h, &range)?;
        let o = &mut *self.offload;
        let view = self.device.grads.slice(range.clone());
        let (src, _record) = view.device_ptr(&o.d2h);
        let dst = o.grad_slots[slot].as_mut_slice().map_err(cuda_error("cuEventSynchronize"))?;
        // SAFETY: `dst[..len]` is pinned memory owned by the offload, which outlives the copy
        // (every step waits for its copies before returning); nothing reads the slot before
        // `d2h_done[slot]` fires (the schedule waits on it); `src` points at `len` live elements
        // of the device gradients.
        unsafe { result::memcpy_dtoh_async(&mut dst[..range.len()], src, o.d2h.cu_stream()) }
            .map_err(cuda_error("cuMemcpyDtoHAsync"))?;
        Ok(o.d2h_done[slot].record(&o.d2h).map_err(cuda_error("cuEventRecord"))?)
    }

    fn wait_d2h(&mut self, slot: usize) -> Result<()> {
        timed_wait(&self.offload.d2h_done[slot], &mut self.waited[0])
    }

    /// H2D of the bucket's param slot into its parameters on the H2D stream; records the slot's
    /// `h2d_done`.
    fn start_h2d(&mut self, bucket: Staged) -> Result<()> {
        let Staged { elements: range, slot } = bucket;
        injected("h2d", self.faults.h2d, &range)?;
        let o = &mut *self.offload;
        let len = range.len();
        let mut view = self.device.params.slice_mut(range);
        let (dst, _record) = view.device_ptr_mut(&o.h2d);
        let src = o.param_slots[slot].as_slice().map_err(cuda_error("cuEventSynchronize"))?;
        // SAFETY: `src[..len]` is pinned memory owned by the offload and not written again
        // before `h2d_done[slot]` fires (the schedule waits on it before the slot's next Adam);
        // `dst` holds `len` elements.
        unsafe { result::memcpy_htod_async(dst, &src[..len], o.h2d.cu_stream()) }
            .map_err(cuda_error("cuMemcpyHtoDAsync"))?;
        Ok(o.h2d_done[slot].record(&o.h2d).map_err(cuda_error("cuEventRecord"))?)
    }

    fn wait_h2d(&mut self, slot: usize) -> Result<()> {
        timed_wait(&self.offload.h2d_done[slot], &mut self.waited[1])
    }

    fn with_staged<R>(&mut self, bucket: &Staged, f: impl FnOnce(&[G], &mut [P]) -> R) -> Result<R> {
        let (o, len) = (&mut *self.offload, bucket.elements.len());
        let grads = o.grad_slots[bucket.slot].as_slice().map_err(cuda_error("cuEventSynchronize"))?;
        // The two slot vectors are distinct fields: borrow them apart.
        let params = o.param_slots[bucket.slot].as_mut_slice().map_err(cuda_error("cuEventSynchronize"))?;
        Ok(f(&grads[..len], &mut params[..len]))
    }

    fn finish(&mut self) -> Result<(Duration, Duration)> {
        let start = Instant::now();
        self.offload.d2h.synchronize().map_err(cuda_error("cuStreamSynchronize"))?;
        let d2h = self.waited[0] + start.elapsed();
        let start = Instant::now();
        self.offload.h2d.synchronize().map_err(cuda_error("cuStreamSynchronize"))?;
        Ok((d2h, self.waited[1] + start.elapsed()))
    }
}
