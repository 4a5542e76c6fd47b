//! The torch-tensor boundary on the host: a call's tensors read and written in place, after
//! checking everything the borrows rely on. This file (and `cuda_tensor.rs`, its device half) is
//! the binding's only `unsafe`.
//!
//! A call registers its tensors with a [`Lend`]: each must be a `torch.Tensor` on the CPU,
//! contiguous, of the expected dtype and shape, its data pointer aligned for the element type
//! (a `TypeError` or `ValueError` naming the argument otherwise). [`Lend::lent`] then checks that
//! every output overlaps no other tensor of the call, and none of another call in flight (calls
//! release the GIL, so two threads' calls may overlap in time), and hands out slices: shared ones
//! of the inputs, one exclusive slice per output. The slices borrow the [`Lent`], which borrows
//! the caller's `Bound` arguments: the Python frame holds every tensor, so its storage cannot be
//! freed while a slice lives.
//!
//! What cannot be checked from here — another Python thread resizing a tensor's storage during
//! the call — is the same contract every torch op has.

use std::marker::PhantomData;
use std::ops::Range;
use std::os::raw::{c_char, c_int};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use pyo3::exceptions::{PyOverflowError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyType};

/// An element type a tensor may hold, with torch's name for it.
pub(crate) trait TorchElement: Copy + Send + Sync + 'static {
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

/// Where a tensor lives, as torch reports it: the CPU, or a CUDA device (anything else is a
/// `ValueError` naming the argument).
pub(crate) fn device_of(name: &str, tensor: &Bound<'_, PyAny>) -> PyResult<flatpeak_common::Device> {
    let py = tensor.py();
    if !tensor.is_instance(torch_tensor_type(py)?)? {
        let kind = tensor.get_type().name()?;
        return Err(PyTypeError::new_err(format!("{name}: expected a torch.Tensor, got {kind}")));
    }
    if tensor.getattr(intern!(py, "is_cpu"))?.extract::<bool>()? {
        return Ok(flatpeak_common::Device::Cpu);
    }
    let device = tensor.getattr(intern!(py, "device"))?;
    let kind: String = device.getattr(intern!(py, "type"))?.extract()?;
    match kind.as_str() {
        "cuda" => Ok(flatpeak_common::Device::Cuda(
            device.getattr("index")?.extract::<Option<usize>>()?.unwrap_or(0),
        )),
        other => Err(PyValueError::new_err(format!(
            "{name}: a tensor on `{other}`; flatpeak runs on cpu (and on cuda when built with the `cuda` feature)"
        ))),
    }
}

/// The error for a CUDA tensor handed to a build without the `cuda` feature, saying how to build
/// with it.
pub(crate) fn cuda_not_built(name: &str) -> PyErr {
    PyValueError::new_err(format!(
        "{name} is a CUDA tensor, but this flatpeak was built without the `cuda` feature; build it \
         with: MATURIN_PEP517_ARGS=\"--features cuda\" pip install ./python"
    ))
}

/// The shape of `tensor` (argument `name`), which must be a `torch.Tensor` (else `TypeError`).
pub(crate) fn shape_of(name: &str, tensor: &Bound<'_, PyAny>) -> PyResult<Vec<usize>> {
    let py = tensor.py();
    if !tensor.is_instance(torch_tensor_type(py)?)? {
        let kind = tensor.get_type().name()?;
        return Err(PyTypeError::new_err(format!("{name}: expected a torch.Tensor, got {kind}")));
    }
    tensor.getattr(intern!(py, "shape"))?.extract()
}

/// Whether `tensor`'s dtype is `T`'s.
pub(crate) fn is_dtype<T: TorchElement>(tensor: &Bound<'_, PyAny>) -> PyResult<bool> {
    let py = tensor.py();
    Ok(tensor.getattr(intern!(py, "dtype"))?.is(torch_dtype::<T>(py)?))
}

/// `str(tensor.dtype)`.
pub(crate) fn dtype_name(tensor: &Bound<'_, PyAny>) -> PyResult<String> {
    Ok(tensor.getattr(intern!(tensor.py(), "dtype"))?.str()?.to_string())
}

