//! The torch-tensor boundary: a tensor's storage read in place, after checking everything the
//! borrow relies on.
//!
//! A [`TensorRef`] is taken from a live `torch.Tensor` only when it is on the CPU, contiguous,
//! of the expected dtype and shape, and its data pointer is aligned for the element type. Its
//! elements are then borrowed as a slice for the duration of one call, while the caller's frame
//! holds the tensor (so its storage cannot be freed). Mutable borrows are taken only of tensors
//! checked not to overlap any other tensor of the call ([`check_disjoint`]), so no `&mut`
//! aliases another borrow.
//!
//! What cannot be checked from here — another Python thread resizing the tensor's storage
//! during the call while the GIL is released — is the same contract every torch op has.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

/// An element type a tensor may hold, with torch's name for it.
pub trait TorchElement: Copy + Send + Sync + 'static {
    /// `str(tensor.dtype)`.
    const TORCH: &'static str;
    /// Where torch's dtype object for this type is kept once looked up.
    fn dtype_cell() -> &'static PyOnceLock<Py<PyAny>>;
}

/// `TorchElement` for `$t`, torch's `$name`, with its own dtype cell.
macro_rules! torch_element {
    ($t:ty, $name:literal) => {
        impl TorchElement for $t {
            const TORCH: &'static str = $name;
            fn dtype_cell() -> &'static PyOnceLock<Py<PyAny>> {
                static DTYPE: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
                &DTYPE
            }
        }
    };
}
torch_element!(f32, "torch.float32");
torch_element!(f64, "torch.float64");
torch_element!(half::bf16, "torch.bfloat16");
torch_element!(i64, "torch.int64");
torch_element!(u8, "torch.uint8");

/// Where a tensor lives, as torch reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorDevice {
    /// `device.type == "cpu"`.
    Cpu,
    /// `device.type == "cuda"`, with its index.
    Cuda(usize),
}

/// The device of `tensor` (`name` for the error): CPU or CUDA, anything else a `ValueError`.
pub fn device_of(name: &str, tensor: &Bound<'_, PyAny>) -> PyResult<TensorDevice> {
    let py = tensor.py();
    if tensor.getattr(intern!(py, "is_cpu"))?.extract::<bool>()? {
        return Ok(TensorDevice::Cpu);
    }
    let device = tensor.getattr(intern!(py, "device"))?;
    let kind: String = device.getattr(intern!(py, "type"))?.extract()?;
    match kind.as_str() {
        "cpu" => Ok(TensorDevice::Cpu),
        "cuda" => Ok(TensorDevice::Cuda(device.getattr("index")?.extract::<Option<usize>>()?.unwrap_or(0))),
        other => Err(PyValueError::new_err(format!(
            "{name}: a tensor on `{other}`; flatpeak runs on cpu (and on cuda when built with the `cuda` feature)"
        ))),
    }
}

/// The error for a CUDA tensor handed to a build without the `cuda` feature, saying how to
/// build with it.
#[cfg(not(feature = "cuda"))]
pub fn cuda_not_built(name: &str) -> PyErr {
    PyValueError::new_err(format!(
        "{name} is a CUDA tensor, but this flatpeak was built without the `cuda` feature; build it \
         with: MATURIN_PEP517_ARGS=\"--features cuda\" pip install ./python"
    ))
}

impl std::fmt::Display for TensorDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TensorDevice::Cpu => write!(f, "cpu"),
            TensorDevice::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// Checks `tensor` (a `torch.Tensor`, argument `name`) is a contiguous tensor of `T` on
