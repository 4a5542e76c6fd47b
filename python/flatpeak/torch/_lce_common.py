"""What the single-process and the ring loss ops share: the options object and the guard that
keeps their backward from being differentiated."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import _flatpeak as _ext


def _options(ignore_index, reduction, label_smoothing, z_loss, softcap, budget_bytes, precision):
    return _ext.LossOptions(
        ignore_index=ignore_index,
        reduction=reduction,
        label_smoothing=label_smoothing,
        z_loss=z_loss,
        softcap=softcap,
        budget_bytes=budget_bytes,
        precision=precision,
    )


_NOT_TWICE = ("flatpeak's linear_cross_entropy is differentiable once: its backward is not "
              "differentiable (a gradient penalty through it would be silently zero)")


def _once_differentiable(grads, needs_graph: bool):
    """``grads`` as backward returns them; when the caller asked for a graph of the backward
    (``create_graph=True``) through inputs that require grad, each gradient tensor carries a node
    that raises if it is differentiated, as torch's ``once_differentiable`` does, instead of
    being a constant whose derivative is silently dropped."""
    if not (needs_graph and torch.is_grad_enabled()):
        return grads
    tensors = [g for g in grads if isinstance(g, Tensor)]
    if not tensors:  # every gradient skipped (a frozen tensor gets None)
        return grads
    refuse = torch._C._functions.DelayedError(_NOT_TWICE, len(tensors))
    guarded = refuse(*[g.detach().requires_grad_() for g in tensors])
    # One input gives one tensor, not a tuple of one (a frozen weight leaves dX alone).
    guarded = iter((guarded,) if isinstance(guarded, Tensor) else guarded)
    return tuple(next(guarded) if isinstance(g, Tensor) else g for g in grads)
