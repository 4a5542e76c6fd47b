//! `flatpeak run <component> --inputs in.safetensors --config cfg.json --outputs out.safetensors`:
//! one primitive on tensors from any framework, so a PyTorch or JAX dump of the same inputs can
//! be checked against flatpeak. Forward and backward (or one optimizer step) on the CPU path;
//! tensor names, dtypes and shapes and each config's fields are documented per component
//! ([`ring_dtp`], [`llep`], [`sco`], [`stream_adamw`]) and in `docs/cli.md`. A missing tensor, a
//! wrong dtype or shape, or an unknown config field is an error that names it.

pub mod llep;
pub mod ring_dtp;
pub mod sco;
pub mod stream_adamw;
pub mod tensors;

use std::path::Path;

use serde::de::DeserializeOwned;

pub use tensors::{Dim, Floats, Outputs, TensorFile};

/// The components `flatpeak run` knows.
pub const COMPONENTS: [&str; 4] = ["llep", "ring-dtp", "sco", "stream-adamw"];

/// Errors of `flatpeak run`.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// Not one of [`COMPONENTS`].
    #[error("unknown component `{0}` (known: llep, ring-dtp, sco, stream-adamw)")]
    UnknownComponent(String),
    /// A file could not be read or written.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: String,
        /// What went wrong.
        message: String,
    },
    /// The config file is not the component's config.
    #[error("config {path}: {message}")]
    Config {
        /// The file.
        path: String,
        /// What went wrong (serde names the field).
        message: String,
    },
    /// A required input tensor is absent.
    #[error("{file}: missing tensor `{name}` (expected {expected})")]
    MissingTensor {
        /// The input file.
        file: String,
        /// The tensor.
        name: String,
        /// Its expected dtype and shape.
        expected: String,
    },
    /// An input tensor has the wrong dtype.
    #[error("tensor `{name}`: dtype {found}, expected {expected}")]
    WrongDtype {
        /// The tensor.
        name: String,
        /// Accepted dtypes.
        expected: String,
        /// Its dtype.
        found: String,
    },
    /// An input tensor has the wrong shape.
    #[error("tensor `{name}`: shape {found:?}, expected {expected}")]
    WrongShape {
        /// The tensor.
        name: String,
        /// The expected shape (`_` is any size).
        expected: String,
        /// Its shape.
        found: Vec<usize>,
    },
    /// The component rejected the inputs or config.
    #[error("ring-dtp: {0}")]
    RingDtp(#[from] ::ring_dtp::Error),
    /// The component rejected the inputs or config.
    #[error("llep: {0}")]
    Llep(#[from] ::llep::Error),
    /// The component rejected the inputs or config.
    #[error("sco: {0}")]
    Sco(#[from] ::sco::Error),
    /// The component rejected the inputs or config.
    #[error("stream-adamw: {0}")]
    StreamAdamW(#[from] ::stream_adamw::Error),
    /// The communicator failed.
    #[error("{0}")]
    Common(#[from] flatpeak_common::Error),
}

/// Parses a component's JSON config; `path` names it in errors.
pub fn parse_config<T: DeserializeOwned>(text: &str, path: &Path) -> Result<T, RunError> {
    serde_json::from_str(text)
        .map_err(|e| RunError::Config { path: path.display().to_string(), message: e.to_string() })
}

/// Runs `component` on the tensors of `inputs` with the config at `config` (defaults when
/// `None`) and writes its outputs to `outputs`; returns the names written.
pub fn run(
    component: &str,
    inputs: &Path,
    config: Option<&Path>,
    outputs: &Path,
) -> Result<Vec<String>, RunError> {
    let tensors = TensorFile::read(inputs)?;
    let text = config
        .map(|path| {
            std::fs::read_to_string(path)
                .map_err(|e| RunError::Config { path: path.display().to_string(), message: e.to_string() })
        })
        .transpose()?;
    let out = run_parsed(component, &tensors, text.as_deref().zip(config))?;
    out.write(outputs)?;
    Ok(out.names().into_iter().map(String::from).collect())
}

/// Runs `component` on parsed `tensors` with a config given as JSON text and the path that
/// names it (defaults when `None`): what [`run`] does between reading and writing files.
pub fn run_parsed(
    component: &str,
    tensors: &TensorFile,
    config: Option<(&str, &Path)>,
) -> Result<Outputs, RunError> {
    fn config_of<T: DeserializeOwned + Default>(config: Option<(&str, &Path)>) -> Result<T, RunError> {
        config.map_or_else(|| Ok(T::default()), |(text, path)| parse_config(text, path))
    }
    match component {
        "ring-dtp" => ring_dtp::run(tensors, &config_of(config)?),
        "llep" => llep::run(tensors, &config_of(config)?),
        "sco" => sco::run(tensors, &config_of(config)?),
        "stream-adamw" => stream_adamw::run(tensors, &config_of(config)?),
        other => Err(RunError::UnknownComponent(other.to_string())),
    }
}

#[cfg(test)]
mod tests;