/// Checks `tensor` (a `torch.Tensor`, argument `name`) is a contiguous tensor of `T` on `device`
/// whose shape is `shape` (`None` for a dimension: any size), with a data pointer aligned for
/// `T`; returns its data address and element count.
///
/// This runs for every tensor of every call (an optimizer step checks four per parameter), so it
/// asks torch as little as it can: attribute names interned, the dtype compared by identity with
/// torch's own dtype object, and messages formatted only on a mismatch.
fn checked<T: TorchElement>(
    name: &str,
    tensor: &Bound<'_, PyAny>,
    shape: &[Option<usize>],
    device: flatpeak_common::Device,
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
    if len > 0 && address == 0 && tensor.get_type().name()? == "DTensor" {
        // A DTensor (FSDP2, tensor parallel) is a wrapper without storage of its own.
        return Err(PyTypeError::new_err(format!(
            "{name}: a DTensor holds no storage of its own: pass this rank's shard (.to_local())"
        )));
    }
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

/// A named byte range of one memory space (the host, or one CUDA device), for the overlap checks.
#[derive(Debug, Clone)]
pub(crate) struct Span {
    pub(crate) name: &'static str,
    pub(crate) space: flatpeak_common::Device,
    pub(crate) bytes: Range<usize>,
    pub(crate) access: Access,
}

/// The spans of the calls in flight, by call: a new call's outputs may overlap none of them,
/// and its inputs none of their outputs.
static IN_FLIGHT: Mutex<Vec<(u64, Span)>> = Mutex::new(Vec::new());
/// Ids of calls ([`Lend`]s), unique for the process.
static NEXT_CALL: AtomicU64 = AtomicU64::new(1);

/// Checks that each output of `spans` overlaps no other span of the call (input or output), nor
/// a span of another call in flight (input or output; and that no input overlaps another call's
/// output), then registers them as call `id`'s until [`release`]. One sort and one sweep within
/// the call: O(n log n) in its tensors.
pub(crate) fn register(id: u64, spans: &[Span]) -> PyResult<()> {
    check_disjoint(spans)?;
    let mut in_flight = IN_FLIGHT.lock().unwrap_or_else(|p| p.into_inner());
    for s in spans.iter().filter(|s| !s.bytes.is_empty()) {
        let clash = in_flight.iter().find(|(_, o)| {
            o.space == s.space
                && (o.access == Access::Write || s.access == Access::Write)
                && o.bytes.start < s.bytes.end
                && s.bytes.start < o.bytes.end
        });
        if let Some((_, other)) = clash {
            return Err(PyRuntimeError::new_err(format!(
                "{} shares memory with {} of another flatpeak call in flight (on another thread): a tensor \
                 one call writes must not be another's at the same time",
                s.name, other.name
            )));
        }
    }
    in_flight.extend(spans.iter().filter(|s| !s.bytes.is_empty()).map(|s| (id, s.clone())));
    Ok(())
}

/// Forgets call `id`'s spans.
pub(crate) fn release(id: u64) {
    IN_FLIGHT.lock().unwrap_or_else(|p| p.into_inner()).retain(|(call, _)| *call != id);
}

/// A new call id.
pub(crate) fn next_call() -> u64 {
    NEXT_CALL.fetch_add(1, Ordering::Relaxed)
}

/// Each output overlaps no other span of the call (inputs may overlap each other: they are only
/// read).
fn check_disjoint(spans: &[Span]) -> PyResult<()> {
    let mut sorted: Vec<&Span> = spans.iter().filter(|s| !s.bytes.is_empty()).collect();
    sorted.sort_by_key(|s| (s.space.ordinal_key(), s.bytes.start));
    // The earlier span reaching furthest, of any kind and among outputs (in the same space): a
    // later span starting before that end overlaps it.
    let (mut furthest, mut furthest_output): (Option<&Span>, Option<&Span>) = (None, None);
    for span in sorted {
        if furthest.is_some_and(|f| f.space != span.space) {
            (furthest, furthest_output) = (None, None);
        }
        let writes = span.access == Access::Write;
        let hit = if writes { furthest } else { furthest_output };
        if let Some(other) = hit.filter(|o| o.bytes.end > span.bytes.start) {
            let (out, with) = if writes { (span, other) } else { (other, span) };
            return Err(PyValueError::new_err(format!(
                "{} shares memory with {}: an output must not alias another tensor",
                out.name, with.name
            )));
        }
        if furthest.is_none_or(|f| span.bytes.end > f.bytes.end) {
            furthest = Some(span);
        }
        if writes && furthest_output.is_none_or(|f| span.bytes.end > f.bytes.end) {
            furthest_output = Some(span);
        }
    }
    Ok(())
}

trait OrdinalKey {
    fn ordinal_key(&self) -> usize;
}

impl OrdinalKey for flatpeak_common::Device {
    fn ordinal_key(&self) -> usize {
        match self {
            flatpeak_common::Device::Cpu => 0,
            flatpeak_common::Device::Cuda(n) => n + 1,
        }
    }
}

/// Host memory: the memory of a [`Lend`]'s handles.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Host;

/// An input of a call's registration ([`Register`]) in memory `M`: read, shared. A handle of one
/// memory is never lent by the other's [`Lent`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct In<T, M = Host> {
    pub(crate) call: u64,
    pub(crate) address: usize,
    pub(crate) len: usize,
    _t: PhantomData<(T, M)>,
}

