//! `flatpeak report`: each landed component's measured comparison, baseline against bounded
//! schedule, as the paper's per-component table. The JSON schema is fixed (version 2):
//!
//! ```json
//! {"version":2,"machine":{"cpus":2,"copy_gbps":50.1,"gemm_f32_gflops":450.0},
//!  "rows":[{"component":"ring-dtp","workload":"N=8192 D=1024 V=32768 P=1 f32",
//!           "kind":"measured","baseline":"materialized logits","peak_bytes_baseline":0,
//!           "peak_bytes":0,"peak_reduction":0.0,"ms_baseline":0.0,"ms":0.0,"speedup":0.0,
//!           "max_rel_err":0.0,"exact":true,"metrics":{"name":0.0}}]}
//! ```
//!
//! A `"measured"` row ran both schedules: `peak_bytes` is the transient working set of one call
//! (high-water of live heap bytes during it, minus live bytes before, minus the outputs it
//! returns, by the counting allocator); `peak_reduction = 1 − peak_bytes/peak_bytes_baseline`;
//! `speedup = ms_baseline/ms` (medians). A `"formula"` row ran nothing: its peaks are computed
//! from plans and formulas at a shape too large for this machine (the paper's), its times,
//! speedup and error are `null`, and the tables print "—" for them.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::machine::MachineInfo;

/// Version of the JSON schema below.
pub const SCHEMA_VERSION: u32 = 2;

/// The four primitives, in the paper's order. A name listed here but not returned by
/// [`crate::components::landed`] is reported as not available.
pub const COMPONENTS: [&str; 4] = ["llep", "ring-dtp", "sco", "stream-adamw"];

/// How a row's figures were obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RowKind {
    /// Both schedules ran here: peaks by the counting allocator, median times, errors against
    /// the oracle.
    Measured,
    /// Nothing ran: both peaks are computed (plans and formulas), there is no time or error.
    Formula,
}

/// One comparison, measured or computed ([`RowKind`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    /// Crate name, e.g. `ring-dtp`.
    pub component: String,
    /// Workload description; names P, the shapes and the dtype.
    pub workload: String,
    /// Measured here, or computed from formulas.
    pub kind: RowKind,
    /// What the bounded schedule is compared against.
    pub baseline: String,
    /// Transient working set of the baseline, bytes.
    pub peak_bytes_baseline: u64,
    /// Transient working set of the bounded schedule, bytes.
    pub peak_bytes: u64,
    /// `1 − peak_bytes / peak_bytes_baseline`.
    pub peak_reduction: f64,
    /// Median wall time of the baseline, ms (`None` for a formula row).
    pub ms_baseline: Option<f64>,
    /// Median wall time of the bounded schedule, ms (`None` for a formula row).
    pub ms: Option<f64>,
    /// `ms_baseline / ms` (`None` for a formula row).
    pub speedup: Option<f64>,
    /// Largest norm-wise relative error of any output against the oracle (`None` for a formula
    /// row).
    pub max_rel_err: Option<f64>,
    /// Whether the outputs meet the component's exactness promise (a formula row makes none).
    pub exact: bool,
    /// Component-specific figures.
    pub metrics: BTreeMap<String, f64>,
}

/// What one comparison measured; [`Row::new`] derives the ratios from it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Comparison {
    /// Transient working set of the baseline, bytes.
    pub peak_bytes_baseline: u64,
    /// Transient working set of the bounded schedule, bytes.
    pub peak_bytes: u64,
    /// Median wall time of the baseline, ms.
    pub ms_baseline: f64,
    /// Median wall time of the bounded schedule, ms.
    pub ms: f64,
    /// Largest norm-wise relative error of any output against the oracle.
    pub max_rel_err: f64,
    /// Whether the outputs meet the component's exactness promise.
    pub exact: bool,
}

fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { a / b } else { f64::NAN }
}

impl Row {
    /// A row from what was measured; the derived ratios are computed here, once.
    pub fn new(
        component: &str,
        workload: &str,
        baseline: &str,
        m: Comparison,
        metrics: BTreeMap<String, f64>,
    ) -> Self {
        Self {
            component: component.into(),
            workload: workload.into(),
            kind: RowKind::Measured,
            baseline: baseline.into(),
            peak_bytes_baseline: m.peak_bytes_baseline,
            peak_bytes: m.peak_bytes,
            peak_reduction: 1.0 - ratio(m.peak_bytes as f64, m.peak_bytes_baseline as f64),
            ms_baseline: Some(m.ms_baseline),
            ms: Some(m.ms),
            speedup: Some(ratio(m.ms_baseline, m.ms)),
            max_rel_err: Some(m.max_rel_err),
            exact: m.exact,
            metrics,
        }
    }

    /// A formula row: both peaks computed, `(baseline, bounded)` bytes, nothing run.
    pub fn formula(
        component: &str,
        workload: &str,
        baseline: &str,
        (peak_bytes_baseline, peak_bytes): (u64, u64),
        metrics: BTreeMap<String, f64>,
    ) -> Self {
        Self {
            component: component.into(),
            workload: workload.into(),
            kind: RowKind::Formula,
            baseline: baseline.into(),
            peak_bytes_baseline,
            peak_bytes,
            peak_reduction: 1.0 - ratio(peak_bytes as f64, peak_bytes_baseline as f64),
            ms_baseline: None,
            ms: None,
            speedup: None,
            max_rel_err: None,
            exact: false,
            metrics,
        }
    }
}

