"""Worker processes of the FSDP2 tests (``test_fsdp.py``): each is one rank of a gloo group, one
thread, that trains a tiny FSDP2 model with ``StreamAdamW(process_group=)`` beside references and
reports what it saw through the result queue.

The gradient convention (torchtitan's): FSDP's division is off (``set_gradient_divide_factor(1.0)``,
a sum over ranks, carried by plain sums: ``set_force_sum_reduction_for_comms(True)``, gloo having no
``PREMUL_SUM``) and each rank's loss is its tokens' summed loss divided by the *global* number of
tokens, so the reduced gradient is the global mean's on any number of ranks, and on gloo too (whose
averaging sums: pytorch issue 162338)."""

from __future__ import annotations

from _moe_workers import _init
from _spawn import reporting

#: The global batch: rows split evenly over the ranks.
BATCH, D_IN, CLASSES = 16, 8, 4
HP = dict(lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def net(torch):
    """A tiny model whose first layer has 3 rows: on 4 ranks one rank's shard of it is empty."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, 3), torch.nn.Tanh(), torch.nn.Linear(3, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, CLASSES, bias=False))


def batch(torch, step: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, D_IN, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def sharded(torch, mesh):
    from torch.distributed.fsdp import fully_shard

    model = net(torch)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for unit in (model[0], model[2], model):  # each FSDP unit reduces its own gradients
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def backward(torch, model, step: int, rank: int, world: int) -> None:
    x, y = batch(torch, step)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world) if world else slice(None)
    loss = torch.nn.functional.cross_entropy(model(x[rows]), y[rows], reduction="sum") / BATCH
    loss.backward()


def full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def params_of(model):
    return [full(p).detach().clone() for p in model.parameters()]


def worst(a, b) -> float:
    return max(rel(x, y) for x, y in zip(a, b))


def reference(torch, steps: int, max_norm=None, skip=(), private: int = 0):
    """One process, the whole batch, torch's AdamW (with ``clip_grad_norm_``): the parameters after
    ``steps`` steps (steps in ``skip`` not taken) and every step's norm. ``private``: the elements of
    every rank's rank-private parameter together (gradient 0.5 each), in the norm."""
    model = net(torch)
    extra = torch.nn.Parameter(torch.zeros(private))
    opt = torch.optim.AdamW(list(model.parameters()) + [extra], **HP)
    norms = []
    for step in range(steps):
        opt.zero_grad()
        backward(torch, model, step, 0, 1)
        extra.grad = torch.full((private,), 0.5)
        if max_norm is not None:
            params = list(model.parameters()) + [extra]
            norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm)))
        if step not in skip:
            opt.step()
    return params_of(model), norms


