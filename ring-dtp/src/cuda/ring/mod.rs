//! Ring-DTP over P CUDA devices through a [`DeviceCommunicator`] (NCCL): the schedules of
//! [`crate::ring`] with device buffers. Every buffer is reserved at [`CudaRing::new`] at the ring
//! plan's size, so the device working set is fixed at launch: two ring buffers, the logits block
//! and the widening buffers, plus per-token state of the rank's own tokens.
//!
//! # Streams: the exchange overlaps the step's GEMMs
//!
//! NCCL runs on the communicator's stream; the GEMMs and kernels run on a second, compute stream
//! of the same context. A ring step issues two grouped NCCL send (to the next rank) + receive
//! (from the previous one) pairs into the second buffer:
//!
//! - **early**, before the step's GEMMs: what the step only reads — the W rows and bias (weight
//!   ring), the X rows, targets and backward row data (activation ring). It runs while the GEMMs
//!   do;
//! - **late**, after them: what the step writes — the travelling dW/dbias or the fold state and
//!   dX. The next step's first logits GEMM (and, in backward, its gradient kernel) does not
//!   touch these, so the late exchange overlaps it; the first kernel that folds or accumulates
//!   into them (the fold; the dW or dX GEMM) waits for it.
//!
//! The accumulators' last hop goes home straight into the outputs. Cross-stream order comes from
//! cudarc's per-buffer read/write events (every buffer here is a `CudaSlice` of the
//! communicator's context, and [`CudaRing::new`] puts that context in multi-stream mode): a
//! receive waits for the last reader of its buffer (the previous step's GEMMs), a GEMM waits for
//! the receive that wrote its operand. Every call starts with the compute stream waiting for the
//! communicator's stream (the caller's inputs) and ends with each waiting for the other, so the
//! caller orders everything on the communicator's stream, as with one stream.
//!
//! A ring's first step of each block writes its own data into the current buffer on the compute
//! stream. That is safe because the buffer in hand at a block's last step is never sent early
//! (there is no next step), and its last NCCL use was the receive the compute stream already
//! waited for, or the home send its write waits for: keep both true when changing the order.
//!
//! [`CudaRing::backward`] returns with the last hops possibly still queued on the
//! communicator's stream; cudarc aborts an NCCL communicator when it drops, so synchronize
//! ([`CudaRing::synchronize`], or a download on that stream) before dropping the ring.

use flatpeak_common::cuda::cuda_error;
use flatpeak_common::cuda::cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
use flatpeak_common::nccl::DeviceCommunicator;
use flatpeak_common::{DType, ReduceOp};
use half::bf16;

use super::engine::Engine;
use super::{DeviceGradients, DeviceInputs, DeviceMatrix, DeviceStats, HostRows};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::inputs::Forward;
use crate::loss;
use crate::plan::{RegionKind, RegionSource, RingKind, RingPlan, Slot};
use crate::ring::run_ring;

/// Rows in their input dtype.
#[derive(Debug)]
enum Raw {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<bf16>),
}

impl Raw {
    fn new(e: &Engine, dtype: DType, len: usize) -> Result<Self> {
        Ok(match dtype {
            DType::F32 => Raw::F32(e.zeros(len)?),
            _ => Raw::Bf16(e.zeros(len)?),
        })
    }
    /// `self[..len] = m[range]`.
    fn load(&mut self, e: &Engine, m: &DeviceMatrix<'_>, range: std::ops::Range<usize>) -> Result<()> {
        let len = range.len();
        match (self, m) {
            (Raw::F32(dst), DeviceMatrix::F32(src)) => e
                .stream
                .memcpy_dtod(&src.slice(range), &mut dst.slice_mut(..len))
                .map_err(cuda_error("cuMemcpyDtoD"))
                .map_err(Error::from),
            (Raw::Bf16(dst), DeviceMatrix::Bf16(src)) => e
                .stream
                .memcpy_dtod(&src.slice(range), &mut dst.slice_mut(..len))
                .map_err(cuda_error("cuMemcpyDtoD"))
                .map_err(Error::from),
            _ => Err(Error::DtypeMismatch { x: m.dtype(), w: m.dtype() }),
        }
    }
    /// The first `len` elements as f32: a view, or widened into `buf`.
    fn f32<'r, 's: 'r, 'b: 'r>(
        &'s self,
        e: &Engine,
        len: usize,
        buf: &'b mut CudaSlice<f32>,
    ) -> Result<CudaView<'r, f32>> {
        match self {
            Raw::F32(s) => Ok(s.slice(..len)),
            Raw::Bf16(s) => {
                e.widen(&s.slice(..len), buf)?;
                Ok(buf.slice(..len))
            }
        }
    }
}

