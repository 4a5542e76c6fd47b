"""What the single-process and the ring loss ops share: the loss's options, defined once (their
names, their op schema and their conversion into the extension's ``LossOptions``), and the guard
that keeps their backward from being differentiated."""

from __future__ import annotations

from typing import Any, Sequence, Tuple

import torch
from torch import Tensor

from .. import _flatpeak as _ext

#: The loss's options in the order every op takes them, with their schema types: the one
#: definition of the ops' option arguments (each op's schema and implementation take them as a
#: tail ``*options``).
OPTIONS: Tuple[Tuple[str, str], ...] = (
    ("ignore_index", "int"),
    ("reduction", "str"),
    ("label_smoothing", "float"),
    ("z_loss", "float"),
    ("softcap", "float?"),
    ("budget_bytes", "int?"),
    ("precision", "str"),
)

#: The options as a ``torch.library`` schema fragment.
OPTIONS_SCHEMA = ", ".join(f"{kind} {name}" for name, kind in OPTIONS)

#: The tensors every loss op takes first, as a schema fragment.
TENSORS_SCHEMA = "Tensor input, Tensor weight, Tensor target, Tensor? bias, Tensor? token_weights"

_REDUCTION = [name for name, _ in OPTIONS].index("reduction")


def options(values: Sequence[Any]) -> Any:
    """The extension's checked ``LossOptions`` of option values in :data:`OPTIONS` order."""
    if len(values) != len(OPTIONS):
        raise TypeError(f"expected {len(OPTIONS)} loss options ({OPTIONS_SCHEMA}), got {len(values)}")
    return _ext.LossOptions(**{name: value for (name, _), value in zip(OPTIONS, values)})


def per_token(values: Sequence[Any]) -> bool:
    """Whether option values in :data:`OPTIONS` order ask for one loss per token."""
    return values[_REDUCTION] == "none"


_NOT_TWICE = ("flatpeak's linear_cross_entropy is differentiable once: its backward is not "
              "differentiable (a gradient penalty through it would be silently zero)")


class _NotTwice(torch.autograd.Function):
    """Passes gradients through unchanged; differentiating them raises (torch's
    ``once_differentiable`` behaviour, through public API)."""

    @staticmethod
    def forward(ctx: Any, *grads: Tensor) -> Tuple[Tensor, ...]:
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx: Any, *upstream: Tensor) -> Tuple[Tensor, ...]:
        raise RuntimeError(_NOT_TWICE)


def guard_grads(grads: Tuple[Any, ...], needs_graph: bool) -> Tuple[Any, ...]:
    """``grads`` as backward returns them; when the caller asked for a graph of the backward
    (``create_graph=True``) through inputs that require grad, each gradient tensor carries a node
    that raises if it is differentiated, as torch's ``once_differentiable`` does, instead of
    being a constant whose derivative is silently dropped."""
    if not (needs_graph and torch.is_grad_enabled()):
        return grads
    tensors = [g for g in grads if isinstance(g, Tensor)]
    if not tensors:  # every gradient skipped (a frozen tensor gets None)
        return grads
    guarded = iter(_NotTwice.apply(*[g.detach().requires_grad_() for g in tensors]))
    return tuple(next(guarded) if isinstance(g, Tensor) else g for g in grads)
