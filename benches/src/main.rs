//! `flatpeak`: measured ceilings, the measured paper table and the memory model. See the crate
//! docs.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use flatpeak::memory_model::{ModelSpec, plan, render_text as render_plan};
use flatpeak_bench::components::{ReportError, WorkloadSet, select};
use flatpeak_bench::machine::{MachineOptions, measure};
use flatpeak_bench::report::{Provenance, Report, SCHEMA_VERSION, machine_line, render_results, render_text};
use flatpeak_common::CountingAllocator;
use indicatif::{ProgressBar, ProgressStyle};

// Components measure peak_bytes with the counting allocator.
#[global_allocator]
static ALLOC: CountingAllocator = CountingAllocator;

#[derive(Debug, Parser)]
#[command(name = "flatpeak", version, about = "Flatten the four memory peaks of long-context MoE training")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Measure this machine's ceilings: copy bandwidth and f32 GEMM rate.
    Machine {
        /// Print `{"cpus":N,"copy_gbps":x,"gemm_f32_gflops":y}` instead of a sentence.
        #[arg(long)]
        json: bool,
    },
    /// Run each landed component's baseline-vs-bounded comparison and print the paper table.
    Report {
        /// Only these components (repeatable): llep, ring-dtp, sco, stream-adamw.
        #[arg(long = "component", value_name = "NAME")]
        components: Vec<String>,
        /// Also write the report as JSON (schema version 2) to this file.
        #[arg(long, value_name = "PATH")]
        json: Option<PathBuf>,
        /// Also write the results document (command, commit, machine, summary, every row) as
        /// Markdown to this file, e.g. docs/results.md.
        #[arg(long, value_name = "PATH")]
        markdown: Option<PathBuf>,
        /// Also write the plot of each peak against its growing dimension (SVG) to this file.
        #[arg(long, value_name = "PATH")]
        svg: Option<PathBuf>,
        /// Run the quick set (one or two rows per component, same shapes) instead of every
        /// workload: CI's check that the report runs.
        #[arg(long)]
        quick: bool,
    },
    /// The GPU bench's calls counted without a GPU (launches, host waits, GEMMs, kernel bytes)
    /// beside the torch code they replace, and the time the counts imply on an H100 and an
    /// H200: a predicted table.
    GpuModel {
        /// Also write the table into this file between its markers, e.g. docs/gpu.md.
        #[arg(long, value_name = "PATH")]
        markdown: Option<PathBuf>,
    },
    /// Per-GPU memory of a long-context MoE training step: a tuned FSDP2 baseline against the
    /// flattened schedules, every peak, which is largest, and the longest context that fits.
    Plan {
        /// A preset (gpt-oss-120b, Qwen3-235B-A22B, DeepSeek-V3), a JSON model file, or a Hugging
        /// Face transformers config.json of a MoE model.
        #[arg(long)]
        model: String,
        /// Tokens of the sequence; a suffix K or M multiplies by 2^10 or 2^20.
        #[arg(long, value_parser = parse_count)]
        context: u64,
        /// GPUs the sequence and the experts are spread over.
        #[arg(long)]
        gpus: u64,
        /// Memory per GPU in bytes; a suffix KiB, MiB, GiB, TiB (powers of 2) or KB, MB, GB, TB
        /// (powers of 10) is accepted.
        #[arg(long, value_parser = parse_bytes)]
        gpu_mem: u64,
        /// Print `{"model":…,"context":…,"baseline":{"peaks":{…},"fits":…,"max_context":…},"flattened":{…}}`.
        #[arg(long)]
        json: bool,
    },
    /// Run one primitive (forward and backward, or one optimizer step) on tensors from a
    /// safetensors file and write its outputs and gradients to another (tensor names and
    /// config fields: docs/cli.md).
    Run {
        /// llep, ring-dtp, sco or stream-adamw.
        component: String,
        /// The input tensors.
        #[arg(long, value_name = "PATH")]
        inputs: PathBuf,
        /// The component's JSON config (defaults when absent).
        #[arg(long, value_name = "PATH")]
        config: Option<PathBuf>,
        /// Where to write the outputs.
        #[arg(long, value_name = "PATH")]
        outputs: PathBuf,
    },
}

/// `digits[suffix]` with the suffix's multiplier, from `units` (matched case-sensitively first,
/// then ignoring case).
fn parse_scaled(spec: &str, units: &[(&str, u64)]) -> Result<u64, String> {
    let spec = spec.trim();
    let split = spec.find(|c: char| !c.is_ascii_digit()).unwrap_or(spec.len());
    let (digits, suffix) = spec.split_at(split);
    let value: u64 =
        digits.parse().map_err(|_| format!("`{spec}`: expected an integer with an optional unit"))?;
    let scale = if suffix.is_empty() {
        1
    } else {
        units
            .iter()
            .find(|(u, _)| *u == suffix)
            .or_else(|| units.iter().find(|(u, _)| u.eq_ignore_ascii_case(suffix)))
            .map(|&(_, m)| m)
            .ok_or_else(|| {
                let known: Vec<&str> = units.iter().map(|(u, _)| *u).collect();
                format!("`{spec}`: unknown unit `{suffix}` (known: {})", known.join(", "))
            })?
    };
    value.checked_mul(scale).ok_or_else(|| format!("`{spec}` overflows 64 bits"))
}

fn parse_count(spec: &str) -> Result<u64, String> {
    parse_scaled(spec, &[("K", 1 << 10), ("M", 1 << 20)])
}

