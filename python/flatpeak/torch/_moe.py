"""``moe_swiglu`` and ``MoEExperts``: a SwiGLU Mixture-of-Experts layer whose dispatch buffers are
fixed at launch (llep's PipelinedLLEP), expert-parallel over a ``torch.distributed`` group.

Two ``torch.library.custom_op`` ops carry it -- ``flatpeak::moe_swiglu_forward`` and
``flatpeak::moe_swiglu_backward`` -- with fake implementations and ``register_autograd``, as the
loss has. The schedule runs in Rust; every exchange of it goes through the caller's process group
(``all_to_all_single`` with split sizes), so the group's backend (gloo on CPUs) carries it.
Backward recomputes each round's expert forward (the layer is checkpointed: forward keeps
nothing but its inputs); with ``activations="save"`` a forward that needs a gradient keeps its
received rows and SwiGLU pre-activations instead (a ``uint8`` tensor a ``torch.autograd.Function``
saves for backward, run eagerly), and backward runs no recompute.

Expert ``e`` lives on rank ``e // E_local`` of the group; each rank passes its own tokens (any
number, zero included) and its ``E_local`` experts' weights in Hugging Face transformers' fused
layout, read in place: ``gate_up_proj`` ``[E_local, 2I, H]`` (the gate's I rows, then the up's),
``down_proj`` ``[E_local, H, I]``.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Dict, NamedTuple, Optional, Tuple, Union, cast

import torch
from torch import Tensor

from .. import _flatpeak as _ext
from ._checks import check_float, check_tensors
from ._groups import handle as _handle
from ._groups import resolve as _group
from ._groups import world_size as _world_size
from ._lce_common import guard_grads
from ._sharding import check_ep_mesh, expert_weights, local, own_experts

_SCHEMES = ("pipelined", "llep", "standard")
_ACTIVATIONS = ("recompute", "save")


#: The layer's options in the order every op takes them, with their schema types: the one
#: definition of the ops' option arguments (each op's schema and implementation take them as a
#: tail ``*opts``).
OPTIONS: Tuple[Tuple[str, str], ...] = (
    ("scheme", "str"),
    ("pair_cap_rows", "int?"),
    ("budget_bytes", "int?"),
    ("max_tokens_factor", "float?"),
    ("min_tokens_per_gemm", "int?"),
    ("imbalance_threshold", "float?"),
    ("activations", "str"),
)
_OPTION_NAMES = tuple(name for name, _ in OPTIONS)
_OPTIONS_SCHEMA = ", ".join(f"{kind} {name}" for name, kind in OPTIONS)
_TENSORS_SCHEMA = ("Tensor hidden_states, Tensor topk_ids, Tensor topk_weights, Tensor gate_up_proj, "
                   "Tensor down_proj, int group, int num_experts")


@functools.lru_cache(maxsize=64)
def _options(*opts: Any) -> Any:
    """The checked ``MoEOptions`` of option values in :data:`OPTIONS` order, one object (and so
    one cached plan and working set) per setting."""
    return _ext.MoEOptions(**dict(zip(_OPTION_NAMES, opts)))


def _saves(opts: Tuple[Any, ...]) -> bool:
    return opts[_OPTION_NAMES.index("activations")] == "save"


class MoEStats(NamedTuple):
    """What one call of :func:`moe_swiglu` did (``return_stats=True``)."""

    #: Routes per expert over every rank's tokens (int64 ``[E]``): for load-balancing losses and
    #: loss-free bias updates.
    tokens_per_expert: Tensor
    #: Dispatch rounds the routing took (skew costs rounds, never memory).
    rounds: int
    #: The most token rows this rank received in one round (at most the plan's ``P * q``).
    recv_high_water_rows: int
    #: Their bytes (rows x hidden x element size).
    recv_high_water_bytes: int
    #: The working set the plan reserved on this rank, fixed before any routing is known.
    workspace_bytes: int
    #: Bytes this forward kept for backward (``activations="save"`` with a gradient needed; 0 when
    #: backward recomputes). Unlike the working set it follows the routing.
    saved_bytes: int = 0
    #: On a GPU, the most device memory one pass of the call holds beside its inputs (its
    #: dispatch buffers, expert scratch and float32 outputs), fixed by the plan and carved from
    #: one tensor of torch's caching allocator (so ``torch.cuda.max_memory_allocated`` includes
    #: it); 0 on the CPU, whose working set is ``workspace_bytes``.
    device_bytes: int = 0


def _forward_impl(hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_proj: Tensor,
                  down_proj: Tensor, group: int, num_experts: int, *opts: Any) -> Tuple[Tensor, Tensor, Tensor]:
    options = _options(*opts)
    pg = _group(group)
    experts = num_experts or gate_up_proj.shape[0] * _world_size(pg)
    device = hidden_states.device
    y = torch.empty(hidden_states.shape, dtype=torch.float32, device=device)
    counts = torch.empty((experts,), dtype=torch.int64)
    # The schedule is planned on the host from the routing (T x k values); on a GPU the rows and
    # the expert weights stay on the device.
    args = (hidden_states, topk_ids.cpu(), topk_weights.cpu(), gate_up_proj, down_proj)
    if _saves(opts) and not hidden_states.is_cuda:
        # A saving forward asks for its store's size first: a rank that keeps nothing (no
        # gradient needed here) makes the same collectives, so ranks never pair up different
        # exchanges.
        _ext.moe_saved_bytes(options, pg, args, num_experts or None)
    stats = _ext.moe_forward(options, pg, args, num_experts or None, (y, counts, None))
    return y.to(hidden_states.dtype), counts.to(device), torch.tensor(stats, dtype=torch.int64, device=device)


_forward = torch.library.custom_op(
    "flatpeak::moe_swiglu_forward", _forward_impl, mutates_args=(),
    schema=f"({_TENSORS_SCHEMA}, {_OPTIONS_SCHEMA}) -> (Tensor, Tensor, Tensor)")


@_forward.register_fake
def _forward_fake(hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor, gate_up_proj: Tensor,
                  down_proj: Tensor, group: int, num_experts: int, *opts: Any) -> Tuple[Tensor, Tensor, Tensor]:
    experts = num_experts or gate_up_proj.shape[0] * _world_size(_group(group))
    return (torch.empty_like(hidden_states), hidden_states.new_empty((experts,), dtype=torch.int64),
            hidden_states.new_empty((len(MoEStats._fields) - 1,), dtype=torch.int64))


def _backward_impl(grad_output: Tensor, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                   gate_up_proj: Tensor, down_proj: Tensor, group: int, num_experts: int,
                   *opts: Any) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    f32: Dict[str, Any] = dict(dtype=torch.float32, device=hidden_states.device)
    dx = torch.empty(hidden_states.shape, **f32)
    dw = torch.empty(topk_weights.shape, **f32)
    dgu = torch.empty(gate_up_proj.shape, **f32)
    dd = torch.empty(down_proj.shape, **f32)
    dy = grad_output.to(hidden_states.dtype).contiguous()
    args = (hidden_states, topk_ids.cpu(), topk_weights.cpu(), gate_up_proj, down_proj)
    _ext.moe_backward(_options(*opts), _group(group), args, num_experts or None, (dy, None), (dx, dw, dgu, dd))
    return dx.to(hidden_states.dtype), dw, dgu.to(gate_up_proj.dtype), dd.to(down_proj.dtype)


_backward = torch.library.custom_op(
    "flatpeak::moe_swiglu_backward", _backward_impl, mutates_args=(),
    schema=f"(Tensor grad_output, {_TENSORS_SCHEMA}, {_OPTIONS_SCHEMA}) -> (Tensor, Tensor, Tensor, Tensor)")


@_backward.register_fake
def _backward_fake(grad_output: Tensor, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor,
                   gate_up_proj: Tensor, down_proj: Tensor, group: int, num_experts: int,
                   *opts: Any) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return (torch.empty_like(hidden_states), torch.empty_like(topk_weights), torch.empty_like(gate_up_proj),
            torch.empty_like(down_proj))


def _setup_context(ctx, inputs, output):
    hidden_states, topk_ids, topk_weights, gate_up_proj, down_proj, *options = inputs
    ctx.save_for_backward(hidden_states, topk_ids, topk_weights, gate_up_proj, down_proj)
    ctx.options = options


def _backward_autograd(ctx, grad_y, _grad_counts, _grad_stats):
    saved = ctx.saved_tensors
    dx, dw, dgu, dd = _backward(grad_y, *saved, *ctx.options)
    hidden_states, _, topk_weights, gate_up_proj, down_proj = saved
    grads = guard_grads((dx, None, dw, dgu, dd), (hidden_states, topk_weights, gate_up_proj, down_proj, grad_y),
                        "moe_swiglu")
    return grads + (None,) * len(ctx.options)


_forward.register_autograd(_backward_autograd, setup_context=_setup_context)


class _SavingSwiGLU(torch.autograd.Function):
    """``activations="save"`` on CPU tensors: the forward keeps its rows and pre-activations in a
    ``uint8`` tensor saved for backward like any other (so checkpointing and saved-tensor hooks
    drop, offload or recompute it as they do the rest), and backward reads it instead of
    recomputing."""

    @staticmethod
    def forward(ctx, hidden_states, topk_ids, topk_weights, gate_up_proj, down_proj, group, num_experts, options):
        pg = _group(group)
        experts = num_experts or gate_up_proj.shape[0] * _world_size(pg)
        y = torch.empty(hidden_states.shape, dtype=torch.float32)
        counts = torch.empty((experts,), dtype=torch.int64)
        args = (hidden_states, topk_ids, topk_weights, gate_up_proj, down_proj)
        opts = _options(*options)
        store = torch.empty(_ext.moe_saved_bytes(opts, pg, args, num_experts or None), dtype=torch.uint8)
        stats = _ext.moe_forward(opts, pg, args, num_experts or None, (y, counts, store))
        ctx.save_for_backward(*args, store)
        ctx.call = (group, num_experts, options)
        stats_tensor = torch.tensor(stats, dtype=torch.int64)
        ctx.mark_non_differentiable(counts, stats_tensor)
        return y.to(hidden_states.dtype), counts, stats_tensor

    @staticmethod
    def backward(ctx, grad_y, _grad_counts, _grad_stats):
        hidden_states, topk_ids, topk_weights, gate_up_proj, down_proj, store = ctx.saved_tensors
        group, num_experts, options = ctx.call
        with torch.no_grad():
            dx = torch.empty(hidden_states.shape, dtype=torch.float32)
            dw = torch.empty(topk_weights.shape, dtype=torch.float32)
            dgu = torch.empty(gate_up_proj.shape, dtype=torch.float32)
            dd = torch.empty(down_proj.shape, dtype=torch.float32)
            dy = grad_y.to(hidden_states.dtype).contiguous()
            _ext.moe_backward(_options(*options), _group(group),
                              (hidden_states, topk_ids, topk_weights, gate_up_proj, down_proj), num_experts or None,
                              (dy, store), (dx, dw, dgu, dd))
            grads = (dx.to(hidden_states.dtype), None, dw, dgu.to(gate_up_proj.dtype), dd.to(down_proj.dtype))
        anchors = (hidden_states, topk_weights, gate_up_proj, down_proj, grad_y)
        return guard_grads(grads, anchors, "moe_swiglu") + (None, None, None)


@torch.compiler.disable
def _saving(*args):
    """:class:`_SavingSwiGLU` (eager: its store is not a tensor a compiled graph can carry)."""
    return _SavingSwiGLU.apply(*args)


def moe_swiglu(
    hidden_states: Tensor,
    topk_ids: Tensor,
    topk_weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    *,
    group: Optional["torch.distributed.ProcessGroup"] = None,
    num_experts: Optional[int] = None,
    scheme: str = "pipelined",
    pair_cap_rows: Optional[int] = None,
    budget_bytes: Optional[int] = None,
    max_tokens_factor: Optional[float] = None,
    min_tokens_per_gemm: Optional[int] = None,
    imbalance_threshold: Optional[float] = None,
    activations: str = "recompute",
    return_stats: bool = False,
) -> Union[Tensor, Tuple[Tensor, MoEStats]]:
    r"""The SwiGLU experts of a Mixture-of-Experts layer, expert-parallel over ``group``, exact.

    ``y_t = sum_j w_tj * down_e(silu(gate_e x_t) * up_e x_t)`` with ``e = topk_ids[t, j]`` and
    ``w_tj = topk_weights[t, j]`` used as given (no renormalisation), in the input's dtype.

    Args:
        hidden_states: ``[T, H]`` or ``[B, S, H]``, float32 or bfloat16, contiguous. Each rank
            passes its own tokens; T may differ between ranks (zero included).
        topk_ids: int64 global expert ids, ``[T, k]`` (``[B, S, k]``); duplicates allowed.
        topk_weights: ``[T, k]`` (``[B, S, k]``), float32 or the input's dtype.
        gate_up_proj: this rank's experts, ``[E_local, 2I, H]`` (the gate's I rows, then the
            up's), the input's dtype, read in place.
        down_proj: ``[E_local, H, I]``, read in place.
        group: the expert-parallel ``torch.distributed`` process group (expert ``e`` lives on its
            rank ``e // E_local``); ``None``: this process holds every expert.
        num_experts: E, by default ``E_local`` x the group's size (and it must be that).
        scheme: ``"pipelined"`` (PipelinedLLEP: every buffer fixed at launch), ``"llep"`` or
            ``"standard"`` (the baselines, whose buffers follow the routing).
        pair_cap_rows: q, the rows any rank sends any other in one round (``None``: the largest
            ``budget_bytes`` holds).
        budget_bytes: bound of the working set (``None``: 64 MiB on a CPU, 768 MiB on a GPU,
            above the least this shape runs in, one row per rank pair with its foreign expert
            slots; one process keeps no foreign slots and one buffer copy); the plan takes the
            largest pair cap whose buffers fit it, before any routing is known. That working set
            is reserved once per shape and kept between calls with the executor that runs it,
            in flatpeak's executor cache (:func:`flatpeak.torch.executor_cache_bytes`; at most
            :func:`flatpeak.torch.executor_cache_limit`, 1 GiB by default, beside the model's
            memory; :func:`flatpeak.torch.clear_executor_cache` frees it).
        max_tokens_factor, min_tokens_per_gemm, imbalance_threshold: the least-loaded
            assignment's alpha, minimum chunk and imbalance threshold (llep's defaults).
        activations: what forward keeps for backward. ``"recompute"``: nothing but its inputs
            (checkpointed; backward re-dispatches each round and recomputes its experts' forward,
            12 GEMMs per expert group in all instead of 9): the layer's memory is the plan's
            working set, whatever the routing. ``"save"``: a forward that needs a gradient keeps
            this rank's received rows and their SwiGLU pre-activations (``saved_bytes`` of
            :class:`MoEStats`, at most ``rows x (H + 4I)`` elements, following the routing) until
            backward, which then dispatches only dY and runs no recompute; CPU tensors only, run
            eagerly (``torch.compile`` runs it outside the graph). Every rank passes the same.
            Results are bitwise the same either way.
        return_stats: also return a :class:`MoEStats`.

    Bad input on any rank (an id out of range, shapes or dtypes that differ between ranks, E not
    divisible by the group's size) raises on every rank -- ``ValueError``, or ``TypeError`` for a
    dtype -- naming the rank and its values; no rank is left waiting.
    """
    if scheme not in _SCHEMES:
        raise ValueError(f"scheme: expected one of {_SCHEMES}, got {scheme!r}")
    if activations not in _ACTIVATIONS:
        raise ValueError(f"activations: expected one of {_ACTIVATIONS}, got {activations!r}")
    check_tensors("moe_swiglu", (("hidden_states", hidden_states), ("topk_ids", topk_ids),
                                 ("topk_weights", topk_weights), ("gate_up_proj", gate_up_proj),
                                 ("down_proj", down_proj)),
                  "pass .to_local() of the expert weights and the expert-parallel group (MoEExperts(mesh=) does)")
    check_float("hidden_states", hidden_states)
    lead = hidden_states.shape[:-1]
    if topk_ids.shape[:-1] != lead or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights: expected shape {list(lead)} + [k], got {list(topk_ids.shape)} "
                         f"and {list(topk_weights.shape)}")
    if topk_weights.dtype not in (torch.float32, hidden_states.dtype):
        raise TypeError(f"topk_weights: expected torch.float32 or {hidden_states.dtype}, got {topk_weights.dtype}")
    if topk_ids.dtype != torch.int64:
        raise TypeError(f"topk_ids: expected dtype torch.int64, got {topk_ids.dtype}")
    h, k = hidden_states.shape[-1], topk_ids.shape[-1]
    x = hidden_states.reshape(-1, h)
    ids = topk_ids.reshape(-1, k).contiguous()
    # The routing weights as float32 (a bf16 router's [T, k] widened: autograd narrows their
    # gradient back).
    weights = topk_weights.reshape(-1, k).to(torch.float32).contiguous()
    # In OPTIONS order.
    options = (scheme, pair_cap_rows, budget_bytes, max_tokens_factor, min_tokens_per_gemm, imbalance_threshold,
               activations)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, weights, gate_up_proj, down_proj))
    if activations == "save" and needs_grad and not x.is_cuda:
        y, counts, stats = _saving(x, ids, weights, gate_up_proj, down_proj, _handle(group), int(num_experts or 0),
                                   options)
    else:
        y, counts, stats = torch.ops.flatpeak.moe_swiglu_forward(
            x, ids, weights, gate_up_proj, down_proj, _handle(group), int(num_experts or 0), *options)
    if y.shape != hidden_states.shape:  # [B, S, H] in; a [T, H] result is returned as it is, not a view
        y = y.reshape(hidden_states.shape)
    if not return_stats:
        return y
    return y, MoEStats(counts, *(int(v) for v in stats.tolist()))


class MoEExperts(torch.nn.Module):
    r"""The experts of a MoE layer as a module owning this rank's slice of the weights:
    ``gate_up_proj`` ``[E_local, 2I, H]`` and ``down_proj`` ``[E_local, H, I]`` (Hugging Face
    transformers' fused layout), ``E_local = num_experts / P``; ``forward(hidden_states,
    topk_ids, topk_weights)`` is :func:`moe_swiglu` over the ``P`` expert-parallel ranks. Options
    of :func:`moe_swiglu` (``scheme``, ``budget_bytes``, ...) are keyword arguments.

    The ranks are ``mesh`` or ``group`` (at most one):

    - ``mesh``, a 1-D ``DeviceMesh`` (the expert-parallel dimension of a larger mesh, e.g.
      ``world_mesh["ep"]``): the weights are ``DTensor``\ s ``Shard(0)`` on it (torchtitan's
      ``GroupedExperts`` convention), so ``fully_shard(experts, mesh=world_mesh["efsdp"])`` shards
      them further correctly and ``torch.distributed.checkpoint`` reshards them. The forward
      computes on the local slices over the mesh's group.
    - ``group``, a process group: plain tensors, this rank's own, marked rank-private (so
      ``StreamAdamW(process_group=)`` counts them once). For DDP, register them as ignored
      (:func:`exclude_experts_from_ddp`); ``fully_shard`` must not take them (it would treat
      them as replicated): the forward refuses weights it swapped in.
    """

    gate_up_proj: torch.nn.Parameter
    down_proj: torch.nn.Parameter

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, *, group=None, mesh=None,
                 dtype: Optional[torch.dtype] = None, device=None, **options):
        super().__init__()
        if group is not None and mesh is not None:
            raise ValueError("group and mesh: pass one (the mesh carries its group)")
        for name, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
                raise ValueError(f"{name}: expected a positive int, got {size!r}")
        world = check_ep_mesh(mesh, num_experts) if mesh is not None else _world_size(group)
        if num_experts <= 0 or num_experts % world:
            raise ValueError(f"num_experts={num_experts} must be a positive multiple of the group size {world}")
        if set(options) - set(_OPTION_NAMES):
            raise TypeError(f"unexpected options {sorted(set(options) - set(_OPTION_NAMES))} (expected some of "
                            f"{list(_OPTION_NAMES)})")
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.group, self.mesh, self.options = group, mesh, options
        e_local = num_experts // world
        kwargs: Dict[str, Any] = dict(dtype=dtype, device=device)
        weights = {"gate_up_proj": torch.empty(e_local, 2 * intermediate_size, hidden_size, **kwargs),
                   "down_proj": torch.empty(e_local, hidden_size, intermediate_size, **kwargs)}
        own_experts(self, {name: w.requires_grad_() for name, w in weights.items()}, group, mesh)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``nn.Linear``'s initialisation, per expert (of this rank's slice)."""
        with torch.no_grad():
            for w in (self.gate_up_proj, self.down_proj):
                bound = 1.0 / math.sqrt(w.shape[-1])
                torch.nn.init.uniform_(local(w), -bound, bound)

    def forward(self, hidden_states: Tensor, topk_ids: Tensor, topk_weights: Tensor) -> Tensor:
        (gate_up, down), group = expert_weights(self, ("gate_up_proj", "down_proj"), self.group)
        y = moe_swiglu(hidden_states, topk_ids, topk_weights, gate_up, down, group=group,
                       num_experts=self.num_experts, **self.options)
        return cast(Tensor, y)  # the options exclude return_stats

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, local={local(self.gate_up_proj).shape[0]}")
