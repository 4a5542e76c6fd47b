//! The CUDA path (feature `cuda`): ring-dtp's CUDA executor on candle's CUDA storage, on the
//! stream of the inputs' candle device, so it is ordered after the candle work that produced
//! the inputs and before the work that reads the outputs, with no added synchronisation.
//!
//! X, W, the bias, the targets and the token weights are read in place from candle's cudarc
//! slices (each a whole slice from offset 0: [`whole`] copies a tensor that is a view into a
//! larger one). The plan's block buffers and the gradients are allocated on that stream. The
//! crate finishes the loss on the host (its statistics come down once per call, which waits for
//! the stream), so the lse is kept on the host for backward and the loss is uploaded as the
//! op's output. No `unsafe` here: candle and cudarc hand out safe slices.

use std::sync::PoisonError;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType as CandleDType, Layout, Storage, Tensor};
use flatpeak_common::cuda::cudarc::driver::{CudaSlice, DeviceRepr, DriverError};
use ring_dtp::cuda::{BlockBuffers, CudaLinearCrossEntropy, DeviceGradientsMut, DeviceInputs, DeviceMatrix};
use ring_dtp::{Loss, Shape};

use crate::error::{Error, Result};
use crate::loss::{FusedLinearCrossEntropy, Grads, PerToken, SavedLse};

/// The per-token tensors on the device: targets as i64, token weights as f32.
#[derive(Debug)]
pub(crate) struct DevicePerToken {
    targets: Tensor,
    weights: Option<Tensor>,
}

fn cuda_error(op: &'static str) -> impl Fn(DriverError) -> Error {
    move |e| Error::Cuda { op, message: format!("{e:?}") }
}

/// `tensor` as one whose storage holds exactly its elements from offset 0 (ring-dtp's device
/// inputs are whole cudarc slices): `tensor` itself when it is, else a contiguous copy.
pub(crate) fn whole(tensor: &Tensor) -> Result<Tensor> {
    let is_whole = {
        let (storage, layout) = tensor.storage_and_layout();
        match &*storage {
            Storage::Cuda(cuda) => layout.contiguous_offsets() == Some((0, storage_len(cuda))),
            _ => false,
        }
    };
    Ok(if is_whole { tensor.clone() } else { tensor.copy()? })
}

fn storage_len(cuda: &CudaStorage) -> usize {
    use candle_core::cuda_backend::CudaStorageSlice as S;
    match &cuda.slice {
        S::F32(s) => s.len(),
        S::BF16(s) => s.len(),
        S::I64(s) => s.len(),
        S::U32(s) => s.len(),
        _ => usize::MAX,
    }
}

/// The targets (as i64) and token weights (as f32) of a CUDA call, kept by the op.
pub(crate) fn per_token(targets: &Tensor, weights: Option<&Tensor>) -> Result<PerToken> {
    let targets = whole(&targets.flatten_all()?.to_dtype(CandleDType::I64)?)?;
    let weights = weights.map(|w| whole(&w.flatten_all()?.to_dtype(CandleDType::F32)?)).transpose()?;
    Ok(PerToken::Device(DevicePerToken { targets, weights }))
}

/// The whole cudarc slice of `T` behind a storage and layout (checked: dtype, offset 0, length).
fn slice_of<'a, T: CudaDType + DeviceRepr>(
    storage: &'a CudaStorage,
    layout: &Layout,
    what: &'static str,
) -> Result<&'a CudaSlice<T>> {
    let slice = storage.as_cuda_slice::<T>()?;
    if layout.contiguous_offsets() == Some((0, slice.len())) {
        Ok(slice)
    } else {
        Err(Error::Shape {
            what,
            expected: "a whole contiguous CUDA storage".into(),
            got: layout.dims().to_vec(),
        })
    }
}

fn matrix<'a>(storage: &'a CudaStorage, layout: &Layout, what: &'static str) -> Result<DeviceMatrix<'a>> {
    match storage.dtype() {
        CandleDType::F32 => Ok(DeviceMatrix::F32(slice_of(storage, layout, what)?)),
        CandleDType::BF16 => Ok(DeviceMatrix::Bf16(slice_of(storage, layout, what)?)),
        got => Err(Error::DType { what, expected: "f32 or bf16", got }),
    }
}

/// A tensor's storage as CUDA storage.
fn cuda_of<'a>(what: &'static str, storage: &'a Storage) -> Result<&'a CudaStorage> {
    match storage {
        Storage::Cuda(cuda) => Ok(cuda),
        _ => Err(Error::Device { what, expected: "cuda".into(), got: "another device".into() }),
    }
}

/// Zeroed block buffers for the plan, on `device`'s stream.
fn block_buffers(device: &CudaDevice, op: &FusedLinearCrossEntropy) -> Result<BlockBuffers> {
    let stream = device.cuda_stream();
    let [logits, x_wide, w_wide] = BlockBuffers::lens(&op.plan).map(|len| len.max(1));
    let alloc = |len| stream.alloc_zeros::<f32>(len).map_err(cuda_error("block buffer"));
    Ok(BlockBuffers { logits: alloc(logits)?, x_wide: alloc(x_wide)?, w_wide: alloc(w_wide)? })
}

