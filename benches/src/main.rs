//! `flatpeak`: measured ceilings and the measured paper table. See the crate docs.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};
use flatpeak_bench::components::{ReportError, select};
use flatpeak_bench::machine::{MachineOptions, measure};
use flatpeak_bench::report::{Report, SCHEMA_VERSION, machine_line, render_markdown, render_text};
use flatpeak_common::{CountingAllocator, Device};
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
        /// Also write the report as JSON (schema version 1) to this file.
        #[arg(long, value_name = "PATH")]
        json: Option<PathBuf>,
        /// Print the table as Markdown.
        #[arg(long)]
        markdown: bool,
        /// Device to run the bounded schedules on.
        #[arg(long, default_value = "cpu", value_parser = parse_device)]
        device: Device,
    },
}

fn parse_device(spec: &str) -> Result<Device, String> {
    spec.parse().map_err(|e: flatpeak_common::Error| e.to_string())
}

fn report(
    components: &[String],
    json: Option<PathBuf>,
    markdown: bool,
    device: Device,
) -> Result<(), String> {
    device.ensure_available().map_err(|e| e.to_string())?;
    let selection = select(components).map_err(|e| e.to_string())?;
    let chosen = &selection.run;
    eprintln!("measuring machine ceilings (1 GiB copy, 2048³ GEMM)…");
    let machine = measure(MachineOptions::default());

    let jobs: Vec<(usize, usize)> = chosen
        .iter()
        .enumerate()
        .flat_map(|(c, comp)| (0..comp.workloads().len()).map(move |w| (c, w)))
        .collect();
    let bar = ProgressBar::new(jobs.len() as u64);
    if let Ok(style) = ProgressStyle::with_template("{bar:30} {pos}/{len} {msg}") {
        bar.set_style(style);
    }
    let mut rows = Vec::with_capacity(jobs.len());
    for (c, w) in jobs {
        let comp = &chosen[c];
        bar.set_message(format!("{} {}", comp.name(), comp.workloads()[w]));
        rows.push(comp.run(w, device, &machine).map_err(|e: ReportError| e.to_string())?);
        bar.inc(1);
    }
    bar.finish_and_clear();

    let report = Report { version: SCHEMA_VERSION, machine, rows };
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(&report).map_err(|e| e.to_string())?;
        std::fs::write(&path, text + "\n").map_err(|e| format!("writing {}: {e}", path.display()))?;
    }
    print!("{}", if markdown { render_markdown(&report) } else { render_text(&report) });
    if !selection.not_available.is_empty() {
        println!("not available: {} (not built yet in this workspace)", selection.not_available.join(", "));
    }
    Ok(())
}

fn main() -> ExitCode {
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
        Command::Report { components, json, markdown, device } => report(&components, json, markdown, device),
    };
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("error: {message}");
            ExitCode::from(2)
        }
    }
}
