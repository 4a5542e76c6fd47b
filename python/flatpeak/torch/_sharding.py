"""How a tensor is laid out over the ranks of a process group, for the decisions the ranks take
together: FSDP2's ``DTensor`` parameters (their local shards, their placements) and the plain
tensors that are each rank's own (expert-parallel experts)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

#: The attribute that marks a plain parameter as this rank's own (not a replica of the others').
RANK_PRIVATE = "_flatpeak_rank_private"


#: The exact types no ``DTensor`` has: the common case, answered without an import or a
#: subclass check (an optimizer step asks once per tensor of every parameter).
_PLAIN = (Tensor, torch.nn.Parameter)


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor``."""
    if type(t) in _PLAIN:
        return False
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def _dtensor_type() -> Optional[type]:
    """``torch.distributed.tensor.DTensor``, or ``None`` without ``torch.distributed``."""
    global _DTENSOR
    if _DTENSOR is _UNKNOWN:
        if torch.distributed.is_available():
            from torch.distributed.tensor import DTensor

            _DTENSOR = DTensor
        else:
            _DTENSOR = None
    return _DTENSOR


_UNKNOWN = object()
_DTENSOR: Any = _UNKNOWN


def local(t: Tensor) -> Tensor:
    """The tensor whose storage this rank holds: a ``DTensor``'s local shard (a view of it, so
    writes land in the ``DTensor``), or ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def mark_rank_private(param: Tensor) -> None:
    """Marks a plain parameter as this rank's own: no other rank holds its values (an expert
    slice), so a group's gradient norm counts it on every rank. The mark is an attribute of the
    parameter: pickling keeps it, ``copy.deepcopy`` does not (torch copies a parameter's data
    only), so mark a deep copy's experts again, or give their param group ``"replicated": False``."""
    setattr(param, RANK_PRIVATE, True)


def is_rank_private(param: Tensor) -> bool:
    """Whether :func:`mark_rank_private` marked ``param``."""
    return bool(getattr(param, RANK_PRIVATE, False))


def copies(param: Tensor, grad: Optional[Tensor], group, replicated: bool) -> int:
    """How many ranks of ``group`` hold ``param``'s local values alike, so each element counts once
    in a norm over the group: for a ``DTensor``, the product of its mesh's ``Replicate`` dimensions
    times the copies of its mesh in the group; for a plain tensor, every rank of the group when
    ``replicated`` (a DDP replica), else 1 (rank-private). A ``Partial`` gradient is refused: it
    must be reduced before the step."""
    if group is None:
        return 1
    world = torch.distributed.get_world_size(group)
    if not is_dtensor(param):
        return world if replicated and not is_rank_private(param) else 1
    mesh = param.device_mesh  # type: ignore[attr-defined]
    if grad is not None and is_dtensor(grad):
        for dim, placement in enumerate(grad.placements):  # type: ignore[attr-defined]
            if placement.is_partial():
                raise ValueError(f"a gradient is Partial on mesh dimension {dim} ({grad.placements}): reduce it "  # type: ignore[attr-defined]
                                 f"(redistribute to Shard or Replicate) before the optimizer step")
    if world % mesh.size():
        raise ValueError(f"process_group: {world} ranks, not a whole number of copies of a parameter's mesh of "
                         f"{mesh.size()} ranks {tuple(mesh.shape)}: the group must hold whole copies of every mesh")
    n = world // mesh.size()
    for dim, placement in enumerate(param.placements):  # type: ignore[attr-defined]
        if placement.is_replicate():
            n *= mesh.size(dim)
    return n


def own_experts(module: torch.nn.Module, weights: Dict[str, Tensor], group, mesh) -> None:
    """Makes ``weights`` (this rank's ``[E_local, ...]`` slices, by attribute name) the expert
    parameters of ``module``: over ``mesh`` (a 1-D expert-parallel ``DeviceMesh``) ``DTensor``\\ s
    ``Shard(0)`` on it, which ``fully_shard(module, mesh=efsdp_mesh)`` shards further correctly
    (torchtitan's ``GroupedExperts`` convention); over ``group`` plain tensors marked
    rank-private; otherwise plain tensors. The module remembers them, so a forward can tell they
    were replaced (:func:`expert_weights`)."""
    params = []
    for name, w in weights.items():
        requires_grad = w.requires_grad
        w = w.detach()
        if mesh is not None:
            from torch.distributed.tensor import DTensor, Shard

            w = DTensor.from_local(w, mesh, [Shard(0)], run_check=False)
        param = torch.nn.Parameter(w, requires_grad=requires_grad)
        if group is not None:
            mark_rank_private(param)
        setattr(module, name, param)
        params.append(param)
    module.__dict__["_flatpeak_own"] = tuple(params) if group is not None else ()
    module.__dict__["_flatpeak_mesh"] = mesh


