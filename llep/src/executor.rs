//! [`Executor`]: one rank's MoE layer executor, chosen by one [`Device`]. It owns its launch
//! [`Plan`] (and with it the config) and the plan's working set, reserved once at construction
//! and reused by every call: on the CPU a host [`Workspace`] of
//! [`Plan::workspace_bytes`] from which every buffer of a pass is carved; on a CUDA device
//! (feature `cuda`) the host side of it ([`Buffers::host_workspace_bytes`]: route tables,
//! metadata staging, grouping arrays), the device buffers being reserved per pass through
//! `cuda::CudaOps`. Either way the pass is the one round schedule of [`crate::device`].
//!
//! One `forward` and one `backward` whatever the device: the first argument, what the rank runs
//! on ([`Rank`]), names it — a host [`Communicator`] with host slices ([`RankInputs`]), or on a
//! GPU `cuda::CudaOps` (the rank's NCCL communicator and streams) with device buffers
//! (`device::DeviceInputs` of `cuda::CudaBuf`). Inputs of the other kind do not type-check; a
//! rank on another device than the executor's is [`Error::WrongDevice`], never a silent copy.

use flatpeak_common::{Communicator, Device, Workspace};

use crate::config::Scheme;
use crate::cpu::{self, SavedActivations};
use crate::error::{Error, Result};
use crate::layer::{Gradients, LayerElement, RankInputs, Routing};
use crate::plan::{Buffers, Pass, Plan};
use crate::schedule::Schedule;

/// What a rank runs the layer on, with the inputs `I` it takes there: a host [`Communicator`]
/// with [`RankInputs`], or (feature `cuda`) `cuda::CudaOps` with `device::DeviceInputs` of
/// `cuda::CudaBuf`. Its associated types are what the executor's calls return there.
pub trait Rank<I: ?Sized> {
    /// The layer's output y (f32, N×H).
    type Output;
    /// dL/dy as backward takes it (in the inputs' dtype).
    type Dy: ?Sized;
    /// What backward returns: dX, the routing weights' and the native experts' gradients.
    type Gradients;

    /// The device the rank's data lives on.
    fn device(&self) -> Device;
    /// The rank's index in its group.
    fn rank_index(&self) -> usize;
    /// The forward pass on `ws` (reset, reserved by the executor). Called by
    /// [`Executor::forward`].
    #[doc(hidden)]
    fn run_forward(&self, ws: &Workspace, schedule: &Schedule, inputs: &I) -> Result<Self::Output>;
    /// The checkpointed backward pass on `ws`. Called by [`Executor::backward`].
    #[doc(hidden)]
    fn run_backward(
        &self,
        ws: &Workspace,
        schedule: &Schedule,
        inputs: &I,
        dy: &Self::Dy,
    ) -> Result<Self::Gradients>;
}

impl<C: Communicator + ?Sized, T: LayerElement> Rank<RankInputs<'_, T>> for C {
    type Output = Vec<f32>;
    type Dy = [T];
    type Gradients = Gradients;

    fn device(&self) -> Device {
        Device::Cpu
    }
    fn rank_index(&self) -> usize {
        self.rank()
    }
    fn run_forward(
        &self,
        ws: &Workspace,
        schedule: &Schedule,
        inputs: &RankInputs<'_, T>,
    ) -> Result<Vec<f32>> {
        cpu::forward(self, ws, schedule, inputs, None)
    }
    fn run_backward(
        &self,
        ws: &Workspace,
        schedule: &Schedule,
        inputs: &RankInputs<'_, T>,
        dy: &[T],
    ) -> Result<Gradients> {
        cpu::backward(self, ws, schedule, inputs, dy, None)
    }
}

/// One rank's PipelinedLLEP layer within its launch [`Plan`]: `y_i = Σ_j w_ij·FFN_{e_ij}(x_i)`
/// and its backward over a group of P ranks, every pass's buffers from the working set reserved
/// at construction (see the module docs). Each call takes this rank's [`Communicator`] and the
/// call's [`Schedule`] (from [`Executor::schedule`], identical on every rank).
///
/// Memory: PipelinedLLEP's reservation is the plan's, whatever the routing: imbalance costs
/// rounds, never memory. The baselines ([`Scheme::Llep`], [`Scheme::StandardEp`]) size their
/// buffers to each call's routing, so a baseline executor reserves what a call needs when it
/// needs more than it holds ([`Executor::reserve`] does it ahead).
#[derive(Debug)]
pub struct Executor {
    plan: Plan,
    device: Device,
    workspace: Workspace,
}

