"""``linear_cross_entropy``: exact ``cross_entropy(input @ weight.T + bias, target)`` whose added
memory is a working set fixed before any data is read.

Two ``torch.library.custom_op`` ops carry it -- ``flatpeak::linear_cross_entropy_forward`` and
``flatpeak::linear_cross_entropy_backward`` -- each with a fake (meta) implementation, wired
together with ``register_autograd``, so ``torch.compile(fullgraph=True)`` traces the loss
without a graph break and autograd sees gradients for ``input``, ``weight`` and ``bias``.

Forward saves the per-row log-sum-exp (4 bytes a token); backward recomputes each block of
logits from it (4 GEMMs in all, against the materialized path's 3), never holding more than
one block of ``tokens x vocab``.

When gradients are wanted from a reduced loss (``mean`` or ``sum``) without ``return_lse``, a
third op, ``flatpeak::linear_cross_entropy_fused``, runs forward and backward in one
pass instead (3 GEMMs per block: each block's logits serve both): it returns dX, dW and dbias
for an upstream gradient of 1, held until backward multiplies them by the real one. A loss is
usually the last op before ``.backward()``; the gradients it holds meanwhile are the size of
``input`` and ``weight``.

Only the gradients autograd wants are computed: a frozen ``weight`` (``requires_grad=False``)
costs no dW GEMM and no ``[vocab, hidden]`` buffer, a frozen ``input`` no dX GEMM, a frozen
``bias`` no dbias. Both gradient ops take ``grads_wanted`` (for ``input``, ``weight``, ``bias``:
``ctx.needs_input_grad`` in backward, ``requires_grad`` at the fused forward) and return an
empty tensor for a gradient not wanted (an op's outputs cannot be ``None``), which the autograd
functions hand back as ``None``.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .. import _flatpeak as _ext
from ._checks import check_float, check_tensors
from ._groups import handle as _group_handle
from ._lce_common import OPTIONS_SCHEMA, TENSORS_SCHEMA, guard_grads, options, per_token
from ._ring_loss import ring_loss as _ring_loss

_REDUCTIONS = ("mean", "sum", "none")


def _cuda_path(input: Tensor) -> bool:
    """CUDA inputs with the CUDA build; without it the extension refuses them, saying how to build."""
    return input.is_cuda and bool(_ext.CUDA)


def _as_f32(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.to(torch.float32)


def _grad_buffers(input: Tensor, weight: Tensor, bias: Optional[Tensor], wanted: Sequence[bool]):
    """The gradient buffers of the wanted gradients (``input``, ``weight``, ``bias``), ``None`` for
    one not wanted (never allocated, never computed) and for a bias that is not there; a list,
    which :func:`_op_grads` empties. On the CPU path dX and dW have the inputs' dtype: for bf16
    inputs the crate accumulates in fp32 and rounds once into them, without an fp32 copy of both
    beside them. The CUDA path writes fp32 (narrowed by :func:`_op_grads`); dbias is fp32."""
    want_dx, want_dw, want_dbias = wanted
    dtype = torch.float32 if _cuda_path(input) else input.dtype
    empty = lambda shape, dtype: torch.empty(shape, dtype=dtype, device=input.device)  # noqa: E731
    return [empty(input.shape, dtype) if want_dx else None, empty(weight.shape, dtype) if want_dw else None,
            empty((weight.shape[0],), torch.float32) if want_dbias and bias is not None else None]


def _op_grads(input: Tensor, weight: Tensor, grads: list) -> Tuple[Tensor, Tensor, Tensor]:
    """The gradient op's outputs from :func:`_grad_buffers`' list (emptied): dX and dW in their
    inputs' dtypes (fp32 buffers of the CUDA path narrowed one at a time, each freed before the
    next is narrowed); an empty tensor for one not computed (an op's outputs cannot be ``None``;
    its autograd function returns ``None`` for it)."""
    dx, dw, dbias = grads
    grads.clear()
    dx = input.new_empty((0,)) if dx is None else dx.to(input.dtype)
    dw = weight.new_empty((0,)) if dw is None else dw.to(weight.dtype)
    return dx, dw, input.new_empty((0,), dtype=torch.float32) if dbias is None else dbias


def _grads_fake(input: Tensor, weight: Tensor, bias: Optional[Tensor], wanted: Sequence[bool]):
    """The fake implementations' gradients: the shapes :func:`_op_grads` returns."""
    want_dx, want_dw, want_dbias = wanted
    return (torch.empty_like(input) if want_dx else input.new_empty((0,)),
            torch.empty_like(weight) if want_dw else weight.new_empty((0,)),
            input.new_empty((weight.shape[0] if want_dbias and bias is not None else 0,), dtype=torch.float32))


