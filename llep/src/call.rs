//! [`Layer`]: the layer as a framework calls it, once per step, on each rank's own tensors.
//!
//! Before any data moves the group agrees on the call ([`agree_records`]): every rank's sizes
//! ([`RankSizes`]), storage type and kind of device, the options' digest ([`Layer::digest`]) and
//! what a backward runs from ([`Backward`]). A rank whose own checks failed (a binding's
//! [`Refusal`](flatpeak_common::comm::Refusal)) enters the agreement too, so bad input on one
//! rank is an error on every rank, naming the rank and its values, never a wait. The call is then
//! planned for N = the most tokens any rank brings, within the layer's budget ([`LayerBudget`]),
//! run on the executor of the last call with the same plan (its working set reserved once, held
//! by the layer between calls) and scheduled from the routing ([`Prepared`]).
//!
//! ```
//! use flatpeak_common::SplitMix64;
//! use llep::{CallOptions, Communicator, Config, DType, Device, ExpertWeights, Layer, LayerBudget};
//! use llep::{LocalGroup, LocalGroupOptions, RankCall, RankInputs, RankSizes, Routing, WeightLayout};
//!
//! let (h, i, k, local) = (16, 8, 2, 2);
//! let results = LocalGroup::run(2, LocalGroupOptions::default(), |comm| {
//!     let tokens = 5 + 3 * comm.rank(); // each rank brings its own batch
//!     let mut rng = SplitMix64::new(comm.rank() as u64);
//!     let x = rng.normal_f32(tokens * h, 0.0, 1.0);
//!     let ids: Vec<i64> = (0..tokens * k).map(|j| (j % 4) as i64).collect();
//!     let weights = vec![0.5f32; tokens * k];
//!     let gate_up = rng.normal_f32(local * 2 * i * h, 0.0, 0.2);
//!     let down = rng.normal_f32(local * h * i, 0.0, 0.2);
//!     let run = || -> llep::Result<_> {
//!         let config = Config::default().min_chunk(4).weight_layout(WeightLayout::Linear);
//!         let mut layer = Layer::new(config, LayerBudget::Default)?;
//!         let routing = Routing { ids: &ids, weights: &weights };
//!         let sizes = RankSizes { tokens, hidden: h, intermediate: i, local_experts: local, top_k: k };
//!         let me = RankCall { sizes, dtype: DType::F32, device: Device::Cpu, routing };
//!         // Agreed with the group, planned for N = 8 tokens, scheduled.
//!         let mut call = layer.call(comm, Ok::<_, llep::Error>(me), CallOptions::default())?;
//!         let inputs = RankInputs { x: &x, routing, experts: ExpertWeights::linear(&gate_up, &down) };
//!         let y = call.forward(comm, &inputs)?;
//!         Ok((y.len(), call.stats().expert_routes.iter().sum::<usize>()))
//!     };
//!     Ok(run())
//! });
//! let results: Vec<_> = results.into_iter().map(|r| r.unwrap().unwrap()).collect();
//! assert_eq!(results, vec![(5 * 16, (5 + 8) * 2), (8 * 16, (5 + 8) * 2)]);
//! # Ok::<(), llep::Error>(())
//! ```

use flatpeak_common::comm::{Agreed, Call, RankRecord, Words, agree_on_inputs, agree_records};
use flatpeak_common::{Budget, Communicator, DType, DTypeNames, Device, Digest, ErrorKind};

use crate::config::{Config, Mode, Shape};
use crate::cpu::SavedActivations;
use crate::error::{Error, Result};
use crate::executor::{Executor, Rank};
use crate::layer::{LayerElement, RankInputs, Routing};
use crate::plan::Plan;
use crate::schedule::Schedule;

/// What [`LayerBudget::Default`] gives the rows of a round above the least a shape runs in, on a
/// CPU.
pub const DEFAULT_CPU_ROWS_BUDGET_BYTES: usize = 64 << 20;

