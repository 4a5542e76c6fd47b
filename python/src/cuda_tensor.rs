//! The torch-tensor boundary on a CUDA device (feature `cuda`), the device half of `tensor.rs`:
//! a call's CUDA tensors borrowed as cudarc slices on **torch's current stream**, so the crates'
//! work is ordered after the torch work that produced the inputs and before the torch work that
//! reads the outputs, with no added synchronisation.
//!
//! A [`DeviceLend`] checks each tensor as `tensor.rs` does (on this device), then checks the
//! outputs exclusive (within the call, and against the calls in flight) and lends the tensors. A
//! lent tensor is a cudarc value made over the tensor's memory ([`Lent`], [`LentMut`]: a slice,
//! one of llep's buffers, ring-dtp's block buffers, stream-adamw's device buffers), which gives
//! the memory back when it drops: its slices are leaked, never freed by cudarc (the tensor owns
//! them). Lent values borrow the [`DeviceLent`], which borrows the caller's `Bound` arguments.

use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use flatpeak_common::Device;
use flatpeak_common::cuda::cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, sys};
use half::bf16;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::error::to_py;
use crate::tensor::{In, Out, Register, Span, TorchElement, next_call, register, release};

/// A cudarc value over borrowed memory, given back (its slices leaked) when it is dropped.
pub(crate) trait GiveBack {
    /// Leaks every slice of the value: the memory is its tensor's.
    fn give_back(self);
}

impl<T: DeviceRepr> GiveBack for CudaSlice<T> {
    fn give_back(self) {
        let _ = self.leak();
    }
}

impl GiveBack for llep::cuda::CudaBuf {
    fn give_back(self) {
        // Made over the tensor's memory as `DevSlice::lent`: dropping it leaks the slice.
        drop(self)
    }
}

impl GiveBack for ring_dtp::cuda::BlockBuffers {
    fn give_back(self) {
        let ring_dtp::cuda::BlockBuffers { logits, x_wide, w_wide } = self;
        logits.give_back();
        x_wide.give_back();
        w_wide.give_back();
    }
}

impl<G: DeviceRepr, P: DeviceRepr> GiveBack for stream_adamw::cuda::CudaDevice<G, P> {
    fn give_back(self) {
        let stream_adamw::cuda::CudaDevice { grads, params } = self;
        grads.give_back();
        params.give_back();
    }
}

/// A lent input: read through `Deref` only.
pub(crate) struct Lent<'l, V: GiveBack>(ManuallyDrop<V>, PhantomData<&'l ()>);

/// A lent output: read and written.
pub(crate) struct LentMut<'l, V: GiveBack>(ManuallyDrop<V>, PhantomData<&'l ()>);

impl<V: GiveBack> Deref for Lent<'_, V> {
    type Target = V;
    fn deref(&self) -> &V {
        &self.0
    }
}

impl<V: GiveBack> Deref for LentMut<'_, V> {
    type Target = V;
    fn deref(&self) -> &V {
        &self.0
    }
}

impl<V: GiveBack> DerefMut for LentMut<'_, V> {
    fn deref_mut(&mut self) -> &mut V {
        &mut self.0
    }
}

impl<V: GiveBack> Drop for Lent<'_, V> {
    fn drop(&mut self) {
        // SAFETY: the value is taken exactly once, here, and not used after.
        unsafe { ManuallyDrop::take(&mut self.0) }.give_back();
    }
}

impl<V: GiveBack> Drop for LentMut<'_, V> {
    fn drop(&mut self) {
        // SAFETY: the value is taken exactly once, here, and not used after.
        unsafe { ManuallyDrop::take(&mut self.0) }.give_back();
    }
}

/// Torch's current stream on device `ordinal`, wrapped for cudarc (not owned: never destroyed).
pub(crate) fn torch_stream(py: Python<'_>, ordinal: usize) -> PyResult<Arc<CudaStream>> {
    let ctx = flatpeak_common::cuda::context(ordinal).map_err(to_py)?;
    let stream = py.import("torch.cuda")?.call_method1("current_stream", (ordinal,))?;
    let raw: usize = stream.getattr("cuda_stream")?.extract()?;
    // SAFETY: torch's current stream of device `ordinal` is a valid stream of the device's primary
    // context (the one `context` retains); torch keeps it alive for the process, and every use of
    // the wrapper is on this stream, so ordering with torch's work is the stream's.
    Ok(unsafe { ctx.wrap_borrowed_stream(raw as sys::CUstream) })
}

/// A CUDA device's memory: the memory of a [`DeviceLend`]'s handles.
#[derive(Debug, Clone, Copy)]
pub(crate) struct DeviceMemory;

/// An input of a [`DeviceLend`].
pub(crate) type DIn<T> = In<T, DeviceMemory>;

/// An output of a [`DeviceLend`] (consumed when lent: one borrow per output).
pub(crate) type DOut<T> = Out<T, DeviceMemory>;

