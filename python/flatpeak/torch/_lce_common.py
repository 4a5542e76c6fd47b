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


def _not_twice(op: str) -> str:
    return (f"flatpeak's {op} is differentiable once: its backward is not differentiable (a gradient penalty "
            f"through it would be silently zero)")


class _NotTwice(torch.autograd.Function):
    """Passes the first ``n`` tensors (gradients) through unchanged; the rest are anchors, the
    tensors those gradients are functions of, read by nothing: they put this node between the
    gradients and everything the gradients depend on, so differentiating a gradient with
    respect to any of it reaches :meth:`backward`, which raises (torch's
    ``once_differentiable`` hangs its error off detached tensors, so ``torch.autograd.grad``
    with respect to an input never reaches it and returns ``None``)."""

    @staticmethod
    def forward(ctx: Any, op: str, n: int, *tensors: Tensor) -> Tuple[Tensor, ...]:
        ctx.op = op
        return tuple(g.view_as(g) for g in tensors[:n])

    @staticmethod
    def backward(ctx: Any, *upstream: Tensor) -> Tuple[Tensor, ...]:
        raise RuntimeError(_not_twice(ctx.op))


def guard_grads(grads: Tuple[Any, ...], anchors: Sequence[Any], op: str = "linear_cross_entropy") -> Tuple[Any, ...]:
    """``grads`` as backward returns them; when backward runs with a graph (``create_graph=True``)
    and one of ``anchors`` (the op's inputs, a saved output, the upstream gradient: what the
    gradients are functions of) requires grad, each gradient tensor is an output of a
    :class:`_NotTwice` node hung off those anchors, which raises when differentiated, instead of
    a constant whose derivative would silently be zero or ``None``; its message names ``op``."""
    connected = [a for a in anchors if isinstance(a, Tensor) and a.requires_grad]
    if not (connected and torch.is_grad_enabled()):
        return grads
    tensors = [g for g in grads if isinstance(g, Tensor)]
    if not tensors:  # every gradient skipped (a frozen tensor gets None)
        return grads
    guarded = iter(_NotTwice.apply(op, len(tensors), *[g.detach().requires_grad_() for g in tensors], *connected))
    return tuple(next(guarded) if isinstance(g, Tensor) else g for g in grads)