/// Sends `send[..n_send]` to `to` and receives `recv[..n_recv]` from `from`, one NCCL group.
fn exchange_raw<C: DeviceCommunicator>(
    comm: &C,
    (send, n_send): (&Raw, usize),
    (recv, n_recv): (&mut Raw, usize),
) -> Result<()> {
    let (to, from) =
        ((comm.rank() + 1) % comm.world_size(), (comm.rank() + comm.world_size() - 1) % comm.world_size());
    match (send, recv) {
        (Raw::F32(s), Raw::F32(r)) => {
            comm.exchange(&[s.slice(..n_send)], to, &mut [r.slice_mut(..n_recv)], from)?
        }
        (Raw::Bf16(s), Raw::Bf16(r)) => {
            comm.exchange(&[s.slice(..n_send)], to, &mut [r.slice_mut(..n_recv)], from)?
        }
        _ => return Err(Error::invalid_config("ring buffers", "of another ring", "one dtype")),
    }
    Ok(())
}

fn ring_peers<C: DeviceCommunicator>(comm: &C) -> (usize, usize) {
    let p = comm.world_size();
    ((comm.rank() + 1) % p, (comm.rank() + p - 1) % p)
}

/// The CUDA ring's regions: buffers on its device.
struct OnDevice;

impl RegionKind for OnDevice {
    type Raw = Raw;
    type F32 = CudaSlice<f32>;
    type F64 = CudaSlice<f64>;
    type U32 = CudaSlice<u32>;
}

/// Allocates regions on the engine's device (zeroed, on its stream).
struct Allocate<'e>(&'e Engine);

impl RegionSource<OnDevice> for Allocate<'_> {
    fn raw(&mut self, dtype: DType, elems: usize) -> Result<Raw> {
        Raw::new(self.0, dtype, elems)
    }
    fn f32(&mut self, len: usize) -> Result<CudaSlice<f32>> {
        self.0.zeros(len)
    }
    fn f64(&mut self, len: usize) -> Result<CudaSlice<f64>> {
        self.0.zeros(len)
    }
    fn u32(&mut self, len: usize) -> Result<CudaSlice<u32>> {
        self.0.zeros(len)
    }
}

/// A weight-ring buffer: a W sub-block, its bias, and the travelling dW and dbias.
type WeightSlot = Slot<OnDevice>;

/// An activation-ring packet: X rows, targets, the fold state, the backward row data and dX.
type Packet = crate::plan::Packet<OnDevice>;

enum Buffers {
    Weight(Box<[WeightSlot; 2]>),
    Activation(Box<[Packet; 2]>),
}

impl std::fmt::Debug for Buffers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Buffers::Weight(_) => "Buffers::Weight([Slot; 2])",
            Buffers::Activation(_) => "Buffers::Activation([Packet; 2])",
        })
    }
}

/// Ring-DTP on this rank's device, with the ring plan's buffers reserved at launch; each call
/// takes the rank's NCCL communicator (on the same device).
#[derive(Debug)]
pub(crate) struct CudaRing {
    config: Config,
    plan: RingPlan,
    ordinal: usize,
    engine: Engine,
    logits: CudaSlice<f32>,
    x_wide: CudaSlice<f32>,
    w_wide: CudaSlice<f32>,
    buffers: Buffers,
}

/// What one ring pass computes.
enum Pass<'a> {
    Fold(&'a mut DeviceStats),
    Grad {
        coef: &'a CudaSlice<f32>,
        lse: &'a CudaSlice<f32>,
        dlse: Option<&'a CudaSlice<f32>>,
        grads: &'a mut DeviceGradients,
    },
}

impl CudaRing {
    /// Reserves the plan's buffers on CUDA device `ordinal`, with a compute stream of its own, so
    /// NCCL's stream is free to move the ring buffers meanwhile (`new_stream` synchronizes the
    /// context once, when it enters multi-stream mode, so earlier work on the caller's streams is
    /// complete and ordered).
    pub fn new(plan: RingPlan, ordinal: usize) -> Result<Self> {
        let config = *plan.config();
        config.check_cuda_precision(plan.dtype())?;
        let ctx = flatpeak_common::cuda::context(ordinal)?;
        let compute = ctx.new_stream().map_err(cuda_error("cuStreamCreate"))?;
        let engine = Engine::new(compute, config.precision)?;
        let (c, vb, d, dt) = (plan.token_block(), plan.vocab_block(), plan.hidden(), plan.dtype());
        let wide = dt != DType::F32;
        let e = &engine;
        let buffers = match plan.kind() {
            RingKind::Weight => {
                let slot = || plan.slot(&mut Allocate(e));
                Buffers::Weight(Box::new([slot()?, slot()?]))
            }
            RingKind::Activation => {
                let packet = || plan.packet(&mut Allocate(e));
                Buffers::Activation(Box::new([packet()?, packet()?]))
            }
        };
        Ok(Self {
            logits: e.zeros(c * vb)?,
            x_wide: e.zeros(if wide { c * d } else { 0 })?,
            w_wide: e.zeros(if wide { vb * d } else { 0 })?,
            engine,
            config,
            plan,
            ordinal,
            buffers,
        })
    }

