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
