"""``StreamAdamW``: ``torch.optim.AdamW``'s update run by flatpeak's SIMD CPU kernel, in place.

The state lives in ``self.state[p]`` under torch's names (``step``, ``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq``), so ``state_dict()`` / ``load_state_dict()`` round-trip, into and out of
``torch.optim.AdamW`` too, and LR schedulers drive ``param_groups[i]["lr"]`` as usual.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch.optim.optimizer import _get_scalar_dtype

from .. import _flatpeak as _ext


class StepResult(NamedTuple):
    """What :meth:`StreamAdamW.step` did."""

    #: True when a non-finite gradient made the step skip (nothing was changed).
    skipped: bool
    #: The closure's loss, when a closure was given.
    loss: Optional[torch.Tensor]


def _hyperparameters(group) -> "_ext.AdamWOptions":
    lr = group["lr"]
    return _ext.AdamWOptions(
        lr=float(lr.item() if isinstance(lr, torch.Tensor) else lr),
        betas=(float(group["betas"][0]), float(group["betas"][1])),
        eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
        amsgrad=bool(group["amsgrad"]),
        maximize=bool(group["maximize"]),
    )


class StreamAdamW(torch.optim.Optimizer):
    r"""AdamW with ``torch.optim.AdamW``'s constructor, update and state, on fp32 CPU parameters.

    The update (decoupled weight decay, bias corrections in float64, AMSGrad's running max of
    the raw second moment, ``maximize``) is torch's, in torch's order of float32 operations; it
    is run by flatpeak's runtime-dispatched SIMD kernel over all cores, in place on the
    parameters and on the state tensors.

    One difference from torch: before any parameter is touched, the step checks every gradient
    (one pass, the sum of squares in float64); if any element is NaN or infinite, the step is
    skipped -- parameters, moments and step counts are left exactly as they were -- and
    :meth:`step` returns ``StepResult(skipped=True, ...)``.

    Parameters must be contiguous float32 CPU tensors with dense float32 gradients (CUDA
    parameters need the package built with the ``cuda`` feature).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize)
        _hyperparameters(defaults)  # a bad hyperparameter fails here, naming its value
        super().__init__(params, defaults)
        #: Steps skipped for non-finite gradients so far.
        self.skipped_steps = 0

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)

    def _state_of(self, p: torch.Tensor, amsgrad: bool):
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=_get_scalar_dtype())
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None) -> StepResult:
        """One AdamW step of every parameter with a gradient; see the class docs for the skip."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise TypeError("StreamAdamW does not support sparse gradients")
                    grads.append(p.grad)
        if not grads:
            return StepResult(False, loss)
        if not math.isfinite(_ext.grad_sq_sum_all(grads)):
            self.skipped_steps += 1
            return StepResult(True, loss)
        batches, counters = [], []
        for group in self.param_groups:
            amsgrad = bool(group["amsgrad"])
            params = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self._state_of(p, amsgrad)
                step = int(state["step"].item()) + 1
                params.append((p, p.grad, state["exp_avg"], state["exp_avg_sq"],
                               state["max_exp_avg_sq"] if amsgrad else None, step))
                counters.append(state["step"])
            batches.append((_hyperparameters(group), params))
        # Every tensor of every group is checked before any is written.
        _ext.adamw_step(batches)
        for step in counters:
            step += 1
        return StepResult(False, loss)
