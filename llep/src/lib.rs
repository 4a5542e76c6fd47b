//! # llep — PipelinedLLEP: expert parallelism whose dispatch buffers are fixed at launch
//!
//! A Mixture-of-Experts layer over P ranks routes each of a rank's N tokens to k of E experts
//! (E/P native to each rank): `y_i = Σ_j w_ij·FFN_{e_ij}(x_i)`, SwiGLU experts
//! `FFN_e(x) = (silu(x·W_gate) ⊙ (x·W_up))·W_down`. Standard expert parallelism sends every
//! route to its expert's rank, so a hot rank receives up to P·k·N rows; LLEP's least-loaded
//! assignment ([`Assignment`]) spills hot experts' routes (and their weights) to the least
//! loaded ranks, capping a rank's load near α·k·N, but still sizes every buffer to what
//! arrives. PipelinedLLEP keeps LLEP's assignment and dispatches in K rounds in which a source
//! sends at most q rows to a destination, so every receive buffer is exactly P·q rows whatever
//! the routing: **imbalance costs rounds, never memory**.
//!
//! Memory bound per rank (all sizes in the launch [`Plan`]'s [`Buffers`], fixed by the config,
//! the shape and the budget before any routing is known): D pipeline copies of send, receive
//! and output buffers of P·q rows × H with their token and route lists (backward adds dY rows
//! and d(weights)), the expert scratch of G = P·q rows × (H, I), the round's index lists (P·q·k routes),
//! F_max foreign expert slots of 3·H·I, and on the host 8·N·k bytes of route tables, up to two
//! rounds' received route metadata and the grouping arrays ([`Buffers::regions`] lists every
//! one). Nothing scales with the skew; the baselines ([`Scheme::Llep`], [`Scheme::StandardEp`])
//! are plans too, sized to their routing.
//!
//! Training runs the layer checkpointed ([`Mode::Checkpointed`]): forward keeps nothing,
//! backward recomputes each round and runs its backward at once, returning dX, the routing
//! weights' gradient (for the router) and the native experts' weight gradients (foreign
//! gradients travel home once per layer). [`Mode::SaveActivations`] instead keeps every round's
//! received rows and SwiGLU pre-activations from [`Executor::forward_saving`] for
//! [`Executor::backward_saved`] (no recompute; its larger, routing-dependent store is
//! [`Schedule::saved_bytes`]). Exact: forward and backward match a dense f64 reference
//! ([`cpu::reference`]) to f32 rounding.
//!
//! A plan with `dtype: DType::Bf16` runs on bf16 tokens, weights and dY ([`LayerElement`]): the
//! dispatch rows and the expert scratch are bf16 (their bytes halve), the GEMMs multiply bf16
//! with f32 accumulation, and the output and every gradient are f32; its errors stay within
//! twice those of the naive bf16 layer ([`cpu::reference::naive_bf16_forward`]) + 1e-2. Every
//! backend runs it: the CPU (AMX or AVX512-BF16 GEMMs where the CPU has them), the emulator
//! (the `_bf16` instantiations of `kernels/llep.cu`) and CUDA (those kernels and cuBLAS
//! `GemmEx` on the bf16 buffers in place, tensor cores with f32 accumulation).
//!
//! The round schedule is written once ([`device`], over the [`device::DeviceOps`] a backend
//! offers) and an [`Executor`] runs it on the backend its [`Device`] names: [`Device::Cpu`] —
//! host memory carved from the one workspace it reserved, the CPU GEMM, the [`Communicator`]'s
//! all-to-all ([`cpu::HostOps`]) — or, with feature `cuda`, `Device::Cuda(n)` (cudarc, NVRTC
//! kernels, cuBLAS, NCCL: `cuda::CudaOps`); without it a CUDA device is a typed error.
//!
//! ```
//! use flatpeak_common::SplitMix64;
//! use llep::{Budget, Communicator, Config, DType, Device, Executor, ExpertWeights, LocalGroup};
//! use llep::{LocalGroupOptions, PairCap, Plan, RankInputs, Routing, Shape};
//!
//! let shape = Shape { ranks: 4, tokens: 64, hidden: 32, intermediate: 16, experts: 8, top_k: 2, dtype: DType::F32 };
//! let config = Config::default().min_chunk(8).pair_cap(PairCap::Rows(8));
//! // Sized at launch, before any routing is known: q = 8 rows per rank pair and round.
//! let plan = Plan::new(&config, shape, Budget::mib(1))?;
//! let bytes = plan.workspace_bytes();
//! // Every token's two slots go to expert 0 (all on rank 0): LLEP spills it to all ranks.
//! let ids = vec![0i64; 64 * 2];
//! let results = LocalGroup::run(4, LocalGroupOptions::default(), |comm| {
//!     let mut rng = SplitMix64::new(comm.rank() as u64);
//!     let x = rng.normal_f32(64 * 32, 0.0, 1.0);
//!     let weights = vec![0.5f32; 64 * 2];
//!     let (gate, up, down) = (rng.normal_f32(2 * 32 * 16, 0.0, 0.2), rng.normal_f32(2 * 32 * 16, 0.0, 0.2), rng.normal_f32(2 * 16 * 32, 0.0, 0.2));
//!     let inputs = RankInputs {
//!         x: &x,
//!         routing: Routing { ids: &ids, weights: &weights },
//!         experts: ExpertWeights { gate: &gate, up: &up, down: &down },
//!     };
//!     let run = || -> llep::Result<_> {
//!         let mut layer = Executor::new(plan, Device::Cpu)?; // reserves `bytes`, once
//!         // This call's rounds within the plan: the routing costs rounds, never memory.
//!         let schedule = layer.schedule(comm, &inputs.routing)?;
//!         let y = layer.forward(comm, &schedule, &inputs)?;
//!         let grads = layer.backward(comm, &schedule, &inputs, &y)?; // dY = y
//!         let transfers = schedule.assignment().transfers().len();
//!         Ok((schedule.rounds(), transfers, grads.dx.len(), layer.high_water(), layer.workspace_bytes()))
//!     };
//!     Ok(run())
//! });
//! for r in results {
//!     let (rounds, transfers, dx_len, used, reserved) = r??;
//!     assert!(rounds >= 1 && transfers == 3 && dx_len == 64 * 32 && used == bytes && reserved == bytes);
//! }
//! # Ok::<(), llep::Error>(())
//! ```
//!
//! A framework calls the layer through [`Layer`] ([`call`]): each rank brings its own tokens, the
//! group agrees on the call before any data moves, and the layer keeps the executor of its last
//! plan between calls.
//!
//! Modules: [`config`] (shape and options), [`assign`] (least-loaded assignment, pure),
//! [`plan`] (launch sizing: the pair cap and every buffer, pure), [`schedule`] (one call's
//! rounds from its routing, pure), [`device`] (the round schedule over [`device::DeviceOps`],
//! written once), [`executor`] (the [`Executor`]), [`cpu`] (the call's schedule over a
//! `Communicator`, the host backend, the saved-activation store and the f64 reference),
//! `paper` (feature `paper`: the LLEP harness's routing profiles, the peak model fitted to the
//! paper's figures and its plan-only rows). With feature `cuda`, `cuda::CudaOps` runs the schedule on a GPU;
//! with `cuda-emu`, `emu_ops::EmuOps` runs it with the kernels under the SIMT emulator,
//! which tests them against the CPU without a GPU.