/// What [`LayerBudget::Default`] gives the rows of a round above the least a shape runs in, on a
/// GPU: a GPU's expert GEMMs want groups of hundreds of rows, and every round costs launches and
/// a host round trip. With one rank (P = 1) at T = 8192, H = 2048, I = 1024, k = 8 the call's
/// whole backward working set (q = T: one round) is 315 MiB in bf16 and 619 MiB in f32; this
/// holds either.
pub const DEFAULT_CUDA_ROWS_BUDGET_BYTES: usize = 768 << 20;

/// The budget a call's plan is made within.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LayerBudget {
    /// The least the shape runs in (one row per rank pair, with the foreign expert slots) plus
    /// the device's rows budget ([`DEFAULT_CPU_ROWS_BUDGET_BYTES`],
    /// [`DEFAULT_CUDA_ROWS_BUDGET_BYTES`]) for the rounds' rows: a fixed budget would refuse
    /// real layers, whose foreign expert slots alone (3·H·I weights and their gradients per
    /// slot) exceed one.
    #[default]
    Default,
    /// At most this many bytes (the plan takes the largest pair cap whose buffers fit it).
    Bytes(usize),
}

impl LayerBudget {
    /// The budget of `shape`'s plan under `config` on `device` (the kind every rank of a call
    /// agreed on).
    pub fn of(self, config: &Config, shape: &Shape, device: Device) -> Result<Budget> {
        let rows = match device {
            Device::Cpu => DEFAULT_CPU_ROWS_BUDGET_BYTES,
            Device::Cuda(_) => DEFAULT_CUDA_ROWS_BUDGET_BYTES,
        };
        Ok(Budget::Bytes(match self {
            LayerBudget::Bytes(bytes) => bytes,
            LayerBudget::Default => Plan::least_workspace_bytes(config, shape)?.saturating_add(rows),
        }))
    }
}

/// The sizes one rank's tensors give: its tokens T, the hidden size H, the experts' intermediate
/// size I, the experts it holds E_local and the routes per token k.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankSizes {
    /// T: this rank's tokens (ranks may differ, zero included).
    pub tokens: usize,
    /// H.
    pub hidden: usize,
    /// I.
    pub intermediate: usize,
    /// E_local: the experts this rank holds (expert e lives on rank e / E_local).
    pub local_experts: usize,
    /// k.
    pub top_k: usize,
}

/// What a backward runs from: the exchanges differ (a saved backward dispatches dY rows only), so
/// every rank must run the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Backward {
    /// Recomputing each round (and every forward: its exchanges do not depend on what it keeps).
    #[default]
    Recomputing,
    /// From the activations a saving forward kept.
    FromSaved,
}

impl Backward {
    fn runs(self) -> &'static str {
        match self {
            Backward::Recomputing => "recomputing",
            Backward::FromSaved => "from saved activations",
        }
    }
}

/// One rank's part of a call: its sizes, storage type, device and routing (on the host).
#[derive(Debug, Clone, Copy)]
pub struct RankCall<'a> {
    /// The sizes its tensors give.
    pub sizes: RankSizes,
    /// Their storage type (f32 or bf16).
    pub dtype: DType,
    /// Where the tokens and the experts live.
    pub device: Device,
    /// Its tokens' routes (host memory on every device: the schedule is planned on the host).
    pub routing: Routing<'a>,
}

/// How a call is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct CallOptions {
    /// E as the caller gives it (`None`: E_local × P, and it must be that).
    pub experts: Option<usize>,
    /// What this call's backward (if it is one) runs from.
    pub backward: Backward,
    /// How messages name dtypes.
    pub names: DTypeNames,
}

impl CallOptions {
    flatpeak_common::setters! {
        /// These options with E given.
        experts: Option<usize>,
        /// These options for a backward that runs as `backward`.
        backward: Backward,
        /// These options naming dtypes as `names` does.
        names: DTypeNames,
    }
}

