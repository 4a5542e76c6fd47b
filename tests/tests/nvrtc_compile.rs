//! The NVRTC kernel compile check (feature `cuda`; no GPU needed). Every kernel source of the
//! workspace is compiled by NVRTC for sm_80 and sm_90, assembled by `ptxas -v`, and rejected on a
//! compile error or any register spill. With `FLATPEAK_REQUIRE_NVRTC=1` (CI sets it) a missing
//! libnvrtc or ptxas fails the test instead of skipping it. Set up with
//! `eval "$(bash scripts/setup-nvrtc.sh)"`.
#![cfg(feature = "cuda")]

use std::path::PathBuf;
use std::process::Command;

use flatpeak_common::kernels::KernelSource;
use flatpeak_common::nvrtc::{Arch, Target, compile};
use flatpeak_common::{Error, nvrtc_available};

const ARCHS: [Arch; 2] = [Arch::SM80, Arch::SM90];

fn required() -> bool {
    std::env::var("FLATPEAK_REQUIRE_NVRTC").is_ok_and(|v| v == "1")
}

/// True when NVRTC can be used; false (skip) when it cannot and it is not required.
fn nvrtc_or_skip() -> bool {
    if nvrtc_available() {
        return true;
    }
    assert!(!required(), "FLATPEAK_REQUIRE_NVRTC=1 but libnvrtc was not found: run scripts/setup-nvrtc.sh");
    eprintln!("skipping: libnvrtc not found (eval \"$(bash scripts/setup-nvrtc.sh)\" to enable)");
    false
}

fn ptxas() -> Option<PathBuf> {
    let path = std::env::var_os("FLATPEAK_PTXAS").map(PathBuf::from).unwrap_or_else(|| "ptxas".into());
    Command::new(&path).arg("--version").output().ok().filter(|o| o.status.success()).map(|_| path)
}

/// Registers and spill bytes per entry point, from `ptxas -v`.
#[derive(Debug)]
struct Usage {
    entry: String,
    registers: u32,
    spill_bytes: u32,
}

fn parse_ptxas(log: &str) -> Vec<Usage> {
    let mut out: Vec<Usage> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let entry = rest.split('\'').next().unwrap_or_default().to_string();
            out.push(Usage { entry, registers: 0, spill_bytes: 0 });
        } else if let Some(last) = out.last_mut() {
            let words: Vec<&str> = line.split_whitespace().collect();
            // "N bytes spill stores, M bytes spill loads" (not "K bytes stack frame").
            last.spill_bytes += words
                .windows(3)
                .filter(|w| w[1] == "bytes" && w[2] == "spill")
                .filter_map(|w| w[0].parse::<u32>().ok())
                .sum::<u32>();
            if let Some(w) = words.windows(2).find(|w| w[1].starts_with("registers")) {
                last.registers = w[0].parse().unwrap_or(0);
            }
        }
    }
    out
}

fn assemble(kernel: &KernelSource, arch: Arch, ptx: &[u8], ptxas: &PathBuf) -> Vec<Usage> {
    let dir = std::env::temp_dir().join(format!("flatpeak-nvrtc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ptx_path = dir.join(format!("{}_{arch}.ptx", kernel.name));
    std::fs::write(&ptx_path, ptx).unwrap();
    let out = Command::new(ptxas)
        .args([
            format!("-arch={arch}"),
            "-v".into(),
            "-o".into(),
            dir.join("out.cubin").display().to_string(),
        ])
        .arg(&ptx_path)
        .output()
        .expect("ptxas runs");
    let log = String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "ptxas rejected {} for {arch}:\n{log}", kernel.name);
    parse_ptxas(&log)
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90_without_spills() {
    if !nvrtc_or_skip() {
        return;
    }
    let ptxas = ptxas();
    assert!(
        ptxas.is_some() || !required(),
        "FLATPEAK_REQUIRE_NVRTC=1 but ptxas was not found (FLATPEAK_PTXAS)"
    );
    let mut table = Vec::new();
    for kernel in flatpeak_tests::all_kernels() {
        for arch in ARCHS {
            let ptx = compile(&kernel, arch, Target::Ptx).unwrap_or_else(|e| panic!("{e}"));
            let text = String::from_utf8_lossy(&ptx.image);
            for entry in kernel.entry_points {
                assert!(
                    text.contains(&format!(".entry {entry}(")),
                    "{}: no entry {entry} for {arch}",
                    kernel.name
                );
            }
            let cubin = compile(&kernel, arch, Target::Cubin).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(
                &cubin.image[..4],
                b"\x7fELF",
                "{}: cubin for {arch} is not an ELF image",
                kernel.name
            );
            let Some(ptxas) = &ptxas else { continue };
            let usage = assemble(&kernel, arch, &ptx.image, ptxas);
            assert_eq!(usage.len(), kernel.entry_points.len(), "{}: ptxas reported {usage:?}", kernel.name);
            for u in usage {
                assert_eq!(
                    u.spill_bytes, 0,
                    "{}::{} spills {} bytes on {arch}",
                    kernel.name, u.entry, u.spill_bytes
                );
                table.push(format!(
                    "{:<10} {:<20} {arch}  {:>3} registers, 0 spills",
                    kernel.name, u.entry, u.registers
                ));
            }
        }
    }
    eprintln!("{}", table.join("\n"));
}

#[test]
fn a_broken_kernel_is_an_error_carrying_the_nvrtc_log() {
    if !nvrtc_or_skip() {
        return;
    }
    let broken = KernelSource {
        name: "broken",
        source: "extern \"C\" __global__ void k(float* x) { x[threadIdx.x] = undefined_name; }",
        entry_points: &["k"],
        headers: &[],
    };
    match compile(&broken, Arch::SM90, Target::Ptx) {
        Err(Error::KernelCompile { kernel, arch, log }) => {
            assert_eq!((kernel.as_str(), arch.as_str()), ("broken", "sm_90"));
            assert!(log.contains("undefined_name"), "log: {log}");
        }
        other => panic!("expected a compile error, got {other:?}"),
    }
}

#[test]
fn ptxas_output_parser_reads_registers_and_spills() {
    let log = "ptxas info    : Compiling entry function 'a' for 'sm_90'\n\
               ptxas info    : Function properties for a\n    \
               8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n\
               ptxas info    : Used 12 registers, used 0 barriers\n\
               ptxas info    : Compiling entry function 'b' for 'sm_90'\n\
               ptxas info    : Used 40 registers, 368 bytes cmem[0]\n";
    let usage = parse_ptxas(log);
    assert_eq!((usage[0].entry.as_str(), usage[0].registers, usage[0].spill_bytes), ("a", 12, 8));
    assert_eq!((usage[1].entry.as_str(), usage[1].registers, usage[1].spill_bytes), ("b", 40, 0));
}
