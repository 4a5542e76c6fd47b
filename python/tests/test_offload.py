"""``flatpeak.torch.offload_checkpoints``: gradients bitwise equal to plain non-reentrant
checkpointing; the slot ring's high water within its bound at 4 and 16 blocks (and the bytes it
holds within slots x boundary); an exception inside a block's backward leaves the ring reset and
the next step exact; extra arguments, eval mode, bad options and torch.compile."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from flatpeak.torch import offload_checkpoints
from flatpeak.torch._offload import ring_of


class Block(torch.nn.Module):
    """A small residual MLP block; ``scale`` is a non-boundary argument, ``fail`` makes its
    backward raise (once)."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)
        self.fail = False

    def forward(self, x, scale=None):
        h = self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        if scale is not None:
            h = h * scale
        if self.fail:
            h = _FailInBackward.apply(h)
        return x + h


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("injected failure in a block's backward")


def stack(depth: int, width: int = 32, seed: int = 0) -> torch.nn.ModuleList:
    torch.manual_seed(seed)
    return torch.nn.ModuleList(Block(width) for _ in range(depth))


def run_plain(layers, x, scale=None):
    for layer in layers:
        x = checkpoint(layer, x, scale, use_reentrant=False)
    return x


def run(layers, x, scale=None):
    for layer in layers:
        x = layer(x, scale)
    return x


def step(layers, runner, x0, scale=None):
    x = x0.clone().requires_grad_()
    for p in layers.parameters():
        p.grad = None
    runner(layers, x, scale).square().mean().backward()
    return x.grad, [p.grad.clone() for p in layers.parameters()]


@pytest.mark.parametrize("depth", [4, 16])
@pytest.mark.parametrize("options", [dict(), dict(keep_resident=2, in_flight=1, prefetch_distance=2)])
def test_gradients_are_bitwise_those_of_plain_checkpointing_and_the_ring_stays_in_its_bound(depth, options):
    plain = stack(depth)
    offloaded = offload_checkpoints(copy.deepcopy(plain), **options)
    x0 = torch.randn(4, 8, 32)
    scale = torch.tensor(0.5)
    for _ in range(2):  # a second step reuses the ring
        want_dx, want = step(plain, run_plain, x0, scale)
        got_dx, got = step(offloaded, run, x0, scale)
        assert torch.equal(got_dx, want_dx)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    boundary = ring_of(offloaded)
    slots = boundary.ring.slots()
    assert slots == options.get("keep_resident", 1) + max(options.get("in_flight", 2),
                                                          options.get("prefetch_distance", 1) + 1)
    assert 1 <= boundary.ring.high_water_slots() <= slots
    assert boundary.high_water_bytes <= boundary.ring.workspace_bytes()
    assert boundary.ring.slots_in_use() == 0  # the step finished: every slot free


def test_the_bound_does_not_grow_with_depth():
    highs = {}
    for depth in (4, 16):
        layers = offload_checkpoints(stack(depth))
        step(layers, run, torch.randn(2, 8, 32))
        highs[depth] = ring_of(layers).ring.high_water_slots()
    assert highs[16] == highs[4] <= 3, highs


def test_an_exception_in_a_blocks_backward_leaves_the_ring_reset_and_the_next_step_exact():
    plain = stack(6)
    offloaded = offload_checkpoints(copy.deepcopy(plain))
    x0 = torch.randn(2, 8, 32)
    offloaded[3].fail = True
    with pytest.raises(RuntimeError, match="injected failure"):
        step(offloaded, run, x0)
    offloaded[3].fail = False
    want_dx, want = step(plain, run_plain, x0)
    got_dx, got = step(offloaded, run, x0)
    assert torch.equal(got_dx, want_dx)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert ring_of(offloaded).ring.slots_in_use() == 0


def test_outside_training_the_blocks_run_as_they_are():
    layers = offload_checkpoints(stack(3))
    x = torch.randn(2, 4, 32)
    with torch.no_grad():
        y = run(layers, x)
    assert not ring_of(layers).started  # no step was started
    layers.eval()
    assert torch.equal(run(layers, x.requires_grad_()), y)


def test_bad_options_and_inputs_are_refused():
    with pytest.raises(ValueError, match="keep_resident"):
        offload_checkpoints(stack(2), keep_resident=0)
    with pytest.raises(ValueError, match="in_flight"):
        offload_checkpoints(stack(2), in_flight=0)
    with pytest.raises(ValueError, match="no blocks"):
        offload_checkpoints(torch.nn.ModuleList())
    layers = offload_checkpoints(stack(2))
    with pytest.raises(ValueError, match="already under offload_checkpoints"):
        offload_checkpoints(layers)
    x = torch.randn(2, 4, 32, requires_grad=True)
    y = layers[0](x)
    with pytest.raises(ValueError, match="block 1's input is"):
        layers[1](torch.randn(2, 5, 32, requires_grad=True))
    del y