/// One call's CUDA tensors on one device, being checked (see the module docs).
pub(crate) struct DeviceLend<'t, 'py> {
    id: u64,
    ordinal: usize,
    stream: Arc<CudaStream>,
    spans: Vec<Span>,
    held: PhantomData<&'t Bound<'py, PyAny>>,
}

impl<'t, 'py> DeviceLend<'t, 'py> {
    /// A new call on CUDA device `ordinal`, on torch's current stream there.
    pub(crate) fn new(py: Python<'py>, ordinal: usize) -> PyResult<Self> {
        Ok(Self {
            id: next_call(),
            ordinal,
            stream: torch_stream(py, ordinal)?,
            spans: Vec::new(),
            held: PhantomData,
        })
    }

    /// Torch's current stream, which every lent value is on.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The CUDA device the call's tensors are on.
    pub(crate) fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// Checks the outputs' exclusivity and lends the tensors.
    pub(crate) fn lent(self) -> PyResult<DeviceLent<'t, 'py>> {
        register(self.id, &self.spans)?;
        Ok(DeviceLent { id: self.id, stream: self.stream, held: PhantomData })
    }
}

impl<'t, 'py> Register<'t, 'py> for DeviceLend<'t, 'py> {
    type Memory = DeviceMemory;

    fn call(&self) -> u64 {
        self.id
    }

    fn space(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    fn spans(&mut self) -> &mut Vec<Span> {
        &mut self.spans
    }
}

/// One call's CUDA tensors, checked and lent until it drops.
pub(crate) struct DeviceLent<'t, 'py> {
    id: u64,
    stream: Arc<CudaStream>,
    held: PhantomData<&'t Bound<'py, PyAny>>,
}

impl Drop for DeviceLent<'_, '_> {
    fn drop(&mut self) {
        release(self.id);
    }
}

impl DeviceLent<'_, '_> {
    /// Torch's current stream, which every lent value is on.
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    fn check(&self, call: u64) -> PyResult<()> {
        if call == self.id {
            Ok(())
        } else {
            Err(PyRuntimeError::new_err("a tensor handle of another call (an internal error of flatpeak)"))
        }
    }

    /// A cudarc slice over `len` elements of `T` at `address`.
    ///
    /// # Safety
    /// `[address, address + len·size_of::<T>())` must be device memory of this stream's context
    /// holding `len` valid `T`s, alive until the slice is given back, and the slice must be given
    /// back ([`GiveBack`]), never dropped.
    unsafe fn slice<T: DeviceRepr>(&self, address: usize, len: usize) -> CudaSlice<T> {
        // SAFETY: the caller's contract is `upgrade_device_ptr`'s (a valid allocation of `len`
        // elements; an empty slice is never dereferenced).
        unsafe { self.stream.upgrade_device_ptr::<T>(address as sys::CUdeviceptr, len) }
    }

    /// Input `h` as a slice, read only.
    pub(crate) fn get<T: TorchElement + DeviceRepr>(&self, h: DIn<T>) -> PyResult<Lent<'_, CudaSlice<T>>> {
        self.check(h.call)?;
        // SAFETY: `h` was made by this call's `DeviceLend`, which checked the tensor behind it (a
        // live CUDA tensor of this device, the caller's frame holding it for the call, contiguous,
        // `len` elements of `T` at the aligned `address`); `Lent` gives the slice back on drop and
        // only derefs it shared; `lent` checked no output of this call or of another in flight
        // overlaps it.
        Ok(Lent(ManuallyDrop::new(unsafe { self.slice(h.address, h.len) }), PhantomData))
    }