/// Runs `f` on the op's device inputs: X and W from the given storages, the rest from the op.
fn with_inputs<R>(
    op: &FusedLinearCrossEntropy,
    (x, w): (DeviceMatrix<'_>, DeviceMatrix<'_>),
    bias: Option<&CudaSlice<f32>>,
    f: impl FnOnce(&DeviceInputs<'_>) -> Result<R>,
) -> Result<R> {
    let PerToken::Device(per_token) = &op.per_token else {
        return Err(Error::Device {
            what: "input",
            expected: "the device forward ran on".into(),
            got: "cuda".into(),
        });
    };
    let (targets_storage, targets_layout) = per_token.targets.storage_and_layout();
    let targets = slice_of::<i64>(cuda_of("targets", &targets_storage)?, targets_layout, "targets")?;
    let weights_guard = per_token.weights.as_ref().map(|t| t.storage_and_layout());
    let weights = match &weights_guard {
        Some((storage, layout)) => {
            Some(slice_of::<f32>(cuda_of("token_weights", storage)?, layout, "token_weights")?)
        }
        None => None,
    };
    let Shape { tokens: n, hidden: d, vocab: v, .. } = op.plan.shape();
    f(&DeviceInputs { x, w, bias, targets, weights, n, d, v })
}

/// The forward of the op on CUDA storage: the loss as a CUDA f32 tensor's storage.
pub(crate) fn forward(
    op: &FusedLinearCrossEntropy,
    (xs, xl): (&CudaStorage, &Layout),
    (ws, wl): (&CudaStorage, &Layout),
    bias: Option<(&CudaStorage, &Layout)>,
) -> Result<(CudaStorage, candle_core::Shape)> {
    let device = xs.device.clone();
    let stream = device.cuda_stream();
    let bias = bias.map(|(s, l)| slice_of::<f32>(s, l, "bias")).transpose()?;
    let mut buffers = block_buffers(&device, op)?;
    let mut lce = CudaLinearCrossEntropy::on_stream(op.plan, stream.clone())?;
    let forward = with_inputs(op, (matrix(xs, xl, "input")?, matrix(ws, wl, "weight")?), bias, |inputs| {
        Ok(lce.forward_with(&mut buffers, inputs)?)
    })?;
    op.save(SavedLse::Host(forward.lse));
    let loss = match forward.loss {
        Loss::Scalar(loss) => vec![loss as f32],
        Loss::PerToken(per_token) => per_token,
    };
    let loss = stream.clone_htod(&loss).map_err(cuda_error("loss upload"))?;
    Ok((CudaStorage::wrap_cuda_slice(loss, device), op.loss_shape()))
}

/// The backward of the op on CUDA tensors: dX, dW (and dbias) allocated on the inputs' stream.
pub(crate) fn backward(
    op: &FusedLinearCrossEntropy,
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    grad_res: &Tensor,
) -> Result<Grads> {
    let upstream = op.grad_output(grad_res)?;
    let Shape { tokens: n, hidden: d, vocab: v, .. } = op.plan.shape();
    let (xs, xl) = x.storage_and_layout();
    let (ws, wl) = w.storage_and_layout();
    let (xs, ws) = (cuda_of("input", &xs)?, cuda_of("weight", &ws)?);
    let bias_guard = bias.map(|b| b.storage_and_layout());
    let device = xs.device.clone();
    let stream = device.cuda_stream();
    let alloc = |len| stream.alloc_zeros::<f32>(len).map_err(cuda_error("gradient"));
    let (mut dx, mut dw) = (alloc(n * d)?, alloc(v * d)?);
    let mut dbias = bias.map(|_| alloc(v)).transpose()?;
    let bias_slice = match &bias_guard {
        Some((storage, layout)) => Some(slice_of::<f32>(cuda_of("bias", storage)?, layout, "bias")?),
        None => None,
    };
    let mut buffers = block_buffers(&device, op)?;
    let mut lce = CudaLinearCrossEntropy::on_stream(op.plan, stream.clone())?;
    let operands = (matrix(xs, xl, "input")?, matrix(ws, wl, "weight")?);
    with_inputs(op, operands, bias_slice, |inputs| {
        let saved = op.saved.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(SavedLse::Host(lse)) = saved.as_ref() else {
            return Err(Error::MissingForward { op: crate::loss::NAME });
        };
        let out = DeviceGradientsMut::new(&mut dx, &mut dw, dbias.as_mut());
        Ok(lce.backward_into_with(
            &mut buffers,
            inputs,
            lse,
            ring_dtp::Upstream::loss(op.upstream(&upstream)),
            out,
        )?)
    })?;
    let tensor = |slice: CudaSlice<f32>, shape: candle_core::Shape| {
        let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, device.clone()));
        Tensor::from_storage(storage, shape, BackpropOp::none(), false)
    };
    Ok(Grads {
        dx: tensor(dx, (n, d).into()).to_dtype(x.dtype())?,
        dw: tensor(dw, (v, d).into()).to_dtype(w.dtype())?,
        dbias: match (dbias, bias) {
            (Some(db), Some(b)) => Some(tensor(db, v.into()).to_dtype(b.dtype())?),
            _ => None,
        },
    })
}