def test_names_hooks_and_pickling_stay_the_blocks_own():
    """No wrapper module: ``state_dict()`` and ``named_parameters()`` keep the plain names (a
    state dict loads either way), a hook on a block runs once per step (outside the checkpoint),
    and a pickled (or deep-copied) sequence loads with its own empty ring and trains exactly."""
    import io
    import pickle

    plain = stack(4)
    offloaded = offload_checkpoints(copy.deepcopy(plain))
    assert list(offloaded.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in offloaded.named_parameters()] == [n for n, _ in plain.named_parameters()]
    plain.load_state_dict(offloaded.state_dict())
    offloaded.load_state_dict(plain.state_dict())
    calls = []
    handle = offloaded[2].register_forward_hook(lambda *_: calls.append(1))
    x0 = torch.randn(2, 8, 32)
    step(offloaded, run, x0)
    assert len(calls) == 1  # not again in the recomputation
    handle.remove()
    buffer = io.BytesIO()
    torch.save(offloaded, buffer)
    buffer.seek(0)
    for loaded in (torch.load(buffer, weights_only=False), pickle.loads(pickle.dumps(offloaded)),
                   copy.deepcopy(offloaded)):
        assert ring_of(loaded) is not ring_of(offloaded) and not ring_of(loaded).started
        assert all(ring_of(loaded) is layer._flatpeak_offload.ring for layer in loaded)  # one ring, shared
        want_dx, want = step(plain, run_plain, x0)
        got_dx, got = step(loaded, run, x0)
        assert torch.equal(got_dx, want_dx)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        assert ring_of(loaded).ring.high_water_slots() >= 1


def test_torch_compile_is_refused_clearly():
    layers = offload_checkpoints(stack(2))

    def f(x):
        return run(layers, x).sum()

    compiled = torch.compile(f, fullgraph=True)
    with pytest.raises(Exception, match="does not run under torch.compile"):
        compiled(torch.randn(2, 4, 32, requires_grad=True))


def test_forward_leaves_only_the_ring_s_boundaries_alive():
    """Plain checkpointing keeps every block's input alive until backward; offloaded, only the
    ring's resident ones are (the others live in the host arena)."""
    import gc
    import weakref

    def alive_after_forward(layers, runner_one):
        x = torch.randn(2, 8, 32, requires_grad=True)
        refs = []
        h = x * 1.0
        for layer in layers:
            refs.append(weakref.ref(h))
            h = runner_one(layer, h)
        gc.collect()
        alive = sum(r() is not None for r in refs)
        h.sum().backward()
        return alive

    depth = 8
    plain = alive_after_forward(stack(depth), lambda layer, h: checkpoint(layer, h, use_reentrant=False))
    offloaded_layers = offload_checkpoints(stack(depth))
    offloaded = alive_after_forward(offloaded_layers, lambda layer, h: layer(h))
    assert plain == depth
    assert offloaded <= ring_of(offloaded_layers).ring.slots(), offloaded
    assert offloaded < depth


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_device_memory_stays_within_the_ring_at_two_depths():
    """On CUDA: gradients bitwise those of plain checkpointing, and the device's high water
    grows by at most the ring's slots of boundaries from 4 to 16 blocks, where plain
    checkpointing grows by 12 boundaries."""
    width, tokens = 1024, 4096
    boundary = tokens * width * 4
    peaks = {}
    for depth in (4, 16):
        plain = stack(depth, width).cuda()
        offloaded = offload_checkpoints(copy.deepcopy(plain))
        x0 = torch.randn(1, tokens, width, device="cuda")
        want_dx, want = step(plain, run_plain, x0)
        got_dx, got = step(offloaded, run, x0)
        assert torch.equal(got_dx, want_dx) and all(torch.equal(a, b) for a, b in zip(got, want))
        for name, layers, runner in (("plain", plain, run_plain), ("offloaded", offloaded, run)):
            for p in layers.parameters():  # the last step's gradients are not part of this one's peak
                p.grad = None
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step(layers, runner, x0)
            torch.cuda.synchronize()
            peaks[(name, depth)] = torch.cuda.max_memory_allocated() - base
        ring = ring_of(offloaded)
        assert ring.high_water_bytes <= ring.ring.workspace_bytes()
    params_12 = sum(p.numel() * 4 * 2 for p in stack(12, width).parameters())  # weights' grads of 12 more blocks
    assert peaks[("plain", 16)] - peaks[("plain", 4)] >= 12 * boundary
    assert peaks[("offloaded", 16)] - peaks[("offloaded", 4)] <= params_12 + 3 * boundary, peaks


def test_backward_prefetches_the_next_boundaries_while_a_block_recomputes():
    """torch's save_on_cpu and offloading checkpoint wrappers fetch each boundary when it is
    needed; here block i's recomputation starts bringing back blocks i-1 .. i-d."""
    for distance in (1, 2):
        layers = offload_checkpoints(stack(6), prefetch_distance=distance)
        step(layers, run, torch.randn(2, 8, 32))  # a first step makes the ring
        boundary = ring_of(layers)
        seen = []
        fetch = boundary.fetch

        def recording(layer, prefetch, fetch=fetch, boundary=boundary, seen=seen):
            t = fetch(layer, prefetch)
            held = {h for h in boundary.ring.slot_holders() if h is not None}
            seen.append((layer, list(prefetch), held))
            return t

        boundary.fetch = recording
        step(layers, run, torch.randn(2, 8, 32))
        assert [layer for layer, _, _ in seen] == list(range(5, -1, -1))
        for layer, prefetch, held in seen:
            assert prefetch == [layer - k for k in range(1, distance + 1) if layer - k >= 0]
            assert layer in held and set(prefetch) <= held, (layer, prefetch, held)