/// The whole report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// [`SCHEMA_VERSION`].
    pub version: u32,
    /// The ceilings measured before the rows.
    pub machine: MachineInfo,
    /// One row per workload of every requested, landed component.
    pub rows: Vec<Row>,
}

/// Human-readable bytes (binary units).
pub fn bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{b} B") } else { format!("{v:.2} {}", UNITS[unit]) }
}

/// One line describing the machine.
pub fn machine_line(m: &MachineInfo) -> String {
    format!(
        "machine: {} cpus, copy {:.1} GB/s (read + write), f32 GEMM 2048³ {:.1} GFLOP/s",
        m.cpus, m.copy_gbps, m.gemm_f32_gflops
    )
}

const HEADER: [&str; 10] = [
    "component",
    "workload",
    "baseline",
    "peak baseline",
    "peak",
    "reduction",
    "ms baseline",
    "ms",
    "speedup",
    "max rel err",
];

/// What a table prints where a formula row has no figure.
pub const NO_FIGURE: &str = "—";

fn cells(r: &Row) -> [String; 10] {
    let or_dash = |v: Option<f64>, f: &dyn Fn(f64) -> String| v.map_or(NO_FIGURE.to_string(), f);
    let (peak_baseline, peak) = match r.kind {
        RowKind::Measured => (bytes(r.peak_bytes_baseline), bytes(r.peak_bytes)),
        RowKind::Formula => (
            format!("{} (computed)", bytes(r.peak_bytes_baseline)),
            format!("{} (computed)", bytes(r.peak_bytes)),
        ),
    };
    [
        r.component.clone(),
        r.workload.clone(),
        r.baseline.clone(),
        peak_baseline,
        peak,
        format!("{:.1}%", 100.0 * r.peak_reduction),
        or_dash(r.ms_baseline, &|v| format!("{v:.2}")),
        or_dash(r.ms, &|v| format!("{v:.2}")),
        or_dash(r.speedup, &|v| format!("{v:.2}×")),
        or_dash(r.max_rel_err, &|v| format!("{v:.1e}{}", if r.exact { "" } else { " (NOT exact)" })),
    ]
}

/// The table as aligned plain text.
pub fn render_text(report: &Report) -> String {
    let rows: Vec<[String; 10]> = report.rows.iter().map(cells).collect();
    let width =
        |i: usize| rows.iter().map(|r| r[i].chars().count()).chain([HEADER[i].len()]).max().unwrap_or(0);
    let widths: Vec<usize> = (0..HEADER.len()).map(width).collect();
    let line = |cols: Vec<&str>| -> String {
        cols.iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect::<Vec<_>>()
            .join("  ")
            .trim_end()
            .to_string()
    };
    let mut out = machine_line(&report.machine) + "\n";
    if rows.is_empty() {
        return out;
    }
    out += &line(HEADER.to_vec());
    out.push('\n');
    for r in &rows {
        out += &line(r.iter().map(String::as_str).collect());
        out.push('\n');
    }
    out
}

/// The table as GitHub Markdown, metrics listed under it.
pub fn render_markdown(report: &Report) -> String {
    let mut out = format!("{}\n\n", machine_line(&report.machine));
    if report.rows.is_empty() {
        return out;
    }
    let _ = writeln!(out, "| {} |", HEADER.join(" | "));
    let _ = writeln!(out, "|{}", "---|".repeat(HEADER.len()));
    for r in &report.rows {
        let _ = writeln!(out, "| {} |", cells(r).join(" | "));
    }
    for r in report.rows.iter().filter(|r| !r.metrics.is_empty()) {
        let metrics: Vec<String> = r.metrics.iter().map(|(k, v)| format!("{k} = {v:.4}")).collect();
        let _ = writeln!(out, "\n- {} `{}`: {}", r.component, r.workload, metrics.join(", "));
    }
    out
}

/// Where a report came from: the command that ran it and the commit it ran at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Provenance {
    /// The command line, as a reader would type it.
    pub command: String,
    /// The commit (`git describe --always --dirty`), or a sentence saying it is unknown.
    pub commit: String,
}

/// The markers around the summary table in `docs/results.md`, which the README repeats (a test
/// checks the copy).
pub const SUMMARY_MARKERS: (&str, &str) = ("<!-- summary:begin -->", "<!-- summary:end -->");

/// The summary table: one line per row (component, workload, baseline, both peaks, reduction,
/// speedup), between [`SUMMARY_MARKERS`].
pub fn render_summary(report: &Report) -> String {
    let mut out = format!(
        "{}
",
        SUMMARY_MARKERS.0
    );
    out += "| component | workload | against | peak: baseline → flatpeak | reduction | speedup |\n|---|---|---|---|---|---|\n";
    for r in &report.rows {
        let c = cells(r);
        let _ =
            writeln!(out, "| {} | {} | {} | {} → {} | {} | {} |", c[0], c[1], c[2], c[3], c[4], c[5], c[8]);
    }
    out + SUMMARY_MARKERS.1 + "\n"
}

