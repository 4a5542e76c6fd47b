"""The executors flatpeak keeps between calls.

Each loss, ring and MoE call runs on an executor of its plan (the shape and options): its
working set, reserved once (host memory on a CPU, device memory on a GPU for the rings, the MoE
layer's host route tables), its kernels and its NCCL communicator. Executors are kept between calls, so a
training step does not reserve memory or compile kernels again, in one cache bounded in bytes:
it holds at most :func:`executor_cache_limit` (1 GiB by default) of reservations, or the one
executor last made when that one alone needs more. Before a new executor is made, the least
recently used are dropped until it fits, so an old working set is freed before a new one is
reserved. The single-GPU loss's executors reserve nothing (0 bytes here): its block buffers,
like the MoE layer's device buffers, are allocated per call through torch's caching allocator.
"""

from __future__ import annotations

from .. import _flatpeak as _ext


def executor_cache_bytes() -> int:
    """Bytes the kept executors have reserved (host and device working sets)."""
    return int(_ext.executor_cache_bytes())


def cached_executors() -> int:
    """How many executors are kept."""
    return int(_ext.cached_executors())


def clear_executor_cache() -> None:
    """Drops every kept executor and its working set (one a call is running on goes when that
    call ends)."""
    _ext.clear_executor_cache()


def executor_cache_limit() -> int:
    """The bound on the kept executors' reservations, in bytes."""
    return int(_ext.executor_cache_limit())


def set_executor_cache_limit(limit_bytes: int) -> None:
    """Sets the bound on the kept executors' reservations; those over it are dropped now, the
    least recently used first (``0``: at most the one executor last made is kept)."""
    if not isinstance(limit_bytes, int) or isinstance(limit_bytes, bool):
        raise TypeError(f"limit_bytes: expected an int, got {type(limit_bytes).__name__}")
    if limit_bytes < 0:
        raise ValueError(f"limit_bytes: expected a number of bytes >= 0, got {limit_bytes}")
    _ext.set_executor_cache_limit(limit_bytes)