/// An output of a call's registration in memory `M`: written, once (not `Copy`: one exclusive
/// borrow per output).
#[derive(Debug)]
pub(crate) struct Out<T, M = Host> {
    pub(crate) call: u64,
    pub(crate) address: usize,
    pub(crate) len: usize,
    _t: PhantomData<(T, M)>,
}

/// How a call uses a tensor it registers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Access {
    /// Read only (inputs may overlap each other).
    Read,
    /// Written (an output overlaps nothing).
    Write,
}

/// A call's registration of torch tensors in one memory ([`Lend`] on the host,
/// `cuda_tensor::DeviceLend` on a CUDA device): each tensor checked once (dtype, device,
/// contiguity, shape), its bytes recorded for the exclusivity check of `lent`, a typed handle
/// given back.
pub(crate) trait Register<'t, 'py> {
    /// The memory of the handles.
    type Memory;

    /// The call the handles belong to.
    fn call(&self) -> u64;

    /// Where the tensors must live.
    fn space(&self) -> flatpeak_common::Device;

    /// The spans registered so far.
    fn spans(&mut self) -> &mut Vec<Span>;

    /// Checks `tensor` (a contiguous tensor of `T` of `shape`, `None`: any size, in this
    /// memory) and records its span: its address and length in elements. An empty host
    /// tensor's address is a dangling, aligned one (its data pointer may be null).
    fn add<T: TorchElement>(
        &mut self,
        name: &'static str,
        access: Access,
        tensor: &'t Bound<'py, PyAny>,
        shape: &[Option<usize>],
    ) -> PyResult<(usize, usize)> {
        let space = self.space();
        let (address, len) = checked::<T>(name, tensor, shape, space)?;
        let address = match (len, space) {
            (0, flatpeak_common::Device::Cpu) => std::ptr::NonNull::<T>::dangling().as_ptr() as usize,
            _ => address,
        };
        let bytes = address..address + len * std::mem::size_of::<T>();
        self.spans().push(Span { name, space, bytes, access });
        Ok((address, len))
    }

    /// Input `name`.
    fn input<T: TorchElement>(
        &mut self,
        name: &'static str,
        tensor: &'t Bound<'py, PyAny>,
        shape: &[Option<usize>],
    ) -> PyResult<In<T, Self::Memory>> {
        let (address, len) = self.add::<T>(name, Access::Read, tensor, shape)?;
        Ok(In { call: self.call(), address, len, _t: PhantomData })
    }

    /// An optional input.
    fn input_opt<T: TorchElement>(
        &mut self,
        name: &'static str,
        tensor: Option<&'t Bound<'py, PyAny>>,
        shape: &[Option<usize>],
    ) -> PyResult<Option<In<T, Self::Memory>>> {
        tensor.map(|t| self.input(name, t, shape)).transpose()
    }

