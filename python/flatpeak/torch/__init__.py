"""flatpeak's PyTorch drop-ins: :func:`linear_cross_entropy`, :class:`LinearCrossEntropyLoss`,
:class:`StreamAdamW`, the MoE experts :func:`moe_swiglu` / :class:`MoEExperts`, and
:func:`offload_checkpoints`; :func:`mark_rank_private` (a parameter no other rank holds, for
``StreamAdamW(process_group=)``) and :func:`exclude_experts_from_ddp`; the executors kept between
calls: :func:`executor_cache_bytes`, :func:`clear_executor_cache`, :func:`set_executor_cache_limit`."""

from ._adamw import StreamAdamW
from ._cache import (
    cached_executors,
    clear_executor_cache,
    executor_cache_bytes,
    executor_cache_limit,
    set_executor_cache_limit,
)
from ._loss import LinearCrossEntropyLoss, linear_cross_entropy
from ._moe import MoEExperts, MoEStats, moe_swiglu
from ._offload import offload_checkpoints
from ._sharding import exclude_experts_from_ddp, mark_rank_private

__all__ = [
    "linear_cross_entropy", "LinearCrossEntropyLoss", "StreamAdamW", "moe_swiglu", "MoEExperts", "MoEStats",
    "offload_checkpoints", "executor_cache_bytes", "cached_executors", "clear_executor_cache",
    "executor_cache_limit", "set_executor_cache_limit", "mark_rank_private",
    "exclude_experts_from_ddp",
]
