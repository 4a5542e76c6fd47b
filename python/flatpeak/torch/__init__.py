"""flatpeak's PyTorch drop-ins: :func:`linear_cross_entropy`, :class:`LinearCrossEntropyLoss`
and :class:`StreamAdamW`."""

from ._adamw import StreamAdamW
from ._loss import LinearCrossEntropyLoss, linear_cross_entropy

__all__ = ["linear_cross_entropy", "LinearCrossEntropyLoss", "StreamAdamW"]
