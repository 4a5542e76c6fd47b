"""Worker processes of the multi-process ring-loss tests (``test_ring_loss.py``): each is one rank
of a gloo group, one thread, that checks ``linear_cross_entropy(..., group=, ring=)`` against the
single-process call on the whole problem and reports through the result queue."""

from __future__ import annotations

import re

from _moe_workers import _init
from _spawn import reporting

D, V = 24, 203  # V not a multiple of the group's size: the last shard is shorter


def shard_rows(world: int, rank: int) -> slice:
    rows = -(-V // world)
    return slice(min(rank * rows, V), min((rank + 1) * rows, V))


def problem(torch, tokens: list, seed: int, dtype):
    g = torch.Generator().manual_seed(seed)
    n = sum(tokens)
    x = torch.randn(n, D, generator=g).to(dtype)
    w = (torch.randn(V, D, generator=g) * 0.3).to(dtype)
    b = (torch.randn(V, generator=g) * 0.1).to(dtype)
    target = torch.randint(0, V, (n,), generator=g)
    target[torch.rand(n, generator=g) < 0.2] = -100
    weights = torch.rand(n, generator=g)
    dy = torch.randn(n, generator=g)
    return x, w, b, target, weights, dy


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


CASES = [
    # (tokens per rank, options, with bias, with token weights, return_lse)
    ([10, 10, 10, 10], dict(reduction="mean"), False, False, False),
    ([10, 10, 10, 10], dict(reduction="sum", label_smoothing=0.1, z_loss=1e-3), True, False, True),
    ([9, 0, 13, 5], dict(reduction="mean", softcap=20.0), True, True, False),
    ([9, 0, 13, 5], dict(reduction="none"), False, False, True),
]


def one_case(torch, dist, rank, world, ring, tokens, options, with_bias, with_weights, return_lse, dtype, seed):
    """The ring call on this rank's share against the one-process call on everything: errors."""
    from flatpeak.torch import linear_cross_entropy

    tokens = tokens[:world]
    x, w, b, target, weights, dy = problem(torch, tokens, seed, dtype)
    start = sum(tokens[:rank])
    mine, shard = slice(start, start + tokens[rank]), shard_rows(world, rank)

    def run(xs, ws, bs, ts, tw, group):
        leaves = [xs.clone().requires_grad_(), ws.clone().requires_grad_()]
        bias = bs.clone().requires_grad_() if with_bias else None
        out = linear_cross_entropy(leaves[0], leaves[1], ts, bias, token_weights=tw if with_weights else None,
                                   return_lse=return_lse, group=group, ring=ring if group is not None else None,
                                   **options)
        loss, lse = out if return_lse else (out, None)
        total = (loss * (dy_rows(group) if options["reduction"] == "none" else 1.0)).sum()
        if lse is not None:
            total = total + 0.1 * (lse * dy_rows(group)).sum()
        total.backward()
        return loss.detach(), None if lse is None else lse.detach(), leaves[0].grad, leaves[1].grad, \
            None if bias is None else bias.grad

    def dy_rows(group):
        return dy[mine] if group is not None else dy

    got = run(x[mine], w[shard], b[shard], target[mine], weights[mine], dist.group.WORLD)
    ref = run(x, w, b, target, weights, None)
    errors = {}
    if options["reduction"] == "none":
        errors["loss"] = rel(got[0], ref[0][mine]) if tokens[rank] else 0.0
    else:
        errors["loss"] = rel(got[0], ref[0])
    if return_lse and tokens[rank]:
        errors["lse"] = rel(got[1], ref[1][mine])
    if tokens[rank]:
        errors["dx"] = rel(got[2], ref[2][mine])
    errors["dw"] = rel(got[3], ref[3][shard])
    if with_bias:
        errors["dbias"] = rel(got[4], ref[4][shard])
    return errors


@reporting
def correctness(rank: int, world: int, init_file: str):
    """Both rings (and the plan's choice), equal and unequal token counts (a rank with none),
    bias, token weights, every reduction and the lse output, f32 to 1e-5; bf16 to 2e-2."""
    torch, dist = _init(rank, world, init_file)
    checked = 0
    for ring in ("weight", "activation", None):
        for i, (tokens, options, with_bias, with_weights, return_lse) in enumerate(CASES):
            errors = one_case(torch, dist, rank, world, ring, tokens, options, with_bias, with_weights,
                              return_lse, torch.float32, 11 + i)
            for name, err in errors.items():
                if err > 1e-5:
                    raise AssertionError(f"ring={ring} {tokens} {options}: {name} relative error {err:.2e}")
            checked += 1
    errors = one_case(torch, dist, rank, world, "weight", [8, 8, 8, 8], dict(reduction="mean"), True, False,
                      False, torch.bfloat16, 5)
    if max(errors.values()) > 2e-2:
        raise AssertionError(f"bf16 errors {errors}")
    return checked


@reporting
def bad_input(rank: int, world: int, init_file: str):
    """Bad input on one rank raises on every rank, naming it; the group still works after."""
    torch, dist = _init(rank, world, init_file)
    from flatpeak.torch import linear_cross_entropy

    x, w, _, target, _, _ = problem(torch, [6] * world, 3, torch.float32)
    mine, shard = slice(6 * rank, 6 * rank + 6), shard_rows(world, rank)
    base = dict(input=x[mine], weight=w[shard].contiguous(), target=target[mine].clone(), ring="weight")
    cases = [
        ("a target >= V on rank 2", 2, lambda a: a.update(target=torch.full((6,), V)), ValueError,
         rf"target {V} of token 0 is outside 0\.\.{V}"),
        ("bf16 on rank 1", 1, lambda a: a.update(input=a["input"].bfloat16(), weight=a["weight"].bfloat16()),
         TypeError, r"rank 1 passed torch.bfloat16 tensors"),
        ("hidden size differs on rank 3", 3 % world,
         lambda a: a.update(input=torch.randn(6, D + 1), weight=torch.randn(a["weight"].shape[0], D + 1)),
         ValueError, rf"rank \d passed hidden size {D + 1}|passed hidden size {D} where rank 0 passed {D + 1}"),
        ("a shard off the layout on rank 0", 0, lambda a: a.update(weight=a["weight"][:-1].contiguous()),
         ValueError, r"weight shards"),
        ("another ring on rank 1", 1, lambda a: a.update(ring="activation"), ValueError, r"plan"),
        ("a ring that does not exist on rank 2", 2, lambda a: a.update(ring="vocab"), ValueError,
         r"ring: expected 'weight', 'activation' or None, got \"vocab\""),
    ]
    seen = []
    for what, bad_rank, edit, exc, pattern in cases:
        args = dict(base)
        if rank == bad_rank:
            edit(args)
        try:
            linear_cross_entropy(group=dist.group.WORLD, **args)
        except exc as err:
            if not re.search(pattern, str(err)):
                raise AssertionError(f"{what}: rank {rank}: message {err!s} does not match {pattern}") from err
            seen.append(what)
        else:
            raise AssertionError(f"{what}: rank {rank} did not raise")
    loss = linear_cross_entropy(group=dist.group.WORLD, **base)
    return (seen, float(loss))


@reporting
def cuda_nccl_one_rank(rank: int, world: int, init_file: str):
    """The ring on CUDA tensors over a one-rank NCCL group (the GPU path: ring-dtp's CudaRing over
    flatpeak's NCCL communicator, the group's metadata staged through CUDA tensors) against the
    single-process call, both rings, with a bias, in f32."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from flatpeak.torch import linear_cross_entropy

    x, w, b, target, _, _ = problem(torch, [40], 21, torch.float32)
    errors = []
    for ring in ("weight", "activation"):
        outs = []
        for group, device in ((dist.group.WORLD, "cuda"), (None, "cpu")):
            leaves = [t.detach().to(device).requires_grad_() for t in (x, w, b)]
            loss = linear_cross_entropy(leaves[0], leaves[1], target.to(device), leaves[2], group=group,
                                        ring=ring if group is not None else None)
            loss.backward()
            outs.append([loss.detach().cpu()] + [t.grad.cpu() for t in leaves])
        errors += [rel(a, c) for a, c in zip(*outs)]
    if max(errors) > 1e-5:
        raise AssertionError(f"errors {errors}")
    return errors
