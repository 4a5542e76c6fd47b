//! # flatpeak-bench
//!
//! The `flatpeak` command and the criterion benches of the flatpeak workspace:
//!
//! - `flatpeak machine [--json]`: this machine's ceilings, measured ([`machine`]).
//! - `flatpeak report [--component NAME]... [--quick] [--json PATH] [--markdown PATH] [--svg PATH]`:
//!   each landed component's baseline-vs-bounded comparison on the CPU fallback, as the paper's
//!   table ([`report`]; `--markdown docs/results.md` writes the results document), and the plot
//!   of every peak against its growing dimension ([`figure`]). The CUDA paths are measured by
//!   the criterion benches that `scripts/gpu-check.sh` runs.
//! - `flatpeak plan --model <preset|file.json> --context N --gpus G --gpu-mem BYTES [--json]`:
//!   the per-GPU memory model of a tuned FSDP2 baseline and of the flattened schedules
//!   (`flatpeak::memory_model`).
//! - `flatpeak run <component> --inputs in.safetensors [--config cfg.json] --outputs out.safetensors`:
//!   one primitive on tensors from any framework (`flatpeak::run`).
//!
//! ```
//! use flatpeak_bench::machine::{measure, MachineOptions};
//! let m = measure(MachineOptions::quick());
//! assert!(m.copy_gbps > 0.0 && m.gemm_f32_gflops > 0.0);
//! ```

pub mod components;
pub mod figure;
pub mod gpu_model;
pub mod machine;
pub mod report;