def _wanted_only(grads, wanted: Sequence[bool]):
    """Backward's ``(dx, dw, dbias)``: ``None`` for a gradient not wanted."""
    return tuple(g if want else None for g, want in zip(grads, wanted))


def _forward_impl(input: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor],
                  token_weights: Optional[Tensor], *opts: Any) -> Tuple[Tensor, Tensor]:
    """The loss and the per-row lse (``opts``: the loss's options, :data:`OPTIONS` order)."""
    n = input.shape[0]
    # The loss is finished on the host (per-token statistics, O(N)) on either path.
    loss = torch.empty((n,) if per_token(opts) else (), dtype=torch.float32)
    lse = torch.empty((n,), dtype=torch.float32)
    _ext.lce_forward(options(opts), (input, weight, target, bias, token_weights), (loss, lse))
    return loss.to(input.device, input.dtype), lse.to(input.device)


_forward = torch.library.custom_op("flatpeak::linear_cross_entropy_forward", _forward_impl, mutates_args=(),
                                   schema=f"({TENSORS_SCHEMA}, {OPTIONS_SCHEMA}) -> (Tensor, Tensor)")


@_forward.register_fake
def _forward_fake(input: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor],
                  token_weights: Optional[Tensor], *opts: Any) -> Tuple[Tensor, Tensor]:
    n = input.shape[0]
    return input.new_empty((n,) if per_token(opts) else ()), input.new_empty((n,), dtype=torch.float32)


def _backward_impl(grad_loss: Tensor, grad_lse: Optional[Tensor], input: Tensor, weight: Tensor, target: Tensor,
                   bias: Optional[Tensor], token_weights: Optional[Tensor], lse: Tensor,
                   *opts_and_wanted: Any) -> Tuple[Tensor, Tensor, Tensor]:
    """dX, dW and dbias (for ``input``, ``weight``, ``bias``) as the last argument,
    ``grads_wanted``, selects them; an empty tensor for each one not wanted (not computed: a
    frozen weight costs no dW GEMM)."""
    *opts, grads_wanted = opts_and_wanted
    grads = _grad_buffers(input, weight, bias, grads_wanted)
    # Upstream gradients are [N] or scalars, often expanded (stride 0) by autograd: made dense
    # (and, on the CUDA path, brought to the host, where the crate forms the row scales).
    upstream = (grad_loss.to("cpu", torch.float32).contiguous(),
                None if grad_lse is None else grad_lse.to("cpu", torch.float32).contiguous())
    _ext.lce_backward(options(opts), (input, weight, target, bias, token_weights), lse.to("cpu").contiguous(),
                      upstream, tuple(grads))
    return _op_grads(input, weight, grads)


_backward = torch.library.custom_op(
    "flatpeak::linear_cross_entropy_backward", _backward_impl, mutates_args=(),
    schema=f"(Tensor grad_loss, Tensor? grad_lse, {TENSORS_SCHEMA}, Tensor lse, {OPTIONS_SCHEMA}, "
           "bool[] grads_wanted) -> (Tensor, Tensor, Tensor)")


@_backward.register_fake
def _backward_fake(grad_loss: Tensor, grad_lse: Optional[Tensor], input: Tensor, weight: Tensor, target: Tensor,
                   bias: Optional[Tensor], token_weights: Optional[Tensor], lse: Tensor,
                   *opts_and_wanted: Any) -> Tuple[Tensor, Tensor, Tensor]:
    return _grads_fake(input, weight, bias, opts_and_wanted[-1])


