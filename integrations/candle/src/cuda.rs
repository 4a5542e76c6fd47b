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

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::{CudaDType, CudaDevice};
use candle_core::op::BackpropOp;
use candle_core::{CudaStorage, DType as CandleDType, Layout, Storage, Tensor};
use flatpeak_common::cuda::cudarc::driver::{CudaSlice, DeviceRepr, DriverError};
use ring_dtp::cuda::{BlockBuffers, DeviceGradientsMut, DeviceInputs, DeviceMatrix};
use ring_dtp::{Forward, GradOutput, LinearCrossEntropy, Plan, Shape, Upstream};

use crate::error::{Error, Result};
use crate::grads::Grads;

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
pub(crate) fn per_token(targets: &Tensor, weights: Option<&Tensor>) -> Result<DevicePerToken> {
    let targets = whole(&targets.flatten_all()?.to_dtype(CandleDType::I64)?)?;
    let weights = weights.map(|w| whole(&w.flatten_all()?.to_dtype(CandleDType::F32)?)).transpose()?;
    Ok(DevicePerToken { targets, weights })
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

/// Forward's operands as candle hands a custom op's CUDA forward its storages.
pub(crate) struct Operands<'a> {
    /// X, `[N, D]`.
    pub(crate) x: (&'a CudaStorage, &'a Layout),
    /// W, `[V, D]`.
    pub(crate) w: (&'a CudaStorage, &'a Layout),
    /// The bias, `[V]` f32.
    pub(crate) bias: Option<(&'a CudaStorage, &'a Layout)>,
}

/// Backward's operands as candle hands a custom op's backward its tensors.
pub(crate) struct Tensors<'a> {
    /// X, `[N, D]`.
    pub(crate) x: &'a Tensor,
    /// W, `[V, D]`.
    pub(crate) w: &'a Tensor,
    /// The bias, `[V]` f32.
    pub(crate) bias: Option<&'a Tensor>,
}

/// Zeroed block buffers for `plan`, on `device`'s stream (candle's allocator).
fn block_buffers(device: &CudaDevice, plan: &Plan) -> Result<BlockBuffers> {
    let stream = device.cuda_stream();
    let [logits, x_wide, w_wide] = BlockBuffers::lens(plan).map(|len| len.max(1));
    let alloc = |len| stream.alloc_zeros::<f32>(len).map_err(cuda_error("block buffer"));
    Ok(BlockBuffers { logits: alloc(logits)?, x_wide: alloc(x_wide)?, w_wide: alloc(w_wide)? })
}

/// An executor of `plan` on `device`'s stream: ordered after the candle work that produced the
/// inputs and before the work that reads the outputs.
fn executor(device: &CudaDevice, plan: Plan) -> Result<LinearCrossEntropy> {
    Ok(LinearCrossEntropy::on_stream(plan, device.cuda_stream())?)
}

/// Runs `body` on the device inputs: X, W and the bias from their storages, the targets and
/// weights from `per_token`.
fn with_inputs<R>(
    plan: &Plan,
    per_token: &DevicePerToken,
    (x, w): (DeviceMatrix<'_>, DeviceMatrix<'_>),
    bias: Option<&CudaSlice<f32>>,
    body: impl FnOnce(&DeviceInputs<'_>) -> Result<R>,
) -> Result<R> {
    let (targets_storage, targets_layout) = per_token.targets.storage_and_layout();
    let targets = slice_of::<i64>(cuda_of("targets", &targets_storage)?, targets_layout, "targets")?;
    let weights_guard = per_token.weights.as_ref().map(|t| t.storage_and_layout());
    let weights = match &weights_guard {
        Some((storage, layout)) => {
            Some(slice_of::<f32>(cuda_of("token_weights", storage)?, layout, "token_weights")?)
        }
        None => None,
    };
    let mut inputs = DeviceInputs::on_device(x, w, targets, plan.shape().hidden);
    inputs.bias = bias;
    inputs.weights = weights;
    body(&inputs)
}

/// The forward of the op on CUDA storage, on the inputs' stream.
pub(crate) fn forward(plan: Plan, per_token: &DevicePerToken, operands: Operands<'_>) -> Result<Forward> {
    let Operands { x: (xs, xl), w: (ws, wl), bias } = operands;
    let bias = bias.map(|(s, l)| slice_of::<f32>(s, l, "bias")).transpose()?;
    let mut buffers = block_buffers(&xs.device, &plan)?;
    let mut lce = executor(&xs.device, plan)?;
    let operands = (matrix(xs, xl, "input")?, matrix(ws, wl, "weight")?);
    with_inputs(&plan, per_token, operands, bias, |inputs| Ok(lce.forward_with(&mut buffers, inputs)?))
}

/// `values` as CUDA f32 storage on `device`'s stream (the loss forward finished on the host).
pub(crate) fn upload(device: &CudaDevice, values: &[f32]) -> Result<CudaStorage> {
    let slice = device.cuda_stream().clone_htod(values).map_err(cuda_error("loss upload"))?;
    Ok(CudaStorage::wrap_cuda_slice(slice, device.clone()))
}

/// The backward of the op on CUDA tensors from forward's `lse`: dX, dW (and dbias) allocated
/// on the inputs' stream, in the arguments' dtypes.
pub(crate) fn backward(
    plan: Plan,
    per_token: &DevicePerToken,
    tensors: Tensors<'_>,
    lse: &[f32],
    grad: GradOutput<'_>,
) -> Result<Grads> {
    let Tensors { x, w, bias } = tensors;
    let Shape { tokens: n, hidden: d, vocab: v, .. } = plan.shape();
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
    let mut buffers = block_buffers(&device, &plan)?;
    let mut lce = executor(&device, plan)?;
    let operands = (matrix(xs, xl, "input")?, matrix(ws, wl, "weight")?);
    with_inputs(&plan, per_token, operands, bias_slice, |inputs| {
        let out = DeviceGradientsMut::new(&mut dx, &mut dw, dbias.as_mut());
        Ok(lce.backward_into_with(&mut buffers, inputs, lse, Upstream::loss(grad), out)?)
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
