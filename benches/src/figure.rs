//! `flatpeak report --svg PATH`: peak memory against the dimension each peak grows with, for
//! the baseline and the bounded schedule, one panel per crate, drawn from the crates' own plans
//! (the same sizes the peak tests check against measured peaks):
//!
//! - vocabulary projection against tokens N (D = 1024, V = 32768, f32): materialized fp32
//!   logits and gradient `8·N·V` against `ring_dtp::Plan`'s workspace and per-token state;
//! - expert dispatch against routing skew (share of tokens on one expert, P = 8, N = 4096 per
//!   rank, H = 512, I = 256, E = 64, k = 8): standard EP's and LLEP's plan-sized buffers (max
//!   over ranks) against PipelinedLLEP's launch-time buffers;
//! - checkpoint boundaries against depth L (N = 32768, H = 4096, bf16): `L·s` against `sco`'s
//!   slot ring;
//! - optimizer staging against parameters (bf16 gradients and parameters): the serial offload's
//!   whole-model staging against the pipeline's R buckets (pinned host memory).

use std::fmt::Write as _;

use flatpeak_common::DType;
use llep::{Config as LlepConfig, Pass, Schedule as LlepSchedule, Scheme, Shape};

use llep::paper::Profile;

/// A line of a panel.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// Legend text.
    pub label: String,
    /// Whether this is a baseline (dashed) or a bounded schedule (solid).
    pub bounded: bool,
    /// (x, bytes), x increasing.
    pub points: Vec<(f64, f64)>,
}

/// One panel: a title, the x axis, log-scaled or linear, and its lines.
#[derive(Debug, Clone, PartialEq)]
pub struct Panel {
    /// Title.
    pub title: String,
    /// X axis label.
    pub x_label: String,
    /// Log-scaled x axis.
    pub log_x: bool,
    /// The lines.
    pub series: Vec<Series>,
}

/// The four panels, from the crates' plans.
pub fn panels() -> Result<Vec<Panel>, String> {
    Ok(vec![vocab_panel()?, dispatch_panel()?, checkpoint_panel()?, optimizer_panel()?])
}

fn vocab_panel() -> Result<Panel, String> {
    let (d, v) = (1024usize, 32768usize);
    let config = ring_dtp::Config::default();
    let ns: Vec<usize> = (10..=17).map(|e| 1usize << e).collect();
    let mut base = Vec::new();
    let mut ours = Vec::new();
    for &n in &ns {
        let plan = ring_dtp::Plan::new(
            &config,
            ring_dtp::Shape { tokens: n, hidden: d, vocab: v, dtype: DType::F32 },
            ring_dtp::Budget::Bytes(256 << 20),
        )
        .map_err(|e| e.to_string())?;
        base.push((n as f64, 8.0 * (n * v) as f64));
        ours.push((
            n as f64,
            (plan.workspace_bytes() + plan.per_token_bytes() + plan.row_scratch_bytes()) as f64,
        ));
    }
    Ok(Panel {
        title: "vocabulary projection (ring-dtp)".into(),
        x_label: "tokens N".into(),
        log_x: true,
        series: vec![
            Series { label: "materialized logits".into(), bounded: false, points: base },
            Series { label: "Ring-DTP blocks".into(), bounded: true, points: ours },
        ],
    })
}

fn dispatch_panel() -> Result<Panel, String> {
    let shape = Shape {
        ranks: 8,
        tokens: 4096,
        hidden: 512,
        intermediate: 256,
        experts: 64,
        top_k: 8,
        dtype: DType::F32,
    };
    let e = |x: llep::Error| x.to_string();
    let launch =
        flatpeak::memory_model::launch_plan(&shape).map_err(e)?.buffers(Pass::Backward).workspace_bytes();
    let (mut ep, mut llep_line, mut ours) = (Vec::new(), Vec::new(), Vec::new());
    for step in 0..=10 {
        let ratio = step as f64 / 10.0;
        let profile = if step == 0 { Profile::Balanced } else { Profile::Hot { ratio, experts: 1 } };
        let ids = profile.ids(&Shape { ranks: 1, ..shape }).map_err(e)?;
        let views: Vec<&[i64]> = (0..shape.ranks).map(|_| ids.as_slice()).collect();
        let sized = |scheme| -> Result<f64, String> {
            let plan = llep::Plan::new(&LlepConfig::with_scheme(scheme), shape, llep::Budget::Unlimited)
                .map_err(e)?;
            let plan = LlepSchedule::from_top_k(&plan, &views).map_err(e)?;
            Ok(plan.max_workspace_bytes(Pass::Backward) as f64)
        };
        ep.push((100.0 * ratio, sized(Scheme::StandardEp)?));
        llep_line.push((100.0 * ratio, sized(Scheme::Llep)?));
        ours.push((100.0 * ratio, launch as f64));
    }
    Ok(Panel {
        title: "expert dispatch (llep)".into(),
        x_label: "% of tokens on one expert".into(),
        log_x: false,
        series: vec![
            Series { label: "standard EP".into(), bounded: false, points: ep },
            Series { label: "LLEP".into(), bounded: false, points: llep_line },
            Series { label: "PipelinedLLEP".into(), bounded: true, points: ours },
        ],
    })
}