    /// An optional input.
    pub(crate) fn get_opt<T: TorchElement + DeviceRepr>(
        &self,
        h: Option<DIn<T>>,
    ) -> PyResult<Option<Lent<'_, CudaSlice<T>>>> {
        h.map(|h| self.get(h)).transpose()
    }

    /// Output `h` as a slice, exclusively (the handle is consumed).
    pub(crate) fn get_mut<T: TorchElement + DeviceRepr>(
        &self,
        h: DOut<T>,
    ) -> PyResult<LentMut<'_, CudaSlice<T>>> {
        self.check(h.call)?;
        // SAFETY: `h` was made by this call's `DeviceLend`, which checked the tensor behind it (a
        // live CUDA tensor of this device held by the caller's frame for the call, contiguous,
        // `len` elements of `T` at the aligned `address`); `lent` checked this output overlaps no
        // other tensor of the call or of a call in flight, and the consumed handle makes this its
        // only borrow; `LentMut` gives the slice back on drop.
        Ok(LentMut(ManuallyDrop::new(unsafe { self.slice(h.address, h.len) }), PhantomData))
    }

    /// An optional output.
    pub(crate) fn get_mut_opt<T: TorchElement + DeviceRepr>(
        &self,
        h: Option<DOut<T>>,
    ) -> PyResult<Option<LentMut<'_, CudaSlice<T>>>> {
        h.map(|h| self.get_mut(h)).transpose()
    }

    /// An empty f32 slice, standing for a gradient that is not computed: no memory behind it.
    pub(crate) fn empty_f32(&self) -> LentMut<'_, CudaSlice<f32>> {
        // SAFETY: zero elements: nothing is read or written through the slice (the crates check a
        // skipped gradient's buffer is empty and never touch it), and `LentMut` gives the null
        // pointer back instead of freeing it.
        LentMut(ManuallyDrop::new(unsafe { self.slice(0, 0) }), PhantomData)
    }

    /// Input `h` (f32 or bf16) as one of llep's device buffers, read only.
    pub(crate) fn llep_buf(&self, h: LlepIn) -> PyResult<Lent<'_, llep::cuda::CudaBuf>> {
        let buf = match h {
            LlepIn::F32(h) => {
                self.check(h.call)?;
                // SAFETY: `h` was made by this call's `DeviceLend`, which checked a live, contiguous
                // CUDA tensor of this device with `len` f32 at the aligned `address`, overlapped by
                // no output in flight; the `Lent` below gives the buffer back and derefs it shared.
                llep::cuda::CudaBuf::F32(llep::cuda::DevSlice::lent(unsafe { self.slice(h.address, h.len) }))
            }
            LlepIn::Bf16(h) => {
                self.check(h.call)?;
                // SAFETY: `h` was made by this call's `DeviceLend`, which checked a live, contiguous
                // CUDA tensor of this device with `len` bf16 at the aligned `address`, overlapped by
                // no output in flight; the `Lent` below gives the buffer back and derefs it shared.
                llep::cuda::CudaBuf::Bf16(llep::cuda::DevSlice::lent(unsafe { self.slice(h.address, h.len) }))
            }
        };
        Ok(Lent(ManuallyDrop::new(buf), PhantomData))
    }

    /// Output `h`, a `uint8` workspace tensor, carved into ring-dtp's block buffers where the
    /// crate lays them out (`ring_dtp::cuda::BlockBuffers::carved`).
    pub(crate) fn block_buffers(
        &self,
        h: DOut<u8>,
        layout: ring_dtp::cuda::CarvedLayout,
    ) -> PyResult<LentMut<'_, ring_dtp::cuda::BlockBuffers>> {
        let ring_dtp::cuda::CarvedLayout { offsets, lens, .. } = layout;
        self.check(h.call)?;
        if !h.address.is_multiple_of(ring_dtp::cuda::BlockBuffers::CARVE_ALIGN) {
            return Err(PyValueError::new_err(format!(
                "workspace: data pointer {:#x} is not {}-byte aligned",
                h.address,
                ring_dtp::cuda::BlockBuffers::CARVE_ALIGN
            )));
        }
        let mut ends: Vec<(usize, usize)> = offsets.iter().zip(lens).map(|(&o, l)| (o, o + 4 * l)).collect();
        ends.sort_unstable();
        let inside = ends.iter().all(|&(start, end)| start.is_multiple_of(4) && end <= h.len);
        let disjoint = ends.windows(2).all(|w| w[0].1 <= w[1].0);
        if !(inside && disjoint) {
            return Err(PyRuntimeError::new_err(format!(
                "the block buffers at {offsets:?} ({lens:?} f32) do not fit the {}-byte workspace (an internal \
                 error of flatpeak)",
                h.len
            )));
        }
        // SAFETY: each carve lies inside the checked, exclusive workspace tensor (checked just
        // above), at 4-byte aligned offsets from its 256-byte aligned start, and the three are
        // disjoint; the tensor lives for the call and `LentMut` gives the slices back on drop.
        let [logits, x_wide, w_wide] =
            std::array::from_fn(|i| unsafe { self.slice(h.address + offsets[i], lens[i]) });
        Ok(LentMut(ManuallyDrop::new(ring_dtp::cuda::BlockBuffers { logits, x_wide, w_wide }), PhantomData))
    }

    /// A parameter and its gradient as stream-adamw's device buffers.
    pub(crate) fn adamw_device<G: TorchElement + DeviceRepr, P: TorchElement + DeviceRepr>(
        &self,
        grads: DIn<G>,
        params: DOut<P>,
    ) -> PyResult<LentMut<'_, stream_adamw::cuda::CudaDevice<G, P>>> {
        self.check(grads.call)?;
        self.check(params.call)?;
        // SAFETY: both handles were made by this call's `DeviceLend`, which checked each tensor (a
        // live, contiguous CUDA tensor of this device with `len` elements at the aligned
        // `address`); `lent` checked the parameters, an output, overlap no other tensor in flight
        // and the gradients no output, the step only reads the gradients, and the consumed `DOut`
        // makes this the parameters' only borrow; `LentMut` gives both slices back on drop.
        let device = unsafe {
            stream_adamw::cuda::CudaDevice {
                grads: self.slice(grads.address, grads.len),
                params: self.slice(params.address, params.len),
            }
        };
        Ok(LentMut(ManuallyDrop::new(device), PhantomData))
    }
}

/// An f32 or bf16 input, for llep's buffers.
#[derive(Debug, Clone, Copy)]
pub(crate) enum LlepIn {
    F32(DIn<f32>),
    Bf16(DIn<bf16>),
}
