//! An [`AgreedRing`]'s calls on a CUDA device: the rank's own device tensors checked and the
//! verdicts agreed on over the host communicator before the first NCCL call (NCCL has no timeout
//! to end a wait on a rank that refused), then padded on the device to the plan's rows.

use flatpeak_common::Communicator;
use flatpeak_common::comm::agree_on_inputs;
use flatpeak_common::cuda::cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use flatpeak_common::cuda::{alloc_error, cuda_error};
use flatpeak_common::nccl::DeviceCommunicator;
use half::bf16;

use crate::cuda::{DeviceGradients, DeviceInputs, DeviceMatrix};
use crate::error::{Error, Result};
use crate::inputs::{Forward, GradOutput, Inputs, Upstream, check_targets, check_weights};
use crate::ring::{AgreedRing, RingLinearCrossEntropy};

/// A rank's device rows padded to the plan's: X, the targets and the weights (buffers of the
/// call, on the communicator's stream).
struct Padded {
    x: Option<Rows>,
    targets: CudaSlice<i64>,
    weights: Option<CudaSlice<f32>>,
}

enum Rows {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<bf16>),
}

/// `src` copied into the first elements of `len` zeros, on `stream`.
fn zero_padded<T: DeviceRepr + ValidAsZeroBits>(
    stream: &std::sync::Arc<CudaStream>,
    src: &CudaSlice<T>,
    len: usize,
) -> Result<CudaSlice<T>> {
    let bytes = len.max(1) * std::mem::size_of::<T>();
    let mut out = stream.alloc_zeros::<T>(len.max(1)).map_err(alloc_error("a ring's padded rows", bytes))?;
    if !src.is_empty() {
        stream.memcpy_dtod(src, &mut out.slice_mut(..src.len())).map_err(cuda_error("cuMemcpyDtoD"))?;
    }
    Ok(out)
}

impl AgreedRing {
    /// The rank's own device tensors checked (lengths; targets against the whole vocabulary and
    /// the weights, downloaded: n_r values each), `backward` the lengths of a backward's host
    /// upstream; the verdicts agreed on over `host`. Returns the host targets and weights.
    fn check_device<C: Communicator + ?Sized>(
        &self,
        host: &C,
        stream: &std::sync::Arc<CudaStream>,
        inputs: &DeviceInputs<'_>,
        backward: Option<(usize, Upstream<'_>)>,
    ) -> Result<(Vec<i64>, Option<Vec<f32>>)> {
        let local = (|| -> Result<_> {
            let (n, d) = (self.own_tokens(), self.plan().hidden());
            let check = |what: &'static str, expected: usize, got: usize| {
                if expected == got { Ok(()) } else { Err(Error::ShapeMismatch { what, expected, got }) }
            };
            check("targets (this rank's tokens)", n, inputs.targets.len())?;
            check("x (this rank's tokens × d)", n.saturating_mul(d), inputs.x.len())?;
            let download = |what| cuda_error(what);
            let targets = stream.clone_dtoh(inputs.targets).map_err(download("cuMemcpyDtoH (targets)"))?;
            check_targets(&targets, self.plan().vocab(), self.plan().config().ignore_index)?;
            let weights = match inputs.weights {
                Some(w) => {
                    check("weights (this rank's tokens)", n, w.len())?;
                    let w = stream.clone_dtoh(w).map_err(download("cuMemcpyDtoH (weights)"))?;
                    check_weights(&w)?;
                    Some(w)
                }
                None => None,
            };
            if let Some((lse, upstream)) = backward {
                check("lse (this rank's tokens)", n, lse)?;
                if let GradOutput::PerToken(g) = upstream.grad {
                    check("grad_output (this rank's tokens)", n, g.len())?;
                }
                if let Some(g) = upstream.dlse {
                    check("dlse (this rank's tokens)", n, g.len())?;
                }
            }
            Ok((targets, weights))
        })();
        agree_on_inputs(host, local)
    }

