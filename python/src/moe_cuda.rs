//! `moe_swiglu` on CUDA tensors (feature `cuda`): llep's executor with its CUDA ops
//! (`llep::cuda::CudaOps`: kernels, cuBLAS and the all-to-alls over the group's NCCL
//! communicator, [`crate::cuda_group`]) on the tensors' device, ordered after torch's current
//! stream. The routing comes from the host (the Python side copies those T × k values there);
//! the hidden states, the experts and dY are read in place on the device, and y and the
//! gradients are written into torch tensors the Python side allocated, on the same stream. The
//! agreement, the plan and the schedule are the crate's, as on the CPU.

use flatpeak_common::Communicator;
use flatpeak_common::cuda::cuda_error;
use flatpeak_common::cuda::cudarc::driver::CudaSlice;
use flatpeak_common::nccl::DeviceCommunicator;
use half::bf16;
use llep::cuda::{CudaBuf, CudaOps, DeviceArena};
use llep::device::{DeviceInputs, DeviceOps};
use llep::{AgreedCall, Backward, DType, Device, RankCall, RankSizes, Routing, Scheme};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::cache::{self, Executor, Key};
use crate::cuda_group::with_nccl;
use crate::cuda_tensor::{DIn, DOut, DeviceLend, DeviceLent, Lent as DeviceBuf, LentMut, LlepIn};
use crate::error::to_py;
use crate::moe_args::{
    ForwardStats, MoEArgs, MoEEntry, MoEGrads, MoEOptions, MoEOuts, MoEUpstream, agree, call_options,
    forward_stats, refuse, sizes, write_counts,
};
use crate::tensor::{In, Lend, Lent, Register};
use crate::torch_group::{Comm, communicator, detached, group_handle};

/// One call's tensors, registered: the tokens and experts on the device, the routing on the host.
struct Ins {
    x: LlepIn,
    gate_up: LlepIn,
    down: LlepIn,
    ids: In<i64>,
    weights: In<f32>,
}

fn typed<'t, 'py, T: crate::tensor::TorchElement>(
    lend: &mut DeviceLend<'t, 'py>,
    args: &'t MoEArgs<'py>,
    s: RankSizes,
) -> PyResult<[DIn<T>; 3]> {
    let (t, h, i, m) = (s.tokens, s.hidden, s.intermediate, s.local_experts);
    Ok([
        lend.input("hidden_states", &args.x, &[Some(t), Some(h)])?,
        lend.input("gate_up_proj", &args.gate_up, &[Some(m), Some(2 * i), Some(h)])?,
        lend.input("down_proj", &args.down, &[Some(m), Some(h), Some(i)])?,
    ])
}

impl Ins {
    fn new<'t, 'py>(
        lend: &mut DeviceLend<'t, 'py>,
        host: &mut Lend<'t, 'py>,
        options: &MoEOptions,
        args: &'t MoEArgs<'py>,
    ) -> PyResult<(Self, RankSizes, DType)> {
        let (s, dtype) = sizes(args)?;
        if options.saves() {
            return Err(PyTypeError::new_err(
                "activations='save' keeps its store in host memory and runs on CPU tensors: llep's CUDA \
                 executor recomputes in backward (pass activations='recompute' for CUDA tensors)",
            ));
        }
        let [x, gate_up, down] = match dtype {
            DType::Bf16 => typed::<bf16>(lend, args, s)?.map(LlepIn::Bf16),
            _ => typed::<f32>(lend, args, s)?.map(LlepIn::F32),
        };
        let (t, k) = (s.tokens, s.top_k);
        let ids = host.input("topk_ids (on the host)", &args.ids, &[Some(t), Some(k)])?;
        let weights = host.input("topk_weights (on the host)", &args.weights, &[Some(t), Some(k)])?;
        Ok((Self { x, gate_up, down, ids, weights }, s, dtype))
    }

    fn routing<'l>(&self, host: &'l Lent<'_, '_>) -> PyResult<Routing<'l>> {
        Ok(Routing { ids: host.get(self.ids)?, weights: host.get(self.weights)? })
    }
}

