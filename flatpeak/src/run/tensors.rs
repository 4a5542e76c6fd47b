//! Reading named tensors from a safetensors file with their expected dtype and shape, and
//! writing the outputs. Every mismatch is a [`RunError`] naming the tensor and what was
//! expected.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use half::bf16;
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

use super::RunError;

/// One expected dimension: a fixed size, or any size (bound by the first tensor that has it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dim {
    /// Exactly this size.
    Is(usize),
    /// Any size.
    Any,
}

fn describe(shape: &[Dim]) -> String {
    let dims: Vec<String> = shape
        .iter()
        .map(|d| match d {
            Dim::Is(n) => n.to_string(),
            Dim::Any => "_".to_string(),
        })
        .collect();
    format!("[{}]", dims.join(", "))
}

/// A float tensor as stored: f32 or bf16.
#[derive(Debug, Clone, PartialEq)]
pub enum Floats {
    /// f32 elements.
    F32(Vec<f32>),
    /// bf16 elements.
    Bf16(Vec<bf16>),
}

impl Floats {
    /// Every element as f32.
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            Floats::F32(v) => v.clone(),
            Floats::Bf16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }
}

#[derive(Debug)]
struct Stored {
    dtype: Dtype,
    shape: Vec<usize>,
    data: Vec<u8>,
}

/// The tensors of one input file, owned.
#[derive(Debug)]
pub struct TensorFile {
    path: PathBuf,
    tensors: BTreeMap<String, Stored>,
}

impl TensorFile {
    /// Reads and parses `path`.
    pub fn read(path: &Path) -> Result<Self, RunError> {
        let io = |message: String| RunError::Io { path: path.display().to_string(), message };
        let bytes = std::fs::read(path).map_err(|e| io(e.to_string()))?;
        Self::parse(&bytes, path)
    }

    /// Parses the bytes of a safetensors file; `path` names it in errors.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<Self, RunError> {
        let io = |message: String| RunError::Io { path: path.display().to_string(), message };
        let parsed =
            SafeTensors::deserialize(bytes).map_err(|e| io(format!("not a safetensors file: {e}")))?;
        let tensors = parsed
            .iter()
            .map(|(name, view)| {
                let stored =
                    Stored { dtype: view.dtype(), shape: view.shape().to_vec(), data: view.data().to_vec() };
                (name.to_string(), stored)
            })
            .collect();
        Ok(Self { path: path.to_path_buf(), tensors })
    }

    /// Whether the file has a tensor called `name`.
    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn get(&self, name: &str, dtypes: &str, shape: &[Dim]) -> Result<&Stored, RunError> {
        let t = self.tensors.get(name).ok_or_else(|| RunError::MissingTensor {
            file: self.path.display().to_string(),
            name: name.to_string(),
            expected: format!("{dtypes} {}", describe(shape)),
        })?;
        let fits = t.shape.len() == shape.len()
            && t.shape.iter().zip(shape).all(|(&n, d)| matches!(d, Dim::Any) || *d == Dim::Is(n));
        if !fits {
            return Err(RunError::WrongShape {
                name: name.to_string(),
                expected: describe(shape),
                found: t.shape.clone(),
            });
        }
        Ok(t)
    }

    fn wrong_dtype(name: &str, expected: &str, found: Dtype) -> RunError {
        RunError::WrongDtype {
            name: name.to_string(),
            expected: expected.to_string(),
            found: format!("{found:?}"),
        }
    }

    /// The shape of `name` after checking it against `shape`.
    pub fn shape(&self, name: &str, dtypes: &str, shape: &[Dim]) -> Result<Vec<usize>, RunError> {
        Ok(self.get(name, dtypes, shape)?.shape.clone())
    }

    /// An F32 tensor.
    pub fn f32(&self, name: &str, shape: &[Dim]) -> Result<(Vec<f32>, Vec<usize>), RunError> {
        let t = self.get(name, "F32", shape)?;
        if t.dtype != Dtype::F32 {
            return Err(Self::wrong_dtype(name, "F32", t.dtype));
        }
        let v = t.data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        Ok((v, t.shape.clone()))
    }

    /// An F32 or BF16 tensor.
    pub fn floats(&self, name: &str, shape: &[Dim]) -> Result<(Floats, Vec<usize>), RunError> {
        let t = self.get(name, "F32 or BF16", shape)?;
        let v = match t.dtype {
            Dtype::F32 => Floats::F32(
                t.data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            ),
            Dtype::BF16 => Floats::Bf16(
                t.data.chunks_exact(2).map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]]))).collect(),
            ),
            other => return Err(Self::wrong_dtype(name, "F32 or BF16", other)),
        };
        Ok((v, t.shape.clone()))
    }

    /// An F64 tensor.
    pub fn f64(&self, name: &str, shape: &[Dim]) -> Result<(Vec<f64>, Vec<usize>), RunError> {
        let t = self.get(name, "F64", shape)?;
        if t.dtype != Dtype::F64 {
            return Err(Self::wrong_dtype(name, "F64", t.dtype));
        }
        let v = t.data.chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().unwrap_or([0; 8]))).collect();
        Ok((v, t.shape.clone()))
    }

    /// An I64 tensor.
    pub fn i64(&self, name: &str, shape: &[Dim]) -> Result<(Vec<i64>, Vec<usize>), RunError> {
        let t = self.get(name, "I64", shape)?;
        if t.dtype != Dtype::I64 {
            return Err(Self::wrong_dtype(name, "I64", t.dtype));
        }
        let v = t.data.chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap_or([0; 8]))).collect();
        Ok((v, t.shape.clone()))
    }

    /// An optional F32 tensor (`None` when absent; checked when present).
    pub fn optional_f32(&self, name: &str, shape: &[Dim]) -> Result<Option<Vec<f32>>, RunError> {
        if self.has(name) { Ok(Some(self.f32(name, shape)?.0)) } else { Ok(None) }
    }
}

