"""Worker processes of the multi-process MoE tests (``test_moe.py``): each is one rank of a gloo
group of ``world`` processes, one thread each, that runs a battery of checks and reports through
its exit code and the result queue. Kept apart from the test module so spawned children import
only this."""

from __future__ import annotations

import datetime
import os
import time
import traceback

from _spawn import reporting

H, I, K, E_LOCAL = 16, 8, 2, 2  # noqa: E741 (I: the experts' intermediate size, the papers' name)


def _init(rank: int, world: int, init_file: str, timeout_s: float = 60.0):
    os.environ["RAYON_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return torch, dist


def global_problem(torch, world: int, tokens: list, profile: str, seed: int, dtype=None):
    """Every rank's tokens, routing and the experts of all ranks (the same on every rank)."""
    dtype = dtype or torch.float32
    g = torch.Generator().manual_seed(seed)
    e = E_LOCAL * world
    total = sum(tokens)
    x = torch.randn(total, H, generator=g)
    if profile == "balanced":
        t = torch.arange(total).unsqueeze(1)
        ids = (t * K + torch.arange(K)) % e
    elif profile == "hot":  # 95% of the routes on expert 0
        ids = torch.randint(0, e, (total, K), generator=g)
        hot = torch.rand(total, K, generator=g) < 0.95
        ids[hot] = 0
    else:  # random, duplicates within a token included
        ids = torch.randint(0, e, (total, K), generator=g)
    w = torch.rand(total, K, generator=g)
    gate_up = torch.randn(e, 2 * I, H, generator=g) / H ** 0.5
    down = torch.randn(e, H, I, generator=g) / I ** 0.5
    dy = torch.randn(total, H, generator=g)
    return [t.to(dtype) if t.is_floating_point() and t is not w else t for t in (x, ids, w, gate_up, down, dy)]


def reference(torch, x, ids, w, gate_up, down, dy):
    """y and every gradient in float64 by plain torch ops."""
    import torch.nn.functional as F

    leaves = [t.detach().double().requires_grad_() for t in (x, w, gate_up, down)]
    xd, wd, gud, dd = leaves
    y = torch.zeros_like(xd)
    inter = gate_up.shape[1] // 2
    for j in range(ids.shape[1]):
        g = gud[ids[:, j]]
        pre = torch.einsum("th,tih->ti", xd, g)
        act = F.silu(pre[:, :inter]) * pre[:, inter:]
        y = y + wd[:, j:j + 1] * torch.einsum("ti,thi->th", act, dd[ids[:, j]])
    (y * dy.double()).sum().backward()
    return y.detach(), [t.grad for t in leaves]


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def run_rank(torch, dist, rank, world, tokens, profile, scheme, seed, dtype=None, **options):
    """Forward + backward of rank ``rank``'s share; returns (errors by name, stats)."""
    from flatpeak.torch import moe_swiglu

    x, ids, w, gate_up, down, dy = global_problem(torch, world, tokens, profile, seed, dtype)
    start = sum(tokens[:rank])
    mine = slice(start, start + tokens[rank])
    experts = slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    leaves = [t.detach().clone().requires_grad_() for t in (x[mine], w[mine], gate_up[experts], down[experts])]
    y, stats = moe_swiglu(leaves[0], ids[mine], leaves[1], leaves[2], leaves[3], group=dist.group.WORLD,
                          scheme=scheme, return_stats=True, **options)
    (y.float() * dy[mine].float()).sum().backward()
    y_ref, (dx_ref, dw_ref, dgu_ref, dd_ref) = reference(torch, x, ids, w, gate_up, down, dy.float())
    errors = {"y": rel(y, y_ref[mine]) if tokens[rank] else 0.0,
              "dx": rel(leaves[0].grad, dx_ref[mine]) if tokens[rank] else 0.0,
              "d_weights": rel(leaves[1].grad, dw_ref[mine]) if tokens[rank] else 0.0,
              "d_gate_up": rel(leaves[2].grad, dgu_ref[experts]),
              "d_down": rel(leaves[3].grad, dd_ref[experts])}
    return errors, stats


@reporting
def correctness(rank: int, world: int, init_file: str):
    """Every scheme against the float64 reference under balanced, 95%:1 and random routing
    (duplicates) with ranks of different T (one with none); the receive high water against the
    plan's bound under balanced and skewed routing; bf16 against twice the naive bf16 error."""
    torch, dist = _init(rank, world, init_file)
    out = []
    q = 3
    for tokens in ([12] * world, [13, 0, 7, 16][:world]):
        for profile in ("balanced", "hot", "random"):
            for scheme, opts in (("pipelined", dict(pair_cap_rows=q)), ("llep", {}), ("standard", {})):
                errors, stats = run_rank(torch, dist, rank, world, tokens, profile, scheme, 7, **opts)
                for name, err in errors.items():
                    bound = 1e-4 if name.startswith("d_") and name != "d_weights" else 1e-5
                    if err > bound:
                        raise AssertionError(f"{tokens} {profile} {scheme}: {name} relative error {err:.2e}")
                if scheme == "pipelined":
                    if stats.recv_high_water_rows > world * q:
                        raise AssertionError(f"{profile}: received {stats.recv_high_water_rows} rows in a "
                                             f"round, above the plan's P*q = {world * q}")
                    out.append((tuple(tokens), profile, stats.rounds, stats.recv_high_water_rows,
                                stats.workspace_bytes, int(stats.tokens_per_expert.sum())))
    # activations="save": backward from what each rank's forward kept, ranks of different T.
    for profile in ("balanced", "hot"):
        errors, stats = run_rank(torch, dist, rank, world, [13, 0, 7, 16][:world], profile, "pipelined", 7,
                                 pair_cap_rows=q, activations="save")
        for name, err in errors.items():
            if err > (1e-4 if name.startswith("d_") and name != "d_weights" else 1e-5):
                raise AssertionError(f"activations='save' {profile}: {name} relative error {err:.2e}")
        if stats.saved_bytes <= 0:
            raise AssertionError(f"activations='save' {profile}: nothing kept ({stats})")
    # bf16: no worse than twice the naive bf16 layer's error + 1e-2, recomputing or from saved bf16
    # pre-activations.
    for activations in ("recompute", "save"):
        errors, _ = run_rank(torch, dist, rank, world, [12] * world, "hot", "pipelined", 9, torch.bfloat16,
                             pair_cap_rows=q, activations=activations)
        if errors["y"] > 2e-2 or errors["dx"] > 5e-2:
            raise AssertionError(f"bf16 errors ({activations}) {errors}")
    return out


@reporting
def bad_input(rank: int, world: int, init_file: str):
    """Bad input on one rank raises on every rank, naming that rank; the group still works."""
    torch, dist = _init(rank, world, init_file)
    from flatpeak.torch import moe_swiglu

    x, ids, w, gate_up, down, _ = global_problem(torch, world, [6] * world, "random", 3)
    mine, experts = slice(6 * rank, 6 * rank + 6), slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    base = dict(hidden_states=x[mine], topk_ids=ids[mine], topk_weights=w[mine],
                gate_up_proj=gate_up[experts].contiguous(), down_proj=down[experts].contiguous())
    e = E_LOCAL * world
    cases = [
        ("an id >= E on rank 2", 2, lambda a: a.update(topk_ids=torch.full_like(a["topk_ids"], e)),
         ValueError, rf"rank 2 .*{e}|outside 0\.\.{e}"),
        ("bf16 on rank 1", 1, lambda a: a.update({k: a[k].bfloat16() for k in
                                                  ("hidden_states", "gate_up_proj", "down_proj")}),
         TypeError, r"rank 1 passed torch.bfloat16 tensors"),
        ("hidden size differs on rank 3", 3 % world,
         lambda a: a.update(hidden_states=torch.randn(6, H + 1), gate_up_proj=torch.randn(E_LOCAL, 2 * I, H + 1),
                            down_proj=torch.randn(E_LOCAL, H + 1, I)),
         ValueError, r"rank \d passed hidden=17"),
        ("other options on rank 1", 1, lambda a: a.update(activations="save"),
         ValueError, r"rank 1 passed other options than rank 0"),
    ]
    seen = []
    for what, bad_rank, edit, exc, pattern in cases:
        args = dict(base)
        if rank == bad_rank:
            edit(args)
        try:
            moe_swiglu(group=dist.group.WORLD, **args)
        except exc as err:
            import re
            if not re.search(pattern, str(err)):
                raise AssertionError(f"{what}: rank {rank}: message {err!s} does not match {pattern}") from err
            seen.append(what)
        else:
            raise AssertionError(f"{what}: rank {rank} did not raise")
    try:
        moe_swiglu(group=dist.group.WORLD, num_experts=e + 1, **base)
    except ValueError as err:
        if "num_experts" not in str(err):
            raise
        seen.append("num_experts")
    else:
        raise AssertionError("num_experts not E_local x P was accepted")
    # The group is intact: a good call runs.
    y = moe_swiglu(group=dist.group.WORLD, **base)
    return (seen, tuple(y.shape))


@reporting
def saving_beside_a_rank_without_gradient(rank: int, world: int, init_file: str):
    """activations="save" where rank 1 needs no gradient (it keeps nothing) and the others do:
    every rank's forward runs the same exchanges and matches the reference; the group stays
    usable."""
    torch, dist = _init(rank, world, init_file)
    from flatpeak.torch import moe_swiglu

    x, ids, w, gate_up, down, dy = global_problem(torch, world, [6] * world, "hot", 4)
    mine, experts = slice(6 * rank, 6 * rank + 6), slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
    leaves = [t.detach().clone().requires_grad_(rank != 1) for t in (x[mine], w[mine], gate_up[experts], down[experts])]
    y, stats = moe_swiglu(leaves[0], ids[mine], leaves[1], leaves[2], leaves[3], group=dist.group.WORLD,
                          activations="save", return_stats=True)
    y_ref, _ = reference(torch, x, ids, w, gate_up, down, dy.float())
    if rel(y, y_ref[mine]) > 1e-5:
        raise AssertionError(f"y relative error {rel(y, y_ref[mine]):.2e}")
    if (stats.saved_bytes > 0) != (rank != 1):
        raise AssertionError(f"rank {rank} kept {stats.saved_bytes} B")
    with torch.no_grad():
        again = moe_swiglu(x[mine], ids[mine], w[mine], gate_up[experts], down[experts], group=dist.group.WORLD)
    return bool(torch.equal(again, y.detach()))


def killed_rank(rank: int, world: int, init_file: str, queue) -> None:
    """The last rank dies as the others enter the op's exchanges: they raise RuntimeError
    within the group's timeout instead of hanging."""
    try:
        torch, dist = _init(rank, world, init_file, timeout_s=20.0)
        from flatpeak.torch import moe_swiglu

        x, ids, w, gate_up, down, _ = global_problem(torch, world, [6] * world, "random", 5)
        mine, experts = slice(6 * rank, 6 * rank + 6), slice(rank * E_LOCAL, (rank + 1) * E_LOCAL)
        dist.barrier()
        if rank == world - 1:
            os._exit(3)
        start = time.monotonic()
        try:
            moe_swiglu(x[mine], ids[mine], w[mine], gate_up[experts].contiguous(), down[experts].contiguous(),
                       group=dist.group.WORLD)
        except RuntimeError as e:
            queue.put((rank, "ok", (time.monotonic() - start, str(e)[:200])))
        else:
            queue.put((rank, "error", "the op returned with a dead peer"))
    except BaseException:  # noqa: BLE001
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        # The report must reach the parent before this process leaves without cleanup (the
        # group's teardown would wait on the dead peer).
        queue.close()
        queue.join_thread()
        os._exit(0)


@reporting
def cuda_nccl_one_rank(rank: int, world: int, init_file: str):
    """A one-rank NCCL group on the GPU: the group's metadata staged through CUDA tensors, the
    rows over flatpeak's NCCL communicator; y and the gradients against the float64 reference."""
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from flatpeak.torch import moe_swiglu

    x, ids, w, gate_up, down, dy = global_problem(torch, world, [32], "random", 13)
    leaves = [t.detach().cuda().requires_grad_() for t in (x, w, gate_up, down)]
    y = moe_swiglu(leaves[0], ids.cuda(), leaves[1], leaves[2], leaves[3], group=dist.group.WORLD)
    (y * dy.cuda()).sum().backward()
    y_ref, grads_ref = reference(torch, x, ids, w, gate_up, down, dy)
    errors = [rel(y.cpu(), y_ref)] + [rel(t.grad.cpu(), g) for t, g in zip(leaves, grads_ref)]
    if max(errors) > 1e-4:
        raise AssertionError(f"errors {errors}")
    return errors
