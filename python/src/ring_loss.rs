//! `linear_cross_entropy(..., group=, ring=)`: ring-dtp's vocabulary-parallel rings over the
//! caller's `torch.distributed` group, one entry per operation whatever the device (CUDA
//! tensors: the ring on the GPU over an NCCL communicator of the group's ranks, on torch's
//! current stream).
//!
//! Each rank brings its own tokens and its shard of the vocabulary; the crate agrees on every
//! rank's share before any data moves ([`ring_dtp::ring::agree`]: a refusal on one rank, this
//! file's own checks of its tensors included, is an error on every rank naming it), plans the
//! ring, pads a rank with fewer tokens than the plan's rows and gives each rank its own rows
//! back. The ring executors are kept between calls ([`crate::cache`]).

use flatpeak_common::Communicator;
use flatpeak_common::comm::Refusal;
use pyo3::prelude::*;
use ring_dtp::ring::{AgreedRing, RankShare, RingCall, agree};
use ring_dtp::{Device, GradientsMut, RingLinearCrossEntropy, Shape, Upstream};

use crate::cache::{self, Executor, Key};
use crate::error::{refusal, to_py};
use crate::loss_args::{
    ForwardOuts, GradArgs, LossArgs, LossIns, LossOptions, UpstreamArgs, grad_output, loss_shape, required,
    ring_choice, ring_part, write_forward,
};
use crate::tensor::{Lend, Register, device_of};
use crate::torch_group::{Comm, communicator, detached, group_handle};

/// Agrees on the call over `comm` and runs `f` on the kept executor of its plan, with the GIL
/// released: `local` is this rank's share (or the refusal of its own checks).
fn on_ring<R: Send>(
    py: Python<'_>,
    comm: &mut Comm,
    call: &RingCall,
    group: usize,
    local: Result<RankShare, Refusal>,
    f: impl FnOnce(&AgreedRing, &mut RingLinearCrossEntropy, &dyn Communicator) -> ring_dtp::Result<R> + Send,
) -> PyResult<R> {
    detached(py, comm, |comm| -> ring_dtp::Result<R> {
        let agreed = agree(comm, call, local)?;
        let (plan, device) = (*agreed.plan(), agreed.device());
        let key = Key::Ring { group, device, plan };
        let made = cache::entry(key, plan.workspace_bytes(), || {
            RingLinearCrossEntropy::new(plan, device).map(Executor::Ring)
        });
        let entry = agreed.ready(comm, made)?;
        let mut executor = entry.lock();
        match &mut *executor {
            Executor::Ring(ring) => f(&agreed, ring, comm),
            _ => Err(ring_dtp::Error::internal("a ring entry holds a ring executor")),
        }
    })?
    .map_err(to_py)
}

/// Forward over `group` (`ring`: `"weight"`, `"activation"` or `None` for the plan's choice):
/// writes the loss (0-dim fp32 for mean and sum, `[n_r]` for none) and this rank's tokens' lse
/// (`[n_r]` fp32) into the host tensors `outputs`.
#[pyfunction]
#[pyo3(signature = (options, group, ring, args, outputs))]
pub(crate) fn lce_ring_forward(
    py: Python<'_>,
    options: &LossOptions,
    group: Bound<'_, PyAny>,
    ring: Option<&str>,
    args: LossArgs<'_>,
    outputs: ForwardOuts<'_>,
) -> PyResult<()> {
    #[cfg(feature = "cuda")]
    if let Ok(Device::Cuda(ordinal)) = device_of("input", &args.input) {
        let call = crate::ring_loss_cuda::RingEntry { options, group: &group, ring, args: &args, ordinal };
        return crate::ring_loss_cuda::forward(py, call, &outputs);
    }
    let handle = group_handle(&group);
    let mut comm = communicator(py, Some(group))?;
    let mut lend = Lend::new();
    let mine = (|| -> PyResult<_> {
        let choice = ring_choice(ring)?;
        if let Device::Cuda(_) = device_of("input", &args.input)? {
            return Err(crate::tensor::cuda_not_built("input"));
        }
        let ins = LossIns::new(&mut lend, &args)?;
        let n = ins.shape.tokens;
        let loss_out = lend.output::<f32>("loss_out", &outputs.loss, &loss_shape(options, n))?;
        let lse_out = lend.output::<f32>("lse_out", &outputs.lse, &[Some(n)])?;
        Ok((choice, ins, loss_out, lse_out, lend.lent()?))
    })();
    let mine = mine.map_err(|e| refusal(py, e));
    let (call, local) =
        ring_part(options, Device::Cpu, mine.as_ref().map(|(choice, ins, ..)| (*choice, ins)));
    let Ok((_, ins, loss_out, lse_out, lent)) = mine else {
        return on_ring(py, &mut comm, &call, handle, local, |_, _, _| Ok(()));
    };
    let inputs = ins.inputs(&lent)?;
    let forward = on_ring(py, &mut comm, &call, handle, local, |agreed, ring, comm| {
        agreed.forward(ring, comm, &inputs)
    })?;
    write_forward(forward, lent.get_mut(loss_out)?, lent.get_mut(lse_out)?);
    Ok(())
}