/// `device` whose shape is `shape` (`None` for a dimension: any size), with a data pointer
/// aligned for `T`; returns its data address and element count.
///
/// This runs for every tensor of every call (an optimizer step checks four per parameter), so
/// it asks torch as little as it can: attribute names interned, the dtype compared by identity
/// with torch's own dtype object, and messages formatted only on a mismatch.
pub fn checked<T: TorchElement>(
    name: &'static str,
    tensor: &Bound<'_, PyAny>,
    shape: &[Option<usize>],
    device: TensorDevice,
) -> PyResult<(usize, usize)> {
    let py = tensor.py();
    let sizes = shape_of(name, tensor)?;
    let dtype = tensor.getattr(intern!(py, "dtype"))?;
    if !dtype.is(torch_dtype::<T>(py)?) {
        return Err(PyTypeError::new_err(format!(
            "{name}: expected dtype {}, got {}",
            T::TORCH,
            dtype.str()?
        )));
    }
    let found = device_of(name, tensor)?;
    if found != device {
        return Err(PyValueError::new_err(format!(
            "{name}: expected a tensor on {device} (where the other arguments are), got one on {found}"
        )));
    }
    let matches =
        sizes.len() == shape.len() && sizes.iter().zip(shape).all(|(&s, e)| e.is_none_or(|e| e == s));
    if !matches {
        let want: Vec<String> = shape.iter().map(|e| e.map_or("*".to_owned(), |e| e.to_string())).collect();
        return Err(PyValueError::new_err(format!(
            "{name}: expected shape [{}], got {sizes:?}",
            want.join(", ")
        )));
    }
    if !tensor.call_method0(intern!(py, "is_contiguous"))?.extract::<bool>()? {
        return Err(PyValueError::new_err(format!(
            "{name}: expected a contiguous tensor (call .contiguous()), got strides {:?}",
            tensor.call_method0("stride")?.extract::<Vec<isize>>()?
        )));
    }
    let len: usize = sizes.iter().product();
    let address: usize = tensor.call_method0(intern!(py, "data_ptr"))?.extract()?;
    if len > 0 && (address == 0 || !address.is_multiple_of(std::mem::align_of::<T>())) {
        return Err(PyValueError::new_err(format!(
            "{name}: data pointer {address:#x} is not aligned for {}",
            T::TORCH
        )));
    }
    Ok((address, len))
}

/// `torch.Tensor`, looked up once per interpreter.
fn torch_tensor_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    static TENSOR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
    TENSOR.import(py, "torch", "Tensor")
}

