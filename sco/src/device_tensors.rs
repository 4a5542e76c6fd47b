//! [`DeviceTensors`]: the tensors of an [`Offloader`](crate::Offloader)'s device, whichever it
//! is — host slices on the CPU fallback, device views on a GPU (feature `cuda`) — so one
//! offloader type serves every device and the layers see the device's tensors. A layer written
//! for host slices (`Layer<Host<T>>`) runs on them through [`OnHost`], a CUDA layer
//! (`Layer<cuda::CudaTensors<T>>`) through `OnCuda`, and a layer may also match on the tensors
//! itself. Tensors of another device than the layer's are `WrongDevice`, never a copy.

use std::fmt;
use std::fmt::Debug;

use bytemuck::Pod;
use flatpeak_common::Device;
#[cfg(feature = "cuda")]
use flatpeak_common::cuda::cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DeviceSlice};

use crate::error::{Error, Result};
use crate::stack::Layer;
use crate::store::{Host, Tensors};

/// An element both backends built in can hold: plain old data, and with the `cuda` feature one
/// cudarc can copy (every float and integer type is both).
pub trait BoundaryElement: Pod + Send + Sync + Debug + flatpeak_common::DeviceElement + 'static {}
impl<T: Pod + Send + Sync + Debug + flatpeak_common::DeviceElement + 'static> BoundaryElement for T {}

/// Where a family's tensors live.
#[derive(Debug)]
enum On<T> {
    Host,
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::CudaTensors<T>),
    #[cfg(not(feature = "cuda"))]
    #[allow(dead_code)]
    Never(std::marker::PhantomData<fn() -> T>, std::convert::Infallible),
}

/// The tensor family of one offloader's device (allocates there: nothing on the host, on the
/// offloader's compute stream on a GPU).
pub struct DeviceTensors<T> {
    on: On<T>,
}

impl<T> DeviceTensors<T> {
    /// Host tensors.
    pub fn host() -> Self {
        Self { on: On::Host }
    }
    /// Tensors on a CUDA device, allocated and copied as `tensors` does.
    #[cfg(feature = "cuda")]
    pub fn cuda(tensors: crate::cuda::CudaTensors<T>) -> Self {
        Self { on: On::Cuda(tensors) }
    }
    /// Their device.
    pub fn device(&self) -> Device {
        match &self.on {
            On::Host => Device::Cpu,
            #[cfg(feature = "cuda")]
            On::Cuda(t) => Device::Cuda(t.stream().context().ordinal()),
            #[cfg(not(feature = "cuda"))]
            On::Never(_, never) => match *never {},
        }
    }
}

impl<T> Clone for DeviceTensors<T> {
    fn clone(&self) -> Self {
        match &self.on {
            On::Host => Self::host(),
            #[cfg(feature = "cuda")]
            On::Cuda(t) => Self { on: On::Cuda(t.clone()) },
            #[cfg(not(feature = "cuda"))]
            On::Never(_, never) => match *never {},
        }
    }
}

impl<T> fmt::Debug for DeviceTensors<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceTensors<{}>({})", std::any::type_name::<T>(), self.device())
    }
}

