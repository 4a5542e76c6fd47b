//! [`RingLinearCrossEntropy`]: one rank's executor of the vocabulary-parallel rings, chosen by
//! one [`Device`]. It owns its [`RingPlan`] (and with it the config) and the plan's working set,
//! reserved once at construction and reused by every call: a host [`Workspace`] on the CPU, the
//! ring buffers, the logits block and the widening buffers on a CUDA device.
//!
//! One `forward` and one `backward` whatever the device: the first argument, what the rank runs
//! on ([`RingRank`]), names it — a host [`Communicator`] with host [`Inputs`], or (feature
//! `cuda`) an NCCL `DeviceCommunicator` with `cuda::DeviceInputs`. Inputs of the other kind do
//! not type-check; a communicator on another device than the executor's is
//! [`Error::WrongDevice`], never a silent copy.

use flatpeak_common::{Communicator, Device, Workspace};

use crate::error::{Error, Result};
use crate::gradients::{Gradients, GradientsMut};
use crate::inputs::{Forward, GradOutput, Inputs, Upstream};
use crate::plan::RingPlan;

/// What a rank runs the ring on, with the inputs `I` it takes there: a host [`Communicator`]
/// with host [`Inputs`], or (feature `cuda`) an NCCL `DeviceCommunicator` with
/// `cuda::DeviceInputs`. `Gradients` is what backward returns there (host vectors, or device
/// buffers that stay on the device).
pub trait RingRank<I: ?Sized> {
    /// The gradients backward returns on this device.
    type Gradients;
    /// The device the rank's data lives on.
    fn device(&self) -> Device;
    /// The forward pass on `ring`'s reservation. Called by [`RingLinearCrossEntropy::forward`].
    #[doc(hidden)]
    fn forward_on(&self, ring: &mut RingLinearCrossEntropy, inputs: &I) -> Result<Forward>;
    /// The backward pass. Called by [`RingLinearCrossEntropy::backward`].
    #[doc(hidden)]
    fn backward_on(
        &self,
        ring: &mut RingLinearCrossEntropy,
        inputs: &I,
        lse: &[f32],
        upstream: Upstream<'_>,
    ) -> Result<Self::Gradients>;
}

/// Where a ring executor runs, with what it reserved there.
#[derive(Debug)]
enum Backend {
    Host(Workspace),
    #[cfg(feature = "cuda")]
    Cuda(Box<crate::cuda::ring::CudaRing>),
}

/// One rank's Ring-DTP executor within its [`RingPlan`] (see the module docs): the loss and
/// gradients of the whole N×V problem over the plan's P ranks, this rank holding ⌈N/P⌉ tokens and
/// a vocabulary shard of ⌈V/P⌉ rows of W ([`RingPlan::tokens`], [`RingPlan::shard`]). Each call
/// takes what the rank runs on; every rank of the ring calls the same operation with the same plan.
///
/// ```
/// use flatpeak_common::{Communicator, LocalGroup, LocalGroupOptions, SplitMix64};
/// use ring_dtp::{Budget, Config, DType, Device, GradOutput, Inputs, Loss, Matrix, RingLinearCrossEntropy, RingOptions, RingPlan, Shape};
///
/// let (n, d, v, p) = (96, 16, 500, 3);
/// let mut rng = SplitMix64::new(2);
/// let (x, w) = (rng.normal_f32(n * d, 0.0, 1.0), rng.normal_f32(v * d, 0.0, 0.2));
/// let targets: Vec<i64> = (0..n as i64).map(|i| i * 13 % v as i64).collect();
/// let shape = Shape { tokens: n, hidden: d, vocab: v, dtype: DType::F32 };
/// let plan = RingPlan::new(&Config::default(), shape, Budget::mib(1), RingOptions::default().ranks(p))?;
/// // Three ranks as threads; each sees only its tokens and its vocabulary shard.
/// let results = LocalGroup::run(p, LocalGroupOptions::default(), |comm| {
///     let (t, s) = (plan.tokens(comm.rank()), plan.shard(comm.rank()));
///     let x = Matrix::F32(&x[t.start * d..t.end * d]);
///     let inputs = Inputs::new(x, Matrix::F32(&w[s.start * d..s.end * d]), &targets[t], d);
///     let run = || {
///         let mut ring = RingLinearCrossEntropy::new(plan, Device::Cpu)?; // reserves its working set once
///         ring.forward_backward(comm, &inputs, GradOutput::Scalar(1.0))
///     };
///     Ok(run())
/// });
/// for r in results {
///     let (fwd, grads) = r??;
///     assert!(matches!(fwd.loss, Loss::Scalar(l) if l > 0.0));
///     assert_eq!(grads.dx.len(), 32 * d); // this rank's tokens
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug)]
pub struct RingLinearCrossEntropy {
    plan: RingPlan,
    device: Device,
    backend: Backend,
}

