"""``StreamAdamW(process_group=)`` under FSDP2 (``fully_shard`` on a CPU mesh, 4 gloo processes,
one thread each): one decision per step on every rank, equal to torch's AdamW (with
``clip_grad_norm_``) on an FSDP2 copy and to one process holding the whole model; non-finite
gradients on one rank skip (or raise) on every rank; bad input on one rank raises on every rank;
``torch.distributed.checkpoint`` reshards the optimizer's state."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import _fsdp_workers as workers  # noqa: E402
from _spawn import spawn  # noqa: E402

TOL = 1e-5


def _ok(reports):
    errors = {r: p for r, (s, p) in reports.items() if s != "ok"}
    assert not errors, "\n".join(f"rank {r}:\n{p}" for r, p in errors.items())
    assert sorted(reports) == list(range(len(reports)))
    return {r: p for r, (_, p) in reports.items()}


def test_one_decision_per_step_under_fsdp2():
    out = _ok(spawn(workers.agreed_steps))
    for rank, seen in out.items():
        plain = seen["plain"]
        assert plain["vs_torch"] < TOL and plain["vs_one"] < TOL, (rank, plain)
        assert plain["state_types"] == ["DTensor", "Tensor"], plain  # moments reshardable, step plain
        assert plain["steps"] == {10.0}, plain
        clip = seen["clip"]
        assert clip["clipped"], clip["norms"]
        assert clip["vs_torch"] < TOL and clip["vs_one"] < TOL, (rank, clip)
        assert clip["norm_err"] < 1e-6 and clip["torch_norm_err"] < 1e-6, (rank, clip)
        nonfinite = seen["nonfinite"]
        assert [i for i, s in enumerate(nonfinite["skipped"]) if s] == [3, 6], nonfinite
        assert nonfinite["untouched"] == [True, True] and nonfinite["skipped_steps"] == 2, nonfinite
        assert nonfinite["vs_one"] < TOL and nonfinite["steps"] == {8.0}, nonfinite
        assert seen["raise"] is not None and "rank 3" in seen["raise"] and "not finite" in seen["raise"], seen
        kinds = [k for k, _ in seen["refusals"]]
        assert kinds == ["ValueError", "ValueError", "TypeError"], (rank, seen["refusals"])
        assert "rank 2 steps with max_norm = 2" in seen["refusals"][0][1], seen["refusals"]
        assert all(f"on_nonfinite = {p}" in seen["refusals"][1][1] for p in ("ignore", "skip")), seen["refusals"]
        assert "sparse" in seen["refusals"][2][1], seen["refusals"]
    # Exactly one rank's first layer has an empty shard, and it stepped with the others.
    assert sum(bool(seen["plain"]["empty"]) for seen in out.values()) == 1
    # The norms are bitwise the same on every rank.
    assert len({tuple(seen["clip"]["norms"]) for seen in out.values()}) == 1


def test_checkpoints_reshard_and_load_across_optimizers(tmp_path, monkeypatch):
    # Saved on 4 ranks, resumed on 2: StreamAdamW's state into StreamAdamW and into torch's
    # AdamW, and torch's into StreamAdamW; 5 more steps equal 10 uninterrupted ones.
    monkeypatch.setenv("FLATPEAK_TEST_CHECKPOINT", str(tmp_path))
    _ok(spawn(workers.save_checkpoints, world=4))
    out = _ok(spawn(workers.resume_checkpoints, world=2))
    for rank, runs in out.items():
        assert sorted(runs) == ["stream->stream", "stream->torch", "torch->stream", "torch->torch"]
        for name, (err, steps) in runs.items():
            assert steps == [5.0], (rank, name, steps)  # the saved step counts, on every parameter
            assert err < TOL, (rank, name, err)


def test_fsdp2_over_a_2d_expert_parallel_mesh_equals_one_process():
    import _ep_workers as ep

    out = _ok(spawn(ep.fsdp2_ep))
    for rank, seen in out.items():
        assert max(seen["errors"].values()) < TOL, (rank, seen["errors"])
        assert "Shard(dim=0)" in seen["placements"]["experts.gate_up_proj"], seen["placements"]
        assert seen["requires_grad"] and seen["trained"] > 1e-3, seen  # the experts trained
    assert len({tuple(seen["norms"]) for seen in out.values()}) == 1  # bitwise, every rank


def test_ddp_leaves_rank_private_experts_alone():
    import _ep_workers as ep

    out = _ok(spawn(ep.ddp_experts))
    for rank, seen in out.items():
        assert seen["ignored"] == ["experts.gate_up_proj", "experts.down_proj"], seen["ignored"]
        assert seen["kept"], f"rank {rank}: DDP replaced the rank's experts"
        assert seen["trained"] > 1e-3, seen["trained"]  # the experts trained
        assert max(seen["errors"].values()) < TOL, (rank, seen["errors"])
    dense = [seen["dense"] for seen in out.values()]
    assert all(other == dense[0] for other in dense[1:]), "dense replicas drifted"  # bitwise
    assert len({seen["norm"] for seen in out.values()}) == 1


def test_compositions_that_would_be_silently_wrong_are_refused():
    import _ep_workers as ep

    out = _ok(spawn(ep.refusals))
    for seen in out.values():
        assert "no longer this rank's own slices" in seen.get("fully_shard", ""), seen
        assert "DTensor" in seen.get("loss", "") and ".to_local()" in seen["loss"], seen
        assert "DTensor" in seen.get("moe", ""), seen


def test_a_patched_transformers_model_under_fsdp2_equals_the_unpatched_one():
    import _hf_fsdp_workers as hf_fsdp

    out = _ok(spawn(hf_fsdp.patched_under_fsdp2))
    for rank, seen in out.items():
        for case in ("loss", "offload", "ep"):
            assert seen[case]["loss"] < TOL and seen[case]["grads"] < 1e-4, (rank, case, seen[case])
        assert "apply flatpeak first, then wrap" in (seen["refused"] or ""), seen["refused"]
