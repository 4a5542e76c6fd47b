//! [`Offloader`]: the offloader of one plan on one [`Device`], one type whatever the device. It
//! lends its boundaries as [`DeviceTensors`] (host slices on the CPU, device views on a GPU), so
//! a [`CheckpointedStack`](crate::CheckpointedStack) drives it with layers for that device: a
//! host layer as it is, a CUDA layer through `OnCuda`; the wrong device is `WrongDevice`.
//! The backends stay usable on their own ([`CheckpointOffloader`] with a simulated link,
//! `cuda::CudaCheckpointOffloader` lending `CudaView`s).

use flatpeak_common::{Device, Link};

use crate::device_tensors::{BoundaryElement, DeviceMut, DeviceRef, DeviceTensors};
use crate::error::{Error, Result};
use crate::offloader::CheckpointOffloader;
use crate::plan::Plan;
use crate::store::CheckpointStore;
/// Where an offloader's ring and arena live.
#[derive(Debug)]
enum Backend<T: BoundaryElement> {
    Host(CheckpointOffloader<T>),
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::CudaCheckpointOffloader<T>),
}

/// The checkpoint offloader of one plan on one device. Memory bound: `plan.workspace_bytes()`
/// of device memory for boundaries (the slot ring) and `plan.host_arena_bytes()` of host
/// memory, reserved by [`Offloader::new`] and never grown.
#[derive(Debug)]
pub struct Offloader<T: BoundaryElement> {
    backend: Backend<T>,
}

impl<T: BoundaryElement> Offloader<T> {
    /// Reserves `plan`'s ring and arena on `device`: on the CPU a host ring and copy-engine
    /// threads at memcpy speed (build a [`CheckpointOffloader`] directly for a simulated link),
    /// on a CUDA device a device ring, a pinned arena and copy streams. A CUDA device that
    /// cannot be used is `Common(CudaUnavailable)` saying why, including a `sco` built without
    /// the `cuda` feature: never a silent fallback to the CPU.
    pub fn new(plan: Plan, device: Device) -> Result<Self> {
        let backend = match device {
            Device::Cpu => Backend::Host(CheckpointOffloader::new(plan, Link::Memcpy)?),
            Device::Cuda(ordinal) => cuda(plan, ordinal)?,
        };
        Ok(Self { backend })
    }

    /// The device it was built for.
    pub fn device(&self) -> Device {
        match &self.backend {
            Backend::Host(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            Backend::Cuda(off) => off.device(),
        }
    }

    /// The plan.
    pub fn plan(&self) -> &Plan {
        match &self.backend {
            Backend::Host(off) => off.plan(),
            #[cfg(feature = "cuda")]
            Backend::Cuda(off) => off.plan(),
        }
    }
}

/// `WrongDevice` for a tensor on `got` handed to an offloader on `expected`.
fn wrong(expected: Device, got: Device) -> Error {
    Error::WrongDevice { executor: expected, inputs: got }
}

impl<T: BoundaryElement> CheckpointStore for Offloader<T> {
    type Tensors = DeviceTensors<T>;