def _setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, Tensor]) -> None:
    input, weight, target, bias, token_weights, *opts = inputs
    _, lse = output
    ctx.save_for_backward(input, weight, target, bias, token_weights, lse)
    ctx.options = opts


def _backward_autograd(ctx: Any, grad_loss: Tensor, grad_lse: Optional[Tensor]) -> Tuple[Any, ...]:
    input, weight, target, bias, token_weights, lse = ctx.saved_tensors
    # Only what autograd asks for: a frozen input, weight or bias gets no gradient computed.
    wanted = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[3]]
    grads = _backward(grad_loss, grad_lse, input, weight, target, bias, token_weights, lse, *ctx.options, wanted)
    dx, dw, dbias = _wanted_only(grads, wanted)
    anchors = (input, weight, bias, grad_loss, grad_lse)
    return guard_grads((dx, dw, None, dbias, None), anchors) + (None,) * len(ctx.options)


_forward.register_autograd(_backward_autograd, setup_context=_setup_context)


def _fused_impl(input: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor],
                token_weights: Optional[Tensor], *opts_and_wanted: Any) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The loss, and dX, dW and dbias for an upstream gradient of 1 as the last argument,
    ``grads_wanted``, selects them (an empty tensor for one not wanted), in one pass (``mean`` or
    ``sum``)."""
    *opts, grads_wanted = opts_and_wanted
    n = input.shape[0]
    # The loss is finished on the host on either path; the gradients live where the inputs do.
    loss = torch.empty((), dtype=torch.float32)
    lse = torch.empty((n,), dtype=torch.float32)
    grads = _grad_buffers(input, weight, bias, grads_wanted)
    _ext.lce_forward_backward(options(opts), (input, weight, target, bias, token_weights), (loss, lse),
                              tuple(grads))
    del lse
    return (loss.to(input.device, input.dtype), *_op_grads(input, weight, grads))


#: :func:`_fused_impl` as an op, for traced graphs (``torch.compile``); eager calls take
#: :class:`_EagerFused`.
_fused = torch.library.custom_op(
    "flatpeak::linear_cross_entropy_fused", _fused_impl, mutates_args=(),
    schema=f"({TENSORS_SCHEMA}, {OPTIONS_SCHEMA}, bool[] grads_wanted) -> (Tensor, Tensor, Tensor, Tensor)")


@_fused.register_fake
def _fused_fake(input: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor],
                token_weights: Optional[Tensor], *opts_and_wanted: Any) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return (input.new_empty(()), *_grads_fake(input, weight, bias, opts_and_wanted[-1]))


def _fused_setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, ...]) -> None:
    loss, dx, dw, dbias = output
    # The loss is saved as the anchor of the double-backward guard (a scalar; the gradients are
    # functions of the inputs behind it).
    ctx.save_for_backward(dx, dw, dbias, loss)
    ctx.wanted = _wanted_at_forward(inputs[3], inputs[-1])
    ctx.n_options = len(inputs) - 5


def _scaled(ctx: Any, grad_loss: Tensor, eager: bool) -> Tuple[Any, ...]:
    """The held gradients times the upstream gradient, as backward's return value."""
    dx, dw, dbias, loss = ctx.saved_tensors
    # An upstream gradient of exactly 1 (the usual `loss.backward()`) in eager mode: the held
    # gradients are handed over as they are (autograd takes them without a copy once the graph
    # is freed, and copies them while a retained graph still holds them).
    if not (eager and grad_loss.item() == 1.0):
        dx, dw, dbias = (g * grad_loss for g in (dx, dw, dbias))
    dx, dw, dbias = _wanted_only((dx, dw, dbias), ctx.wanted)
    grads = (dx, dw, None, dbias, None)
    return guard_grads(grads, (loss, grad_loss)) + (None,) * ctx.n_options