fn parse_bytes(spec: &str) -> Result<u64, String> {
    let units = [
        ("KiB", 1u64 << 10),
        ("MiB", 1 << 20),
        ("GiB", 1 << 30),
        ("TiB", 1 << 40),
        ("KB", 1_000),
        ("MB", 1_000_000),
        ("GB", 1_000_000_000),
        ("TB", 1_000_000_000_000),
    ];
    parse_scaled(spec, &units)
}

fn memory_plan(model: &str, context: u64, gpus: u64, gpu_mem: u64, json: bool) -> Result<(), String> {
    let spec = ModelSpec::load(model).map_err(|e| e.to_string())?;
    let out = plan(&spec, context, gpus, gpu_mem).map_err(|e| e.to_string())?;
    if json {
        println!("{}", serde_json::to_string(&out).map_err(|e| e.to_string())?);
    } else {
        print!("{}", render_plan(&out));
    }
    Ok(())
}

/// Where the report's optional files go.
struct ReportFiles {
    json: Option<PathBuf>,
    markdown: Option<PathBuf>,
    svg: Option<PathBuf>,
}

/// The command line that ran this report, as `cargo run` from the repository, and the commit.
fn provenance() -> Provenance {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let command = format!("cargo run --release -p flatpeak-bench -- {}", args.join(" "));
    let commit = std::process::Command::new("git")
        .args(["describe", "--always", "--dirty", "--abbrev=12"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown (not run from a git checkout)".to_string());
    Provenance { command, commit }
}

fn report(components: &[String], files: ReportFiles, set: WorkloadSet) -> Result<(), String> {
    let ReportFiles { json, markdown, svg } = files;
    if let Some(path) = &svg {
        let panels = flatpeak_bench::figure::panels()?;
        std::fs::write(path, flatpeak_bench::figure::render_svg(&panels))
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
        eprintln!("wrote the peak plot to {}", path.display());
    }
    let selection = select(components).map_err(|e| e.to_string())?;
    let chosen = &selection.run;
    eprintln!("measuring machine ceilings (1 GiB copy, 2048³ GEMM)…");
    let machine = measure(MachineOptions::default());

    let jobs: Vec<(usize, usize)> = chosen
        .iter()
        .enumerate()
        .flat_map(|(c, comp)| comp.workloads_in(set).into_iter().map(move |w| (c, w)))
        .collect();
    let bar = ProgressBar::new(jobs.len() as u64);
    if let Ok(style) = ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}") {
        bar.set_style(style);
    }
    let mut rows = Vec::with_capacity(jobs.len());
    for (c, w) in jobs {
        let comp = &chosen[c];
        bar.set_message(format!("{} {}", comp.name(), comp.workloads()[w]));
        rows.push(comp.run(w, &machine).map_err(|e: ReportError| e.to_string())?);
        bar.inc(1);
    }
    bar.finish_and_clear();

    let report = Report { version: SCHEMA_VERSION, machine, rows };
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        std::fs::write(&path, text + "\n").map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    if let Some(path) = markdown {
        std::fs::write(&path, render_results(&report, &provenance()))
            .map_err(|e| format!("writing {}: {e}", path.display()))?;
        eprintln!("wrote the results document to {}", path.display());
    }
    print!("{}", render_text(&report));
    if !selection.not_available.is_empty() {
        println!("not available: {} (not built yet in this workspace)", selection.not_available.join(", "));
    }
    Ok(())
}

/// One glibc malloc arena for the whole process, which keeps the memory it has faulted in, set
/// before any thread starts.
///
/// The llep rows run P rank threads on this machine's cores and report each rank's CPU time.
/// - With an arena per thread, which rank draws which arena changes run to run, and a rank whose
///   arena keeps trimming and re-faulting its heap was measured 30–40% above its peers on
///   identical work, which moved the makespan by whichever rank that was. With one arena every
///   rank allocates alike; the few, large allocations of these steps make its lock cheap.
/// - Even with one arena, a step's outputs (megabytes each) came from fresh `mmap`s or a heap
///   top that had just been trimmed, so whichever rank drew them paid the kernel's page
///   zeroing inside its step: one rank 15% above the others for a whole run, a different one
///   per scheme. Serving every allocation below 1 GiB from the heap and never trimming it makes
///   a step reuse the pages of the previous one, as a device's caching allocator would. Peak
///   bytes are counted by the counting allocator (bytes requested), which this does not change.
fn one_malloc_arena() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets allocator parameters; it runs before any other thread exists,
    // so no allocation races with the change.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX);
    }
}

fn main() -> ExitCode {
    one_malloc_arena();
    let outcome = match Cli::parse().command {
        Command::Machine { json } => {
            let m = measure(MachineOptions::default());
            if json {
                serde_json::to_string(&m).map(|s| println!("{s}")).map_err(|e| e.to_string())
            } else {
                println!("{}", machine_line(&m));
                Ok(())
            }
        }
        Command::Report { components, json, markdown, svg, quick } => {
            let set = if quick { WorkloadSet::Quick } else { WorkloadSet::Full };
            report(&components, ReportFiles { json, markdown, svg }, set)
        }
        Command::GpuModel { markdown } => flatpeak_bench::gpu_model::render().and_then(|section| {
            print!("{section}");
            markdown.map_or(Ok(()), |path| flatpeak_bench::gpu_model::write_section(&path, &section))
        }),
        Command::Plan { model, context, gpus, gpu_mem, json } => {
            memory_plan(&model, context, gpus, gpu_mem, json)
        }
        Command::Run { component, inputs, config, outputs } => {
            flatpeak::run::run(&component, &inputs, config.as_deref(), &outputs)
                .map(|names| println!("wrote {} to {}", names.join(", "), outputs.display()))
                .map_err(|e| e.to_string())
        }
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::from(2)
        }
    }
}
