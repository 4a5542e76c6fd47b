//! The loss's tensors lent on a CUDA device (feature `cuda`): the registration is the host's
//! ([`LossIns::new`] in either memory); this is the lending of the plain and the ring losses'
//! CUDA paths as ring-dtp's device inputs.

use flatpeak_common::cuda::cudarc::driver::CudaSlice;
use half::bf16;
use pyo3::prelude::*;
use ring_dtp::Shape;
use ring_dtp::cuda::{DeviceInputs, DeviceMatrix};

use crate::cuda_tensor::{DeviceLent, DeviceMemory, Lent};
use crate::loss_args::{LossIns, Operands};

/// One call's (or one rank's) tensors on a CUDA device, registered.
pub(crate) type DeviceLossIns = LossIns<DeviceMemory>;

/// The inputs' device slices, lent for the call.
pub(crate) struct Slices<'l> {
    x: Operand<'l>,
    w: Operand<'l>,
    target: Lent<'l, CudaSlice<i64>>,
    bias: Option<Lent<'l, CudaSlice<f32>>>,
    weights: Option<Lent<'l, CudaSlice<f32>>>,
    shape: Shape,
}

enum Operand<'l> {
    F32(Lent<'l, CudaSlice<f32>>),
    Bf16(Lent<'l, CudaSlice<bf16>>),
}

impl Operand<'_> {
    fn matrix(&self) -> DeviceMatrix<'_> {
        match self {
            Operand::F32(m) => DeviceMatrix::F32(m),
            Operand::Bf16(m) => DeviceMatrix::Bf16(m),
        }
    }
}

impl LossIns<DeviceMemory> {
    /// The registered tensors' slices, lent.
    pub(crate) fn slices<'l>(&self, lent: &'l DeviceLent<'_, '_>) -> PyResult<Slices<'l>> {
        let (x, w) = match self.operands {
            Operands::F32(x, w) => (Operand::F32(lent.get(x)?), Operand::F32(lent.get(w)?)),
            Operands::Bf16(x, w) => (Operand::Bf16(lent.get(x)?), Operand::Bf16(lent.get(w)?)),
        };
        Ok(Slices {
            x,
            w,
            target: lent.get(self.target)?,
            bias: lent.get_opt(self.bias)?,
            weights: lent.get_opt(self.weights)?,
            shape: self.shape,
        })
    }
}

impl Slices<'_> {
    /// The crate's device inputs over the slices.
    pub(crate) fn inputs(&self) -> DeviceInputs<'_> {
        let mut inputs =
            DeviceInputs::on_device(self.x.matrix(), self.w.matrix(), &self.target, self.shape.hidden);
        inputs.v = self.shape.vocab;
        (inputs.bias, inputs.weights) = (self.bias.as_deref(), self.weights.as_deref());
        inputs
    }
}