/// A rank's record of a call: its sizes, E as given (0: none) and the call's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CallWords {
    sizes: RankSizes,
    experts: usize,
    options: u64,
    backward: Backward,
}

impl Words for CallWords {
    const LEN: usize = 8;
    fn write(&self, out: &mut [u64]) {
        let s = self.sizes;
        let sizes = [s.tokens, s.hidden, s.intermediate, s.local_experts, s.top_k, self.experts];
        for (o, v) in out.iter_mut().zip(sizes) {
            *o = v as u64;
        }
        out[6] = self.options;
        out[7] = u64::from(self.backward == Backward::FromSaved);
    }
    fn read(w: &[u64]) -> Self {
        let at = |i: usize| w[i] as usize;
        let sizes = RankSizes {
            tokens: at(0),
            hidden: at(1),
            intermediate: at(2),
            local_experts: at(3),
            top_k: at(4),
        };
        let backward = if w[7] == 1 { Backward::FromSaved } else { Backward::Recomputing };
        Self { sizes, experts: at(5), options: w[6], backward }
    }
}

/// The name the agreement gives a layer call.
const CALL: &str = "llep layer";

/// The layer over a group, as a framework calls it (see the module docs): its options, its
/// budget, and the executor of its last plan with the working set that executor reserved.
#[derive(Debug)]
pub struct Layer {
    config: Config,
    budget: LayerBudget,
    executor: Option<Executor>,
}

impl Layer {
    /// A layer with these options (checked) and budget; reserves nothing until its first call.
    pub fn new(config: Config, budget: LayerBudget) -> Result<Self> {
        config.validate()?;
        if budget == LayerBudget::Bytes(0) {
            return Err(Error::invalid_config("budget_bytes", 0usize, "a positive number of bytes"));
        }
        Ok(Self { config, budget, executor: None })
    }

    /// The options.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The budget.
    pub fn budget(&self) -> LayerBudget {
        self.budget
    }

    /// The digest every rank of a call compares: the options' ([`Config::digest`]) and the
    /// budget.
    pub fn digest(&self) -> u64 {
        let budget = match self.budget {
            LayerBudget::Default => Digest::new().u64(0),
            LayerBudget::Bytes(b) => Digest::new().u64(1).usize(b),
        };
        Digest::new().u64(self.config.digest()).u64(budget.finish()).finish()
    }

    /// Bytes of the working set the layer holds between calls (its last executor's).
    pub fn held_bytes(&self) -> usize {
        self.executor.as_ref().map_or(0, Executor::workspace_bytes)
    }

    /// Drops the executor the layer holds, and its working set.
    pub fn release(&mut self) {
        self.executor = None;
    }

    /// One call over `comm`'s group: agrees on every rank's part (`local`, or why this rank has
    /// none), plans it, takes the executor of its plan (made, its working set reserved, when the
    /// plan changed: the old one goes first) and schedules the routing. Every rank of the group
    /// calls it at the same point; the agreement's refusals name the rank that differs:
    ///
    /// - its tensors on another kind of device, or of another dtype, than rank 0's
    ///   ([`ErrorKind::Type`]);
    /// - other H, I, E_local, k or E than rank 0's, other options ([`Layer::digest`]), or a
    ///   backward that runs from another source ([`ErrorKind::Value`]);
    ///
    /// and E that is not E_local × P is [`Error::ExpertsPerRank`].
    pub fn call<C, E>(
        &mut self,
        comm: &C,
        local: std::result::Result<RankCall<'_>, E>,
        options: CallOptions,
    ) -> Result<Prepared<'_>>
    where
        C: Communicator + ?Sized,
        E: Into<Error>,
    {
        let agreed = self.agree(comm, local, options)?;
        let executor = executor_for(&mut self.executor, agreed.plan, agreed.device)?;
        agreed.prepare(executor, comm)
    }

