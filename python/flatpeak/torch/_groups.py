"""Process groups as custom-op arguments: ``torch.library`` ops take numbers, not groups, so a
group is passed by handle and resolved inside the op."""

from __future__ import annotations

import torch

#: Process groups by handle; 0 is "no group" (one process).
_GROUPS: dict = {}


def handle(group) -> int:
    """The handle of ``group`` (0 for ``None``), kept resolvable for the process's life."""
    if group is None:
        return 0
    key = id(group)
    _GROUPS[key] = group
    return key


def resolve(key: int):
    """The group of a handle (``None`` for 0)."""
    return None if key == 0 else _GROUPS[key]


def world_size(group) -> int:
    """Ranks of ``group`` (1 for ``None``)."""
    if group is None:
        return 1
    return torch.distributed.get_world_size(group)
