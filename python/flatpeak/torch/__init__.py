"""flatpeak's PyTorch drop-ins: :func:`linear_cross_entropy`, :class:`LinearCrossEntropyLoss`,
:class:`StreamAdamW`, the MoE experts :func:`moe_swiglu` / :class:`MoEExperts`, and
:func:`offload_checkpoints`."""

from ._adamw import StreamAdamW
from ._loss import LinearCrossEntropyLoss, linear_cross_entropy
from ._moe import MoEExperts, MoEStats, moe_swiglu
from ._offload import offload_checkpoints

__all__ = [
    "linear_cross_entropy", "LinearCrossEntropyLoss", "StreamAdamW", "moe_swiglu", "MoEExperts", "MoEStats",
    "offload_checkpoints",
]
