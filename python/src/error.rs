//! One mapping from flatpeak's errors to Python exceptions, by the kind the crate that raised
//! the error gave it ([`flatpeak_common::ErrorKind`]): `TypeError` for a dtype or a device,
//! `ValueError` for a value or a shape, `MemoryError` for a refused allocation, `RuntimeError`
//! for what failed while running (a lost peer, a timeout, a CUDA call, a bug in flatpeak). The
//! message is the error's own, which names the offending argument and values. And the other way:
//! a Python exception raised by a rank's own checks, as the [`Refusal`] its group agrees on.

use flatpeak_common::comm::Refusal;
use flatpeak_common::{ErrorKind, HasErrorKind};
use pyo3::exceptions::{PyMemoryError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

/// The exception of `kind` carrying `message`.
fn raise(kind: ErrorKind, message: String) -> PyErr {
    match kind {
        ErrorKind::Type => PyTypeError::new_err(message),
        ErrorKind::Value => PyValueError::new_err(message),
        ErrorKind::Memory => PyMemoryError::new_err(message),
        ErrorKind::Runtime => PyRuntimeError::new_err(message),
    }
}

/// An error of a flatpeak crate as the exception its kind calls for: `.map_err(to_py)`.
pub(crate) fn to_py<E: HasErrorKind + std::fmt::Display>(e: E) -> PyErr {
    raise(e.error_kind(), e.to_string())
}

/// A Python exception raised by this rank's own checks, as the refusal its group agrees on (its
/// kind by the exception's type).
pub(crate) fn refusal(py: Python<'_>, e: PyErr) -> Refusal {
    let kind = if e.is_instance_of::<PyTypeError>(py) {
        ErrorKind::Type
    } else if e.is_instance_of::<PyValueError>(py) {
        ErrorKind::Value
    } else if e.is_instance_of::<PyMemoryError>(py) {
        ErrorKind::Memory
    } else {
        ErrorKind::Runtime
    };
    Refusal { kind, message: e.value(py).to_string() }
}
