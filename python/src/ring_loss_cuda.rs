//! `linear_cross_entropy(..., group=, ring=)` on CUDA tensors (feature `cuda`): the crate's ring
//! over an NCCL communicator of the group's ranks ([`crate::cuda_group`]), on torch's current
//! stream. The agreement on every rank's share, the check of the targets and weights against the
//! whole vocabulary (agreed over the group before the first NCCL call: NCCL has no timeout to end
//! a wait on a rank that refused) and the padding of a rank with fewer tokens are the crate's
//! ([`AgreedRing::forward_device`]); the forward's loss and lse come back on the host, the
//! gradients stay on the device.

use std::sync::Arc;

use flatpeak_common::Communicator;
use flatpeak_common::comm::Refusal;
use flatpeak_common::cuda::cuda_error;
use flatpeak_common::cuda::cudarc::driver::{CudaSlice, CudaStream};
use flatpeak_common::nccl::NcclComm;
use pyo3::prelude::*;
use ring_dtp::ring::{AgreedRing, RankShare, RingCall};
use ring_dtp::{Device, RingLinearCrossEntropy, Shape, Upstream};

use crate::cache::{self, Executor, Key};
use crate::cuda_group::with_nccl;
use crate::cuda_tensor::{DeviceLend, LentMut};
use crate::error::{refusal, to_py};
use crate::loss_args::{
    ForwardOuts, GradArgs, LossArgs, LossOptions, UpstreamArgs, grad_output, loss_shape, required,
    ring_choice, ring_part, write_forward,
};
use crate::loss_device::DeviceLossIns;
use crate::tensor::{Lend, Register};
use crate::torch_group::{Comm, communicator, detached, group_handle};

/// A ring call on CUDA tensors as its entry receives it.
pub(crate) struct RingEntry<'a, 'py> {
    /// The loss's options.
    pub(crate) options: &'a LossOptions,
    /// The `torch.distributed` group.
    pub(crate) group: &'a Bound<'py, PyAny>,
    /// The ring named (`None`: the plan's choice).
    pub(crate) ring: Option<&'a str>,
    /// The call's tensors.
    pub(crate) args: &'a LossArgs<'py>,
    /// Their device.
    pub(crate) ordinal: usize,
}

/// Where a ring call runs: the group's handle, the device and torch's current stream there.
struct Site<'a> {
    group: usize,
    ordinal: usize,
    torch: &'a Arc<CudaStream>,
}

/// Agrees on the call over the host communicator, then runs `f` on the kept ring of its plan
/// over the group's NCCL communicator (both ready on every rank), with the GIL released.
fn on_ring<R: Send>(
    py: Python<'_>,
    comm: &mut Comm,
    call: &RingCall,
    site: &Site<'_>,
    local: Result<RankShare, Refusal>,
    f: impl FnOnce(&AgreedRing, &mut RingLinearCrossEntropy, &dyn Communicator, &NcclComm) -> PyResult<R> + Send,
) -> PyResult<R> {
    let Site { group, ordinal, torch } = *site;
    detached(py, comm, |host| -> PyResult<R> {
        let agreed = ring_dtp::ring::agree(host, call, local).map_err(to_py)?;
        let (plan, device) = (*agreed.plan(), Device::Cuda(ordinal));
        with_nccl(host, group, ordinal, torch, |nccl| {
            let key = Key::Ring { group, device, plan };
            let made = cache::entry(key, plan.workspace_bytes(), || {
                RingLinearCrossEntropy::new(plan, device).map(Executor::Ring)
            });
            let entry = agreed.ready(host, made).map_err(to_py)?;
            let mut executor = entry.lock();
            match &mut *executor {
                Executor::Ring(ring) => f(&agreed, ring, host, nccl),
                _ => Err(to_py(ring_dtp::Error::internal("a ring entry holds a ring executor"))),
            }
        })
    })?
}

/// Forward on CUDA tensors over `group`: the loss and this rank's lse into the host tensors
/// `outputs`.
pub(crate) fn forward(py: Python<'_>, call: RingEntry<'_, '_>, outputs: &ForwardOuts<'_>) -> PyResult<()> {
    let RingEntry { options, group, ring, args, ordinal } = call;
    let mut comm = communicator(py, Some(group.clone()))?;
    let (mut lend, mut host) = (DeviceLend::new(py, ordinal)?, Lend::new());
    let torch = lend.stream().clone();
    let site = Site { group: group_handle(group), ordinal, torch: &torch };
    let mine = (|| -> PyResult<_> {
        let choice = ring_choice(ring)?;
        let ins = DeviceLossIns::new(&mut lend, args)?;
        let n = ins.shape.tokens;
        let loss_out = host.output::<f32>("loss_out", &outputs.loss, &loss_shape(options, n))?;
        let lse_out = host.output::<f32>("lse_out", &outputs.lse, &[Some(n)])?;
        Ok((choice, ins, (loss_out, lse_out), (lend.lent()?, host.lent()?)))
    })();
    let mine = mine.map_err(|e| refusal(py, e));
    let (call, local) =
        ring_part(options, Device::Cuda(ordinal), mine.as_ref().map(|(choice, ins, ..)| (*choice, ins)));
    let Ok((_, ins, (loss_out, lse_out), (lent, host))) = mine else {
        return on_ring(py, &mut comm, &call, &site, local, |_, _, _, _| Ok(()));
    };
    let slices = ins.slices(&lent)?;
    let inputs = slices.inputs();
    let forward = on_ring(py, &mut comm, &call, &site, local, |agreed, ring, host, nccl| {
        agreed.forward_device(ring, host, nccl, &inputs).map_err(to_py)
    })?;
    write_forward(forward, host.get_mut(loss_out)?, host.get_mut(lse_out)?);
    Ok(())
}

