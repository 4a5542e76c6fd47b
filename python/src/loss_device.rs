//! The loss's tensors on a CUDA device (feature `cuda`), registered for one call: the one
//! registration of the plain and the ring losses' CUDA paths (the host one is
//! [`crate::loss_args::LossIns`]).

use flatpeak_common::cuda::cudarc::driver::CudaSlice;
use half::bf16;
use pyo3::prelude::*;
use ring_dtp::cuda::{DeviceInputs, DeviceMatrix};
use ring_dtp::{DType, Shape};

use crate::cuda_tensor::{DIn, DeviceLend, DeviceLent, Lent};
use crate::loss_args::LossArgs;

/// X and W in their dtype.
#[derive(Clone, Copy)]
enum Operands {
    F32(DIn<f32>, DIn<f32>),
    Bf16(DIn<bf16>, DIn<bf16>),
}

/// One call's (or one rank's) device tensors, registered.
pub(crate) struct DeviceLossIns {
    operands: Operands,
    target: DIn<i64>,
    pub(crate) bias: Option<DIn<f32>>,
    weights: Option<DIn<f32>>,
    pub(crate) shape: Shape,
}

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

impl DeviceLossIns {
    /// The tensors of `args` (input `[N, D]`, weight `[V, D]`, target `[N]`, bias `[V]`,
    /// token_weights `[N]`) on `lend`'s device, registered with it.
    pub(crate) fn new<'t, 'py>(lend: &mut DeviceLend<'t, 'py>, args: &'t LossArgs<'py>) -> PyResult<Self> {
        let shape = args.shape()?;
        let Shape { tokens: n, hidden: d, vocab: v, dtype } = shape;
        let (x, w) = ([Some(n), Some(d)], [Some(v), Some(d)]);
        let operands = match dtype {
            DType::Bf16 => {
                Operands::Bf16(lend.input("input", &args.input, &x)?, lend.input("weight", &args.weight, &w)?)
            }
            _ => {
                Operands::F32(lend.input("input", &args.input, &x)?, lend.input("weight", &args.weight, &w)?)
            }
        };
        Ok(Self {
            operands,
            target: lend.input("target", &args.target, &[Some(n)])?,
            bias: lend.input_opt("bias", args.bias.as_ref(), &[Some(v)])?,
            weights: lend.input_opt("token_weights", args.token_weights.as_ref(), &[Some(n)])?,
            shape,
        })
    }

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