    /// [`call`](Self::call)'s agreement and plan, without the executor: a caller that keeps its
    /// executors elsewhere (a binding's cache, by plan) takes the plan's and
    /// [`prepares`](AgreedCall::prepare) the call on it.
    pub fn agree<'r, C, E>(
        &self,
        comm: &C,
        local: std::result::Result<RankCall<'r>, E>,
        options: CallOptions,
    ) -> Result<AgreedCall<'r>>
    where
        C: Communicator + ?Sized,
        E: Into<Error>,
    {
        let digest = self.digest();
        let local = local.map_err(Into::into);
        let (device, routing) = match &local {
            Ok(me) => (me.device, Some(me.routing)),
            Err(_) => (Device::Cpu, None),
        };
        let record = local.map(|me| RankRecord {
            device: me.device.into(),
            dtype: me.dtype,
            sizes: CallWords {
                sizes: me.sizes,
                experts: options.experts.unwrap_or(0),
                options: digest,
                backward: options.backward,
            },
        });
        let agreed = agree_records(comm, Call { name: CALL, names: options.names }, record)?;
        let routing =
            routing.ok_or(Error::Internal { invariant: "an agreed call has this rank's routing" })?;
        let shape = agreed_shape(&agreed, options.experts)?;
        let plan = Plan::new(&self.config, shape, self.budget.of(&self.config, &shape, device)?)?;
        Ok(AgreedCall { plan, device, routing })
    }
}

/// A call agreed on by the group and planned ([`Layer::agree`]): its plan, this rank's device and
/// routing.
#[derive(Debug, Clone, Copy)]
pub struct AgreedCall<'r> {
    plan: Plan,
    device: Device,
    routing: Routing<'r>,
}

impl AgreedCall<'_> {
    /// The plan (every rank's the same).
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// This rank's device.
    pub fn device(&self) -> Device {
        self.device
    }

    /// `made` (this rank's executor of the plan, or why it has none), agreed on by the group
    /// before the call's first exchange: a rank that could not make its executor (its device
    /// refused the memory) is an error on every rank, never a wait.
    pub fn ready<C: Communicator + ?Sized, T>(&self, comm: &C, made: Result<T>) -> Result<T> {
        agree_on_inputs(comm, made)
    }

    /// The call on `executor` (one of this plan, on this device; [`Error::ScheduleMismatch`] or
    /// [`Error::WrongDevice`] otherwise): schedules the routing over `comm`'s group.
    pub fn prepare<'e, C: Communicator + ?Sized>(
        self,
        executor: &'e mut Executor,
        comm: &C,
    ) -> Result<Prepared<'e>> {
        let mismatch = if executor.device() != self.device {
            Some(Error::WrongDevice { executor: executor.device(), inputs: self.device })
        } else if executor.plan() != &self.plan {
            let what = "the executor's plan (made for another call)";
            let (planned, found) = (self.plan.workspace_bytes(), executor.plan().workspace_bytes());
            Some(Error::ScheduleMismatch { what, planned, found })
        } else {
            None
        };
        if let Some(e) = mismatch {
            // Refused in the schedule's first exchange, so the other ranks return too.
            return match agree_on_inputs(comm, Err::<(), _>(e)) {
                Err(e) => Err(e),
                Ok(()) => Err(Error::internal("a refusal agreed on as a success")),
            };
        }
        let schedule = executor.schedule(comm, &self.routing)?;
        Ok(Prepared { executor, schedule, rank: comm.rank() })
    }
}

/// The cached executor of `plan` on `device` (a new one, its working set reserved once, when the
/// plan or the device changed: the old working set goes before the new one is reserved).
fn executor_for(cached: &mut Option<Executor>, plan: Plan, device: Device) -> Result<&mut Executor> {
    if cached.as_ref().is_none_or(|e| e.plan() != &plan || e.device() != device) {
        *cached = None;
        *cached = Some(Executor::new(plan, device)?);
    }
    cached.as_mut().ok_or(Error::Internal { invariant: "an executor was cached just above" })
}

