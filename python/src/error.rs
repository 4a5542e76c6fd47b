//! One mapping from flatpeak's errors to Python exceptions, by the kind the crate that raised
//! the error gave it ([`flatpeak_common::ErrorKind`]): `TypeError` for a dtype or a device,
//! `ValueError` for a value or a shape, `MemoryError` for a refused allocation, `RuntimeError`
//! for what failed while running (a lost peer, a timeout, a CUDA call, a bug in flatpeak). The
//! message is the error's own, which names the offending argument and values.

use flatpeak_common::{ErrorKind, HasErrorKind};
use pyo3::exceptions::{PyMemoryError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;

/// An error of a flatpeak crate, as the exception its kind calls for.
pub(crate) trait IntoPyErr {
    /// The exception.
    fn into_py_err(self) -> PyErr;
}

/// The exception of `kind` carrying `message`.
fn raise(kind: ErrorKind, message: String) -> PyErr {
    match kind {
        ErrorKind::Type => PyTypeError::new_err(message),
        ErrorKind::Value => PyValueError::new_err(message),
        ErrorKind::Memory => PyMemoryError::new_err(message),
        ErrorKind::Runtime => PyRuntimeError::new_err(message),
    }
}

macro_rules! into_py_err {
    ($($error:ty),*) => {$(
        impl IntoPyErr for $error {
            fn into_py_err(self) -> PyErr {
                raise(self.kind(), self.to_string())
            }
        }
    )*};
}

into_py_err!(flatpeak_common::Error, llep::Error, ring_dtp::Error, sco::Error, stream_adamw::Error);

/// `e` as its exception: `.map_err(to_py)`.
pub(crate) fn to_py(e: impl IntoPyErr) -> PyErr {
    e.into_py_err()
}

/// An input refusal as the group agrees on it: its exception kind and message.
#[derive(Debug)]
pub(crate) struct Refusal {
    pub(crate) kind: ErrorKind,
    pub(crate) message: String,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl HasErrorKind for Refusal {
    fn error_kind(&self) -> ErrorKind {
        self.kind
    }
}

impl From<flatpeak_common::Error> for Refusal {
    fn from(e: flatpeak_common::Error) -> Self {
        Self { kind: e.kind(), message: e.to_string() }
    }
}

impl Refusal {
    /// A Python exception raised by a rank's own checks, by its type.
    pub(crate) fn from_py(py: Python<'_>, e: PyErr) -> Self {
        let kind = if e.is_instance_of::<PyTypeError>(py) {
            ErrorKind::Type
        } else if e.is_instance_of::<PyValueError>(py) {
            ErrorKind::Value
        } else if e.is_instance_of::<PyMemoryError>(py) {
            ErrorKind::Memory
        } else {
            ErrorKind::Runtime
        };
        Self { kind, message: e.value(py).to_string() }
    }

    /// The exception of its kind.
    pub(crate) fn into_py(self) -> PyErr {
        raise(self.kind, self.message)
    }
}