/// Backward over `group` from forward's `lse` (`[n_r]`): `upstream` is the gradient of the loss
/// (0-dim for mean and sum, `[n_r]` for none) and that of the lse, if any; writes this rank's
/// dX (`[n_r, D]`), its shard's dW (`[v_r, D]`) and dbias into the fp32 tensors `grads_out`.
#[pyfunction]
#[pyo3(signature = (options, group, ring, args, lse, upstream, grads_out))]
#[allow(clippy::too_many_arguments)] // the loss's own backward's arguments, and the group's two
pub(crate) fn lce_ring_backward(
    py: Python<'_>,
    options: &LossOptions,
    group: Bound<'_, PyAny>,
    ring: Option<&str>,
    args: LossArgs<'_>,
    lse: Bound<'_, PyAny>,
    upstream: UpstreamArgs<'_>,
    grads_out: GradArgs<'_>,
) -> PyResult<()> {
    #[cfg(feature = "cuda")]
    if let Ok(Device::Cuda(ordinal)) = device_of("input", &args.input) {
        let call = crate::ring_loss_cuda::RingEntry { options, group: &group, ring, args: &args, ordinal };
        return crate::ring_loss_cuda::backward(py, call, &lse, &upstream, &grads_out);
    }
    let handle = group_handle(&group);
    let mut comm = communicator(py, Some(group))?;
    let mut lend = Lend::new();
    let mine = (|| -> PyResult<_> {
        let choice = ring_choice(ring)?;
        if let Device::Cuda(_) = device_of("input", &args.input)? {
            return Err(crate::tensor::cuda_not_built("input"));
        }
        let ins = LossIns::new(&mut lend, &args)?;
        let Shape { tokens: n, hidden: d, vocab: v, .. } = ins.shape;
        let lse = lend.input::<f32>("lse", &lse, &[Some(n)])?;
        let grad = lend.input::<f32>("grad_output", &upstream.grad, &loss_shape(options, n))?;
        let dlse = lend.input_opt::<f32>("grad_lse", upstream.grad_lse.as_ref(), &[Some(n)])?;
        let dx = lend.output::<f32>("dx", required("dx", &grads_out.dx)?, &[Some(n), Some(d)])?;
        let dw = lend.output::<f32>("dw", required("dw", &grads_out.dw)?, &[Some(v), Some(d)])?;
        let dbias = lend.output_opt::<f32>("dbias", grads_out.dbias.as_ref(), &[Some(v)])?;
        Ok((choice, ins, (lse, grad, dlse), (dx, dw, dbias), lend.lent()?))
    })();
    let mine = mine.map_err(|e| refusal(py, e));
    let (call, local) =
        ring_part(options, Device::Cpu, mine.as_ref().map(|(choice, ins, ..)| (*choice, ins)));
    let Ok((_, ins, (lse, grad, dlse), (dx, dw, dbias), lent)) = mine else {
        return on_ring(py, &mut comm, &call, handle, local, |_, _, _| Ok(()));
    };
    let (inputs, lse, grad, dlse) =
        (ins.inputs(&lent)?, lent.get(lse)?, lent.get(grad)?, lent.get_opt(dlse)?);
    let upstream = Upstream::loss(grad_output(options, grad)).with_dlse(dlse);
    let out = GradientsMut::new(lent.get_mut(dx)?, lent.get_mut(dw)?, lent.get_mut_opt(dbias)?);
    on_ring(py, &mut comm, &call, handle, local, |agreed, ring, comm| {
        agreed.backward_into(ring, comm, &inputs, lse, upstream, out)
    })
}
