//! Candle CPU storage read in place as the slices the crates take: no copy of X, W or the
//! gradients, only of what is per token or per vocabulary entry when its dtype differs.

use std::borrow::Cow;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Layout, Storage, Tensor};
use ring_dtp::Matrix;

use crate::error::{Error, Result};

/// The contiguous elements of `data` under `layout`.
fn contiguous<'a, T>(data: &'a [T], layout: &Layout, what: &'static str) -> Result<&'a [T]> {
    layout.contiguous_offsets().and_then(|(start, end)| data.get(start..end)).ok_or_else(|| Error::Shape {
        what,
        expected: "a contiguous tensor".into(),
        got: layout.dims().to_vec(),
    })
}

/// X or W as ring-dtp's matrix: f32 or bf16, in place.
pub(crate) fn matrix<'a>(storage: &'a CpuStorage, layout: &Layout, what: &'static str) -> Result<Matrix<'a>> {
    match storage {
        CpuStorage::F32(data) => Ok(Matrix::F32(contiguous(data, layout, what)?)),
        CpuStorage::BF16(data) => Ok(Matrix::Bf16(contiguous(data, layout, what)?)),
        other => Err(Error::DType { what, expected: "f32 or bf16", got: other.dtype() }),
    }
}

/// A vector read as f32: in place when it is f32, widened when it is bf16 or f16 (bias and
/// token weights: V or N elements).
pub(crate) fn f32_vector<'a>(
    storage: &'a CpuStorage,
    layout: &Layout,
    what: &'static str,
) -> Result<Cow<'a, [f32]>> {
    match storage {
        CpuStorage::F32(data) => Ok(Cow::Borrowed(contiguous(data, layout, what)?)),
        CpuStorage::BF16(data) => Ok(contiguous(data, layout, what)?.iter().map(|x| x.to_f32()).collect()),
        CpuStorage::F16(data) => Ok(contiguous(data, layout, what)?.iter().map(|x| x.to_f32()).collect()),
        other => Err(Error::DType { what, expected: "f32, bf16 or f16", got: other.dtype() }),
    }
}

/// A CPU tensor's elements as `f32` on the host (for the captured per-token tensors).
pub(crate) fn f32_values(tensor: &Tensor, what: &'static str) -> Result<Vec<f32>> {
    let (storage, layout) = tensor.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => Ok(f32_vector(cpu, layout, what)?.into_owned()),
        _ => Err(Error::Device { what, expected: "cpu".into(), got: format!("{:?}", tensor.device()) }),
    }
}

/// Target ids as i64 on the host: i64 in place, u32 and i32 widened (N elements).
pub(crate) fn targets<'a>(storage: &'a CpuStorage, layout: &Layout) -> Result<Cow<'a, [i64]>> {
    const WHAT: &str = "targets";
    match storage {
        CpuStorage::I64(data) => Ok(Cow::Borrowed(contiguous(data, layout, WHAT)?)),
        CpuStorage::U32(data) => Ok(contiguous(data, layout, WHAT)?.iter().map(|&t| i64::from(t)).collect()),
        CpuStorage::I32(data) => Ok(contiguous(data, layout, WHAT)?.iter().map(|&t| i64::from(t)).collect()),
        other => Err(Error::DType { what: WHAT, expected: "i64, u32 or i32", got: other.dtype() }),
    }
}

/// A CPU tensor's target ids as i64 on the host.
pub(crate) fn target_values(tensor: &Tensor) -> Result<Vec<i64>> {
    let (storage, layout) = tensor.storage_and_layout();
    match &*storage {
        Storage::Cpu(cpu) => Ok(targets(cpu, layout)?.into_owned()),
        _ => Err(Error::Device {
            what: "targets",
            expected: "cpu".into(),
            got: format!("{:?}", tensor.device()),
        }),
    }
}

/// A tensor's storage as CPU storage.
pub(crate) fn cpu_of<'a>(what: &'static str, storage: &'a Storage) -> Result<&'a CpuStorage> {
    match storage {
        Storage::Cpu(cpu) => Ok(cpu),
        _ => Err(Error::Device { what, expected: "cpu".into(), got: "another device".into() }),
    }
}

/// The contiguous f32 elements of a CPU storage, in place.
pub(crate) fn f32_slice<'a>(storage: &'a Storage, layout: &Layout, what: &'static str) -> Result<&'a [f32]> {
    match cpu_of(what, storage)? {
        CpuStorage::F32(data) => contiguous(data, layout, what),
        other => Err(Error::DType { what, expected: "f32", got: other.dtype() }),
    }
}