    /// The padded device rows of `inputs` (the host targets and weights padded and uploaded), on
    /// `stream`; X unpadded when the rank brings all its rows.
    fn pad_device(
        &self,
        stream: &std::sync::Arc<CudaStream>,
        inputs: &DeviceInputs<'_>,
        (targets, weights): (Vec<i64>, Option<Vec<f32>>),
    ) -> Result<Padded> {
        let (rows, own, d) = (self.planned_tokens(), self.own_tokens(), self.plan().hidden());
        let extra = rows - own;
        let x = if extra == 0 {
            None
        } else {
            Some(match inputs.x {
                DeviceMatrix::F32(x) => Rows::F32(zero_padded(stream, x, rows * d)?),
                DeviceMatrix::Bf16(x) => Rows::Bf16(zero_padded(stream, x, rows * d)?),
            })
        };
        let ignore = self.plan().config().ignore_index;
        let targets: Vec<i64> = targets.into_iter().chain(std::iter::repeat_n(ignore, extra)).collect();
        let upload = cuda_error("cuMemcpyHtoD");
        let targets = stream.clone_htod(&targets).map_err(&upload)?;
        let weights = weights
            .map(|w| {
                stream.clone_htod(&w.into_iter().chain(std::iter::repeat_n(0.0, extra)).collect::<Vec<f32>>())
            })
            .transpose()
            .map_err(&upload)?;
        Ok(Padded { x, targets, weights })
    }

    /// [`forward`](AgreedRing::forward) on a CUDA device: the rank's own device tensors checked
    /// and agreed on over `host`, padded on `nccl`'s stream, the ring run over `nccl`.
    pub fn forward_device<C: Communicator + ?Sized, N: DeviceCommunicator>(
        &self,
        ring: &mut RingLinearCrossEntropy,
        host: &C,
        nccl: &N,
        inputs: &DeviceInputs<'_>,
    ) -> Result<Forward> {
        let stream = nccl.stream().clone();
        let rows = self.check_device(host, &stream, inputs, None)?;
        let padded = self.pad_device(&stream, inputs, rows)?;
        let forward = ring.forward(nccl, &padded_inputs(inputs, &padded))?;
        Ok(self.own_rows(forward))
    }

    /// [`backward_into`](AgreedRing::backward_into) on a CUDA device, from this rank's own rows'
    /// host `lse` and upstream gradients: the gradients stay on the device, dX with the plan's
    /// rows (the first n_r·D elements are this rank's own tokens'), dW and dbias its shard's.
    pub fn backward_device<C: Communicator + ?Sized, N: DeviceCommunicator>(
        &self,
        ring: &mut RingLinearCrossEntropy,
        host: &C,
        nccl: &N,
        inputs: &DeviceInputs<'_>,
        lse: &[f32],
        upstream: Upstream<'_>,
    ) -> Result<DeviceGradients> {
        let stream = nccl.stream().clone();
        let rows = self.check_device(host, &stream, inputs, Some((lse.len(), upstream)))?;
        let padded = self.pad_device(&stream, inputs, rows)?;
        let pad = |v: &[f32]| -> Vec<f32> {
            let mut out = vec![0.0; self.planned_tokens()];
            out[..v.len()].copy_from_slice(v);
            out
        };
        let (lse_rows, dlse_rows) = (pad(lse), upstream.dlse.map(pad));
        let grad_rows = match upstream.grad {
            GradOutput::PerToken(g) => Some(pad(g)),
            GradOutput::Scalar(_) => None,
        };
        let grad = grad_rows.as_deref().map_or(upstream.grad, GradOutput::PerToken);
        let upstream = Upstream::loss(grad).with_dlse(dlse_rows.as_deref());
        let forward = Forward { loss: crate::inputs::Loss::Scalar(0.0), lse: lse_rows };
        ring.backward(nccl, &padded_inputs(inputs, &padded), &forward, upstream)
    }
}

/// `inputs` with the padded rows (where there are any), targets and weights.
fn padded_inputs<'p>(inputs: &DeviceInputs<'p>, padded: &'p Padded) -> DeviceInputs<'p> {
    let x = match &padded.x {
        None => inputs.x,
        Some(Rows::F32(x)) => DeviceMatrix::F32(x),
        Some(Rows::Bf16(x)) => DeviceMatrix::Bf16(x),
    };
    let mut out = Inputs::on_device(x, inputs.w, &padded.targets, inputs.d);
    (out.bias, out.weights) = (inputs.bias, padded.weights.as_ref());
    out
}
