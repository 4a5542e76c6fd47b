"""flatpeak for PyTorch.

``flatpeak.torch`` holds the drop-ins for a PyTorch training loop:

* :func:`flatpeak.torch.linear_cross_entropy` / :class:`flatpeak.torch.LinearCrossEntropyLoss`:
  ``cross_entropy(input @ weight.T + bias, target)`` with exact loss and gradients whose added
  memory is a working set fixed before any data is read (the ``tokens x vocab`` logits never
  exist at once);
* :class:`flatpeak.torch.StreamAdamW`: ``torch.optim.AdamW``'s update, run by flatpeak's SIMD
  CPU kernel in place, with torch's state names and a step that skips on non-finite gradients.

The Rust core is the ``flatpeak._flatpeak`` extension (crates ``ring-dtp`` and
``stream-adamw``).
"""

from . import _flatpeak

__all__ = ["torch", "cuda_built"]


def cuda_built() -> bool:
    """Whether this build carries the CUDA path (the ``cuda`` cargo feature)."""
    return bool(_flatpeak.CUDA)