    /// Output `name`: as an input, written by the call.
    fn output<T: TorchElement>(
        &mut self,
        name: &'static str,
        tensor: &'t Bound<'py, PyAny>,
        shape: &[Option<usize>],
    ) -> PyResult<Out<T, Self::Memory>> {
        let (address, len) = self.add::<T>(name, Access::Write, tensor, shape)?;
        Ok(Out { call: self.call(), address, len, _t: PhantomData })
    }

    /// An optional output.
    fn output_opt<T: TorchElement>(
        &mut self,
        name: &'static str,
        tensor: Option<&'t Bound<'py, PyAny>>,
        shape: &[Option<usize>],
    ) -> PyResult<Option<Out<T, Self::Memory>>> {
        tensor.map(|t| self.output(name, t, shape)).transpose()
    }
}

/// One call's host tensors, being checked (see the module docs).
#[derive(Debug)]
pub(crate) struct Lend<'t, 'py> {
    id: u64,
    spans: Vec<Span>,
    held: PhantomData<&'t Bound<'py, PyAny>>,
}

impl<'t, 'py> Register<'t, 'py> for Lend<'t, 'py> {
    type Memory = Host;

    fn call(&self) -> u64 {
        self.id
    }

    fn space(&self) -> flatpeak_common::Device {
        flatpeak_common::Device::Cpu
    }

    fn spans(&mut self) -> &mut Vec<Span> {
        &mut self.spans
    }
}

impl Default for Lend<'_, '_> {
    fn default() -> Self {
        Self::new()
    }
}

impl<'t, 'py> Lend<'t, 'py> {
    /// A new call.
    pub(crate) fn new() -> Self {
        Self { id: next_call(), spans: Vec::new(), held: PhantomData }
    }

    /// An output whose data starts on an `align`-byte line (as a fresh `torch.empty` does).
    pub(crate) fn output_aligned<T: TorchElement>(
        &mut self,
        name: &'static str,
        tensor: &'t Bound<'py, PyAny>,
        shape: &[Option<usize>],
        align: usize,
    ) -> PyResult<Out<T>> {
        let out = self.output::<T>(name, tensor, shape)?;
        if out.len > 0 && !out.address.is_multiple_of(align) {
            return Err(PyValueError::new_err(format!(
                "{name}: data pointer {:#x} is not on a {align}-byte line (pass a fresh torch.empty(...), not a slice \
                 of one)",
                out.address
            )));
        }
        Ok(out)
    }

    /// Checks the outputs' exclusivity (within the call and against the calls in flight) and
    /// lends the tensors.
    pub(crate) fn lent(self) -> PyResult<Lent<'t, 'py>> {
        register(self.id, &self.spans)?;
        Ok(Lent { id: self.id, held: PhantomData })
    }
}

/// One call's host tensors, checked and lent until it drops (see the module docs).
#[derive(Debug)]
pub(crate) struct Lent<'t, 'py> {
    id: u64,
    held: PhantomData<&'t Bound<'py, PyAny>>,
}

impl Lent<'_, '_> {
    /// An internal error: a handle of another call.
    fn foreign() -> PyErr {
        PyRuntimeError::new_err("a tensor handle of another call (an internal error of flatpeak)")
    }

    /// The elements of input `h`.
    pub(crate) fn get<T: TorchElement>(&self, h: In<T>) -> PyResult<&[T]> {
        if h.call != self.id {
            return Err(Self::foreign());
        }
        // SAFETY: `h` was made by this call's `Lend`, which checked the tensor behind it (a live
        // `torch.Tensor` the caller's frame holds for `'t`, contiguous, `len` elements of `T`
        // from the aligned, non-null `address`, or a dangling pointer for none); `lent`
        // checked that no output of this call, nor of any call in flight, overlaps it, so nothing
        // writes it while the slice (bound to `&self`, which the frame outlives) lives.
        Ok(unsafe { std::slice::from_raw_parts(h.address as *const T, h.len) })
    }