fn checkpoint_panel() -> Result<Panel, String> {
    let (n, h) = (32768usize, 4096usize);
    let (mut base, mut ours) = (Vec::new(), Vec::new());
    for layers in [4usize, 8, 16, 32, 64, 128] {
        let plan = sco::Plan::new(
            &sco::Config::default(),
            sco::Shape::of::<u16>(layers, n * h),
            sco::Budget::Unlimited,
        )
        .map_err(|e| e.to_string())?;
        base.push((layers as f64, plan.plain_device_bytes() as f64));
        ours.push((layers as f64, (plan.peak_slots() * plan.boundary_bytes()) as f64));
    }
    Ok(Panel {
        title: "checkpoint boundaries (sco)".into(),
        x_label: "depth L".into(),
        log_x: true,
        series: vec![
            Series { label: "all boundaries on device".into(), bounded: false, points: base },
            Series { label: "selective offload".into(), bounded: true, points: ours },
        ],
    })
}

fn optimizer_panel() -> Result<Panel, String> {
    let (mut base, mut ours) = (Vec::new(), Vec::new());
    for exp in 8..=11 {
        let n = 10usize.pow(exp);
        let staging = |schedule| -> Result<f64, String> {
            let options = stream_adamw::Config::default().schedule(schedule);
            let plan = stream_adamw::Plan::new(&options, bf16_shape(n), stream_adamw::Budget::Unlimited)
                .map_err(|e| e.to_string())?;
            Ok(plan.staging_bytes() as f64)
        };
        base.push((n as f64, staging(stream_adamw::StepSchedule::Serial)?));
        ours.push((n as f64, staging(stream_adamw::StepSchedule::Pipelined)?));
    }
    Ok(Panel {
        title: "optimizer staging (stream-adamw)".into(),
        x_label: "parameters".into(),
        log_x: true,
        series: vec![
            Series { label: "serial offload".into(), bounded: false, points: base },
            Series { label: "bucket pipeline".into(), bounded: true, points: ours },
        ],
    })
}

const PANEL_W: f64 = 460.0;
const PANEL_H: f64 = 320.0;
const MARGIN_L: f64 = 70.0;
const MARGIN_R: f64 = 20.0;
const MARGIN_T: f64 = 36.0;
const MARGIN_B: f64 = 48.0;
const COLORS: [&str; 3] = ["#c0392b", "#8e44ad", "#2471a3"];

