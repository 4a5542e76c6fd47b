"""``flatpeak.torch.moe_swiglu`` / ``MoEExperts``: exact against a float64 reference of plain torch
ops, in one process and expert-parallel over a 4-process gloo group (one thread per process);
receive buffers within the plan's bound whatever the skew; bad input on one rank raises on every
rank; a dead rank makes the others raise; ``torch.compile(fullgraph=True)``."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
import _moe_workers as workers  # noqa: E402
from _spawn import WORLD, spawn  # noqa: E402
from _threads import results_of_threads  # noqa: E402

from flatpeak.torch import MoEExperts, moe_swiglu  # noqa: E402


def test_expert_parallel_over_gloo_matches_the_float64_reference():
    reports = spawn(workers.correctness)
    errors = {r: p for r, (s, p) in reports.items() if s != "ok"}
    assert not errors, "\n".join(f"rank {r}:\n{p}" for r, p in errors.items())
    assert sorted(reports) == list(range(WORLD))
    # The receive buffers do not grow with skew: the same working set under balanced and 95%:1
    # routing, which costs rounds instead.
    for rank, (_, rows) in reports.items():
        by = {(tokens, profile): (rounds, high, ws) for tokens, profile, rounds, high, ws, _ in rows}
        balanced, hot = by[((12,) * WORLD, "balanced")], by[((12,) * WORLD, "hot")]
        assert balanced[2] == hot[2], f"rank {rank}: workspace {balanced[2]} vs {hot[2]}"
        assert hot[0] > balanced[0], f"rank {rank}: skew should cost rounds: {balanced} vs {hot}"


def test_bad_input_on_one_rank_raises_on_every_rank():
    reports = spawn(workers.bad_input)
    errors = {r: p for r, (s, p) in reports.items() if s != "ok"}
    assert not errors, "\n".join(f"rank {r}:\n{p}" for r, p in errors.items())
    for rank, (_, (seen, shape)) in reports.items():
        assert len(seen) == 5 and shape == (6, workers.H), (rank, seen, shape)


def test_saving_ranks_beside_one_without_a_gradient_run_the_same_exchanges():
    reports = spawn(workers.saving_beside_a_rank_without_gradient)
    errors = {r: p for r, (s, p) in reports.items() if s != "ok"}
    assert not errors, "\n".join(f"rank {r}:\n{p}" for r, p in errors.items())
    assert all(same for _, same in reports.values()), reports


def test_a_dead_rank_makes_the_others_raise_instead_of_hanging():
    reports = spawn(workers.killed_rank, timeout=120, reporting=WORLD - 1)
    alive = {r: p for r, p in reports.items() if r != WORLD - 1}
    assert sorted(alive) == list(range(WORLD - 1)), reports
    for rank, (status, payload) in alive.items():
        assert status == "ok", f"rank {rank}: {payload}"
        elapsed, message = payload
        assert elapsed < 60, f"rank {rank} waited {elapsed:.1f} s: {message}"


def dense(torch_, x, ids, w, gate_up, down):
    return workers.reference(torch_, x, ids, w, gate_up, down, torch.zeros(x.shape))[0]


@pytest.mark.parametrize("activations", ["recompute", "save"])
@pytest.mark.parametrize("scheme", ["pipelined", "llep", "standard"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_process_matches_the_reference_in_batch_shape(scheme, dtype, activations):
    x, ids, w, gate_up, down, dy = workers.global_problem(torch, 2, [10, 10], "hot", 11, dtype)
    x3, ids3, w3, dy3 = x.reshape(4, 5, -1), ids.reshape(4, 5, -1), w.reshape(4, 5, -1), dy.reshape(4, 5, -1)
    leaves = [t.detach().clone().requires_grad_() for t in (x3, w3, gate_up, down)]
    y, stats = moe_swiglu(leaves[0], ids3, leaves[1], leaves[2], leaves[3], scheme=scheme, pair_cap_rows=4,
                          activations=activations, return_stats=True)
    assert (stats.saved_bytes > 0) == (activations == "save"), stats
    assert y.shape == x3.shape and y.dtype == dtype
    (y.float() * dy3.float()).sum().backward()
    y_ref, grads = workers.reference(torch, x, ids, w, gate_up, down, dy.float())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert workers.rel(y.reshape(20, -1), y_ref) <= tol
    for leaf, ref in zip(leaves, grads):
        assert workers.rel(leaf.grad.reshape(ref.shape), ref) <= (1e-4 if dtype == torch.float32 else 5e-2)
    assert int(stats.tokens_per_expert.sum()) == 20 * workers.K
    assert stats.tokens_per_expert.shape == (gate_up.shape[0],)


def test_one_process_reserves_no_foreign_slots_and_runs_one_round():
    """With one process every expert is its own and its exchanges are with itself: the plan keeps
    no foreign expert slots (48 MiB each at H=2048, I=1024: an expert's weights and gradients)
    and one buffer copy, so the whole working set is the rows', and the default budget runs the
    call in one round, exact."""
    t, h, i, e = 6, 2048, 1024, 2
    g = torch.Generator().manual_seed(3)
    x = torch.randn(t, h, generator=g)
    ids = torch.tensor([[0], [1], [0], [1], [1], [0]])
    w = torch.rand(t, 1, generator=g)
    gate_up = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    down = torch.randn(e, h, i, generator=g) / i ** 0.5
    y, stats = moe_swiglu(x, ids, w, gate_up, down, return_stats=True)
    assert stats.rounds == 1
    assert stats.workspace_bytes < 1 << 20, stats
    assert stats.device_bytes == 0, "a CPU call allocates no device memory"
    pre = torch.einsum("th,tih->ti", x.double(), gate_up[ids[:, 0]].double())
    act = torch.nn.functional.silu(pre[:, :i]) * pre[:, i:]
    want = torch.einsum("ti,thi->th", act, down[ids[:, 0]].double()) * w.double()
    assert workers.rel(y, want) <= 1e-5


def test_bad_input_in_one_process_names_the_argument():
    x, ids, w, gate_up, down, _ = workers.global_problem(torch, 1, [6], "random", 1)
    with pytest.raises(ValueError, match=r"outside 0\.\.2"):
        moe_swiglu(x, ids + 5, w, gate_up, down)
    with pytest.raises(TypeError, match=r"topk_ids: expected dtype torch.int64"):
        moe_swiglu(x, ids.int(), w, gate_up, down)
    with pytest.raises(ValueError, match=r"gate_up_proj"):
        moe_swiglu(x, ids, w, gate_up[:, :, :-1].contiguous(), down)
    with pytest.raises(ValueError, match=r"scheme"):
        moe_swiglu(x, ids, w, gate_up, down, scheme="fast")
    with pytest.raises(ValueError, match=r"num_experts"):
        moe_swiglu(x, ids, w, gate_up, down, num_experts=3)


def test_saved_activations_are_kept_only_for_a_gradient_and_serve_every_backward():
    """activations="save": a forward without a gradient keeps nothing; a retained graph's second
    backward reads the same store and gives the same gradients; the y is bitwise the recomputing
    layer's and the gradients agree to rounding."""
    x, ids, w, gate_up, down, dy = workers.global_problem(torch, 1, [24], "random", 5)
    with torch.no_grad():
        y0, stats0 = moe_swiglu(x, ids, w, gate_up, down, activations="save", return_stats=True)
    assert stats0.saved_bytes == 0
    runs = {}
    for activations in ("recompute", "save"):
        leaves = [t.detach().clone().requires_grad_() for t in (x, w, gate_up, down)]
        y, stats = moe_swiglu(leaves[0], ids, leaves[1], leaves[2], leaves[3], activations=activations,
                              return_stats=True)
        (y * dy).sum().backward(retain_graph=True)
        first = [leaf.grad.clone() for leaf in leaves]
        for leaf in leaves:
            leaf.grad = None
        (y * dy).sum().backward()
        assert all(torch.equal(a, leaf.grad) for a, leaf in zip(first, leaves)), activations
        runs[activations] = (y.detach(), first, stats)
    assert torch.equal(runs["save"][0], runs["recompute"][0]) and torch.equal(runs["save"][0], y0)
    assert runs["save"][2].saved_bytes > 0
    for a, b in zip(runs["save"][1], runs["recompute"][1]):
        assert workers.rel(a, b) <= 1e-5


def test_the_saved_store_is_a_saved_tensor_that_hooks_may_move():
    """The store goes through torch's saved-tensor hooks like any saved tensor (so checkpointing
    drops it and offloading moves it); a backward from a copy the hook returns is unchanged."""
    x, ids, w, gate_up, down, dy = workers.global_problem(torch, 1, [24], "hot", 8)
    grads = {}
    for copy in (False, True):
        packed = []

        def pack(t, packed=packed, copy=copy):
            packed.append((t.dtype, t.numel()))
            return t.clone() if copy else t

        leaves = [t.detach().clone().requires_grad_() for t in (x, w, gate_up, down)]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y, stats = moe_swiglu(leaves[0], ids, leaves[1], leaves[2], leaves[3], activations="save",
                                  return_stats=True)
        assert (torch.uint8, stats.saved_bytes) in packed
        (y * dy).sum().backward()
        grads[copy] = [leaf.grad for leaf in leaves]
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True]))