/// The results document (`docs/results.md`): how it was produced, the machine, the summary,
/// every row with its times and error, and every row's metrics.
pub fn render_results(report: &Report, provenance: &Provenance) -> String {
    let mut out = String::from("# flatpeak: measured results\n\n");
    out += "Generated by `flatpeak report`; do not edit by hand. To reproduce it:\n\n";
    let _ = writeln!(out, "```sh\n{}\n```\n", provenance.command);
    let _ = writeln!(out, "- commit: `{}`", provenance.commit);
    let _ = writeln!(out, "- {}", machine_line(&report.machine));
    out += "- peaks: transient working set of one call by the counting allocator (bytes live during \
            the call beyond those before it and its outputs); times: medians of interleaved runs; \
            errors: norm-wise relative, against an f64 oracle. Rows marked (computed) and \"—\" ran \
            nothing: their peaks come from plans and formulas at the paper's shapes.\n\n";
    out += "## Summary\n\n";
    out += &render_summary(report);
    out += "\n## Every row\n\n";
    out += &render_markdown(report);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Report {
        let mut metrics = BTreeMap::new();
        metrics.insert("gemm_efficiency".to_string(), 0.9);
        Report {
            version: SCHEMA_VERSION,
            machine: MachineInfo { cpus: 2, copy_gbps: 50.0, gemm_f32_gflops: 400.0 },
            rows: vec![Row::new(
                "ring-dtp",
                "N=8 D=4 V=16 P=1 f32",
                "materialized logits",
                Comparison {
                    peak_bytes_baseline: 1000,
                    peak_bytes: 100,
                    ms_baseline: 2.0,
                    ms: 1.0,
                    max_rel_err: 1e-7,
                    exact: true,
                },
                metrics,
            )],
        }
    }

    #[test]
    fn derived_ratios() {
        let r = &sample().rows[0];
        assert!((r.peak_reduction - 0.9).abs() < 1e-12);
        assert_eq!((r.kind, r.speedup), (RowKind::Measured, Some(2.0)));
    }

    fn formula_row() -> Row {
        Row::formula("llep", "paper shape (plan only)", "LLEP (fitted model)", (4000, 1000), BTreeMap::new())
    }

    #[test]
    fn a_formula_row_prints_dashes_and_null_times() {
        let r = formula_row();
        assert!((r.peak_reduction - 0.75).abs() < 1e-12);
        let report = Report { rows: vec![r], ..sample() };
        let text = render_text(&report);
        assert!(text.contains("(computed)") && text.matches(NO_FIGURE).count() == 4, "{text}");
        assert!(!text.contains("0.00×") && !text.contains("0.00 "), "{text}");
        let v = serde_json::to_value(&report).unwrap();
        assert_eq!(v["rows"][0]["kind"], "formula");
        assert!(v["rows"][0]["ms"].is_null() && v["rows"][0]["speedup"].is_null());
    }

    #[test]
    fn the_results_document_names_its_command_and_commit() {
        let provenance = Provenance {
            command: "flatpeak report --markdown docs/results.md".into(),
            commit: "abc1234".into(),
        };
        let doc = render_results(&sample(), &provenance);
        for want in
            ["flatpeak report --markdown docs/results.md", "`abc1234`", "machine: 2 cpus", "| ring-dtp |"]
        {
            assert!(doc.contains(want), "{want} missing from {doc}");
        }
        let summary = render_summary(&sample());
        assert!(doc.contains(&summary) && summary.starts_with(SUMMARY_MARKERS.0), "{summary}");
    }

    #[test]
    fn json_schema_is_the_documented_one() {
        let v: serde_json::Value = serde_json::to_value(sample()).unwrap();
        assert_eq!(v["version"], 2);
        let machine: Vec<&str> = v["machine"].as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(machine, ["copy_gbps", "cpus", "gemm_f32_gflops"]);
        let row: Vec<&str> = v["rows"][0].as_object().unwrap().keys().map(String::as_str).collect();
        let mut want = [
            "component",
            "workload",
            "kind",
            "baseline",
            "peak_bytes_baseline",
            "peak_bytes",
            "peak_reduction",
            "ms_baseline",
            "ms",
            "speedup",
            "max_rel_err",
            "exact",
            "metrics",
        ];
        want.sort_unstable();
        assert_eq!(row, want);
        let back: Report = serde_json::from_value(v).unwrap();
        assert_eq!(back, sample());
    }

    #[test]
    fn renders_text_and_markdown() {
        let text = render_text(&sample());
        assert!(text.contains("90.0%") && text.contains("2.00×") && text.contains("1000 B"), "{text}");
        let md = render_markdown(&sample());
        assert!(md.contains("| ring-dtp |") && md.contains("gemm_efficiency = 0.9000"), "{md}");
        assert_eq!(bytes(3 << 30), "3.00 GiB");
    }
}