/// Backward on CUDA tensors over `group` from forward's host `lse` and the host upstream
/// gradients: dX (`[n_r, D]`), dW (`[v_r, D]`) and dbias into the fp32 device tensors
/// `grads_out`.
pub(crate) fn backward(
    py: Python<'_>,
    call: RingEntry<'_, '_>,
    lse: &Bound<'_, PyAny>,
    upstream: &UpstreamArgs<'_>,
    grads_out: &GradArgs<'_>,
) -> PyResult<()> {
    let RingEntry { options, group, ring, args, ordinal } = call;
    let mut comm = communicator(py, Some(group.clone()))?;
    let (mut lend, mut host) = (DeviceLend::new(py, ordinal)?, Lend::new());
    let torch = lend.stream().clone();
    let site = Site { group: group_handle(group), ordinal, torch: &torch };
    let mine = (|| -> PyResult<_> {
        let choice = ring_choice(ring)?;
        let ins = DeviceLossIns::new(&mut lend, args)?;
        let Shape { tokens: n, hidden: d, vocab: v, .. } = ins.shape;
        let lse = host.input::<f32>("lse", lse, &[Some(n)])?;
        let grad = host.input::<f32>("grad_output", &upstream.grad, &loss_shape(options, n))?;
        let dlse = host.input_opt::<f32>("grad_lse", upstream.grad_lse.as_ref(), &[Some(n)])?;
        let dx = lend.output::<f32>("dx", required("dx", &grads_out.dx)?, &[Some(n), Some(d)])?;
        let dw = lend.output::<f32>("dw", required("dw", &grads_out.dw)?, &[Some(v), Some(d)])?;
        let dbias = lend.output_opt::<f32>("dbias", grads_out.dbias.as_ref(), &[Some(v)])?;
        Ok((choice, ins, (lse, grad, dlse), (dx, dw, dbias), (lend.lent()?, host.lent()?)))
    })();
    let mine = mine.map_err(|e| refusal(py, e));
    let (call, local) =
        ring_part(options, Device::Cuda(ordinal), mine.as_ref().map(|(choice, ins, ..)| (*choice, ins)));
    let Ok((_, ins, (lse, grad, dlse), (dx, dw, dbias), (lent, host))) = mine else {
        return on_ring(py, &mut comm, &call, &site, local, |_, _, _, _| Ok(()));
    };
    let (lse, grad, dlse) = (host.get(lse)?, host.get(grad)?, host.get_opt(dlse)?);
    let upstream = Upstream::loss(grad_output(options, grad)).with_dlse(dlse);
    let slices = ins.slices(&lent)?;
    let inputs = slices.inputs();
    let (mut dx, mut dw, mut dbias) = (lent.get_mut(dx)?, lent.get_mut(dw)?, lent.get_mut_opt(dbias)?);
    on_ring(py, &mut comm, &call, &site, local, |agreed, ring, host, nccl| {
        let g = agreed.backward_device(ring, host, nccl, &inputs, lse, upstream).map_err(to_py)?;
        // On the communicator's stream, which torch's waits for on exit.
        let on = flatpeak_common::nccl::DeviceCommunicator::stream(nccl);
        copy_prefix(on, &g.dx, &mut dx)?;
        copy_prefix(on, &g.dw, &mut dw)?;
        if let (Some(src), Some(dst)) = (&g.dbias, dbias.as_mut()) {
            copy_prefix(on, src, dst)?;
        }
        Ok(())
    })
}

/// Copies the first `dst.len()` elements of a ring's f32 output `src` into the lent tensor `dst`
/// on `on` (the ring's outputs may hold more: padded rows, a buffer of at least one element).
fn copy_prefix(
    on: &std::sync::Arc<flatpeak_common::cuda::cudarc::driver::CudaStream>,
    src: &CudaSlice<f32>,
    dst: &mut LentMut<'_, CudaSlice<f32>>,
) -> PyResult<()> {
    if dst.is_empty() {
        return Ok(());
    }
    let len = dst.len();
    if src.len() < len {
        return Err(to_py(ring_dtp::Error::internal("a ring's gradient is shorter than its tensor")));
    }
    on.memcpy_dtod(&src.slice(..len), &mut **dst).map_err(cuda_error("cuMemcpyDtoD")).map_err(to_py)
}