/// Runs `f` on the call prepared on the kept executor of its plan, with llep's CUDA ops over the
/// group's NCCL communicator, between torch's stream and the ops' (see [`crate::cuda_group`]).
fn on_device<R: Send>(
    py: Python<'_>,
    comm: &mut Comm,
    agreed: AgreedCall<'_>,
    group: usize,
    lent: &DeviceLent<'_, '_>,
    f: impl FnOnce(&CudaOps<'_, flatpeak_common::nccl::NcclComm>, &mut llep::Prepared<'_>) -> PyResult<R> + Send,
) -> PyResult<R> {
    let (plan, device) = (*agreed.plan(), agreed.device());
    let Device::Cuda(ordinal) = device else {
        return Err(to_py(llep::Error::internal("a CUDA call agreed on a CUDA device")));
    };
    let torch = lent.stream().clone();
    // PipelinedLLEP's buffers (sized by the plan; the baselines' follow each call's routing) are
    // carved from one zeroed tensor of torch's caching allocator, so
    // `torch.cuda.max_memory_allocated` sees the whole device working set; kept alive until the
    // call's streams are done with it (torch's stream waits for them before reusing it). A rank
    // whose tensor torch refuses fails the group's first agreement, as an executor would.
    let (_arena, lent_arena) = match plan.config().scheme {
        Scheme::PipelinedLlep => {
            let (tensor, lent) = arena_tensor(py, &plan, ordinal);
            (tensor, Some(lent))
        }
        _ => (None, None),
    };
    detached(py, comm, |host: &dyn Communicator| -> PyResult<R> {
        let key = Key::Moe { device, plan };
        let made = match &lent_arena {
            Some(Err(e)) => Err(e.clone()),
            _ => cache::entry(key, plan.workspace_bytes(), || {
                llep::Executor::new(plan, device).map(Executor::Moe)
            }),
        };
        let entry = agreed.ready(host, made).map_err(to_py)?;
        let mut executor = entry.lock();
        let Executor::Moe(executor) = &mut *executor else {
            return Err(to_py(llep::Error::internal("an MoE entry holds an MoE executor")));
        };
        with_nccl(host, group, ordinal, &torch, |nccl| {
            let ops = CudaOps::new(nccl).map_err(to_py)?;
            let ops = match &lent_arena {
                // SAFETY: `_arena` is a fresh zeroed tensor of `bytes` bytes on this device at
                // `address` (aligned: checked by `arena_tensor`), allocated on torch's stream,
                // which the communicator's stream, and so the ops', waits for (`with_nccl`);
                // nothing else references it, and it is dropped after this call, whose streams
                // torch's waits for before its allocator reuses the memory.
                Some(Ok((address, bytes))) => ops.lending(unsafe { DeviceArena::new(*address, *bytes) }),
                _ => ops,
            };
            let mut call = agreed.prepare(executor, host).map_err(to_py)?;
            let out = f(&ops, &mut call);
            // The communicator's stream (which torch's waits for) after everything the ops issued.
            let joined =
                nccl.stream().join(ops.stream()).map_err(cuda_error("cuStreamWaitEvent")).map_err(to_py);
            let out = out?;
            joined?;
            Ok(out)
        })
    })?
}

/// Device memory lent to a call: its address and bytes, or why this rank has none.
type LentArena = Result<(u64, usize), llep::Error>;

/// A zeroed `uint8` tensor of `plan`'s device arena bytes on device `ordinal`, from torch's
/// caching allocator on its current stream, and its data pointer and bytes; a tensor torch
/// refuses (out of memory) is [`DeviceAlloc`](flatpeak_common::Error::DeviceAlloc) and one not
/// aligned for llep an internal error, for the group to agree on.
fn arena_tensor<'py>(
    py: Python<'py>,
    plan: &llep::Plan,
    ordinal: usize,
) -> (Option<Bound<'py, PyAny>>, LentArena) {
    let bytes = plan.device_arena_bytes();
    let made = (|| -> PyResult<(Bound<'py, PyAny>, u64)> {
        let torch = py.import("torch")?;
        let kwargs = PyDict::new(py);
        kwargs.set_item("dtype", torch.getattr("uint8")?)?;
        kwargs.set_item("device", format!("cuda:{ordinal}"))?;
        let tensor = torch.call_method("zeros", (bytes,), Some(&kwargs))?;
        let address: u64 = tensor.call_method0("data_ptr")?.extract()?;
        Ok((tensor, address))
    })();
    match made {
        Ok((tensor, address)) if address.is_multiple_of(DeviceArena::ALIGN as u64) => {
            (Some(tensor), Ok((address, bytes)))
        }
        Ok((tensor, _)) => {
            (Some(tensor), Err(llep::Error::internal("torch's allocator returns 256-byte aligned tensors")))
        }
        Err(_) => {
            let what = "the MoE layer's device buffers (a torch tensor)";
            (None, Err(llep::Error::Common(flatpeak_common::Error::DeviceAlloc { what, bytes })))
        }
    }
}

