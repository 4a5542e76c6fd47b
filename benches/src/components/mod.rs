//! The components `flatpeak report` can measure. Each landed primitive registers a
//! [`Component`] here; names in [`crate::report::COMPONENTS`] without one are
//! reported as not available.

pub mod llep;
mod llep_data;
mod llep_errors;
pub mod ring_dtp;
mod ring_dtp_baseline;
pub mod ring_dtp_ring;
pub mod sco;
pub mod stream_adamw;

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

/// The workload `index` of `workloads`, or a [`ReportError::Workload`] saying there is none.
pub fn workload<'w, W>(component: &str, workloads: &'w [W], index: usize) -> Result<&'w W, ReportError> {
    workloads
        .get(index)
        .ok_or_else(|| ReportError::workload(component, &format!("#{index}"), "no such workload"))
}

/// Which workloads a report runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WorkloadSet {
    /// Every workload (the README's results).
    #[default]
    Full,
    /// One or two rows per component at the same shapes (CI's check that the report runs).
    Quick,
}

/// One primitive's comparison on the CPU fallback (the CUDA paths are measured by the
/// criterion benches that `scripts/gpu-check.sh` runs).
pub trait Component: Sync {
    /// Crate name, one of [`COMPONENTS`].
    fn name(&self) -> &'static str;
    /// The workload descriptions it will measure, in order.
    fn workloads(&self) -> Vec<String>;
    /// The indices of [`workloads`](Component::workloads) in the quick set.
    fn quick(&self) -> Vec<usize>;
    /// The indices a report of `set` runs, in order.
    fn workloads_in(&self, set: WorkloadSet) -> Vec<usize> {
        match set {
            WorkloadSet::Full => (0..self.workloads().len()).collect(),
            WorkloadSet::Quick => self.quick(),
        }
    }
    /// Measures workload `index`, with the machine's ceilings at hand.
    fn run(&self, index: usize, machine: &MachineInfo) -> Result<Row, ReportError>;
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
        let (mut quick_rows, mut full_rows) = (0, 0);
        for c in &all.run {
            let (n, quick) = (c.workloads().len(), c.workloads_in(WorkloadSet::Quick));
            assert!(!quick.is_empty() && quick.iter().all(|&i| i < n), "{}", c.name());
            assert!(quick.windows(2).all(|w| w[0] < w[1]), "{}: {quick:?}", c.name());
            assert_eq!(c.workloads_in(WorkloadSet::Full), (0..n).collect::<Vec<_>>());
            (quick_rows, full_rows) = (quick_rows + quick.len(), full_rows + n);
        }
        assert!(2 * quick_rows <= full_rows, "the quick set is {quick_rows} of {full_rows} rows");
    }
}