impl RingLinearCrossEntropy {
    /// Reserves `plan`'s working set on `device`. A CUDA device without the `cuda` feature, the
    /// driver or the device is `Common(CudaUnavailable)`, saying why; a precision the device does
    /// not run for the plan's dtype is [`Error::UnsupportedPrecision`].
    pub fn new(plan: RingPlan, device: Device) -> Result<Self> {
        let backend = match device {
            Device::Cpu => {
                plan.config().check_host_precision(plan.dtype(), "the host ring")?;
                Backend::Host(Workspace::new(plan.workspace_bytes())?)
            }
            Device::Cuda(ordinal) => {
                device.ensure_available()?;
                cuda_backend(plan, ordinal)?
            }
        };
        Ok(Self { plan, device, backend })
    }

    /// The plan.
    pub fn plan(&self) -> &RingPlan {
        &self.plan
    }

    /// The device it runs on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Bytes of the working set it reserved ([`RingPlan::workspace_bytes`]).
    pub fn workspace_bytes(&self) -> usize {
        self.plan.workspace_bytes()
    }

    /// [`Error::WrongDevice`] unless a rank on `on` runs here.
    fn check_device(&self, on: Device) -> Result<()> {
        if on == self.device { Ok(()) } else { Err(Error::WrongDevice { executor: self.device, inputs: on }) }
    }

    /// The host workspace (the device was checked).
    fn host(&mut self) -> Result<&mut Workspace> {
        match &mut self.backend {
            Backend::Host(ws) => Ok(ws),
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => Err(Error::internal("a host rank reached a CUDA ring past the device check")),
        }
    }

    /// The loss (over every rank's tokens: the same scalar on every rank, or this rank's
    /// per-token losses) and this rank's tokens' lse. The inputs are checked on every rank and the
    /// verdicts agreed on before the first message, so bad input on one rank is an error on all
    /// of them.
    pub fn forward<R: RingRank<I> + ?Sized, I: ?Sized>(&mut self, on: &R, inputs: &I) -> Result<Forward> {
        self.check_device(on.device())?;
        on.forward_on(self, inputs)
    }

    /// This rank's dX (its tokens), dW and dbias (its shard), from forward's per-row lse, for the
    /// upstream gradients of the loss (a [`GradOutput`] converts) and, optionally, of the lse.
    pub fn backward<R: RingRank<I> + ?Sized, I: ?Sized>(
        &mut self,
        on: &R,
        inputs: &I,
        forward: &Forward,
        upstream: Upstream<'_>,
    ) -> Result<R::Gradients> {
        self.check_device(on.device())?;
        on.backward_on(self, inputs, &forward.lse, upstream)
    }

    /// [`forward`](Self::forward), then [`backward`](Self::backward) with `grad` (4 GEMMs: the
    /// loss over the whole vocabulary is known only after a full turn of the ring).
    pub fn forward_backward<R: RingRank<I> + ?Sized, I: ?Sized>(
        &mut self,
        on: &R,
        inputs: &I,
        grad: GradOutput<'_>,
    ) -> Result<(Forward, R::Gradients)> {
        let forward = self.forward(on, inputs)?;
        let grads = self.backward(on, inputs, &forward, grad.into())?;
        Ok((forward, grads))
    }

    /// [`backward`](Self::backward) on the host into caller-owned fp32 buffers (overwritten): dX
    /// of this rank's tokens (n_r×D), dW and dbias of its shard (v_r×D, v_r), from forward's
    /// `lse` (n_r). The lengths are checked with the inputs, on every rank, before the first
    /// message. The rings compute every gradient: a selection that skips one
    /// ([`GradientsMut::wanted`]) is [`Error::UnsupportedSelection`] (on every rank).
    pub fn backward_into<C: Communicator + ?Sized>(
        &mut self,
        comm: &C,
        inputs: &Inputs<'_>,
        lse: &[f32],
        upstream: Upstream<'_>,
        out: GradientsMut<'_>,
    ) -> Result<()> {
        self.check_device(Device::Cpu)?;
        let plan = self.plan;
        super::backward_into(comm, (&plan, self.host()?), inputs, (lse, upstream), out)
    }
}