def check_ep_mesh(mesh, num_experts: int) -> int:
    """The size of a 1-D expert-parallel mesh that splits ``num_experts`` evenly."""
    if mesh.ndim != 1:
        raise ValueError(f"mesh: expected the 1-D expert-parallel mesh (e.g. world_mesh['ep']), got a {mesh.ndim}-D "
                         f"mesh {tuple(mesh.shape)}")
    if num_experts <= 0 or num_experts % mesh.size():
        raise ValueError(f"num_experts={num_experts} must be a positive multiple of the mesh size {mesh.size()}")
    return int(mesh.size())


def expert_weights(module: torch.nn.Module, names: Tuple[str, ...], group) -> Tuple[Tuple[Tensor, ...], Any]:
    """The expert weights a forward computes with, and the group to dispatch over: a mesh's
    ``DTensor`` weights as their local shards (gradients flow back as ``DTensor``\\ s) over the
    mesh's group; a group's rank-private weights as they are, over it -- unless they are no longer
    the tensors :func:`own_experts` made (``fully_shard`` over them swaps in a patchwork of the
    ranks' slices): a ``RuntimeError`` that says what to do."""
    weights = tuple(getattr(module, n) for n in names)
    mesh = module.__dict__.get("_flatpeak_mesh")
    if mesh is not None:
        if not all(is_dtensor(w) for w in weights):
            raise RuntimeError(f"{type(module).__name__}: its expert weights were made DTensors on the expert-parallel "
                               f"mesh and are no longer DTensors: replace them with DTensors Shard(0) on that mesh")
        return tuple(w.to_local() for w in weights), mesh.get_group()
    own = module.__dict__.get("_flatpeak_own", ())
    if group is not None and own and any(w is not o for w, o in zip(weights, own)):
        raise RuntimeError(
            f"{type(module).__name__}: the expert weights are no longer this rank's own slices (fully_shard over "
            f"expert-parallel experts treats them as replicated and mixes the ranks' experts): build the experts "
            f"on the expert-parallel mesh instead (MoEExperts(mesh=), flatpeak.transformers.apply(ep_mesh=)), whose "
            f"DTensor weights fully_shard shards correctly, or leave them out of fully_shard (ignored_params)")
    return weights, group


def exclude_experts_from_ddp(model: torch.nn.Module) -> List[str]:
    """Registers every rank-private expert weight of ``model`` (``MoEExperts(group=)``'s,
    ``flatpeak.transformers.apply(group=)``'s) as ignored by ``DistributedDataParallel``, so
    ``DDP(model)`` neither broadcasts rank 0's experts to the other ranks nor averages different
    experts' gradients. Call it before ``DDP(model)``; returns the names."""
    from torch.nn.parallel import DistributedDataParallel

    names = [name for name, p in model.named_parameters() if is_rank_private(p)]
    ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, ignored + [n for n in names if n not in ignored])
    return names


def refuse_wrapped(model: torch.nn.Module, call: str) -> None:
    """A ``ValueError`` when ``model`` is already wrapped for data parallelism (DDP, FSDP2) or
    holds ``DTensor`` parameters: ``call`` replaces modules and parameters, which the wrappers
    have already taken hold of."""
    from torch.nn.parallel import DistributedDataParallel

    wrapped = isinstance(model, DistributedDataParallel)
    if not wrapped and torch.distributed.is_available():
        from torch.distributed.fsdp import FSDPModule

        wrapped = any(isinstance(m, FSDPModule) for m in model.modules())
    if wrapped or any(is_dtensor(p) for p in model.parameters()):
        raise ValueError(f"{call}: the model is already wrapped (DDP, fully_shard) or sharded: apply flatpeak first, "
                         f"then wrap it")