/// A tensor read by a layer, on its device.
#[derive(Debug)]
#[non_exhaustive]
pub enum DeviceRef<'a, T: BoundaryElement> {
    /// Host memory.
    Host(&'a [T]),
    /// CUDA device memory.
    #[cfg(feature = "cuda")]
    Cuda(CudaView<'a, T>),
}

/// A tensor written by a layer, on its device.
#[derive(Debug)]
#[non_exhaustive]
pub enum DeviceMut<'a, T: BoundaryElement> {
    /// Host memory.
    Host(&'a mut [T]),
    /// CUDA device memory.
    #[cfg(feature = "cuda")]
    Cuda(CudaViewMut<'a, T>),
}

/// A tensor a step owns (outputs, gradients), on its device.
#[derive(Debug)]
#[non_exhaustive]
pub enum DeviceTensor<T: BoundaryElement> {
    /// Host memory.
    Host(Vec<T>),
    /// CUDA device memory.
    #[cfg(feature = "cuda")]
    Cuda(CudaSlice<T>),
}

impl<'a, T: BoundaryElement> DeviceRef<'a, T> {
    /// The host elements, or `WrongDevice` for a tensor on a GPU.
    pub fn host(&self) -> Result<&'a [T]> {
        match self {
            Self::Host(s) => Ok(s),
            #[allow(unreachable_patterns)]
            other => Err(wrong(Device::Cpu, other.device())),
        }
    }
    /// The tensor's device.
    pub fn device(&self) -> Device {
        match self {
            Self::Host(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            Self::Cuda(v) => Device::Cuda(v.stream().context().ordinal()),
        }
    }
}

impl<T: BoundaryElement> DeviceMut<'_, T> {
    /// The tensor's device.
    pub fn device(&self) -> Device {
        match self {
            Self::Host(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            Self::Cuda(v) => Device::Cuda(v.stream().context().ordinal()),
        }
    }
}

impl<'a, T: BoundaryElement> From<&'a [T]> for DeviceRef<'a, T> {
    fn from(host: &'a [T]) -> Self {
        Self::Host(host)
    }
}

impl<T: BoundaryElement> From<Vec<T>> for DeviceTensor<T> {
    fn from(host: Vec<T>) -> Self {
        Self::Host(host)
    }
}

impl<T: BoundaryElement> DeviceTensor<T> {
    /// The host elements, or `WrongDevice` for a tensor on a GPU.
    pub fn into_host(self) -> Result<Vec<T>> {
        match self {
            Self::Host(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Self::Cuda(s) => {
                Err(Error::WrongDevice { executor: Device::Cpu, inputs: Device::Cuda(s.ordinal()) })
            }
        }
    }
}

/// `WrongDevice` for a tensor on `got` handed where `expected` computes.
fn wrong(expected: Device, got: Device) -> Error {
    Error::WrongDevice { executor: expected, inputs: got }
}

impl<T: BoundaryElement> Tensors for DeviceTensors<T> {
    type Elem = T;
    type Ref<'a> = DeviceRef<'a, T>;
    type Mut<'a> = DeviceMut<'a, T>;
    type Owned = DeviceTensor<T>;

    fn zeros(&self, len: usize) -> Result<DeviceTensor<T>> {
        match &self.on {
            On::Host => Ok(DeviceTensor::Host(Host::<T>::new().zeros(len)?)),
            #[cfg(feature = "cuda")]
            On::Cuda(t) => Ok(DeviceTensor::Cuda(t.zeros(len)?)),
            #[cfg(not(feature = "cuda"))]
            On::Never(_, never) => match *never {},
        }
    }
    fn copy(&self, src: DeviceRef<'_, T>, dst: DeviceMut<'_, T>) -> Result<()> {
        match (&self.on, src, dst) {
            (On::Host, DeviceRef::Host(src), DeviceMut::Host(dst)) => Host::<T>::new().copy(src, dst),
            #[cfg(feature = "cuda")]
            (On::Cuda(t), DeviceRef::Cuda(src), DeviceMut::Cuda(dst)) => t.copy(src, dst),
            #[allow(unreachable_patterns)]
            (_, src, dst) => {
                let got = if src.device() != self.device() { src.device() } else { dst.device() };
                Err(wrong(self.device(), got))
            }
        }
    }
    fn view(t: &DeviceTensor<T>) -> DeviceRef<'_, T> {
        match t {
            DeviceTensor::Host(v) => DeviceRef::Host(v),
            #[cfg(feature = "cuda")]
            DeviceTensor::Cuda(s) => DeviceRef::Cuda(s.as_view()),
        }
    }
    fn view_mut(t: &mut DeviceTensor<T>) -> DeviceMut<'_, T> {
        match t {
            DeviceTensor::Host(v) => DeviceMut::Host(v),
            #[cfg(feature = "cuda")]
            DeviceTensor::Cuda(s) => DeviceMut::Cuda(s.as_view_mut()),
        }
    }
    fn len(t: &DeviceRef<'_, T>) -> usize {
        match t {
            DeviceRef::Host(v) => v.len(),
            #[cfg(feature = "cuda")]
            DeviceRef::Cuda(v) => v.len(),
        }
    }
}