fn bytes_label(b: f64) -> String {
    let units = [(1u64 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")];
    for (scale, unit) in units {
        if b >= scale as f64 {
            return format!("{} {unit}", trim(b / scale as f64));
        }
    }
    format!("{} B", trim(b))
}

fn count_label(x: f64) -> String {
    let units = [(1e9, "G"), (1e6, "M"), (1e3, "K")];
    if x >= 1024.0 && x.log2().fract() == 0.0 {
        return if x >= (1u64 << 20) as f64 {
            format!("{}M", trim(x / (1u64 << 20) as f64))
        } else {
            format!("{}K", trim(x / 1024.0))
        };
    }
    for (scale, unit) in units {
        if x >= scale {
            return format!("{}{unit}", trim(x / scale));
        }
    }
    trim(x)
}

fn trim(v: f64) -> String {
    if (v - v.round()).abs() < 1e-9 { format!("{}", v.round()) } else { format!("{v:.1}") }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// The panels as one SVG document (two per row, log-scaled bytes).
pub fn render_svg(panels: &[Panel]) -> String {
    let cols = 2usize;
    let rows = panels.len().div_ceil(cols);
    let (w, h) = (PANEL_W * cols as f64, PANEL_H * rows as f64 + 30.0);
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="11">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="20" text-anchor="middle" font-size="14">Peak working set: baseline (dashed) against the bounded schedule (solid)</text>"#,
        w / 2.0
    );
    for (idx, panel) in panels.iter().enumerate() {
        let (ox, oy) = ((idx % cols) as f64 * PANEL_W, 30.0 + (idx / cols) as f64 * PANEL_H);
        render_panel(&mut s, panel, ox, oy);
    }
    s.push_str("</svg>\n");
    s
}

fn render_panel(s: &mut String, p: &Panel, ox: f64, oy: f64) {
    let pts = p.series.iter().flat_map(|se| se.points.iter());
    let (xmin, xmax) = pts.clone().fold((f64::MAX, f64::MIN), |(a, b), &(x, _)| (a.min(x), b.max(x)));
    let (ymin, ymax) = pts.fold((f64::MAX, f64::MIN), |(a, b), &(_, y)| (a.min(y), b.max(y)));
    // Bytes on a log₂ axis with ticks every ×4 (×16 when the range is wide): 64 MiB, 256 MiB, …
    let (l2min, l2max) = (ymin.max(1.0).log2(), ymax.max(1.0).log2());
    let tick = if l2max - l2min > 16.0 { 4.0 } else { 2.0 };
    let ylo = (l2min / tick).floor() * tick;
    let yhi = ((l2max / tick).ceil() * tick).max(ylo + tick);
    let fx = |x: f64| if p.log_x { x.max(1e-12).log10() } else { x };
    let (xlo, xhi) = (fx(xmin), fx(xmax).max(fx(xmin) + 1e-9));
    let (pw, ph) = (PANEL_W - MARGIN_L - MARGIN_R, PANEL_H - MARGIN_T - MARGIN_B);
    let sx = |x: f64| ox + MARGIN_L + (fx(x) - xlo) / (xhi - xlo) * pw;
    let sy = |y: f64| oy + MARGIN_T + (yhi - y.max(1.0).log2()) / (yhi - ylo) * ph;
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle" font-size="13">{}</text>"#,
        ox + PANEL_W / 2.0,
        oy + 20.0,
        escape(&p.title)
    );
    let _ = writeln!(
        s,
        r##"<rect x="{}" y="{}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>"##,
        ox + MARGIN_L,
        oy + MARGIN_T
    );
    let mut level = ylo;
    while level <= yhi + 1e-9 {
        let y = sy(level.exp2());
        let _ = writeln!(
            s,
            r##"<line x1="{}" y1="{y}" x2="{}" y2="{y}" stroke="#ddd"/>"##,
            ox + MARGIN_L,
            ox + MARGIN_L + pw
        );
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}" text-anchor="end">{}</text>"#,
            ox + MARGIN_L - 4.0,
            y + 4.0,
            bytes_label(level.exp2())
        );
        level += tick;
    }
    if let Some(first) = p.series.first() {
        for &(x, _) in &first.points {
            let px = sx(x);
            let _ = writeln!(
                s,
                r#"<text x="{px}" y="{}" text-anchor="middle">{}</text>"#,
                oy + MARGIN_T + ph + 14.0,
                count_label(x)
            );
        }
    }
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        ox + MARGIN_L + pw / 2.0,
        oy + PANEL_H - 10.0,
        escape(&p.x_label)
    );
    for (k, se) in p.series.iter().enumerate() {
        let color = if se.bounded { COLORS[2] } else { COLORS[k.min(1)] };
        let dash = if se.bounded { "" } else { r#" stroke-dasharray="6 4""# };
        let path: Vec<String> =
            se.points.iter().map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y))).collect();
        let _ = writeln!(
            s,
            r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"{dash}/>"#,
            path.join(" ")
        );
        let ly = oy + MARGIN_T + 14.0 + 14.0 * k as f64;
        let lx = ox + MARGIN_L + 8.0;
        let _ = writeln!(
            s,
            r#"<line x1="{lx}" y1="{}" x2="{}" y2="{}" stroke="{color}" stroke-width="2"{dash}/>"#,
            ly - 4.0,
            lx + 22.0,
            ly - 4.0
        );
        let _ = writeln!(s, r#"<text x="{}" y="{ly}">{}</text>"#, lx + 28.0, escape(&se.label));
    }
}

/// N parameters with bf16 gradients and parameters on the link.
fn bf16_shape(params: usize) -> stream_adamw::Shape {
    stream_adamw::Shape { params, grad_dtype: DType::Bf16, param_dtype: DType::Bf16 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_lines_are_flat_where_baselines_grow() {
        let panels = panels().expect("plans");
        assert_eq!(panels.len(), 4);
        for p in &panels {
            let grows =
                |se: &Series| se.points.last().map_or(0.0, |l| l.1) / se.points.first().map_or(1.0, |f| f.1);
            let base = p.series.iter().filter(|s| !s.bounded).map(grows).fold(0.0, f64::max);
            let ours = p.series.iter().filter(|s| s.bounded).map(grows).fold(0.0, f64::max);
            assert!(base > 4.0, "{}: baseline grows only {base}×", p.title);
            assert!(ours < 1.5, "{}: bounded schedule grows {ours}×", p.title);
        }
        let svg = render_svg(&panels);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), panels.iter().map(|p| p.series.len()).sum::<usize>());
    }
}