/// The layer's shape over the group, from every rank's agreed record (the same verdict on every
/// rank): H, I, E_local, k and E equal to rank 0's, the same options and backward, E = E_local × P,
/// and N = the most tokens any rank brings.
fn agreed_shape(agreed: &Agreed<CallWords>, experts: Option<usize>) -> Result<Shape> {
    let ranks = agreed.ranks();
    let first = ranks[0].sizes;
    let layer = |w: &CallWords| {
        let s = w.sizes;
        [s.hidden, s.intermediate, s.local_experts, s.top_k, w.experts]
    };
    if let Some((r, theirs, zeros)) = agreed.first_differing(layer) {
        let show = |v: [usize; 5]| {
            let names = ["hidden", "intermediate", "E_local", "top_k", "num_experts"];
            names.iter().zip(v).map(|(n, v)| format!("{n}={v}")).collect::<Vec<_>>().join(", ")
        };
        let message = format!("rank {r} passed {} where rank 0 passed {}", show(theirs), show(zeros));
        return Err(agreed.refuse(r, ErrorKind::Value, message).into());
    }
    if let Some((r, _, _)) = agreed.first_differing(|w| w.options) {
        let message = format!(
            "rank {r} passed other options than rank 0 (scheme, pair_cap_rows, budget_bytes, activations, ...): \
             every rank of the group must pass the same"
        );
        return Err(agreed.refuse(r, ErrorKind::Value, message).into());
    }
    if let Some((r, theirs, zeros)) = agreed.first_differing(|w| w.backward) {
        let message = format!(
            "rank {r}'s backward runs {} where rank 0's runs {}: every rank's forward must keep the same \
             (the same activations= and a gradient needed on every rank)",
            theirs.runs(),
            zeros.runs()
        );
        return Err(agreed.refuse(r, ErrorKind::Value, message).into());
    }
    let (p, local) = (ranks.len(), first.sizes.local_experts);
    let experts = experts.unwrap_or(local.saturating_mul(p));
    if experts != local.saturating_mul(p) {
        return Err(Error::ExpertsPerRank { experts, local_experts: local, ranks: p });
    }
    let tokens = ranks.iter().map(|r| r.sizes.sizes.tokens).max().unwrap_or(0);
    let s = first.sizes;
    let shape = Shape {
        ranks: p,
        tokens,
        hidden: s.hidden,
        intermediate: s.intermediate,
        experts,
        top_k: s.top_k,
        dtype: agreed.mine().dtype,
    };
    shape.validate()?;
    Ok(shape)
}

/// A call agreed on, planned and scheduled: the layer's executor of its plan and the schedule of
/// its routing, the same on every rank. Its passes are the [`Executor`]'s.
#[derive(Debug)]
pub struct Prepared<'l> {
    executor: &'l mut Executor,
    schedule: Schedule,
    rank: usize,
}

/// What one call did on this rank ([`Prepared::stats`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallStats {
    /// Routes per expert over every rank's tokens (`[E]`): for load-balancing losses and
    /// loss-free bias updates.
    pub expert_routes: Vec<usize>,
    /// Dispatch rounds the routing took (skew costs rounds, never memory).
    pub rounds: usize,
    /// The most token rows this rank receives in one round (at most the plan's `P·q`).
    pub recv_high_water_rows: usize,
    /// Their bytes (rows × H × element size).
    pub recv_high_water_bytes: usize,
    /// The working set the executor reserved on this rank, fixed before any routing is known.
    pub workspace_bytes: usize,
    /// On a CUDA device, the most device memory one pass of the call allocates besides its
    /// inputs ([`Buffers::device_bytes`](crate::Buffers::device_bytes): its buffers and f32
    /// outputs); 0 on the CPU, whose working set is `workspace_bytes`.
    pub device_bytes: usize,
}