def test_saved_activations_refuse_what_they_cannot_serve():
    from flatpeak import _flatpeak as ext

    x, ids, w, gate_up, down, dy = workers.global_problem(torch, 1, [6], "random", 1)
    with pytest.raises(ValueError, match=r"activations: expected one of \('recompute', 'save'\), got 'keep'"):
        moe_swiglu(x, ids, w, gate_up, down, activations="keep")
    args = (x, ids, w.float(), gate_up, down)
    saving = ext.MoEOptions(activations="save")
    nbytes = ext.moe_saved_bytes(saving, None, args, None)
    y, counts = torch.empty(x.shape), torch.empty((gate_up.shape[0],), dtype=torch.int64)
    with pytest.raises(ValueError, match=r"saved_out: these options recompute in backward"):
        ext.moe_forward(ext.MoEOptions(), None, args, None, (y, counts, torch.zeros(nbytes, dtype=torch.uint8)))
    with pytest.raises(ValueError, match=rf"saved-activation store \(bytes\): expected {nbytes}, got {nbytes - 64}"):
        ext.moe_forward(saving, None, args, None, (y, counts, torch.zeros(nbytes - 64, dtype=torch.uint8)))
    with pytest.raises(ValueError, match=r"saved_out: data pointer 0x[0-9a-f]+ is not on a 64-byte line"):
        ext.moe_forward(saving, None, args, None, (y, counts, torch.zeros(nbytes + 1, dtype=torch.uint8)[1:]))
    grads = (torch.empty(x.shape), torch.empty(w.shape), torch.empty(gate_up.shape), torch.empty(down.shape))
    # A store no forward filled: refused, naming what it lacks, before any gradient is written.
    with pytest.raises(ValueError, match=r"rounds of the saved forward"):
        ext.moe_backward(saving, None, args, None, (dy, torch.zeros(nbytes, dtype=torch.uint8)), grads)
    # Options made to save run a recomputing backward only through the saving path.
    with pytest.raises(ValueError, match=r"Mode::Checkpointed"):
        ext.moe_backward(saving, None, args, None, (dy, None), grads)
    with pytest.raises(ValueError, match=r"Mode::SaveActivations"):
        ext.moe_saved_bytes(ext.MoEOptions(), None, args, None)


