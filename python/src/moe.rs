//! `moe_swiglu` on torch tensors: llep's layer over the caller's `torch.distributed` group (or in
//! one process without one), one entry per operation whatever the device (CUDA tensors take
//! `moe_cuda.rs`).
//!
//! The weights are read in place in torch's layout (llep's `WeightLayout::Linear`):
//! `gate_up_proj` `[E_local, 2I, H]`, `down_proj` `[E_local, H, I]`. Every rank may bring its own
//! number of tokens. The crate agrees on every rank's sizes and terms before any data moves
//! ([`llep::Layer::agree`]: a refusal on one rank, this file's own checks of its tensors
//! included, is an error on every rank naming it), plans the call and schedules it; the executors
//! are kept between calls ([`crate::cache`]).

use half::bf16;
use llep::{AgreedCall, Backward, Device, ExpertWeights, LayerElement, RankCall, RankInputs, Routing};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::cache::{self, Executor, Key};
use crate::error::to_py;
use crate::moe_args::{
    ForwardStats, MoEArgs, MoEEntry, MoEGrads, MoEOptions, MoEOuts, MoEUpstream, agree, call_options,
    forward_stats, refuse, sizes, write_counts,
};
use crate::tensor::{In, Lend, Lent, Out, Register, TorchElement, device_of};
use crate::torch_group::{Comm, communicator, detached, detached_in_pool};

/// One call's host tensors of storage type `T`, registered.
struct Ins<T> {
    x: In<T>,
    ids: In<i64>,
    weights: In<f32>,
    gate_up: In<T>,
    down: In<T>,
}

impl<T: TorchElement> Ins<T> {
    fn new<'t, 'py>(lend: &mut Lend<'t, 'py>, args: &'t MoEArgs<'py>, s: llep::RankSizes) -> PyResult<Self> {
        let (t, h, i, m, k) = (s.tokens, s.hidden, s.intermediate, s.local_experts, s.top_k);
        Ok(Self {
            x: lend.input("hidden_states", &args.x, &[Some(t), Some(h)])?,
            ids: lend.input("topk_ids", &args.ids, &[Some(t), Some(k)])?,
            weights: lend.input("topk_weights", &args.weights, &[Some(t), Some(k)])?,
            gate_up: lend.input("gate_up_proj", &args.gate_up, &[Some(m), Some(2 * i), Some(h)])?,
            down: lend.input("down_proj", &args.down, &[Some(m), Some(h), Some(i)])?,
        })
    }

    fn inputs<'l>(&self, lent: &'l Lent<'_, '_>) -> PyResult<RankInputs<'l, T>> {
        let routing = Routing { ids: lent.get(self.ids)?, weights: lent.get(self.weights)? };
        let experts = ExpertWeights::linear(lent.get(self.gate_up)?, lent.get(self.down)?);
        Ok(RankInputs { x: lent.get(self.x)?, routing, experts })
    }
}