    /// Waits for every operation issued so far, on the compute stream and `comm`'s.
    pub fn synchronize<C: DeviceCommunicator>(&self, comm: &C) -> Result<()> {
        self.engine.stream.synchronize().map_err(cuda_error("cuStreamSynchronize"))?;
        comm.stream().synchronize().map_err(cuda_error("cuStreamSynchronize")).map_err(Error::from)
    }

    /// `comm` on this ring's device, of the plan's world; `inputs` the rank's share.
    fn check<C: DeviceCommunicator>(&self, comm: &C, inputs: &DeviceInputs<'_>) -> Result<(usize, usize)> {
        let on = comm.stream().context().ordinal();
        if on != self.ordinal {
            let (executor, inputs) =
                (flatpeak_common::Device::Cuda(self.ordinal), flatpeak_common::Device::Cuda(on));
            return Err(Error::WrongDevice { executor, inputs });
        }
        let rank = comm.rank();
        let (n, v, d) = (self.plan.tokens(rank).len(), self.plan.shard(rank).len(), self.plan.hidden());
        for (what, expected, found) in [
            ("world size", self.plan.world(), comm.world_size()),
            ("hidden size (d)", d, inputs.d),
            ("x (n_r·d)", n * d, inputs.x.len()),
            ("w shard (v_r·d)", v * d, inputs.w.len()),
            ("targets (n_r)", n, inputs.targets.len()),
        ] {
            if expected != found {
                return Err(Error::ShapeMismatch { what, expected, got: found });
            }
        }
        if let Some(b) = inputs.bias.filter(|b| b.len() != v) {
            return Err(Error::ShapeMismatch { what: "bias shard (v_r)", expected: v, got: b.len() });
        }
        if let Some(w) = inputs.weights.filter(|w| w.len() != n) {
            return Err(Error::ShapeMismatch { what: "weights (n_r)", expected: n, got: w.len() });
        }
        if inputs.x.dtype() != self.plan.dtype() || inputs.w.dtype() != self.plan.dtype() {
            return Err(Error::DtypeMismatch { x: inputs.x.dtype(), w: inputs.w.dtype() });
        }
        Ok((n, v))
    }

    /// Σ over ranks of `values` (f64, on the devices), identical on every rank.
    fn all_sum<C: DeviceCommunicator, const K: usize>(&self, comm: &C, values: [f64; K]) -> Result<[f64; K]> {
        let mut buf = self.engine.upload(&values)?;
        comm.all_reduce(&mut buf, ReduceOp::Sum)?;
        let host = self.engine.download(&buf.slice(..K))?;
        let mut out = [0f64; K];
        out.copy_from_slice(&host);
        Ok(out)
    }

    /// The loss over all ranks' tokens (or this rank's per-token losses) and this rank's lse.
    pub fn forward<C: DeviceCommunicator>(&mut self, comm: &C, inputs: &DeviceInputs<'_>) -> Result<Forward> {
        let (n, _) = self.check(comm, inputs)?;
        self.after_caller(comm)?;
        let (d, v) = (self.plan.hidden(), self.plan.vocab());
        let mut resolved = self.engine.zeros::<u32>(n)?;
        let host = HostRows::resolve(
            &self.engine,
            &self.config,
            (inputs.targets, inputs.weights),
            (n, v),
            &mut resolved,
        )?;
        let mut stats = DeviceStats::new(&self.engine, n)?;
        self.run(comm, inputs, &resolved, Pass::Fold(&mut stats))?;
        let stats = stats.download(&self.engine, n)?;
        let shadow = host.inputs((n, d, v));
        let (per_token, lse) = loss::per_token_losses(&self.config, &shadow, v, &stats);
        let local: f64 = per_token.iter().map(|&x| x as f64).sum();
        let [total, denom] = self.all_sum(comm, [local, shadow.valid_weight(&self.config)])?;
        Ok(Forward { loss: loss::reduce_loss(&self.config, per_token, total, denom), lse })
    }

