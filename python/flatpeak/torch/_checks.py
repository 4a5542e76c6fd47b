"""The checks every entry point makes on its tensor arguments, before any reaches an op."""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

import torch
from torch import Tensor

from ._sharding import is_dtensor


def check_tensors(call: str, tensors: Iterable[Tuple[str, Optional[Tensor]]], local_hint: str) -> None:
    """Each named argument a plain tensor (or ``None`` where optional), all on one device --
    ``meta`` included: a meta tensor among real ones would otherwise run the fake implementation
    and return uninitialised memory (the messages are torch's). A ``DTensor`` is a ``TypeError``
    that says what to pass instead (``local_hint``): ``call`` runs on this rank's tensors."""
    devices: Dict[torch.device, str] = {}
    for name, t in tensors:
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if is_dtensor(t):
            raise TypeError(f"{name}: a DTensor (placements {tuple(t.placements)}): {call} takes this rank's plain "  # type: ignore[attr-defined]
                            f"tensors; {local_hint}")
        devices.setdefault(t.device, name)
    if len(devices) > 1:
        (first, a), (second, b) = list(devices.items())[:2]
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"{first} and {second}! ({a} is on {first}, {b} on {second})")


#: What a float16 tensor is told: what flatpeak computes in instead.
FLOAT16_HINT = ("float16 is not supported (flatpeak accumulates bfloat16 and float32 in float32): use bfloat16, or "
                "float32 weights under torch.autocast(dtype=torch.bfloat16)")


def check_float(name: str, t: Tensor) -> None:
    """``t`` float32 or bfloat16 (what the loss and the experts compute in), or a ``TypeError``
    naming its dtype and, for float16, what works instead."""
    if t.dtype in (torch.float32, torch.bfloat16):
        return
    hint = f": {FLOAT16_HINT}" if t.dtype == torch.float16 else ""
    raise TypeError(f"{name}: expected dtype torch.float32 or torch.bfloat16, got {t.dtype}{hint}")
