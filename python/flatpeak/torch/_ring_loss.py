"""``linear_cross_entropy(..., group=, ring=)``: the vocabulary-parallel loss over a
``torch.distributed`` process group, ring-dtp's two rings.

Each rank passes its own tokens and its shard of the projection (rank ``r`` of ``P`` holding
vocabulary rows ``r * ceil(V / P)`` onwards, ``V`` the sum of the shards); the loss is the one over
every rank's tokens and the whole vocabulary, the same scalar on every rank, and backward gives
each rank its own tokens' ``dx`` and its shard's ``dw``. The ring runs in Rust; its messages go
through the group's ``all_to_all_single`` (gloo, CPU tensors); on CUDA tensors (built with
``cuda``) the ring runs on the GPU over an NCCL communicator of the group's ranks, on torch's
current stream. Two ``torch.library`` custom ops carry it, wired with ``register_autograd`` as
the single-process loss is.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
from torch import Tensor

from .. import _flatpeak as _ext
from ._groups import resolve
from ._lce_common import OPTIONS_SCHEMA, TENSORS_SCHEMA, guard_grads, options, per_token

RINGS = ("weight", "activation")


def _forward_impl(input: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor],
                  token_weights: Optional[Tensor], group: int, ring: Optional[str],
                  *opts: Any) -> Tuple[Tensor, Tensor]:
    n = input.shape[0]
    loss = torch.empty((n,) if per_token(opts) else (), dtype=torch.float32)
    lse = torch.empty((n,), dtype=torch.float32)
    _ext.lce_ring_forward(options(opts), resolve(group), ring, (input, weight, target, bias, token_weights),
                          (loss, lse))
    return loss.to(input.device, input.dtype), lse.to(input.device)


_forward = torch.library.custom_op(
    "flatpeak::linear_cross_entropy_ring_forward", _forward_impl, mutates_args=(),
    schema=f"({TENSORS_SCHEMA}, int group, str? ring, {OPTIONS_SCHEMA}) -> (Tensor, Tensor)")


@_forward.register_fake
def _forward_fake(input: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor],
                  token_weights: Optional[Tensor], group: int, ring: Optional[str],
                  *opts: Any) -> Tuple[Tensor, Tensor]:
    n = input.shape[0]
    return input.new_empty((n,) if per_token(opts) else ()), input.new_empty((n,), dtype=torch.float32)


def _backward_impl(grad_loss: Tensor, grad_lse: Optional[Tensor], input: Tensor, weight: Tensor, target: Tensor,
                   bias: Optional[Tensor], token_weights: Optional[Tensor], lse: Tensor, group: int,
                   ring: Optional[str], *opts: Any) -> Tuple[Tensor, Tensor, Tensor]:
    f32: Dict[str, Any] = dict(dtype=torch.float32, device=input.device)
    dx = torch.empty(input.shape, **f32)
    dw = torch.empty(weight.shape, **f32)
    dbias = torch.empty((weight.shape[0] if bias is not None else 0,), **f32)
    # Upstream gradients and the lse are n values: made dense on the host, where the ring forms
    # the row scales.
    upstream = (grad_loss.to("cpu", torch.float32).contiguous(),
                None if grad_lse is None else grad_lse.to("cpu", torch.float32).contiguous())
    grads = (dx, dw, dbias if bias is not None else None)
    _ext.lce_ring_backward(options(opts), resolve(group), ring, (input, weight, target, bias, token_weights),
                           lse.cpu().contiguous(), upstream, grads)
    return dx.to(input.dtype), dw.to(weight.dtype), dbias


_backward = torch.library.custom_op(
    "flatpeak::linear_cross_entropy_ring_backward", _backward_impl, mutates_args=(),
    schema=f"(Tensor grad_loss, Tensor? grad_lse, {TENSORS_SCHEMA}, Tensor lse, int group, str? ring, "
           f"{OPTIONS_SCHEMA}) -> (Tensor, Tensor, Tensor)")


@_backward.register_fake
def _backward_fake(grad_loss: Tensor, grad_lse: Optional[Tensor], input: Tensor, weight: Tensor, target: Tensor,
                   bias: Optional[Tensor], token_weights: Optional[Tensor], lse: Tensor, group: int,
                   ring: Optional[str], *opts: Any) -> Tuple[Tensor, Tensor, Tensor]:
    dbias = input.new_empty((weight.shape[0] if bias is not None else 0,), dtype=torch.float32)
    return torch.empty_like(input), torch.empty_like(weight), dbias


def _setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, Tensor]) -> None:
    input, weight, target, bias, token_weights, *rest = inputs
    ctx.save_for_backward(input, weight, target, bias, token_weights, output[1])
    ctx.rest = rest


def _backward_autograd(ctx: Any, grad_loss: Tensor, grad_lse: Optional[Tensor]) -> Tuple[Any, ...]:
    input, weight, target, bias, token_weights, lse = ctx.saved_tensors
    dx, dw, dbias = _backward(grad_loss, grad_lse, input, weight, target, bias, token_weights, lse, *ctx.rest)
    dbias = None if bias is None else dbias
    anchors = (input, weight, bias, grad_loss, grad_lse)
    return guard_grads((dx, dw, None, dbias, None), anchors) + (None,) * len(ctx.rest)


_forward.register_autograd(_backward_autograd, setup_context=_setup_context)


def ring_loss(args: tuple, group: int, ring: Optional[str]) -> Tuple[Tensor, Tensor]:
    """The loss and lse of ``args`` (``linear_cross_entropy``'s op arguments) over ``group``."""
    input, weight, target, bias, token_weights, *opts = args
    return torch.ops.flatpeak.linear_cross_entropy_ring_forward(input, weight, target, bias, token_weights, group,
                                                               ring, *opts)