#[cfg(feature = "cuda")]
fn cuda_backend(plan: RingPlan, ordinal: usize) -> Result<Backend> {
    Ok(Backend::Cuda(Box::new(crate::cuda::ring::CudaRing::new(plan, ordinal)?)))
}

#[cfg(not(feature = "cuda"))]
fn cuda_backend(_plan: RingPlan, ordinal: usize) -> Result<Backend> {
    // `ensure_available` already failed without the feature; this keeps the reason explicit.
    Err(Error::Common(flatpeak_common::Error::CudaUnavailable {
        reason: format!("cuda:{ordinal} requested, but ring-dtp was built without the `cuda` feature"),
    }))
}

/// A rank on the host: a [`Communicator`] with host [`Inputs`] (its tokens, its shard).
impl<C: Communicator + ?Sized> RingRank<Inputs<'_>> for C {
    type Gradients = Gradients;

    fn device(&self) -> Device {
        Device::Cpu
    }
    fn forward_on(&self, ring: &mut RingLinearCrossEntropy, inputs: &Inputs<'_>) -> Result<Forward> {
        let plan = ring.plan;
        super::forward(self, (&plan, ring.host()?), inputs)
    }
    fn backward_on(
        &self,
        ring: &mut RingLinearCrossEntropy,
        inputs: &Inputs<'_>,
        lse: &[f32],
        upstream: Upstream<'_>,
    ) -> Result<Gradients> {
        let (n, d) = (inputs.n, inputs.d);
        let v_r = inputs.v;
        let mut grads = Gradients {
            dx: vec![0.0; n.saturating_mul(d)],
            dw: vec![0.0; v_r.saturating_mul(d)],
            dbias: inputs.bias.map(|_| vec![0.0; v_r]),
        };
        let out = GradientsMut::new(&mut grads.dx, &mut grads.dw, grads.dbias.as_deref_mut());
        ring.backward_into(self, inputs, lse, upstream, out)?;
        Ok(grads)
    }
}

#[cfg(feature = "cuda")]
mod on_cuda {
    use flatpeak_common::Device;
    use flatpeak_common::nccl::DeviceCommunicator;

    use super::{Backend, RingLinearCrossEntropy, RingRank};
    use crate::cuda::{DeviceGradients, DeviceInputs};
    use crate::error::{Error, Result};
    use crate::inputs::{Forward, Upstream};

    impl RingLinearCrossEntropy {
        /// The CUDA ring (the device was checked).
        fn cuda(&mut self) -> Result<&mut crate::cuda::ring::CudaRing> {
            match &mut self.backend {
                Backend::Cuda(ring) => Ok(ring),
                Backend::Host(_) => {
                    Err(Error::internal("a CUDA rank reached a host ring past the device check"))
                }
            }
        }

        /// Waits for every operation issued so far on a CUDA ring, on its compute stream and
        /// `comm`'s (cudarc aborts an NCCL communicator when it drops: synchronize before
        /// dropping it, since a backward returns with its last hops possibly still queued).
        pub fn synchronize<C: DeviceCommunicator>(&mut self, comm: &C) -> Result<()> {
            self.cuda()?.synchronize(comm)
        }
    }

    /// A rank on a CUDA device: an NCCL communicator with device inputs; the gradients stay on
    /// the device.
    impl<C: DeviceCommunicator> RingRank<DeviceInputs<'_>> for C {
        type Gradients = DeviceGradients;

        fn device(&self) -> Device {
            Device::Cuda(self.stream().context().ordinal())
        }
        fn forward_on(
            &self,
            ring: &mut RingLinearCrossEntropy,
            inputs: &DeviceInputs<'_>,
        ) -> Result<Forward> {
            ring.cuda()?.forward(self, inputs)
        }
        fn backward_on(
            &self,
            ring: &mut RingLinearCrossEntropy,
            inputs: &DeviceInputs<'_>,
            lse: &[f32],
            upstream: Upstream<'_>,
        ) -> Result<DeviceGradients> {
            ring.cuda()?.backward(self, inputs, lse, upstream)
        }
    }
}
