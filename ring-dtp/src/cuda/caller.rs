//! [`LinearCrossEntropy`] on the caller's resources (a framework's): its stream, so the work is
//! ordered with the framework's with no added synchronisation, and block buffers from its own
//! allocator, handed in per call, so the framework's memory statistics see the working set.

use std::sync::Arc;

use flatpeak_common::cuda::cudarc::driver::CudaStream;

use super::{BlockBuffers, CudaLinearCrossEntropy, DeviceGradientsMut, DeviceInputs};
use crate::error::Result;
use crate::executor::LinearCrossEntropy;
use crate::inputs::{Forward, GradOutput, Upstream};
use crate::plan::Plan;

impl LinearCrossEntropy {
    /// An executor of `plan` that runs on `stream` (a framework's current stream: its work is
    /// ordered with the framework's, no synchronisation added) and reserves no block buffers:
    /// the `*_with` calls take them ([`BlockBuffers::lens`] each, from the caller's memory).
    /// Its kernels and cuBLAS handle are the device's, compiled and created once per process.
    pub fn on_stream(plan: Plan, stream: Arc<CudaStream>) -> Result<Self> {
        let ordinal = stream.context().ordinal();
        Ok(Self::of_cuda(plan, ordinal, CudaLinearCrossEntropy::on_stream(plan, stream)?))
    }

    /// The stream a CUDA executor issues on.
    pub fn stream(&mut self) -> Result<&Arc<CudaStream>> {
        Ok(self.cuda_backend()?.stream())
    }

    /// [`forward`](Self::forward) of device inputs with the caller's block buffers.
    pub fn forward_with(&mut self, buffers: &mut BlockBuffers, inputs: &DeviceInputs<'_>) -> Result<Forward> {
        self.check_inputs_device(inputs)?;
        self.cuda_backend()?.forward_with(buffers, inputs)
    }

    /// [`backward`](Self::backward) of device inputs from forward's per-row `lse` with the
    /// caller's block buffers, writing the gradients its selection wants into the caller's
    /// device buffers `out` (overwritten).
    pub fn backward_into_with(
        &mut self,
        buffers: &mut BlockBuffers,
        inputs: &DeviceInputs<'_>,
        lse: &[f32],
        upstream: Upstream<'_>,
        out: DeviceGradientsMut<'_>,
    ) -> Result<()> {
        self.check_inputs_device(inputs)?;
        self.cuda_backend()?.backward_into_with(buffers, inputs, lse, upstream, out)
    }

    /// [`forward_backward`](Self::forward_backward) of device inputs with the caller's block
    /// buffers, writing the gradients into the caller's device buffers `out` (overwritten).
    pub fn forward_backward_into_with(
        &mut self,
        buffers: &mut BlockBuffers,
        inputs: &DeviceInputs<'_>,
        grad: GradOutput<'_>,
        out: DeviceGradientsMut<'_>,
    ) -> Result<Forward> {
        self.check_inputs_device(inputs)?;
        self.cuda_backend()?.forward_backward_into_with(buffers, inputs, grad, out)
    }

    /// [`Error::WrongDevice`](crate::Error::WrongDevice) unless `inputs` live on this executor's
    /// device.
    fn check_inputs_device(&self, inputs: &DeviceInputs<'_>) -> Result<()> {
        use crate::executor::LossInputs;
        self.check_device(inputs.device())
    }
}