    /// This rank's dX (its tokens), dW and dbias (its shard) from forward's `lse`, for the
    /// upstream gradients of the loss and, optionally, of the lse output.
    pub fn backward<C: DeviceCommunicator>(
        &mut self,
        comm: &C,
        inputs: &DeviceInputs<'_>,
        lse: &[f32],
        upstream: crate::inputs::Upstream<'_>,
    ) -> Result<DeviceGradients> {
        let crate::inputs::Upstream { grad, dlse } = upstream;
        let (n, v_r) = self.check(comm, inputs)?;
        self.after_caller(comm)?;
        let (d, v) = (self.plan.hidden(), self.plan.vocab());
        if lse.len() != n {
            return Err(Error::ShapeMismatch { what: "lse (n_r)", expected: n, got: lse.len() });
        }
        if let Some(g) = dlse.filter(|g| g.len() != n) {
            return Err(Error::ShapeMismatch { what: "dlse (n_r)", expected: n, got: g.len() });
        }
        let e = &self.engine;
        let mut resolved = e.zeros::<u32>(n)?;
        let host =
            HostRows::resolve(e, &self.config, (inputs.targets, inputs.weights), (n, v), &mut resolved)?;
        let shadow = host.inputs((n, d, v));
        let [denom] = self.all_sum(comm, [shadow.valid_weight(&self.config)])?;
        let e = &self.engine;
        let coef = e.upload(&loss::coefficients(&self.config, &shadow, grad, denom)?)?;
        let lse = e.upload(lse)?;
        let dlse = dlse.map(|g| e.upload(g)).transpose()?;
        let mut grads = DeviceGradients {
            dx: e.zeros(n * d)?,
            dw: e.zeros(v_r * d)?,
            dbias: inputs.bias.map(|_| e.zeros(v_r)).transpose()?,
        };
        let pass = Pass::Grad { coef: &coef, lse: &lse, dlse: dlse.as_ref(), grads: &mut grads };
        self.run(comm, inputs, &resolved, pass)?;
        Ok(grads)
    }

    fn run<C: DeviceCommunicator>(
        &mut self,
        comm: &C,
        inputs: &DeviceInputs<'_>,
        resolved: &CudaSlice<u32>,
        pass: Pass<'_>,
    ) -> Result<()> {
        let Self { config, plan, engine: e, logits, x_wide, w_wide, buffers, .. } = self;
        let (rank, backward) = (comm.rank(), matches!(pass, Pass::Grad { .. }));
        // One backend per ring, the same call context; only the buffer pair differs.
        macro_rules! drive {
            ($pair:expr) => {{
                let [cur, inc] = &mut **$pair;
                let mut ops = RingBackend {
                    config,
                    plan,
                    comm,
                    e,
                    logits,
                    x_wide,
                    w_wide,
                    cur,
                    inc,
                    inputs,
                    resolved,
                    pass,
                };
                run_ring(&mut ops, plan, rank, backward)
            }};
        }
        let ran = match buffers {
            Buffers::Weight(slots) => drive!(slots),
            Buffers::Activation(packets) => drive!(packets),
        };
        // The last hops land on the communicator's stream: compute (the downloads that follow)
        // waits for them, and the caller's stream for the compute stream's outputs.
        self.engine.stream.join(comm.stream()).map_err(cuda_error("cuStreamWaitEvent"))?;
        comm.stream().join(&self.engine.stream).map_err(cuda_error("cuStreamWaitEvent"))?;
        ran
    }

    /// The compute stream waits for the work the caller ordered on the communicator's stream
    /// (uploads of the inputs).
    fn after_caller<C: DeviceCommunicator>(&self, comm: &C) -> Result<()> {
        self.engine.stream.join(comm.stream()).map_err(cuda_error("cuStreamWaitEvent")).map_err(Error::from)
    }
}

fn dtod<T: flatpeak_common::cuda::cudarc::driver::DeviceRepr>(
    e: &Engine,
    src: &CudaView<'_, T>,
    dst: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    e.stream.memcpy_dtod(src, dst).map_err(cuda_error("cuMemcpyDtoD")).map_err(Error::from)
}

fn zero<
    T: flatpeak_common::cuda::cudarc::driver::DeviceRepr
        + flatpeak_common::cuda::cudarc::driver::ValidAsZeroBits,
>(
    e: &Engine,
    dst: &mut CudaViewMut<'_, T>,
) -> Result<()> {
    e.stream.memset_zeros(dst).map_err(cuda_error("cuMemsetD8")).map_err(Error::from)
}

mod activation;
mod padded;
mod weight;

/// A ring's CUDA backend ([`RingOps`](crate::ring::RingOps)): the call's context and the two
/// buffers `B` of its ring — [`WeightSlot`]s (`weight.rs`) or [`Packet`]s (`activation.rs`).
struct RingBackend<'a, C: DeviceCommunicator, B> {
    config: &'a Config,
    plan: &'a RingPlan,
    comm: &'a C,
    e: &'a Engine,
    logits: &'a mut CudaSlice<f32>,
    x_wide: &'a mut CudaSlice<f32>,
    w_wide: &'a mut CudaSlice<f32>,
    cur: &'a mut B,
    inc: &'a mut B,
    inputs: &'a DeviceInputs<'a>,
    resolved: &'a CudaSlice<u32>,
    pass: Pass<'a>,
}
