"""How a tensor is laid out over the ranks of a process group, for the decisions the ranks take
together: FSDP2's ``DTensor`` parameters (their local shards, their placements) and the plain
tensors that are each rank's own (expert-parallel experts)."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

#: The attribute that marks a plain parameter as this rank's own (not a replica of the others').
RANK_PRIVATE = "_flatpeak_rank_private"


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor``."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: Tensor) -> Tensor:
    """The tensor whose storage this rank holds: a ``DTensor``'s local shard (a view of it, so
    writes land in the ``DTensor``), or ``t`` itself."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def mark_rank_private(param: Tensor) -> None:
    """Marks a plain parameter as this rank's own: no other rank holds its values (an expert
    slice), so a group's gradient norm counts it on every rank."""
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