    fn plan(&self) -> &Plan {
        Offloader::plan(self)
    }
    fn tensors(&self) -> DeviceTensors<T> {
        match &self.backend {
            Backend::Host(_) => DeviceTensors::host(),
            #[cfg(feature = "cuda")]
            Backend::Cuda(off) => DeviceTensors::cuda(off.tensors()),
        }
    }
    fn offload_from(&mut self, layer: usize, tensor: DeviceRef<'_, T>) -> Result<()> {
        let device = self.device();
        match (&mut self.backend, tensor) {
            (Backend::Host(off), DeviceRef::Host(t)) => off.offload_from(layer, t),
            #[cfg(feature = "cuda")]
            (Backend::Cuda(off), DeviceRef::Cuda(t)) => off.offload_from(layer, t),
            #[allow(unreachable_patterns)]
            (_, t) => Err(wrong(device, t.device())),
        }
    }
    fn forward_into<R>(
        &mut self,
        layer: usize,
        f: impl FnOnce(DeviceRef<'_, T>, DeviceMut<'_, T>) -> Result<R>,
    ) -> Result<R> {
        match &mut self.backend {
            Backend::Host(off) => off.forward_into(layer, |x, y| f(DeviceRef::Host(x), DeviceMut::Host(y))),
            #[cfg(feature = "cuda")]
            Backend::Cuda(off) => off.forward_into(layer, |x, y| f(DeviceRef::Cuda(x), DeviceMut::Cuda(y))),
        }
    }
    fn prefetch(&mut self, layer: usize) -> Result<()> {
        match &mut self.backend {
            Backend::Host(off) => CheckpointStore::prefetch(off, layer),
            #[cfg(feature = "cuda")]
            Backend::Cuda(off) => CheckpointStore::prefetch(off, layer),
        }
    }
    fn fetch_with<R>(&mut self, layer: usize, f: impl FnOnce(DeviceRef<'_, T>) -> Result<R>) -> Result<R> {
        match &mut self.backend {
            Backend::Host(off) => off.fetch_with(layer, |x| f(DeviceRef::Host(x))),
            #[cfg(feature = "cuda")]
            Backend::Cuda(off) => off.fetch_with(layer, |x| f(DeviceRef::Cuda(x))),
        }
    }
    fn release(&mut self, layer: usize) -> Result<()> {
        match &mut self.backend {
            Backend::Host(off) => CheckpointStore::release(off, layer),
            #[cfg(feature = "cuda")]
            Backend::Cuda(off) => CheckpointStore::release(off, layer),
        }
    }
    fn finish_step(&mut self) -> Result<()> {
        match &mut self.backend {
            Backend::Host(off) => CheckpointStore::finish_step(off),
            #[cfg(feature = "cuda")]
            Backend::Cuda(off) => CheckpointStore::finish_step(off),
        }
    }
    fn high_water_bytes(&self) -> usize {
        match &self.backend {
            Backend::Host(off) => CheckpointStore::high_water_bytes(off),
            #[cfg(feature = "cuda")]
            Backend::Cuda(off) => CheckpointStore::high_water_bytes(off),
        }
    }
}

#[cfg(feature = "cuda")]
fn cuda<T: BoundaryElement>(plan: Plan, ordinal: usize) -> Result<Backend<T>> {
    Device::Cuda(ordinal).ensure_available()?;
    Ok(Backend::Cuda(crate::cuda::CudaCheckpointOffloader::new(plan, ordinal)?))
}

#[cfg(not(feature = "cuda"))]
fn cuda<T: BoundaryElement>(_plan: Plan, ordinal: usize) -> Result<Backend<T>> {
    Err(crate::Error::Common(flatpeak_common::Error::CudaUnavailable {
        reason: format!("cuda:{ordinal} requested, but sco was built without the `cuda` feature"),
    }))
}

#[cfg(test)]
mod tests {
    use flatpeak_common::Budget;

    use super::*;
    use crate::plan::{Config, Shape};

    #[test]
    fn the_device_chooses_the_backend_and_a_missing_one_says_why() {
        let plan = Plan::new(&Config::default(), Shape::of::<f32>(4, 8), Budget::Unlimited).unwrap();
        let host = Offloader::<f32>::new(plan, Device::Cpu).unwrap();
        assert_eq!((host.device(), *host.plan()), (Device::Cpu, plan));
        assert_eq!(host.tensors().device(), Device::Cpu);
        match Offloader::<f32>::new(plan, Device::Cuda(1 << 20)) {
            Err(crate::Error::Common(flatpeak_common::Error::CudaUnavailable { reason })) => {
                #[cfg(not(feature = "cuda"))]
                assert!(reason.contains("sco was built without the `cuda` feature"), "{reason}");
                assert!(!reason.is_empty());
            }
            other => panic!("expected CudaUnavailable, got {other:?}"),
        }
    }
}