/// Copies llep's f32 output `src` into the lent tensor `dst` on `ops`' stream (the output may hold
/// more: a buffer of at least one element).
fn copy_out(
    ops: &CudaOps<'_, flatpeak_common::nccl::NcclComm>,
    src: &CudaBuf,
    dst: &mut LentMut<'_, CudaSlice<f32>>,
) -> PyResult<()> {
    let CudaBuf::F32(src) = src else {
        return Err(to_py(llep::Error::internal("llep returns f32 outputs")));
    };
    if dst.is_empty() {
        return Ok(());
    }
    let len = dst.len();
    if src.len() < len {
        return Err(to_py(llep::Error::internal("an output is shorter than its tensor")));
    }
    ops.stream().memcpy_dtod(&src.slice(..len), &mut **dst).map_err(cuda_error("cuMemcpyDtoD")).map_err(to_py)
}

/// The call's device tensors, lent: the tokens, gate_up and down.
struct Bufs<'l> {
    x: DeviceBuf<'l, CudaBuf>,
    gate: DeviceBuf<'l, CudaBuf>,
    down: DeviceBuf<'l, CudaBuf>,
}

impl<'l> Bufs<'l> {
    fn new(ins: &Ins, lent: &'l DeviceLent<'_, '_>) -> PyResult<Self> {
        Ok(Self {
            x: lent.llep_buf(ins.x)?,
            gate: lent.llep_buf(ins.gate_up)?,
            down: lent.llep_buf(ins.down)?,
        })
    }