/// torch's dtype object for `T` (`torch.float32`, …), looked up once per interpreter.
fn torch_dtype<T: TorchElement>(py: Python<'_>) -> PyResult<&Bound<'_, PyAny>> {
    T::dtype_cell()
        .get_or_try_init(py, || {
            Ok::<_, PyErr>(py.import("torch")?.getattr(T::TORCH.trim_start_matches("torch."))?.unbind())
        })
        .map(|dtype| dtype.bind(py))
}

/// The shape of `tensor` (argument `name`), which must be a `torch.Tensor` (else `TypeError`).
pub fn shape_of(name: &str, tensor: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    let py = tensor.py();
    if !tensor.is_instance(torch_tensor_type(py)?)? {
        let kind = tensor.get_type().name()?;
        return Err(PyTypeError::new_err(format!("{name}: expected a torch.Tensor, got {kind}")));
    }
    tensor.getattr(intern!(py, "shape"))?.extract()
}

/// A checked CPU tensor's element range: start pointer and element count.
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<T> {
    ptr: *mut T,
    len: usize,
    name: &'static str,
}

// SAFETY: a `TensorRef` is a pointer into a tensor's storage that the caller's frame keeps alive
// for the call; sending it to the threads of the call (with the GIL released) moves no
// ownership, and every access goes through `as_slice`/`as_mut_slice`, whose contracts hold on
// any thread.
unsafe impl<T: Send> Send for TensorRef<T> {}
// SAFETY: a shared `&TensorRef` hands out nothing but the pointer behind the `unsafe` accessors,
// whose callers uphold the aliasing rules whichever thread they run on.
unsafe impl<T: Sync> Sync for TensorRef<T> {}

impl<T: TorchElement> TensorRef<T> {
    /// Checks `tensor` (a `torch.Tensor`, argument `name`) is a contiguous CPU tensor of `T`
    /// whose shape is `shape` (`None` for a dimension: any size), and returns its storage.
    pub fn new(name: &'static str, tensor: &Bound<'_, PyAny>, shape: &[Option<usize>]) -> PyResult<Self> {
        let (address, len) = checked::<T>(name, tensor, shape, TensorDevice::Cpu)?;
        // An empty tensor may have a null data pointer: its slice is the empty one.
        let ptr = if len == 0 { std::ptr::NonNull::<T>::dangling().as_ptr() } else { address as *mut T };
        Ok(Self { ptr, len, name })
    }

    /// Elements of the tensor.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The byte range of the storage, for overlap checks.
    fn bytes(&self) -> std::ops::Range<usize> {
        let start = self.ptr as usize;
        start..start + self.len * std::mem::size_of::<T>()
    }

    /// The elements, read.
    ///
    /// # Safety
    /// The tensor this was taken from must stay alive and unresized for the slice's lifetime,
    /// and no `&mut` to an overlapping range may exist meanwhile.
    pub unsafe fn as_slice<'a>(&self) -> &'a [T] {
        // SAFETY: `new` checked the pointer is non-null (or dangling for 0 elements) and aligned
        // for `T`, and that the tensor is contiguous with `len` elements of `T` from it; the
        // caller guarantees the storage lives and is not written through another borrow.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The elements, written.
    ///
    /// # Safety
    /// As [`as_slice`](Self::as_slice), and no other borrow of an overlapping range may exist:
    /// [`check_disjoint`] must have passed for every tensor of the call.
    pub unsafe fn as_mut_slice<'a>(&self) -> &'a mut [T] {
        // SAFETY: as in `as_slice`; exclusivity is the caller's `check_disjoint`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// A named byte range, for [`check_disjoint`].
#[derive(Debug, Clone)]
pub struct Span {
    name: &'static str,
    bytes: std::ops::Range<usize>,
}

#[cfg(feature = "cuda")]
impl Span {
    /// Whether the two byte ranges share a byte.
    pub fn overlaps(&self, other: &Span) -> bool {
        self.bytes.start < other.bytes.end && other.bytes.start < self.bytes.end
    }

    /// The `bytes` bytes from `address` (a device tensor's, for the CUDA path's overlap checks).
    pub fn raw(name: &'static str, address: usize, bytes: usize) -> Self {
        Span { name, bytes: address..address.saturating_add(bytes) }
    }
}

impl<T: TorchElement> From<&TensorRef<T>> for Span {
    fn from(t: &TensorRef<T>) -> Self {
        Span { name: t.name, bytes: t.bytes() }
    }
}

/// Checks that each output overlaps no other tensor of the call (input or output): the
/// condition for its `&mut` slice to be exclusive. Inputs may overlap each other (they are only
/// read). One sort and one sweep: O(n log n) in the tensors of the call.
pub fn check_disjoint(outputs: &[Span], inputs: &[Span]) -> PyResult<()> {
    let mut spans: Vec<(&Span, bool)> =
        outputs.iter().map(|s| (s, true)).chain(inputs.iter().map(|s| (s, false))).collect();
    spans.retain(|(s, _)| !s.bytes.is_empty());
    spans.sort_by_key(|(s, _)| s.bytes.start);
    // The earlier span reaching furthest, of any kind and among outputs: a later span starting
    // before that end overlaps it.
    let (mut furthest, mut furthest_output): (Option<&Span>, Option<&Span>) = (None, None);
    for &(span, is_output) in &spans {
        let hit = if is_output { furthest } else { furthest_output };
        if let Some(other) = hit.filter(|o| o.bytes.end > span.bytes.start) {
            let (out, with) = if is_output { (span, other) } else { (other, span) };
            return Err(PyValueError::new_err(format!(
                "{} shares memory with {}: an output must not alias another tensor",
                out.name, with.name
            )));
        }
        if furthest.is_none_or(|f| span.bytes.end > f.bytes.end) {
            furthest = Some(span);
        }
        if is_output && furthest_output.is_none_or(|f| span.bytes.end > f.bytes.end) {
            furthest_output = Some(span);
        }
    }
    Ok(())
}