/// Runs `f` on the call prepared on the kept executor of its plan (made at the first call of that
/// plan, the making agreed on by the group), inside the rayon pool with the GIL released (the
/// executor's lock taken first, on this thread).
fn on_executor<R: Send>(
    py: Python<'_>,
    comm: &mut Comm,
    agreed: AgreedCall<'_>,
    f: impl FnOnce(&dyn flatpeak_common::Communicator, &mut llep::Prepared<'_>) -> llep::Result<R> + Send,
) -> PyResult<R> {
    let (plan, device) = (*agreed.plan(), agreed.device());
    let entry = detached(py, comm, |comm| {
        let key = Key::Moe { device, plan };
        let made = cache::entry(key, plan.workspace_bytes(), || {
            llep::Executor::new(plan, device).map(Executor::Moe)
        });
        agreed.ready(comm, made)
    })?
    .map_err(to_py)?;
    detached_in_pool(
        py,
        comm,
        || entry.lock(),
        |comm, executor| match executor {
            Executor::Moe(executor) => f(comm, &mut agreed.prepare(executor, comm)?),
            _ => Err(llep::Error::internal("an MoE entry holds an MoE executor")),
        },
    )?
    .map_err(to_py)
}

/// E as the call's counts tensor holds it.
fn experts(args: &MoEArgs<'_>, num_experts: Option<usize>, world: usize) -> PyResult<usize> {
    let local = crate::tensor::shape_of("gate_up_proj", &args.gate_up)?.first().copied().unwrap_or(0);
    Ok(num_experts.unwrap_or(local * world))
}

fn forward_typed<T: TorchElement + LayerElement>(
    py: Python<'_>,
    entry: MoEEntry<'_, '_>,
    args: &MoEArgs<'_>,
    outputs: &MoEOuts<'_>,
) -> PyResult<ForwardStats> {
    let MoEEntry { options, group, num_experts } = entry;
    let mut comm = communicator(py, group)?;
    let world = comm.as_ref().map_or(1, |c| c.world_size());
    let call = call_options(num_experts, Backward::Recomputing);
    let mut lend = Lend::new();
    let mine = (|| -> PyResult<_> {
        let (s, dtype) = sizes(args)?;
        let ins = Ins::<T>::new(&mut lend, args, s)?;
        let y = lend.output::<f32>("y_out", &outputs.y, &[Some(s.tokens), Some(s.hidden)])?;
        let counts =
            lend.output::<i64>("counts_out", &outputs.counts, &[Some(experts(args, num_experts, world)?)])?;
        let saved = outputs
            .saved
            .as_ref()
            .map(|t| lend.output_aligned::<u8>("saved_out", t, &[None], 64))
            .transpose()?;
        Ok((s, dtype, ins, (y, counts, saved), lend.lent()?))
    })();
    let (s, dtype, ins, (y, counts, saved), lent) = match mine {
        Ok(mine) => mine,
        Err(e) => return Err(refuse(py, &mut comm, options, e, call)),
    };
    let inputs = ins.inputs(&lent)?;
    let me = RankCall { sizes: s, dtype, device: Device::Cpu, routing: inputs.routing };
    let agreed = agree(py, &mut comm, options, Ok(me), call)?;
    let store = saved.map(|h| lent.get_mut(h)).transpose()?;
    let (out, stats, kept) = on_executor(py, &mut comm, agreed, |comm, call| {
        let (y, kept) = match store {
            None => (call.forward(comm, &inputs)?, 0),
            Some(bytes) => {
                let mut saved = call.store_over(bytes)?;
                (call.forward_saving(comm, &inputs, &mut saved)?, saved.bytes())
            }
        };
        Ok((y, call.stats(), kept))
    })?;
    lent.get_mut(y)?.copy_from_slice(&out);
    write_counts(&stats, lent.get_mut(counts)?);
    Ok(forward_stats(&stats, kept))
}

/// Forward: writes `y` (`[T, H]` float32) into `y_out` and the global routes per expert (`[E]`
/// int64, on the host) into `counts_out`; returns `(rounds, recv_high_water_rows,
/// recv_high_water_bytes, workspace_bytes, saved_bytes, device_bytes)`. With a `saved_out` tensor (`uint8`, at
/// least [`moe_saved_bytes`]; options made with `activations="save"`, CPU tensors) it keeps there
/// what [`moe_backward`] reads instead of recomputing.
#[pyfunction]
#[pyo3(signature = (options, group, args, num_experts, outputs))]
pub(crate) fn moe_forward(
    py: Python<'_>,
    options: &MoEOptions,
    group: Option<Bound<'_, PyAny>>,
    args: MoEArgs<'_>,
    num_experts: Option<usize>,
    outputs: MoEOuts<'_>,
) -> PyResult<ForwardStats> {
    if outputs.saved.is_some() && !options.saves() {
        return Err(PyValueError::new_err(
            "saved_out: these options recompute in backward; keeping activations needs options made with \
             activations='save'",
        ));
    }
    #[cfg(feature = "cuda")]
    if let Ok(Device::Cuda(ordinal)) = device_of("hidden_states", &args.x) {
        let entry = MoEEntry { options, group, num_experts };
        return crate::moe_cuda::forward(py, entry, &args, ordinal, &outputs);
    }
    if let Ok(Device::Cuda(_)) = device_of("hidden_states", &args.x) {
        return Err(crate::tensor::cuda_not_built("hidden_states"));
    }
    let entry = MoEEntry { options, group, num_experts };
    if crate::tensor::is_dtype::<bf16>(&args.x)? {
        forward_typed::<bf16>(py, entry, &args, &outputs)
    } else {
        forward_typed::<f32>(py, entry, &args, &outputs)
    }
}

fn saved_bytes_typed<T: TorchElement + LayerElement>(
    py: Python<'_>,
    entry: MoEEntry<'_, '_>,
    args: &MoEArgs<'_>,
) -> PyResult<usize> {
    let MoEEntry { options, group, num_experts } = entry;
    let mut comm = communicator(py, group)?;
    let call = call_options(num_experts, Backward::Recomputing);
    let mut lend = Lend::new();
    let mine = (|| -> PyResult<_> {
        let (s, dtype) = sizes(args)?;
        let ins = Ins::<T>::new(&mut lend, args, s)?;
        Ok((s, dtype, ins, lend.lent()?))
    })();
    let (s, dtype, ins, lent) = match mine {
        Ok(mine) => mine,
        Err(e) => return Err(refuse(py, &mut comm, options, e, call)),
    };
    let inputs = ins.inputs(&lent)?;
    let me = RankCall { sizes: s, dtype, device: Device::Cpu, routing: inputs.routing };
    let agreed = agree(py, &mut comm, options, Ok(me), call)?;
    on_executor(py, &mut comm, agreed, |_, call| call.saved_bytes())
}

/// Bytes of the `uint8` tensor a saving forward of these inputs keeps its activations in
/// (options made with `activations="save"`): this rank's received rows, routes and
/// pre-activations under the routing, agreed with the group as a forward agrees.
#[pyfunction]
#[pyo3(signature = (options, group, args, num_experts))]
pub(crate) fn moe_saved_bytes(
    py: Python<'_>,
    options: &MoEOptions,
    group: Option<Bound<'_, PyAny>>,
    args: MoEArgs<'_>,
    num_experts: Option<usize>,
) -> PyResult<usize> {
    let entry = MoEEntry { options, group, num_experts };
    if crate::tensor::is_dtype::<bf16>(&args.x)? {
        saved_bytes_typed::<bf16>(py, entry, &args)
    } else {
        saved_bytes_typed::<f32>(py, entry, &args)
    }
}

/// The gradient outputs, registered.
struct GradOuts {
    dx: Out<f32>,
    d_weights: Out<f32>,
    d_gate_up: Out<f32>,
    d_down: Out<f32>,
}

impl GradOuts {
    fn new<'t, 'py>(
        lend: &mut Lend<'t, 'py>,
        grads: &'t MoEGrads<'py>,
        s: llep::RankSizes,
    ) -> PyResult<Self> {
        let (t, h, i, m, k) = (s.tokens, s.hidden, s.intermediate, s.local_experts, s.top_k);
        Ok(Self {
            dx: lend.output("dx", &grads.dx, &[Some(t), Some(h)])?,
            d_weights: lend.output("d_topk_weights", &grads.d_weights, &[Some(t), Some(k)])?,
            d_gate_up: lend.output("d_gate_up_proj", &grads.d_gate_up, &[Some(m), Some(2 * i), Some(h)])?,
            d_down: lend.output("d_down_proj", &grads.d_down, &[Some(m), Some(h), Some(i)])?,
        })
    }
}

fn backward_typed<T: TorchElement + LayerElement>(
    py: Python<'_>,
    entry: MoEEntry<'_, '_>,
    args: &MoEArgs<'_>,
    upstream: &MoEUpstream<'_>,
    grads_out: &MoEGrads<'_>,
) -> PyResult<()> {
    let MoEEntry { options, group, num_experts } = entry;
    let mut comm = communicator(py, group)?;
    let from = if upstream.saved.is_some() { Backward::FromSaved } else { Backward::Recomputing };
    let call = call_options(num_experts, from);
    let mut lend = Lend::new();
    let mine = (|| -> PyResult<_> {
        let (s, dtype) = sizes(args)?;
        let ins = Ins::<T>::new(&mut lend, args, s)?;
        let dy = lend.input::<T>("grad_output", &upstream.grad, &[Some(s.tokens), Some(s.hidden)])?;
        // The store is read, not changed, but lent exclusively: the crate carves it.
        let saved = upstream
            .saved
            .as_ref()
            .map(|t| lend.output_aligned::<u8>("saved", t, &[None], 64))
            .transpose()?;
        let outs = GradOuts::new(&mut lend, grads_out, s)?;
        Ok((s, dtype, ins, (dy, saved), outs, lend.lent()?))
    })();
    let (s, dtype, ins, (dy, saved), outs, lent) = match mine {
        Ok(mine) => mine,
        Err(e) => return Err(refuse(py, &mut comm, options, e, call)),
    };
    let (inputs, dy) = (ins.inputs(&lent)?, lent.get(dy)?);
    let me = RankCall { sizes: s, dtype, device: Device::Cpu, routing: inputs.routing };
    let agreed = agree(py, &mut comm, options, Ok(me), call)?;
    let store = saved.map(|h| lent.get_mut(h)).transpose()?;
    let grads = on_executor(py, &mut comm, agreed, |comm, call| match store {
        None => call.backward(comm, &inputs, dy),
        Some(bytes) => {
            let mut saved = call.store_over(bytes)?;
            call.backward_saved(comm, &inputs, dy, &mut saved)
        }
    })?;
    lent.get_mut(outs.dx)?.copy_from_slice(&grads.dx);
    lent.get_mut(outs.d_weights)?.copy_from_slice(&grads.d_weights);
    lent.get_mut(outs.d_gate_up)?.copy_from_slice(&grads.d_gate);
    lent.get_mut(outs.d_down)?.copy_from_slice(&grads.d_down);
    Ok(())
}

/// Backward from `upstream = (grad_output, saved)`: `grad_output` `[T, H]` in the input's dtype;
/// `saved`, the `uint8` tensor a saving forward of these inputs kept its activations in (read,
/// not changed: it serves another backward too), or `None` to recompute each round. Writes dX,
/// d(topk_weights), d(gate_up_proj) and d(down_proj) into the float32 tensors `grads_out`.
#[pyfunction]
#[pyo3(signature = (options, group, args, num_experts, upstream, grads_out))]
pub(crate) fn moe_backward(
    py: Python<'_>,
    options: &MoEOptions,
    group: Option<Bound<'_, PyAny>>,
    args: MoEArgs<'_>,
    num_experts: Option<usize>,
    upstream: MoEUpstream<'_>,
    grads_out: MoEGrads<'_>,
) -> PyResult<()> {
    #[cfg(feature = "cuda")]
    if let Ok(Device::Cuda(ordinal)) = device_of("hidden_states", &args.x) {
        let entry = MoEEntry { options, group, num_experts };
        return crate::moe_cuda::backward(py, entry, &args, ordinal, &upstream, &grads_out);
    }
    if let Ok(Device::Cuda(_)) = device_of("hidden_states", &args.x) {
        return Err(crate::tensor::cuda_not_built("hidden_states"));
    }
    let entry = MoEEntry { options, group, num_experts };
    if crate::tensor::is_dtype::<bf16>(&args.x)? {
        backward_typed::<bf16>(py, entry, &args, &upstream, &grads_out)
    } else {
        backward_typed::<f32>(py, entry, &args, &upstream, &grads_out)
    }
}