def _fused_backward(ctx: Any, grad_loss: Tensor, _grad_dx: Tensor, _grad_dw: Tensor,
                    _grad_dbias: Tensor) -> Tuple[Any, ...]:
    return _scaled(ctx, grad_loss, eager=False)


_fused.register_autograd(_fused_backward, setup_context=_fused_setup_context)


class _EagerFused(torch.autograd.Function):
    """The fused call in eager mode. The held gradients are not outputs of the op here: autograd
    copies a gradient that is also a saved output of its node (measured: the f32 peak rose by
    dW's size), and takes one that is not."""

    @staticmethod
    def forward(ctx, input, weight, target, bias, token_weights, *options):
        loss, dx, dw, dbias = _fused_impl(input, weight, target, bias, token_weights, *options)
        ctx.save_for_backward(dx, dw, dbias, loss)
        ctx.wanted = _wanted_at_forward(bias, options[-1])
        ctx.n_options = len(options)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        return _scaled(ctx, grad_loss, eager=True)


def _wanted_at_forward(bias: Optional[Tensor], grads_wanted) -> Tuple[bool, ...]:
    """The fused call's selection as its autograd function hands it back: what it computed, and
    no dbias without a bias."""
    want_dx, want_dw, want_dbias = grads_wanted
    return bool(want_dx), bool(want_dw), bool(want_dbias) and bias is not None