impl Prepared<'_> {
    /// The call's schedule.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The plan's shape (N = the most tokens any rank brought).
    pub fn shape(&self) -> &Shape {
        self.schedule.shape()
    }

    /// The layer's forward on this rank ([`Executor::forward`]).
    pub fn forward<R: Rank<I> + ?Sized, I>(&mut self, on: &R, inputs: &I) -> Result<R::Output> {
        self.executor.forward(on, &self.schedule, inputs)
    }

    /// The layer's checkpointed backward on this rank ([`Executor::backward`]).
    pub fn backward<R: Rank<I> + ?Sized, I>(
        &mut self,
        on: &R,
        inputs: &I,
        dy: &R::Dy,
    ) -> Result<R::Gradients> {
        self.executor.backward(on, &self.schedule, inputs, dy)
    }

    /// Bytes of the store a saving forward of this call keeps on this rank
    /// ([`SavedActivations::bytes_for`]); a layer that recomputes keeps none and is
    /// [`Error::InvalidConfig`] (`mode`).
    pub fn saved_bytes(&self) -> Result<usize> {
        if self.schedule.config().mode != Mode::SaveActivations {
            return Err(Error::invalid_config(
                "mode",
                self.schedule.config().mode,
                "Mode::SaveActivations (a layer whose backward recomputes keeps no activations)",
            ));
        }
        Ok(SavedActivations::bytes_for(&self.schedule, self.rank))
    }

    /// A store for this call's saving forward over the caller's `bytes` (at least
    /// [`saved_bytes`](Self::saved_bytes), on a 64-byte line), or over what a saving forward of
    /// the same call filled, for its backward ([`SavedActivations::over`]).
    pub fn store_over<'b>(&self, bytes: &'b mut [u8]) -> Result<SavedActivations<'b>> {
        SavedActivations::over(&self.schedule, self.rank, bytes)
    }

    /// The forward keeping its activations in `saved` ([`Executor::forward_saving`]).
    pub fn forward_saving<C: Communicator + ?Sized, T: LayerElement>(
        &mut self,
        comm: &C,
        inputs: &RankInputs<'_, T>,
        saved: &mut SavedActivations<'_>,
    ) -> Result<Vec<f32>> {
        self.executor.forward_saving(comm, &self.schedule, inputs, saved)
    }

    /// The backward from what a saving forward kept in `saved` ([`Executor::backward_saved`]).
    pub fn backward_saved<C: Communicator + ?Sized, T: LayerElement>(
        &mut self,
        comm: &C,
        inputs: &RankInputs<'_, T>,
        dy: &[T],
        saved: &mut SavedActivations<'_>,
    ) -> Result<crate::layer::Gradients> {
        self.executor.backward_saved(comm, &self.schedule, inputs, dy, saved)
    }

    /// What the call does on this rank.
    pub fn stats(&self) -> CallStats {
        let s = &self.schedule;
        let (p, me) = (s.shape().ranks, self.rank);
        let rows = (0..s.rounds())
            .map(|j| (0..p).map(|src| s.round_pair_rows(src, me, j)).sum::<usize>())
            .max()
            .unwrap_or(0);
        CallStats {
            expert_routes: (0..s.shape().experts).map(|e| s.assignment().counts().load(e)).collect(),
            rounds: s.rounds(),
            recv_high_water_rows: rows,
            recv_high_water_bytes: rows * s.shape().hidden * s.shape().elem_bytes(),
            workspace_bytes: self.executor.workspace_bytes(),
            device_bytes: match self.executor.device() {
                Device::Cpu => 0,
                _ => [crate::Pass::Forward, crate::Pass::Backward]
                    .map(|pass| s.buffers(me, pass).device_bytes())
                    .into_iter()
                    .max()
                    .unwrap_or(0),
            },
        }
    }
}
