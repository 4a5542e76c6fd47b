//! The components `flatpeak report` can measure. Each landed primitive registers a
//! [`Component`] here; names in [`crate::report::COMPONENTS`] without one are
//! reported as not available.

pub mod llep;
mod llep_data;
pub mod ring_dtp;
pub mod ring_dtp_ring;
pub mod sco;
pub mod stream_adamw;

use flatpeak_common::Device;

use crate::machine::MachineInfo;
use crate::report::{COMPONENTS, Row};

/// Errors of the report driver.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReportError {
    /// `--component` named something that is not a flatpeak primitive.
    #[error("unknown component `{name}` (known: {known})")]
    UnknownComponent {
        /// The name given.
        name: String,
        /// The known names, comma-separated.
        known: String,
    },
    /// The device cannot be used.
    #[error(transparent)]
    Device(#[from] flatpeak_common::Error),
    /// A component failed while measuring a workload.
    #[error("{component} failed on `{workload}`: {message}")]
    Workload {
        /// The component.
        component: String,
        /// The workload.
        workload: String,
        /// What went wrong.
        message: String,
    },
}

impl ReportError {
    /// A failure of `component` on `workload`.
    pub fn workload(component: &str, workload: &str, message: impl std::fmt::Display) -> Self {
        ReportError::Workload {
            component: component.into(),
            workload: workload.into(),
            message: message.to_string(),
        }
    }
}

/// The workload `index` of `workloads`, on a device this component measures in the report.
/// The CUDA paths are measured by `scripts/gpu-check.sh`, so `cuda:N` is an error here.
pub fn cpu_workload<'w, W>(
    component: &str,
    workloads: &'w [W],
    index: usize,
    device: Device,
    describe: impl Fn(&W) -> String,
) -> Result<&'w W, ReportError> {
    let w = workloads
        .get(index)
        .ok_or_else(|| ReportError::workload(component, &format!("#{index}"), "no such workload"))?;
    if device != Device::Cpu {
        let why = format!(
            "the report measures the CPU fallback; the CUDA path of {component} is measured by scripts/gpu-check.sh"
        );
        return Err(ReportError::workload(component, &describe(w), why));
    }
    Ok(w)
}

/// One primitive's measured comparison.
pub trait Component: Sync {
    /// Crate name, one of [`COMPONENTS`].
    fn name(&self) -> &'static str;
    /// The workload descriptions it will measure, in order.
    fn workloads(&self) -> Vec<String>;
    /// Measures workload `index` on `device`, with the machine's ceilings at hand.
    fn run(&self, index: usize, device: Device, machine: &MachineInfo) -> Result<Row, ReportError>;
}

/// Every landed component, in the paper's order.
pub fn landed() -> Vec<Box<dyn Component>> {
    vec![
        Box::new(llep::LlepComponent),
        Box::new(ring_dtp::RingDtpComponent),
        Box::new(sco::ScoComponent),
        Box::new(stream_adamw::StreamAdamWComponent),
    ]
}

/// What [`select`] chose.
pub struct Selection {
    /// Landed components to run, in registry order.
    pub run: Vec<Box<dyn Component>>,
    /// Requested names that have not landed yet.
    pub not_available: Vec<&'static str>,
}

impl std::fmt::Debug for Selection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let run: Vec<&str> = self.run.iter().map(|c| c.name()).collect();
        f.debug_struct("Selection").field("run", &run).field("not_available", &self.not_available).finish()
    }
}

/// The components to run for the requested names (all when empty), and the requested names
/// that have not landed yet. Unknown names are an error.
pub fn select(requested: &[String]) -> Result<Selection, ReportError> {
    for name in requested {
        if !COMPONENTS.contains(&name.as_str()) {
            return Err(ReportError::UnknownComponent { name: name.clone(), known: COMPONENTS.join(", ") });
        }
    }
    let wanted = |name: &str| requested.is_empty() || requested.iter().any(|r| r == name);
    let chosen: Vec<Box<dyn Component>> = landed().into_iter().filter(|c| wanted(c.name())).collect();
    let not_available =
        COMPONENTS.into_iter().filter(|&n| wanted(n) && !chosen.iter().any(|c| c.name() == n)).collect();
    Ok(Selection { run: chosen, not_available })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selection_reports_unknown_and_missing_names() {
        let err = select(&["ringdtp".into()]).expect_err("unknown name");
        assert!(err.to_string().contains("unknown component `ringdtp`"));
        let one = select(&["sco".into()]).unwrap();
        assert!(one.run.iter().all(|c| c.name() == "sco"));
        assert_eq!(one.not_available.len() + one.run.len(), 1);
        let all = select(&[]).unwrap();
        assert_eq!(all.run.len() + all.not_available.len(), COMPONENTS.len());
    }
}