@reporting
def agreed_steps(rank: int, world: int, init_file: str):
    """Tests 1-3: StreamAdamW(process_group=) on FSDP2 against torch's AdamW on an FSDP2 copy and
    against one process; with clipping; a NaN, then an inf, on one rank; refusals on every rank."""
    torch, dist = _init(rank, world, init_file)
    from torch.distributed.device_mesh import init_device_mesh

    from flatpeak.torch import StreamAdamW

    mesh = init_device_mesh("cpu", (world,))
    group = dist.group.WORLD
    out = {}
    steps = 10
    # 1. No clipping, against torch's AdamW on an FSDP2 copy and one process.
    ours, theirs = sharded(torch, mesh), sharded(torch, mesh)
    opt = StreamAdamW(ours.parameters(), **HP, process_group=group)
    torch_opt = torch.optim.AdamW(theirs.parameters(), **HP)
    empty = [tuple(p.to_local().shape) for p in ours.parameters() if p.to_local().numel() == 0]
    for step in range(steps):
        for model, o in ((ours, opt), (theirs, torch_opt)):
            o.zero_grad()
            backward(torch, model, step, rank, world)
            o.step()
    state = opt.state[next(iter(ours.parameters()))]
    out["plain"] = dict(
        vs_torch=worst(params_of(ours), params_of(theirs)), vs_one=worst(params_of(ours), reference(torch, steps)[0]),
        empty=empty, state_types=sorted({type(v).__name__ for v in state.values()}),
        steps={float(opt.state[p]["step"]) for p in ours.parameters()})
    # 2. Clipping at every step: clip_grad_norm_ + AdamW on the FSDP2 copy, and one process.
    ours, theirs = sharded(torch, mesh), sharded(torch, mesh)
    opt = StreamAdamW(ours.parameters(), **HP, max_norm=0.05, process_group=group)
    torch_opt = torch.optim.AdamW(theirs.parameters(), **HP)
    norms, torch_norms = [], []
    for step in range(steps):
        opt.zero_grad()
        backward(torch, ours, step, rank, world)
        opt.step()
        norms.append(opt.last_grad_norm)
        torch_opt.zero_grad()
        backward(torch, theirs, step, rank, world)
        torch_norms.append(float(full(torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.05))))
        torch_opt.step()
    ref_params, ref_norms = reference(torch, steps, max_norm=0.05)
    out["clip"] = dict(
        vs_torch=worst(params_of(ours), params_of(theirs)), vs_one=worst(params_of(ours), ref_params),
        norms=norms, norm_err=max(abs(a - b) / b for a, b in zip(norms, ref_norms)),
        torch_norm_err=max(abs(a - b) / b for a, b in zip(norms, torch_norms)),
        clipped=all(n > 0.05 for n in norms))
    # 3. A NaN in rank 1's shard at step 3, an inf in rank 2's rank-private parameter at step 6:
    #    every rank skips both; the rest equals one process that skipped them.
    from flatpeak.torch import mark_rank_private

    ours = sharded(torch, mesh)
    own = torch.nn.Parameter(torch.full((5,), float(rank)))
    mark_rank_private(own)
    opt = StreamAdamW(list(ours.parameters()) + [own], **HP, max_norm=0.05, process_group=group)
    skipped, untouched = [], []
    for step in range(steps):
        opt.zero_grad()
        backward(torch, ours, step, rank, world)
        own.grad = torch.full((5,), 0.5)
        if step == 3 and rank == 1:
            next(p for p in ours.parameters() if p.to_local().numel()).grad.to_local()[0] = float("nan")
        if step == 6 and rank == 2:
            own.grad[1] = float("inf")
        before = [p.to_local().clone() for p in ours.parameters()] + [own.detach().clone()]
        opt.step()
        skipped.append(opt.last_step_skipped)
        if opt.last_step_skipped:
            after = [p.to_local() for p in ours.parameters()] + [own.detach()]
            untouched.append(all(torch.equal(a, b) for a, b in zip(before, after)))
    out["nonfinite"] = dict(
        skipped=skipped, untouched=untouched, skipped_steps=opt.skipped_steps,
        vs_one=worst(params_of(ours), reference(torch, steps, max_norm=0.05, skip=(3, 6), private=5 * world)[0]),
        steps={float(opt.state[p]["step"]) for p in ours.parameters()})
    # on_nonfinite="raise": a RuntimeError on every rank, naming the rank.
    opt = StreamAdamW(ours.parameters(), **HP, process_group=group, on_nonfinite="raise")
    opt.zero_grad()
    backward(torch, ours, 0, rank, world)
    if rank == 3:
        next(p for p in ours.parameters() if p.to_local().numel()).grad.to_local()[0] = float("inf")
    try:
        opt.step()
        out["raise"] = None
    except RuntimeError as e:
        out["raise"] = str(e)
    # Refusals: rank 2 clips at another bound (ValueError everywhere); rank 1's gradient is
    # sparse (a TypeError raised in Python, on every rank).
    opt = StreamAdamW(ours.parameters(), **HP, max_norm=2.0 if rank == 2 else 1.0, process_group=group)
    backward(torch, ours, 0, rank, world)
    out["refusals"] = []
    try:
        opt.step()
    except ValueError as e:
        out["refusals"].append(("ValueError", str(e)))
    # Rank 0 steps unchecked where the others check (ValueError everywhere, nothing written).
    opt = StreamAdamW(ours.parameters(), **HP, process_group=group,
                      on_nonfinite="ignore" if rank == 0 else "skip")
    before = [p.to_local().clone() for p in ours.parameters()]
    try:
        opt.step()
    except ValueError as e:
        untouched = all(torch.equal(a, p.to_local()) for a, p in zip(before, ours.parameters()))
        out["refusals"].append(("ValueError", str(e) if untouched else "written"))
    sparse = torch.nn.Parameter(torch.zeros(3, 2))
    opt = StreamAdamW([sparse], process_group=group)
    sparse.grad = torch.zeros(3, 2).to_sparse() if rank == 1 else torch.zeros(3, 2)
    try:
        opt.step()
    except (TypeError, RuntimeError) as e:
        out["refusals"].append((type(e).__name__, str(e)))
    return out


def _checkpoint_dir() -> str:
    import os

    return os.environ["FLATPEAK_TEST_CHECKPOINT"]


def _train(torch, model, opt, steps, rank, world, max_norm):
    """``steps`` steps of ``opt`` (a torch optimizer clips first with ``clip_grad_norm_``)."""
    from flatpeak.torch import StreamAdamW

    for step in steps:
        opt.zero_grad()
        backward(torch, model, step, rank, world)
        if not isinstance(opt, StreamAdamW):
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()


def _optimizer(torch, kind: str, model, group, max_norm):
    from flatpeak.torch import StreamAdamW

    if kind == "stream":
        return StreamAdamW(model.parameters(), **HP, max_norm=max_norm, process_group=group)
    return torch.optim.AdamW(model.parameters(), **HP)


@reporting
def save_checkpoints(rank: int, world: int, init_file: str):
    """Test 7, first half: 5 steps on ``world`` ranks with StreamAdamW and with torch's AdamW,
    each saved with ``torch.distributed.checkpoint`` (the model's and the optimizer's state)."""
    torch, dist = _init(rank, world, init_file)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    for kind in ("stream", "torch"):
        model = sharded(torch, mesh)
        opt = _optimizer(torch, kind, model, dist.group.WORLD, 0.05)
        _train(torch, model, opt, range(5), rank, world, 0.05)
        state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
        dcp.save(state, checkpoint_id=f"{_checkpoint_dir()}/{kind}")
    return True


@reporting
def resume_checkpoints(rank: int, world: int, init_file: str):
    """Test 7, second half, on another number of ranks: each checkpoint loaded into StreamAdamW and
    into torch's AdamW, 5 more steps; the parameters against one process's 10 uninterrupted steps."""
    torch, dist = _init(rank, world, init_file)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    expected = reference(torch, 10, max_norm=0.05)[0]
    out = {}
    for saved in ("stream", "torch"):
        for kind in ("stream", "torch"):
            model = sharded(torch, mesh)
            opt = _optimizer(torch, kind, model, dist.group.WORLD, 0.05)
            state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
            dcp.load(state, checkpoint_id=f"{_checkpoint_dir()}/{saved}")
            set_model_state_dict(model, state["model"])
            set_optimizer_state_dict(model, opt, state["optim"])
            steps = {float(opt.state[p]["step"]) for p in model.parameters()}
            _train(torch, model, opt, range(5, 10), rank, world, 0.05)
            out[f"{saved}->{kind}"] = (worst(params_of(model), expected), sorted(steps))
    return out