pub mod assign;
pub mod call;
pub mod config;
pub mod cpu;
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod cuda;
pub mod device;
#[cfg(feature = "cuda-emu")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda-emu")))]
pub mod emu;
#[cfg(feature = "cuda-emu")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda-emu")))]
pub mod emu_ops;
pub mod error;
pub mod executor;
pub mod kernels;
pub mod layer;
#[cfg(feature = "paper")]
#[cfg_attr(docsrs, doc(cfg(feature = "paper")))]
pub mod paper;
pub mod plan;
mod route_tables;
pub mod schedule;

pub use assign::{Assignment, Piece, RouteCounts, RouteMapper, Transfer, local_counts};
pub use call::{
    AgreedCall, Backward, CallOptions, CallStats, DEFAULT_CPU_ROWS_BUDGET_BYTES,
    DEFAULT_CUDA_ROWS_BUDGET_BYTES, Layer, LayerBudget, Prepared, RankCall, RankSizes,
};
pub use config::{Chunking, Config, Mode, PairCap, Scheme, Shape, SpillSplit, WeightLayout};
pub use error::{Error, Result};
pub use executor::{Executor, Rank};
pub use flatpeak_common::gemm_bf16::Bf16Kernel;
pub use flatpeak_common::{Budget, Communicator, DType, Device, LocalGroup, LocalGroupOptions, Workspace};
pub use half::bf16;
pub use layer::{ExpertWeights, Gradients, LayerElement, RankInputs, Routing};
pub use plan::{Buffers, Pass, Plan};
pub use schedule::{Schedule, pair_rows, round_rows};