def _fuses(input: Tensor, weight: Tensor, bias: Optional[Tensor], reduction: str, return_lse: bool) -> bool:
    """Whether forward also runs backward: a reduced loss (its upstream gradient is a scalar that
    backward applies), no lse output, gradients wanted; on the CPU, or on a GPU with the
    ``cuda`` build (without it the forward op says how to build it)."""
    wanted = torch.is_grad_enabled() and (
        input.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    where = not input.is_cuda or _cuda_path(input)
    return wanted and reduction != "none" and not return_lse and where


def _flatten_leading(name: str, t: Tensor, trailing: int) -> Tensor:
    """``t`` with every dimension but the last ``trailing`` flattened, without a copy."""
    if t.dim() <= trailing + 1:
        return t
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (call .contiguous()), got strides {t.stride()}")
    return t.reshape(-1, *t.shape[t.dim() - trailing:]) if trailing else t.reshape(-1)


def linear_cross_entropy(
    input: Tensor,
    weight: Tensor,
    target: Tensor,
    bias: Optional[Tensor] = None,
    *,
    reduction: str = "mean",
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    softcap: Optional[float] = None,
    token_weights: Optional[Tensor] = None,
    return_lse: bool = False,
    budget_bytes: Optional[int] = None,
    precision: str = "native",
    group: Optional["torch.distributed.ProcessGroup"] = None,
    ring: Optional[str] = None,
) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    r"""Cross-entropy of the linear projection ``input @ weight.T + bias`` against ``target``,
    exact, without materializing the ``tokens x vocab`` logits.

    For a token ``i`` with target ``y != ignore_index`` and logits
    ``z = softcap * tanh((x_i W^T + b) / softcap)`` (or ``x_i W^T + b`` without a softcap),
    ``lse = log sum_j exp(z_j)`` and

    ``loss_i = w_i * (lse - (1 - a) z_y - (a / V) sum_j z_j + z_loss * lse^2)``

    (``a``: label smoothing in PyTorch's convention, ``w_i``: ``token_weights``, 1 by default).
    Ignored tokens contribute 0. ``mean`` divides the sum by the sum of the non-ignored tokens'
    weights (their count without weights), as ``F.cross_entropy`` does. **Unlike torch**, a batch
    whose tokens are all ignored has loss 0 and zero gradients under ``mean`` (torch gives NaN).

    Args:
        input: ``[tokens, hidden]`` or ``[batch, seq, hidden]`` (flattened), float32 or bfloat16,
            read in place when contiguous; a non-contiguous view (transposed, sliced) is copied
            once into a contiguous tensor of its size, as torch's own matmul would.
        weight: ``[vocab, hidden]``, the dtype of ``input`` (the projection, not class weights);
            as ``input``, copied once only when it is a non-contiguous view (a tied embedding's
            transpose, for one).
        target: int64 class ids, ``[tokens]`` or ``[batch, seq]``.
        bias: optional ``[vocab]`` bias, the dtype of ``input``.
        reduction: ``"mean"``, ``"sum"`` or ``"none"`` (per-token losses, shaped like ``target``).
        ignore_index: targets equal to it are skipped.
        label_smoothing: in ``[0, 1]``, as torch's.
        z_loss: coefficient of ``lse^2`` (PaLM's z-loss), ``>= 0``.
        softcap: logit soft-capping ``cap * tanh(z / cap)`` (Gemma 2), ``None`` for off.
        token_weights: optional float32 per-token weights (finite, ``>= 0``), shaped like
            ``target``.
        return_lse: also return the per-token log-sum-exp (float32, differentiable).
        budget_bytes: bound of the working set (default 128 MiB on a CPU, 640 MiB on a GPU,
            whose GEMMs need wider blocks; each device's own block buffers are what it bounds);
            the plan picks its blocks within it
            before any data is read. Where the working set is reserved (the CPU, and every ring),
            it is reserved once per shape and kept between calls with its executor, in
            flatpeak's executor cache: memory beside the model's that
            :func:`flatpeak.torch.executor_cache_bytes` reports, bounded by
            :func:`flatpeak.torch.executor_cache_limit` (1 GiB by default, e.g. up to 8
            executors of the default 128 MiB) and freed by
            :func:`flatpeak.torch.clear_executor_cache`.
        precision: ``"native"`` (GEMMs in the dtype of ``input``: bf16 dot products or tensor
            cores for bfloat16, the logit gradient rounded to bfloat16 before the two gradient
            GEMMs, as autograd of a bfloat16 matmul does), ``"f32"`` (every GEMM in float32,
            the logit gradient kept float32; the same as ``"native"`` for float32 inputs) or
            ``"tf32"`` (float32 CUDA tensors only: TF32 tensor-core GEMMs, *not exact*, about
            1e-3 relative; anything else raises ``ValueError``).
        group: a ``torch.distributed`` process group of ``P`` ranks to run the vocabulary-parallel
            loss over (CPU tensors, gloo), or ``None`` for this process alone. Each rank passes its
            own tokens (any number) and its shard of ``weight`` (and ``bias``): rank ``r`` holds
            vocabulary rows ``r * ceil(V / P)`` onwards of ``V``, the sum of the shards' rows (an
            even split when ``P`` divides ``V``). The loss is the one over every rank's tokens and
            the whole vocabulary (the same on every rank); each rank gets its own tokens' ``dx``
            and its shard's ``dw``, as one process holding everything would. The ``[tokens, V/P]``
            logits shard of Megatron's vocab-parallel loss is never made. Bad input on one rank
            raises on every rank.
        ring: with ``group``: ``"weight"`` (the weight shards circulate; suits many tokens),
            ``"activation"`` (the tokens circulate; suits a large vocabulary) or ``None`` (the plan
            picks the one whose travelling unit is smaller).

    Accumulation is float32 for both dtypes; the loss has the dtype of ``input``, the lse is
    float32. On the CPU, bfloat16 gradients are rounded once from the float32 accumulators inside
    the crate, which gives each part's float32 pages back as it is rounded: a call holds the
    float32 ``dW`` and one token block of ``dX`` beside the bfloat16 results, not both float32
    gradients and then their copies.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: expected one of {_REDUCTIONS}, got {reduction!r}")
    if ring is not None and group is None:
        raise ValueError(f"ring={ring!r} needs group= (the process group whose ranks form the ring)")
    check_tensors("linear_cross_entropy", (("input", input), ("weight", weight), ("target", target),
                                           ("bias", bias), ("token_weights", token_weights)),
                  "pass .to_local() (an FSDP2-sharded lm_head: call the loss while FSDP has it unsharded, as "
                  "flatpeak.transformers.apply does)")
    check_float("input", input)
    lead_shape, batched = target.shape, input.dim() == 3
    # Tokens pair with targets by position: the target's shape is the input's leading shape, as
    # F.cross_entropy requires (the same element count in another shape would pair them wrongly).
    if input.dim() >= 2:
        for name, t in (("target", target), ("token_weights", token_weights)):
            if t is not None and t.shape != input.shape[:-1]:
                raise ValueError(f"{name}: expected shape {list(input.shape[:-1])}, got {list(t.shape)} (the "
                                 f"leading shape of input {list(input.shape)})")
    # A non-contiguous input or weight (a transposed or sliced view) is copied once, as torch's
    # own matmul would for such an operand; a contiguous one is read in place, never copied.
    if isinstance(input, Tensor) and input.dim() >= 2 and not input.is_contiguous():
        input = input.contiguous()
    if isinstance(weight, Tensor) and weight.dim() == 2 and not weight.is_contiguous():
        weight = weight.contiguous()
    if batched:
        input = _flatten_leading("input", input, 1)
    # Targets and token weights are N elements: a shifted (sliced) target is copied, as torch
    # would.
    if batched:
        target = target.reshape(-1)
        token_weights = None if token_weights is None else token_weights.reshape(-1)
    else:
        target = target.contiguous()
        token_weights = None if token_weights is None else token_weights.contiguous()
    if bias is not None and isinstance(bias, Tensor) and bias.dtype != input.dtype:
        raise TypeError(f"bias: expected dtype {input.dtype} (the dtype of input), got {bias.dtype}")
    args = (input, weight, target, _as_f32(bias), token_weights, int(ignore_index), reduction,
            float(label_smoothing), float(z_loss), None if softcap is None else float(softcap), budget_bytes,
            str(precision))
    if group is not None:
        # Every check from here on is made on every rank and agreed on before the ring runs.
        loss, lse = _ring_loss(args, _group_handle(group), ring)
    elif _fuses(input, weight, bias, reduction, return_lse):
        # Forward computes backward's gradients now: only those of the tensors that require
        # grad (a frozen weight costs no dW GEMM, a frozen input no dX GEMM).
        wanted = [input.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad]
        if torch.compiler.is_compiling():
            return torch.ops.flatpeak.linear_cross_entropy_fused(*args, wanted)[0]
        return _EagerFused.apply(*args, wanted)
    else:
        loss, lse = torch.ops.flatpeak.linear_cross_entropy_forward(*args)
    if reduction == "none":
        loss = loss.reshape(lead_shape)
    lse = lse.reshape(lead_shape)
    return (loss, lse) if return_lse else loss


class LinearCrossEntropyLoss(torch.nn.Module):
    """:func:`linear_cross_entropy` as a module: the options at construction,
    ``forward(input, weight, target, bias=None, token_weights=None)``."""

    def __init__(self, *, reduction: str = "mean", ignore_index: int = -100, label_smoothing: float = 0.0,
                 z_loss: float = 0.0, softcap: Optional[float] = None, return_lse: bool = False,
                 budget_bytes: Optional[int] = None, precision: str = "native"):
        super().__init__()
        # Checked here, once: a bad option fails at construction, not at the first batch.
        options((ignore_index, reduction, label_smoothing, z_loss, softcap, budget_bytes, precision))
        self.reduction = reduction
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.return_lse = return_lse
        self.budget_bytes = budget_bytes
        self.precision = precision

    def forward(self, input: Tensor, weight: Tensor, target: Tensor, bias: Optional[Tensor] = None,
                token_weights: Optional[Tensor] = None):
        return linear_cross_entropy(
            input, weight, target, bias, reduction=self.reduction, ignore_index=self.ignore_index,
            label_smoothing=self.label_smoothing, z_loss=self.z_loss, softcap=self.softcap,
            token_weights=token_weights, return_lse=self.return_lse, budget_bytes=self.budget_bytes,
            precision=self.precision,
        )

    def extra_repr(self) -> str:
        return (f"reduction={self.reduction!r}, ignore_index={self.ignore_index}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, softcap={self.softcap}, "
                f"precision={self.precision!r}")
