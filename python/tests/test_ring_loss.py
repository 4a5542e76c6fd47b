"""``flatpeak.torch.linear_cross_entropy(..., group=, ring=)``: the vocabulary-parallel loss over a
4-process gloo group (one thread per process) equals the single-process call on the whole problem
(loss, each rank's dx and its shard's dw and dbias) in both rings; bad input on one rank raises
on every rank; without a group, ``ring=`` is refused."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import _ring_workers as workers  # noqa: E402
from _spawn import WORLD, spawn  # noqa: E402

from flatpeak.torch import linear_cross_entropy  # noqa: E402


def test_both_rings_over_gloo_equal_the_single_process_loss():
    reports = spawn(workers.correctness)
    errors = {r: p for r, (s, p) in reports.items() if s != "ok"}
    assert not errors, "\n".join(f"rank {r}:\n{p}" for r, p in errors.items())
    assert sorted(reports) == list(range(WORLD))
    assert all(checked == 3 * len(workers.CASES) for _, checked in reports.values())


def test_bad_input_on_one_rank_raises_on_every_rank():
    reports = spawn(workers.bad_input)
    errors = {r: p for r, (s, p) in reports.items() if s != "ok"}
    assert not errors, "\n".join(f"rank {r}:\n{p}" for r, p in errors.items())
    losses = {loss for _, (_, loss) in reports.values()}
    assert len(losses) == 1, f"the ranks' losses differ: {losses}"
    for rank, (_, (seen, _)) in reports.items():
        assert len(seen) == 6, (rank, seen)


def test_a_ring_without_a_group_is_refused():
    x, w, t = torch.randn(4, 8), torch.randn(16, 8), torch.randint(0, 16, (4,))
    with pytest.raises(ValueError, match="needs group="):
        linear_cross_entropy(x, w, t, ring="weight")


CUDA = torch.cuda.is_available() and getattr(__import__("flatpeak._flatpeak", fromlist=["CUDA"]), "CUDA", False)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device and flatpeak built with `cuda`")
def test_cuda_tensors_over_a_one_rank_nccl_group_equal_the_single_process_loss():
    reports = spawn(workers.cuda_nccl_one_rank, world=1, timeout=240)
    assert reports[0][0] == "ok", reports[0][1]