impl Executor {
    /// Reserves `plan`'s working set on `device`: on the CPU [`Plan::workspace_bytes`] (both
    /// passes; nothing for the baselines, whose buffers follow each call's routing). A CUDA
    /// device without the `cuda` feature, the driver or the device is
    /// `Common(CudaUnavailable)`, saying why.
    pub fn new(plan: Plan, device: Device) -> Result<Self> {
        let bytes = match (device, plan.config().scheme) {
            (_, Scheme::Llep | Scheme::StandardEp) => 0,
            (Device::Cpu, Scheme::PipelinedLlep) => plan.workspace_bytes(),
            (Device::Cuda(_), Scheme::PipelinedLlep) => [Pass::Forward, Pass::Backward]
                .map(|p| plan.buffers(p).host_workspace_bytes())
                .into_iter()
                .max()
                .unwrap_or(0),
        };
        Self::with_workspace_bytes(plan, device, bytes)
    }

    /// As [`new`](Executor::new), reserving `bytes` instead: less serves the forward pass only
    /// (at least `plan.buffers(Pass::Forward)`'s), more a baseline's routing-sized buffers. A
    /// PipelinedLLEP pass that needs more than the reservation is
    /// `Common(WorkspaceExhausted)`, never growth.
    pub fn with_workspace_bytes(plan: Plan, device: Device, bytes: usize) -> Result<Self> {
        plan.config().validate()?;
        if let Device::Cuda(ordinal) = device {
            cuda_available(ordinal)?;
        }
        Ok(Self { plan, device, workspace: Workspace::new(bytes)? })
    }

    /// The launch plan.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }
    /// The device it runs on.
    pub fn device(&self) -> Device {
        self.device
    }
    /// Bytes of the host workspace it reserved.
    pub fn workspace_bytes(&self) -> usize {
        self.workspace.capacity()
    }
    /// The most bytes any pass carved from it: what the schedule really needed of its plan.
    pub fn high_water(&self) -> usize {
        self.workspace.high_water()
    }

    /// Reserves at least `bytes` now (a baseline's buffers for a routing about to run, so the
    /// reservation is not made inside a timed call). Keeps a larger reservation. A reservation
    /// the system refuses is `Common(HostAlloc)`, leaving an empty workspace.
    pub fn reserve(&mut self, bytes: usize) -> Result<()> {
        if bytes > self.workspace.capacity() {
            // The old reservation goes first: the two are never held at once.
            self.workspace = Workspace::new(0)?;
            self.workspace = Workspace::new(bytes)?;
        }
        Ok(())
    }

    /// This call's rounds within the plan, from this rank's routing (all-gathers the route and
    /// row counts: every rank calls it and gets the same schedule). See [`cpu::schedule`].
    pub fn schedule<C: Communicator + ?Sized>(&self, comm: &C, routing: &Routing<'_>) -> Result<Schedule> {
        cpu::schedule(comm, &self.plan, routing)
    }

    /// The host workspace for one `pass` of `schedule` on rank `rank` of a call on device
    /// `on`, reset: checks the device and that the schedule belongs to this plan and, for a
    /// baseline, reserves what its routing needs.
    fn workspace_for(
        &mut self,
        schedule: &Schedule,
        (rank, pass): (usize, Pass),
        on: Device,
    ) -> Result<&Workspace> {
        if self.device != on {
            return Err(Error::WrongDevice { executor: self.device, inputs: on });
        }
        if self.plan.config().scheme == Scheme::PipelinedLlep {
            let planned = self.plan.buffers(pass).workspace_bytes();
            let found = schedule.buffers(rank, pass).workspace_bytes();
            if schedule.pair_cap() != self.plan.pair_cap() || planned != found {
                let what = "buffer bytes of the schedule (made within another plan)";
                return Err(Error::ScheduleMismatch { what, planned, found });
            }
        } else {
            let b: Buffers = schedule.buffers(rank, pass);
            self.reserve(if on == Device::Cpu { b.workspace_bytes() } else { b.host_workspace_bytes() })?;
        }
        self.workspace.reset();
        Ok(&self.workspace)
    }

    /// The layer's forward on this rank: `y_i = Σ_j w_ij·FFN_{e_ij}(x_i)`, N×H, keeping nothing
    /// for backward. Every buffer comes from the reservation. `on` is what the rank runs on
    /// ([`Rank`]: a host communicator, or `cuda::CudaOps` on a GPU), `inputs` its kind of inputs.
    pub fn forward<R: Rank<I> + ?Sized, I>(
        &mut self,
        on: &R,
        schedule: &Schedule,
        inputs: &I,
    ) -> Result<R::Output> {
        let ws = self.workspace_for(schedule, (on.rank_index(), Pass::Forward), on.device())?;
        on.run_forward(ws, schedule, inputs)
    }

    /// The layer's backward on this rank, checkpointed: rounds in reverse, each re-dispatching
    /// x and dY rows and recomputing its expert forward before its backward. Returns dX, the
    /// routing weights' gradient and the native experts' weight gradients (foreign
    /// contributions included), on the rank's device.
    pub fn backward<R: Rank<I> + ?Sized, I>(
        &mut self,
        on: &R,
        schedule: &Schedule,
        inputs: &I,
        dy: &R::Dy,
    ) -> Result<R::Gradients> {
        let ws = self.workspace_for(schedule, (on.rank_index(), Pass::Backward), on.device())?;
        on.run_backward(ws, schedule, inputs, dy)
    }