class TinyMoE(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.router = torch.nn.Linear(workers.H, 4, bias=False)
        self.experts = MoEExperts(4, workers.H, workers.I)

    def forward(self, x):
        probs = self.router(x).softmax(-1)
        w, ids = probs.topk(2, dim=-1)
        return self.experts(x, ids, w).square().mean()


def test_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    model = TinyMoE()
    x = torch.randn(3, 5, workers.H)
    eager = model(x)
    eager.backward()
    eager_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")(x)
    compiled.backward()
    assert torch.allclose(compiled, eager, rtol=1e-6, atol=1e-7)
    for p, g in zip(model.parameters(), eager_grads):
        assert torch.allclose(p.grad, g, rtol=1e-5, atol=1e-7)


def test_threads_sharing_the_cached_executor_neither_deadlock_nor_race():
    x, ids, w, gate_up, down, _ = workers.global_problem(torch, 1, [32], "random", 13)
    want = moe_swiglu(x, ids, w, gate_up, down)
    results = results_of_threads(lambda: moe_swiglu(x, ids, w, gate_up, down), threads=4, steps=10)
    assert all(torch.equal(r, want) for r in results)


def test_threads_sharing_the_executor_at_a_size_whose_steps_split_on_the_pool():
    """The CPU executor runs on a rayon pool thread and splits its row operations there: calls
    from several Python threads on one cached executor (its lock taken before the pool) finish,
    each forward and backward bitwise the sequential one."""
    g = torch.Generator().manual_seed(5)
    t, h, i, e, k = 2048, 128, 128, 8, 2
    x = torch.randn(t, h, generator=g)
    ids = torch.randint(0, e, (t, k), generator=g)
    w = torch.rand(t, k, generator=g)
    gate_up = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    down = torch.randn(e, h, i, generator=g) / i ** 0.5
    dy = torch.randn(t, h, generator=g)

    def step():
        leaves = [a.clone().requires_grad_() for a in (x, w, gate_up, down)]
        y = moe_swiglu(leaves[0], ids, leaves[1], leaves[2], leaves[3])
        y.backward(dy)
        return [y.detach()] + [a.grad for a in leaves]

    want = step()
    results = results_of_threads(step, threads=4, steps=3)
    assert all(torch.equal(a, b) for got in results for a, b in zip(got, want))


CUDA = torch.cuda.is_available() and getattr(__import__("flatpeak._flatpeak", fromlist=["CUDA"]), "CUDA", False)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device and flatpeak built with `cuda`")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_tensors_match_the_cpu_path(dtype):
    """One process, all experts, on the GPU (llep's device schedule on torch's current stream,
    a one-rank NCCL communicator): y and every gradient as on the CPU."""
    x, ids, w, gate_up, down, dy = workers.global_problem(torch, 1, [64], "hot", 5, dtype)

    def run(device):
        leaves = [t.detach().to(device).requires_grad_() for t in (x, w, gate_up, down)]
        y = moe_swiglu(leaves[0], ids.to(device), leaves[1], leaves[2], leaves[3], pair_cap_rows=8)
        (y.float() * dy.to(device).float()).sum().backward()
        return [y.detach().cpu()] + [t.grad.cpu() for t in leaves]

    bound = 1e-4 if dtype == torch.float32 else 3e-2
    for got, want in zip(run("cuda"), run("cpu")):
        assert workers.rel(got, want) <= bound
    # llep's device buffers come from torch's caching allocator: its peak covers them (none on
    # the CPU).
    for device, any_bytes in (("cuda", True), ("cpu", False)):
        args = [t.to(device) for t in (x, ids, w, gate_up, down)]
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        _, stats = moe_swiglu(*args, pair_cap_rows=8, return_stats=True)
        assert (stats.device_bytes > 0) == any_bytes, (device, stats)
        if device == "cuda":
            assert torch.cuda.max_memory_allocated() - before >= stats.device_bytes, stats
    # The saved-activation store lives in host memory: CUDA tensors are refused, saying so.
    with pytest.raises(TypeError, match=r"activations='save' .* runs on CPU tensors"):
        moe_swiglu(x.cuda(), ids.cuda(), w.cuda(), gate_up.cuda(), down.cuda(), activations="save")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device and flatpeak built with `cuda`")
def test_cuda_over_a_one_rank_nccl_group():
    reports = spawn(workers.cuda_nccl_one_rank, world=1, timeout=240)
    assert reports[0][0] == "ok", reports[0][1]