/// Output tensors, written in one safetensors file.
#[derive(Debug, Default)]
pub struct Outputs {
    tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)>,
}

impl Outputs {
    /// Adds an F32 tensor.
    pub fn f32(&mut self, name: &str, shape: &[usize], data: &[f32]) {
        let bytes = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.tensors.push((name.to_string(), Dtype::F32, shape.to_vec(), bytes));
    }
    /// Adds a BF16 tensor.
    pub fn bf16(&mut self, name: &str, shape: &[usize], data: &[bf16]) {
        let bytes = data.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect();
        self.tensors.push((name.to_string(), Dtype::BF16, shape.to_vec(), bytes));
    }
    /// Adds an F64 tensor.
    pub fn f64(&mut self, name: &str, shape: &[usize], data: &[f64]) {
        let bytes = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.tensors.push((name.to_string(), Dtype::F64, shape.to_vec(), bytes));
    }
    /// Adds an I64 tensor.
    pub fn i64(&mut self, name: &str, shape: &[usize], data: &[i64]) {
        let bytes = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.tensors.push((name.to_string(), Dtype::I64, shape.to_vec(), bytes));
    }
    /// The names added so far, in order.
    pub fn names(&self) -> Vec<&str> {
        self.tensors.iter().map(|t| t.0.as_str()).collect()
    }
    /// Writes the file.
    pub fn write(&self, path: &Path) -> Result<(), RunError> {
        let bytes = self.to_bytes(path)?;
        std::fs::write(path, bytes)
            .map_err(|e| RunError::Io { path: path.display().to_string(), message: e.to_string() })
    }

    /// The tensors as the bytes of a safetensors file; `path` names it in errors.
    pub fn to_bytes(&self, path: &Path) -> Result<Vec<u8>, RunError> {
        let io = |message: String| RunError::Io { path: path.display().to_string(), message };
        let views = self
            .tensors
            .iter()
            .map(|(name, dtype, shape, data)| {
                TensorView::new(*dtype, shape.clone(), data)
                    .map(|v| (name.clone(), v))
                    .map_err(|e| io(e.to_string()))
            })
            .collect::<Result<Vec<_>, _>>()?;
        safetensors::serialize(views, None).map_err(|e| io(e.to_string()))
    }
}