    /// [`forward`](Executor::forward) in [`Mode::SaveActivations`](crate::Mode::SaveActivations),
    /// keeping its activations in `saved` (reserved with [`SavedActivations::new`] for this
    /// schedule and rank) for [`backward_saved`](Executor::backward_saved); bitwise the same y.
    pub fn forward_saving<C: Communicator + ?Sized, T: LayerElement>(
        &mut self,
        comm: &C,
        schedule: &Schedule,
        inputs: &RankInputs<'_, T>,
        saved: &mut SavedActivations,
    ) -> Result<Vec<f32>> {
        let ws = self.workspace_for(schedule, (comm.rank(), Pass::Forward), Device::Cpu)?;
        cpu::forward(comm, ws, schedule, inputs, Some(saved))
    }

    /// The backward from the activations [`forward_saving`](Executor::forward_saving) kept:
    /// rounds in reverse, each dispatching dY rows only, then every group's backward from its
    /// saved pre-activations. Returns what [`backward`](Executor::backward) returns.
    pub fn backward_saved<C: Communicator + ?Sized, T: LayerElement>(
        &mut self,
        comm: &C,
        schedule: &Schedule,
        inputs: &RankInputs<'_, T>,
        dy: &[T],
        saved: &mut SavedActivations,
    ) -> Result<Gradients> {
        let ws = self.workspace_for(schedule, (comm.rank(), Pass::Backward), Device::Cpu)?;
        cpu::backward(comm, ws, schedule, inputs, dy, Some(saved))
    }
}

#[cfg(feature = "cuda")]
fn cuda_available(ordinal: usize) -> Result<()> {
    Device::Cuda(ordinal).ensure_available()?;
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn cuda_available(ordinal: usize) -> Result<()> {
    Err(Error::Common(flatpeak_common::Error::CudaUnavailable {
        reason: format!("cuda:{ordinal} requested, but llep was built without the `cuda` feature"),
    }))
}

#[cfg(feature = "cuda")]
mod on_cuda {
    use flatpeak_common::nccl::DeviceCommunicator;
    use flatpeak_common::{Device, Workspace};

    use super::Rank;
    use crate::cuda::{CudaBuf, CudaOps};
    use crate::device::{self, DeviceGradients, DeviceInputs, DeviceOps};
    use crate::error::Result;
    use crate::schedule::Schedule;

    /// A rank on a CUDA device: device buffers in the plan's dtype (f32 or bf16, [`CudaBuf`]);
    /// y and the gradients (f32) stay on the device.
    impl<C: DeviceCommunicator> Rank<DeviceInputs<'_, CudaBuf>> for CudaOps<'_, C> {
        type Output = CudaBuf;
        type Dy = CudaBuf;
        type Gradients = DeviceGradients<CudaBuf>;

        fn device(&self) -> Device {
            Device::Cuda(self.stream().context().ordinal())
        }
        fn rank_index(&self) -> usize {
            DeviceOps::rank(self)
        }
        fn run_forward(
            &self,
            ws: &Workspace,
            schedule: &Schedule,
            inputs: &DeviceInputs<'_, CudaBuf>,
        ) -> Result<CudaBuf> {
            device::forward(self, ws, schedule, inputs, None)
        }
        fn run_backward(
            &self,
            ws: &Workspace,
            schedule: &Schedule,
            inputs: &DeviceInputs<'_, CudaBuf>,
            dy: &CudaBuf,
        ) -> Result<DeviceGradients<CudaBuf>> {
            device::backward(self, ws, schedule, inputs, dy, None)
        }
    }
}

#[cfg(test)]
mod tests {
    use flatpeak_common::{Budget, DType};

    use super::*;
    use crate::config::{Config, PairCap, Shape};

    fn plan() -> Plan {
        let shape = Shape {
            ranks: 1,
            tokens: 8,
            hidden: 4,
            intermediate: 2,
            experts: 2,
            top_k: 1,
            dtype: DType::F32,
        };
        Plan::new(&Config::default().pair_cap(PairCap::Rows(4)), shape, Budget::Unlimited).unwrap()
    }

    #[test]
    fn reserves_the_plan_once() {
        let exec = Executor::new(plan(), Device::Cpu).unwrap();
        assert_eq!((exec.device(), exec.workspace_bytes()), (Device::Cpu, plan().workspace_bytes()));
    }

    #[test]
    fn a_cuda_device_that_is_not_there_is_an_error_that_says_why() {
        match Executor::new(plan(), Device::Cuda(1 << 20)) {
            Err(Error::Common(flatpeak_common::Error::CudaUnavailable { reason })) => {
                assert!(!reason.is_empty())
            }
            other => panic!("expected CudaUnavailable, got {other:?}"),
        }
    }
}