    /// The elements of output `h`, exclusively (the handle is consumed: one slice per output).
    #[allow(clippy::mut_from_ref)] // each output's range is exclusive: see the SAFETY comment
    pub(crate) fn get_mut<T: TorchElement>(&self, h: Out<T>) -> PyResult<&mut [T]> {
        if h.call != self.id {
            return Err(Self::foreign());
        }
        // SAFETY: `h` was made by this call's `Lend`, which checked the tensor behind it (a live
        // `torch.Tensor` the caller's frame holds for `'t`, contiguous, `len` elements of `T` from
        // the aligned, non-null `address`, or a dangling one for none); `lent` checked that
        // this output overlaps no other tensor of the call and no tensor of any call in flight,
        // and the handle, not `Copy`, is consumed here, so this is the only reference to these
        // bytes while it lives.
        Ok(unsafe { std::slice::from_raw_parts_mut(h.address as *mut T, h.len) })
    }

    /// An optional input's elements.
    pub(crate) fn get_opt<T: TorchElement>(&self, h: Option<In<T>>) -> PyResult<Option<&[T]>> {
        h.map(|h| self.get(h)).transpose()
    }

    /// An optional output's elements.
    pub(crate) fn get_mut_opt<T: TorchElement>(&self, h: Option<Out<T>>) -> PyResult<Option<&mut [T]>> {
        h.map(|h| self.get_mut(h)).transpose()
    }
}

impl Drop for Lent<'_, '_> {
    fn drop(&mut self) {
        release(self.id);
    }
}

/// CPython's `PyBUF_WRITE` (`pybuffer.h`), the flag of a writable memoryview: a value of the
/// stable ABI that pyo3 exports only for the full API.
const PYBUF_WRITE: c_int = 0x200;

/// Runs `f` on a `uint8` CPU tensor over `bytes` (no copy; an empty tensor for none), for a
/// collective that writes it (a receive buffer) before it returns.
pub(crate) fn with_byte_tensor<R>(
    py: Python<'_>,
    bytes: &mut [u8],
    f: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<R>,
) -> PyResult<R> {
    byte_tensor(py, bytes.as_mut_ptr(), bytes.len(), f)
}

/// Runs `f` on a `uint8` CPU tensor over `bytes` (no copy), for a collective that only reads it
/// (a send buffer) before it returns: `f` must not write the tensor.
pub(crate) fn with_read_byte_tensor<R>(
    py: Python<'_>,
    bytes: &[u8],
    f: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<R>,
) -> PyResult<R> {
    // The pointer is writable only to satisfy the buffer protocol (torch.frombuffer warns on a
    // read-only buffer): `f`, by this function's contract, only reads.
    byte_tensor(py, bytes.as_ptr().cast_mut(), bytes.len(), f)
}

/// A `uint8` tensor over `len` bytes at `ptr`, for `f`: the buffers of [`with_byte_tensor`] and
/// [`with_read_byte_tensor`], whose borrows hold the memory for the whole call.
fn byte_tensor<R>(
    py: Python<'_>,
    ptr: *mut u8,
    len: usize,
    f: impl FnOnce(&Bound<'_, PyAny>) -> PyResult<R>,
) -> PyResult<R> {
    let torch = py.import("torch")?;
    let kwargs = PyDict::new(py);
    kwargs.set_item("dtype", torch.getattr("uint8")?)?;
    if len == 0 {
        return f(&torch.call_method("empty", (0,), Some(&kwargs))?);
    }
    let size = isize::try_from(len)
        .map_err(|_| PyOverflowError::new_err(format!("{len} bytes exceed a Python buffer")))?;
    // SAFETY: the callers borrow the `len` bytes at `ptr` for this whole call (mutably, or shared
    // for an `f` that only reads), so the memoryview over them (and the tensor torch.frombuffer
    // makes of it, without a copy) touches memory no one else writes meanwhile; `f` is a
    // synchronous collective, after which neither is used (they are dropped here or, at worst,
    // kept by Python without being read: torch.distributed keeps no argument tensor).
    let view = unsafe { pyo3::ffi::PyMemoryView_FromMemory(ptr.cast::<c_char>(), size, PYBUF_WRITE) };
    // SAFETY: a new reference (or null with the error set), owned from here on.
    let view = unsafe { Bound::from_owned_ptr_or_err(py, view) }?;
    let tensor = torch.call_method("frombuffer", (view,), Some(&kwargs))?;
    f(&tensor)
}
