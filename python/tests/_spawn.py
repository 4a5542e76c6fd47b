"""Runs a worker function as the ranks of a gloo group of spawned processes, for the
multi-process tests (``test_moe.py``, ``test_ring_loss.py``)."""

from __future__ import annotations

import multiprocessing
import os
import tempfile
from typing import Optional

WORLD = 4


def spawn(target, world: int = WORLD, timeout: float = 300.0, reporting: Optional[int] = None):
    """Runs ``target(rank, world, init_file, queue)`` in ``world`` spawned processes; returns the
    reports of the first ``reporting`` ranks to report (default: all of them; a rank that never
    reports fails the test after ``timeout`` seconds)."""
    reporting = world if reporting is None else reporting
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=target, args=(r, world, init_file, queue)) for r in range(world)]
        for p in procs:
            p.start()
        reports = {}
        try:
            for _ in range(reporting):
                rank, status, payload = queue.get(timeout=timeout)
                reports[rank] = (status, payload)
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    return reports


def reporting(body):
    """A spawn target from ``body(rank, world, init_file) -> payload``: reports ``(rank, "ok",
    payload)``, or the traceback of whatever ``body`` raised as ``(rank, "error", text)``, and
    leaves the process group destroyed either way."""
    import functools
    import traceback

    @functools.wraps(body)
    def target(rank: int, world: int, init_file: str, queue) -> None:
        try:
            queue.put((rank, "ok", body(rank, world, init_file)))
        except BaseException:  # noqa: BLE001 -- reported to the parent, which fails the test
            queue.put((rank, "error", traceback.format_exc()))
        finally:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception:  # noqa: BLE001
                    pass

    return target
