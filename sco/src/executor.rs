//! [`Offloader`]: the offloader chosen by one [`Device`]. Its backends lend different tensors
//! (host slices on the CPU, device views on a GPU), so the choice is an enum the caller matches
//! once, not one type that would hand the wrong tensors to the wrong device: each variant is a
//! [`CheckpointStore`](crate::CheckpointStore) a [`CheckpointedStack`](crate::CheckpointedStack)
//! can drive with layers for that device.

use bytemuck::Pod;
use flatpeak_common::{Device, Link};

use crate::error::Result;
use crate::offloader::CheckpointOffloader;
use crate::plan::Plan;

/// An element both backends built in can hold: plain old data, and with the `cuda` feature one
/// cudarc can copy (every float and integer type is both).
#[cfg(feature = "cuda")]
pub trait Element:
    Pod
    + Send
    + Sync
    + flatpeak_common::cuda::cudarc::driver::DeviceRepr
    + flatpeak_common::cuda::cudarc::driver::ValidAsZeroBits
{
}
#[cfg(feature = "cuda")]
impl<T> Element for T where
    T: Pod
        + Send
        + Sync
        + flatpeak_common::cuda::cudarc::driver::DeviceRepr
        + flatpeak_common::cuda::cudarc::driver::ValidAsZeroBits
{
}
/// An element both backends built in can hold: plain old data, and with the `cuda` feature one
/// cudarc can copy (every float and integer type is both).
#[cfg(not(feature = "cuda"))]
pub trait Element: Pod + Send + Sync {}
#[cfg(not(feature = "cuda"))]
impl<T: Pod + Send + Sync> Element for T {}

/// The checkpoint offloader of one plan on one device. Memory bound: `plan.workspace_bytes()`
/// of device memory for boundaries (the slot ring) and `plan.host_arena_bytes()` of host
/// memory, reserved by [`Offloader::new`] and never grown.
#[derive(Debug)]
#[non_exhaustive]
pub enum Offloader<T: Element> {
    /// The CPU fallback ([`Device::Cpu`]): a host "device" ring and copy-engine threads.
    Host(CheckpointOffloader<T>),
    /// A CUDA device ([`Device::Cuda`], feature `cuda`): a device ring, a pinned arena, copy
    /// streams.
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::CudaCheckpointOffloader<T>),
}

impl<T: Element> Offloader<T> {
    /// Reserves `plan`'s ring and arena on `device` (on the CPU, copies at memcpy speed; build a
    /// [`CheckpointOffloader`] directly for a simulated link). A CUDA device that cannot be used
    /// is `Common(CudaUnavailable)` saying why, including a `sco` built without the `cuda`
    /// feature: never a silent fallback to the CPU.
    pub fn new(plan: Plan, device: Device) -> Result<Self> {
        match device {
            Device::Cpu => Ok(Self::Host(CheckpointOffloader::new(plan, Link::Memcpy)?)),
            Device::Cuda(ordinal) => cuda(plan, ordinal),
        }
    }

    /// The device it was built for.
    pub fn device(&self) -> Device {
        match self {
            Self::Host(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            Self::Cuda(off) => off.device(),
        }
    }

    /// The plan.
    pub fn plan(&self) -> &Plan {
        match self {
            Self::Host(off) => off.plan(),
            #[cfg(feature = "cuda")]
            Self::Cuda(off) => off.plan(),
        }
    }
}

#[cfg(feature = "cuda")]
fn cuda<T: Element>(plan: Plan, ordinal: usize) -> Result<Offloader<T>> {
    Device::Cuda(ordinal).ensure_available()?;
    Ok(Offloader::Cuda(crate::cuda::CudaCheckpointOffloader::new(plan, ordinal)?))
}

#[cfg(not(feature = "cuda"))]
fn cuda<T: Element>(_plan: Plan, ordinal: usize) -> Result<Offloader<T>> {
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
        assert!(matches!(host, Offloader::Host(_)));
        assert_eq!((host.device(), *host.plan()), (Device::Cpu, plan));
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
