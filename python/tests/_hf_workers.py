"""Worker processes of the expert-parallel ``flatpeak.transformers`` test: each is one rank of
a gloo group, one thread (kept apart from the test module so spawned children import only this)."""

from __future__ import annotations

import _hf_models as hf
from _spawn import reporting


@reporting
def expert_parallel(rank: int, world: int, init_file: str):
    """:func:`_expert_parallel` on Qwen3-MoE (every layer sparse, no shared expert)."""
    return _expert_parallel(rank, world, init_file, "qwen3_moe")


@reporting
def expert_parallel_shared_experts(rank: int, world: int, init_file: str):
    """:func:`_expert_parallel` on GLM-4-MoE: a dense first layer, and a shared expert (replicated
    on every rank, not sharded) beside the routed ones."""
    return _expert_parallel(rank, world, init_file, "glm4_moe")


def _expert_parallel(rank: int, world: int, init_file: str, model_type: str):
    """Rank ``rank``'s patched model against the unpatched one: its loss on its own batch, its
    expert slice's gradients against those of the sum of every rank's loss, and every other
    gradient against those of its own loss."""
    import copy

    from _moe_workers import _init

    import flatpeak.transformers as fpt_

    _, dist = _init(rank, world, init_file)

    ref = hf.tiny_model(model_type, seed=3)
    patched = fpt_.apply(copy.deepcopy(ref), group=dist.group.WORLD)
    ids, labels = hf.batch(50 + rank)
    out = patched(input_ids=ids, labels=labels)
    out.loss.backward()
    own = ref(input_ids=ids, labels=labels).loss
    errors = {"loss": hf.rel(out.loss, own)}
    own.backward()
    non_expert = {n: p.grad.clone() for n, p in ref.named_parameters() if ".experts." not in n}
    ref.zero_grad()
    total = sum(ref(input_ids=i, labels=lab).loss for i, lab in (hf.batch(50 + r) for r in range(world)))
    total.backward()
    local = 8 // world
    rows = slice(rank * local, (rank + 1) * local)
    for (name, p), (_, q) in zip(ref.named_parameters(), patched.named_parameters()):
        if ".experts." in name:
            errors[name] = hf.rel(q.grad, p.grad[rows])
            if q.shape[0] != local:
                raise AssertionError(f"{name}: {tuple(q.shape)} kept, expected {local} experts")
        else:
            errors[name] = hf.rel(q.grad, non_expert[name])
    bad = {k: v for k, v in errors.items() if v > (1e-5 if k == "loss" else 1e-4)}
    if bad:
        raise AssertionError(f"errors above their bounds: {bad}")
    return errors["loss"]