/// The host slice of a host tensor; `WrongDevice` for a device one.
fn host_ref<'a, T: BoundaryElement>(t: DeviceRef<'a, T>) -> Result<&'a [T]> {
    match t {
        DeviceRef::Host(s) => Ok(s),
        #[allow(unreachable_patterns)]
        other => Err(wrong(Device::Cpu, other.device())),
    }
}

/// The host slice of a host tensor; `WrongDevice` for a device one.
fn host_mut<'a, T: BoundaryElement>(t: DeviceMut<'a, T>) -> Result<&'a mut [T]> {
    match t {
        DeviceMut::Host(s) => Ok(s),
        #[allow(unreachable_patterns)]
        other => Err(wrong(Device::Cpu, other.device())),
    }
}

/// A layer on host slices (`Layer<Host<T>>`) on an offloader's tensors: on a CPU offloader
/// they are host slices; device tensors are `WrongDevice`.
#[derive(Debug, Clone)]
pub struct OnHost<L>(pub L);

/// `Layer<DeviceTensors<T>>` for an adapter of a layer on one device's family: each tensor is
/// unwrapped to that device's by `$as_ref`/`$as_mut` (`WrongDevice` otherwise), what
/// `forward_saving` returns wrapped as `DeviceTensor::$variant`.
macro_rules! device_layer {
    ($adapter:ident, $family:ty, $as_ref:ident, $as_mut:ident, $variant:ident) => {
        impl<T: BoundaryElement, L: Layer<$family>> Layer<DeviceTensors<T>> for $adapter<L> {
            fn width(&self) -> usize {
                self.0.width()
            }
            fn param_count(&self) -> usize {
                self.0.param_count()
            }
            fn forward(&self, x: DeviceRef<'_, T>, y: DeviceMut<'_, T>) -> Result<()> {
                self.0.forward($as_ref(x)?, $as_mut(y)?)
            }
            fn forward_saving(&self, x: DeviceRef<'_, T>, y: DeviceMut<'_, T>) -> Result<DeviceTensor<T>> {
                Ok(DeviceTensor::$variant(self.0.forward_saving($as_ref(x)?, $as_mut(y)?)?))
            }
            fn backward(
                &self,
                x: DeviceRef<'_, T>,
                saved: Option<DeviceRef<'_, T>>,
                dy: DeviceRef<'_, T>,
                dx: DeviceMut<'_, T>,
                dparams: DeviceMut<'_, T>,
            ) -> Result<()> {
                let saved = saved.map($as_ref).transpose()?;
                self.0.backward($as_ref(x)?, saved, $as_ref(dy)?, $as_mut(dx)?, $as_mut(dparams)?)
            }
        }
    };
}

device_layer!(OnHost, Host<T>, host_ref, host_mut, Host);

/// A CUDA layer (`Layer<cuda::CudaTensors<T>>`) on an offloader's tensors: on a GPU they are its
/// device views; host tensors are `WrongDevice`.
#[cfg(feature = "cuda")]
#[derive(Debug, Clone)]
pub struct OnCuda<L>(pub L);

#[cfg(feature = "cuda")]
mod on_cuda {
    use flatpeak_common::Device;
    use flatpeak_common::cuda::cudarc::driver::{CudaView, CudaViewMut};

    use super::{BoundaryElement, DeviceMut, DeviceRef, DeviceTensor, DeviceTensors, OnCuda, wrong};
    use crate::cuda::CudaTensors;
    use crate::error::Result;
    use crate::stack::Layer;

    fn cuda_ref<'a, T: BoundaryElement>(t: DeviceRef<'a, T>) -> Result<CudaView<'a, T>> {
        match t {
            DeviceRef::Cuda(v) => Ok(v),
            DeviceRef::Host(_) => Err(wrong(Device::Cuda(0), Device::Cpu)),
        }
    }
    fn cuda_mut<'a, T: BoundaryElement>(t: DeviceMut<'a, T>) -> Result<CudaViewMut<'a, T>> {
        match t {
            DeviceMut::Cuda(v) => Ok(v),
            DeviceMut::Host(_) => Err(wrong(Device::Cuda(0), Device::Cpu)),
        }
    }

    device_layer!(OnCuda, CudaTensors<T>, cuda_ref, cuda_mut, Cuda);
}