    /// Runs `f` on the call's device inputs (with an empty `up`: torch's fused layout has none).
    fn with_inputs<R>(
        &self,
        ops: &CudaOps<'_, flatpeak_common::nccl::NcclComm>,
        routing: Routing<'_>,
        dtype: DType,
        f: impl FnOnce(&DeviceInputs<'_, CudaBuf>) -> PyResult<R>,
    ) -> PyResult<R> {
        let up = DeviceOps::alloc(ops, 0, dtype).map_err(to_py)?;
        f(&DeviceInputs { x: &self.x, routing, gate: &self.gate, up: &up, down: &self.down })
    }
}

/// Forward on CUDA tensors: y (`[T, H]` float32, on the device) into `outputs.y`, the global routes
/// per expert into the host `outputs.counts`; the forward's statistics.
pub(crate) fn forward(
    py: Python<'_>,
    entry: MoEEntry<'_, '_>,
    args: &MoEArgs<'_>,
    ordinal: usize,
    outputs: &MoEOuts<'_>,
) -> PyResult<ForwardStats> {
    let MoEEntry { options, group, num_experts } = entry;
    let handle = group.as_ref().map_or(0, group_handle);
    let mut comm = communicator(py, group)?;
    let world = comm.as_ref().map_or(1, |c| c.world_size());
    let call = call_options(num_experts, Backward::Recomputing);
    let (mut lend, mut host) = (DeviceLend::new(py, ordinal)?, Lend::new());
    let mine = (|| -> PyResult<_> {
        let (ins, s, dtype) = Ins::new(&mut lend, &mut host, options, args)?;
        let y: DOut<f32> = lend.output("y_out", &outputs.y, &[Some(s.tokens), Some(s.hidden)])?;
        let e = num_experts.unwrap_or(s.local_experts * world);
        let counts = host.output::<i64>("counts_out", &outputs.counts, &[Some(e)])?;
        Ok((ins, s, dtype, (y, counts), (lend.lent()?, host.lent()?)))
    })();
    let (ins, s, dtype, (y, counts), (lent, host)) = match mine {
        Ok(mine) => mine,
        Err(e) => return Err(refuse(py, &mut comm, options, e, call)),
    };
    let routing = ins.routing(&host)?;
    let me = RankCall { sizes: s, dtype, device: Device::Cuda(ordinal), routing };
    let agreed = agree(py, &mut comm, options, Ok(me), call)?;
    let (mut y, bufs) = (lent.get_mut(y)?, Bufs::new(&ins, &lent)?);
    let stats = on_device(py, &mut comm, agreed, handle, &lent, |ops, call| {
        bufs.with_inputs(ops, routing, dtype, |inputs| {
            let out = call.forward(ops, inputs).map_err(to_py)?;
            copy_out(ops, &out, &mut y)?;
            Ok(call.stats())
        })
    })?;
    write_counts(&stats, host.get_mut(counts)?);
    Ok(forward_stats(&stats, 0))
}

/// Backward on CUDA tensors from `upstream`'s dY (`[T, H]`, the input's dtype, on the device): dX,
/// d(topk_weights), d(gate_up_proj) and d(down_proj) into the float32 device tensors `grads_out`.
pub(crate) fn backward(
    py: Python<'_>,
    entry: MoEEntry<'_, '_>,
    args: &MoEArgs<'_>,
    ordinal: usize,
    upstream: &MoEUpstream<'_>,
    grads_out: &MoEGrads<'_>,
) -> PyResult<()> {
    let MoEEntry { options, group, num_experts } = entry;
    let handle = group.as_ref().map_or(0, group_handle);
    let mut comm = communicator(py, group)?;
    let call = call_options(num_experts, Backward::Recomputing);
    let (mut lend, mut host) = (DeviceLend::new(py, ordinal)?, Lend::new());
    let mine = (|| -> PyResult<_> {
        let (ins, s, dtype) = Ins::new(&mut lend, &mut host, options, args)?;
        let (t, h, i, m, k) = (s.tokens, s.hidden, s.intermediate, s.local_experts, s.top_k);
        let dy = match dtype {
            DType::Bf16 => LlepIn::Bf16(lend.input("grad_output", &upstream.grad, &[Some(t), Some(h)])?),
            _ => LlepIn::F32(lend.input("grad_output", &upstream.grad, &[Some(t), Some(h)])?),
        };
        let outs: [DOut<f32>; 4] = [
            lend.output("dx", &grads_out.dx, &[Some(t), Some(h)])?,
            lend.output("d_topk_weights", &grads_out.d_weights, &[Some(t), Some(k)])?,
            lend.output("d_gate_up_proj", &grads_out.d_gate_up, &[Some(m), Some(2 * i), Some(h)])?,
            lend.output("d_down_proj", &grads_out.d_down, &[Some(m), Some(h), Some(i)])?,
        ];
        Ok((ins, s, dtype, dy, outs, (lend.lent()?, host.lent()?)))
    })();
    let (ins, s, dtype, dy, outs, (lent, host)) = match mine {
        Ok(mine) => mine,
        Err(e) => return Err(refuse(py, &mut comm, options, e, call)),
    };
    let routing = ins.routing(&host)?;
    let me = RankCall { sizes: s, dtype, device: Device::Cuda(ordinal), routing };
    let agreed = agree(py, &mut comm, options, Ok(me), call)?;
    let (dy, bufs) = (lent.llep_buf(dy)?, Bufs::new(&ins, &lent)?);
    let mut outs = outs.map(|o| lent.get_mut(o)).into_iter().collect::<PyResult<Vec<_>>>()?;
    on_device(py, &mut comm, agreed, handle, &lent, |ops, call| {
        bufs.with_inputs(ops, routing, dtype, |inputs| {
            let g = call.backward(ops, inputs, &dy).map_err(to_py)?;
            for (src, dst) in [&g.dx, &g.d_weights, &g.d_gate, &g.d_down].into_iter().zip(outs.iter_mut()) {
                copy_out(ops, src, dst)?;
            }
            Ok(())
        })
    })
}
