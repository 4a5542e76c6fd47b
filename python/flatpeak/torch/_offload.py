"""``offload_checkpoints``: sco (selective checkpoint offload) for a sequence of PyTorch blocks.

Each block runs under non-reentrant ``torch.utils.checkpoint``; the one tensor that
outlives it, its input boundary, is held by sco's slot ring instead of by the checkpoint: copied
to host memory as forward passes (pinned, on a side stream, on CUDA), kept on the device only
while the ring says so (the ``keep_resident`` newest and the copies in flight), and brought back
``prefetch_distance`` blocks ahead during backward. Whatever the depth, the device holds at most
``slots = keep_resident + max(in_flight, prefetch_distance + 1)`` boundaries, against one per
block under plain checkpointing.

The ring's accounting (which slot a boundary gets, which copy to wait for, what stays resident,
when a slot frees) is sco's ``SlotRing`` in Rust (``flatpeak._flatpeak.SlotRing``); this module
performs the copies it asks for and reports when they land.

How the boundary leaves the checkpoint: the block's input ``x`` goes through ``_Park`` (which
hands ``x`` to the ring and returns a stride-0 placeholder of ``x``'s shape, one element of
storage) and the checkpointed function starts with ``_Unpark`` (which returns the ring's
boundary), so the checkpoint keeps only the placeholder. Gradients flow back through both as the
identity. The blocks are not wrapped: a transformers layer gets the offload as its
checkpointing function, any other block an instance ``forward`` (so names, hooks and pickling
stay the block's own).
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .. import _flatpeak as _ext


class _Copy:
    """One copy between the device and the host: done at once on the CPU, an event on CUDA."""

    def __init__(self, event: Optional["torch.cuda.Event"]):
        self.event = event

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class _Made:
    """What a ring is made for: one boundary's shape, dtype and device, its slot accounting, the
    host arena of every block's boundary and the side stream of the copies (CUDA)."""

    def __init__(self, x: Tensor, layers: int, options: Dict[str, int], pin_memory: bool):
        self.shape, self.dtype, self.device = x.shape, x.dtype, x.device
        self.ring = _ext.SlotRing(layers, x.numel() * x.element_size(), **options)
        self.arena = torch.empty((layers, x.numel()), dtype=x.dtype, pin_memory=pin_memory and x.is_cuda)
        self.side_stream: Optional[torch.cuda.Stream] = torch.cuda.Stream(device=x.device) if x.is_cuda else None

    def fits(self, x: Tensor) -> bool:
        """Whether ``x`` is a boundary of this shape, dtype and device."""
        return x.shape == self.shape and x.dtype == self.dtype and x.device == self.device


class _BoundaryRing:
    """The device side of one sequence's slot ring: the tensors its slots hold, the host arena,
    and the copies in flight. Made at the first training forward (when the boundary's shape,
    dtype and device are known), reset at the start of each step."""

    def __init__(self, layers: int, keep_resident: int, in_flight: int, prefetch_distance: int, pin_memory: bool):
        self.layers, self.pin_memory = layers, pin_memory
        self.options = dict(keep_resident=keep_resident, in_flight=in_flight, prefetch_distance=prefetch_distance)
        # Checked now (a bad option fails at once, not at the first batch).
        _ext.SlotRing(layers, 1, **self.options)
        self._made: Optional[_Made] = None
        self.held: Dict[int, Tuple[int, Tensor]] = {}  # slot -> (layer, tensor)
        self.d2h: Dict[int, _Copy] = {}
        self.h2d: Dict[int, _Copy] = {}
        self.forwarded = 0  # boundaries offloaded this step
        self.released = 0
        self.high_water_bytes = 0

    def __getstate__(self) -> Dict[str, Any]:
        # What the ring was made with; a copy starts without a step (tensors, copies and the
        # Rust accounting are this process's).
        return dict(layers=self.layers, pin_memory=self.pin_memory, **self.options)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        _BoundaryRing.__init__(self, **state)

    @property
    def made(self) -> _Made:
        """The ring as made for the boundary of the step (a step has started)."""
        if self._made is None:
            raise RuntimeError("offload_checkpoints: the slot ring is used before block 0 started a step "
                               "(an internal error of flatpeak)")
        return self._made

    @property
    def ring(self) -> Any:
        """sco's slot accounting (``flatpeak._flatpeak.SlotRing``)."""
        return self.made.ring

    @property
    def started(self) -> bool:
        """Whether a training step has made the ring (block 0's first training forward)."""
        return self._made is not None

    def fits(self, x: Tensor) -> bool:
        """Whether a step has started with a boundary like ``x``."""
        return self._made is not None and self._made.fits(x)

    def describe(self) -> str:
        """The step's boundary, in words."""
        m = self._made
        return "none yet" if m is None else f"{tuple(m.shape)} {m.dtype} on {m.device}"

    # -- set-up and step boundaries ------------------------------------------------------------

    def start_step(self, x: Tensor) -> None:
        """Before block 0's forward: a new step (the previous one is forgotten, even if an
        exception ended it midway), and the ring made for ``x``'s boundary when it changed."""
        if self._made is not None:
            self.reset()
        if not self.fits(x):
            self._made = _Made(x, self.layers, self.options, self.pin_memory)
        self.forwarded = self.released = 0

    def reset(self) -> None:
        """Waits for every copy and forgets the step (slots freed, tensors dropped)."""
        for copy in list(self.d2h.values()) + list(self.h2d.values()):
            copy.wait()
        self.d2h.clear()
        self.h2d.clear()
        self.held.clear()
        if self._made is not None:
            self._made.ring.finish_step()

    def _sync_held(self) -> None:
        """Drops the tensor of every slot the ring no longer gives to its layer."""
        holders = self.ring.slot_holders()
        for slot in [s for s, (layer, _) in self.held.items() if holders[s] != layer]:
            del self.held[slot]
        held = sum(t.numel() * t.element_size() for _, t in self.held.values())
        self.high_water_bytes = max(self.high_water_bytes, held)

    def _reserve(self) -> int:
        """A free slot, waiting for the copies to the host the ring names first."""
        while True:
            kind, value = self.ring.reserve()
            if kind == "slot":
                return value
            self.d2h.pop(value, _Copy(None)).wait()
            self.ring.d2h_landed(value)
            self._sync_held()

    # -- forward ----------------------------------------------------------------------------------

    def offload(self, layer: int, x: Tensor) -> None:
        """Block ``layer``'s boundary: takes a slot (it stays there while resident) and starts
        its copy to the host."""
        self.ring.offload(layer, self._reserve())
        slot = self.ring.resident(layer)[1]
        self.held[slot] = (layer, x)
        host = self.made.arena[layer].view(x.shape)
        if self.made.side_stream is None:
            host.copy_(x)
            self.ring.d2h_landed(layer)
        else:
            stream = self.made.side_stream
            stream.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(stream):
                host.copy_(x, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            # The caching allocator must not hand x's memory to another tensor while the copy
            # reads it (the stream race torchtune's OffloadActivations once had).
            x.record_stream(stream)
            self.d2h[layer] = _Copy(event)
        self.forwarded += 1
        self._sync_held()

    def resident(self, layer: int) -> Tensor:
        """The boundary as forward left it (the block's own first forward)."""
        kind, slot = self.ring.resident(layer)
        return self.held[slot][1]

    # -- backward ---------------------------------------------------------------------------------

    def _bring_back(self, layer: int, wait: bool) -> None:
        """Starts the copy of ``layer`` back to the device when the ring says it is needed; a
        prefetch (``wait=False``) is skipped when no slot is free without waiting."""
        if not self.ring.want(layer):
            return
        if wait:
            slot = self._reserve()
        else:
            kind, slot = self.ring.reserve()
            if kind != "slot":
                return
        if self.ring.start_h2d(layer, slot) is None:
            return
        m = self.made
        host = m.arena[layer].view(m.shape)
        if m.side_stream is None:
            t = host.clone()
            self.ring.h2d_landed(layer)
        else:
            current = torch.cuda.current_stream(m.device)
            t = torch.empty(m.shape, dtype=m.dtype, device=m.device)
            stream = m.side_stream
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                t.copy_(host, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            t.record_stream(stream)
            self.h2d[layer] = _Copy(event)
        self.held[slot] = (layer, t)
        self._sync_held()

    def fetch(self, layer: int, prefetch: Sequence[int]) -> Tensor:
        """Block ``layer``'s boundary for its recomputation (lent until :meth:`release`), and
        the copies back of the ``prefetch`` blocks started."""
        self._bring_back(layer, wait=True)
        while True:
            kind, slot = self.ring.lend(layer)
            if kind == "ready":
                break
            self.h2d.pop(layer, _Copy(None)).wait()
            self.ring.h2d_landed(layer)
        event = self.h2d.pop(layer, None)
        if event is not None and event.event is not None:
            torch.cuda.current_stream(self.made.device).wait_event(event.event)
        t = self.held[slot][1]
        for ahead in prefetch:
            self._bring_back(ahead, wait=False)
        return t

    def release(self, layer: int) -> None:
        """Block ``layer``'s backward is done with its boundary."""
        self.ring.unlend(layer)
        self.ring.release(layer)
        self.released += 1
        self._sync_held()
        if self.released == self.forwarded:
            self.reset()


class _Park(torch.autograd.Function):
    """Hands ``x`` to the ring; returns a stride-0 placeholder of its shape (what the checkpoint
    keeps). Backward: the identity, and the block is done with its boundary."""

    @staticmethod
    def forward(ctx, x: Tensor, ring: _BoundaryRing, layer: int) -> Tensor:
        ring.offload(layer, x.detach())
        ctx.ring, ctx.layer = ring, layer
        return x.new_zeros(()).expand(x.shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        ctx.ring.release(ctx.layer)
        return grad, None, None


class _Unpark(torch.autograd.Function):
    """The boundary in place of the placeholder: as forward left it in the block's first
    forward, fetched back (and the next ones prefetched) in its recomputation. Backward: the
    identity."""

    @staticmethod
    def forward(ctx, placeholder: Tensor, ring: _BoundaryRing, layer: int, first: bool) -> Tensor:
        if first:
            x = ring.resident(layer)
        else:
            distance = ring.options["prefetch_distance"]
            x = ring.fetch(layer, [layer - k for k in range(1, distance + 1) if layer - k >= 0])
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None, None, None


class _Offloaded:
    """Block ``index`` of a sequence under :func:`offload_checkpoints`: a checkpoint function,
    called as transformers calls ``_gradient_checkpointing_func`` (``(function, *args)``): runs
    ``function(*args)`` under non-reentrant checkpointing with its first tensor argument (the
    boundary) kept by the ring. Picklable (the ring is remade empty on load)."""

    def __init__(self, ring: _BoundaryRing, index: int):
        self.ring, self.index = ring, index

    def __call__(self, function: Callable[..., Any], *args: Any) -> Any:
        if torch.compiler.is_compiling():
            raise RuntimeError("offload_checkpoints does not run under torch.compile (its copies and the slot ring "
                               "are eager-mode side effects): compile the blocks themselves, then wrap them")
        position = next((i for i, a in enumerate(args) if isinstance(a, Tensor)), None)
        if position is None:
            raise TypeError(f"block {self.index}: offload_checkpoints needs a tensor argument (the boundary) among "
                            f"the positional arguments")
        x = args[position]
        if not (torch.is_grad_enabled() and x.requires_grad):
            return function(*args)
        ring, layer = self.ring, self.index
        if layer == 0:
            ring.start_step(x)
        elif not ring.fits(x):
            raise ValueError(f"offload_checkpoints: block {layer}'s input is {tuple(x.shape)} {x.dtype} on "
                             f"{x.device}, block 0's was {ring.describe()}: every block of the sequence takes the "
                             f"same boundary, called in order from block 0")
        placeholder = _Park.apply(x, ring, layer)

        def run(placeholder_, *rest):
            # The first call runs inside this forward; a later one is the recomputation.
            boundary = _Unpark.apply(placeholder_, ring, layer, bool(_FORWARDING))
            full = list(rest)
            full.insert(position, boundary)
            return function(*full)

        rest = [a for i, a in enumerate(args) if i != position]
        _FORWARDING.append(layer)
        try:
            return torch.utils.checkpoint.checkpoint(run, placeholder, *rest, use_reentrant=False)
        finally:
            _FORWARDING.pop()


class _OffloadedForward:
    """A block's ``forward`` under :func:`offload_checkpoints` (set on the instance, so the module
    tree, its parameter names and its hooks stay as they were; the hooks run outside the
    checkpoint): in training, the class's ``forward`` through the block's :class:`_Offloaded`;
    otherwise as it is. Picklable."""

    def __init__(self, block: torch.nn.Module):
        self.block = block

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        block = self.block
        forward = functools.partial(type(block).forward, block, **kwargs)
        if not (torch.is_grad_enabled() and block.training):
            return forward(*args)
        return _offload_of(block)(forward, *args)


def _offload_of(block: torch.nn.Module) -> _Offloaded:
    offload = getattr(block, _ATTRIBUTE, None)
    if not isinstance(offload, _Offloaded):
        raise RuntimeError(f"{type(block).__name__} is not under offload_checkpoints (an internal error of flatpeak)")
    return offload


def _keep_offloaded(block: torch.nn.Module, args: Any) -> None:
    """A transformers layer's forward pre-hook: its checkpointing is the offload, whatever
    ``gradient_checkpointing_enable`` / ``_disable`` set since (they assign both attributes)."""
    offload = _offload_of(block)
    if getattr(block, "_gradient_checkpointing_func", None) is not offload:
        setattr(block, "_gradient_checkpointing_func", offload)
    if not getattr(block, "gradient_checkpointing", False):
        setattr(block, "gradient_checkpointing", True)


def _is_transformers_layer(block: torch.nn.Module) -> bool:
    """Whether ``block`` is a transformers ``GradientCheckpointingLayer`` (its forward calls
    ``_gradient_checkpointing_func`` in training and drops the KV cache there)."""
    layers = sys.modules.get("transformers.modeling_layers")
    kind = getattr(layers, "GradientCheckpointingLayer", None)
    return kind is not None and isinstance(block, kind)


#: The blocks whose forward is running (a stack): a checkpointed function called while it is
#: not empty is forward's first call, otherwise backward's recomputation.
_FORWARDING: List[int] = []


Blocks = Union[torch.nn.ModuleList, List[torch.nn.Module]]


def offload_checkpoints(layers: Blocks, *, keep_resident: int = 1, in_flight: int = 2,
                        prefetch_distance: int = 1, pin_memory: bool = True) -> Blocks:
    """Makes each block of ``layers`` (an ``nn.ModuleList``, or a list of modules called in
    order) run under non-reentrant checkpointing with its input boundary kept by sco's slot ring,
    in place, and returns ``layers``.

    The blocks stay where they are, as they are: the module tree, ``named_parameters()`` and
    ``state_dict()`` keep their names (a checkpoint saved with or without offload loads into
    either), and the blocks' hooks (FSDP2's included) run outside the checkpoint, once. A
    transformers decoder layer (``GradientCheckpointingLayer``) gets the offload as its
    checkpointing function, so transformers' own handling applies (the KV cache is not written
    by a training forward, whose recomputation would write it twice); its
    ``gradient_checkpointing_enable()`` / ``_disable()`` leave the offload on. Any other block
    gets an instance ``forward`` that runs its class's ``forward`` the same way. The blocks stay
    picklable (a loaded copy has its own ring, empty).

    The block's first positional tensor argument is the boundary (the same shape for every
    block). In training (grad enabled, ``.training``, a boundary that requires grad) block
    ``i``'s boundary is copied to host memory as forward passes (pinned, on a side stream, on
    CUDA) and fetched back during backward ``prefetch_distance`` blocks ahead; the device holds
    at most ``keep_resident + max(in_flight, prefetch_distance + 1)`` boundaries at once,
    whatever the depth. Gradients are bitwise those of plain non-reentrant checkpointing. Outside
    training the blocks run as they are. CPU tensors run the same schedule with host slots.

    Args:
        layers: the blocks, called in order (block 0 starts a step).
        keep_resident: the newest boundaries kept on the device after their copy (the last
            block's backward comes first), at least 1.
        in_flight: copies to the host in flight during forward, at least 1.
        prefetch_distance: blocks fetched ahead during backward.
        pin_memory: host memory pinned (CUDA only), so the copies overlap compute.

    Raises:
        ValueError: an option out of its domain (sco's ``Config``), an empty sequence, or a block
            already under ``offload_checkpoints``.
    """
    blocks = list(layers)
    if not blocks:
        raise ValueError("offload_checkpoints: the sequence has no blocks")
    for i, block in enumerate(blocks):
        if not isinstance(block, torch.nn.Module):
            raise TypeError(f"offload_checkpoints: block {i} is a {type(block).__name__}, not a torch.nn.Module")
        if isinstance(getattr(block, _ATTRIBUTE, None), _Offloaded):
            raise ValueError(f"offload_checkpoints: block {i} is already under offload_checkpoints")
    ring = _BoundaryRing(len(blocks), keep_resident, in_flight, prefetch_distance, pin_memory)
    for i, block in enumerate(blocks):
        offload = _Offloaded(ring, i)
        setattr(block, _ATTRIBUTE, offload)
        if _is_transformers_layer(block):
            setattr(block, "_gradient_checkpointing_func", offload)
            setattr(block, "gradient_checkpointing", True)
            block.register_forward_pre_hook(_keep_offloaded)
        else:
            setattr(block, "forward", _OffloadedForward(block))
    return layers


#: The attribute of a block under :func:`offload_checkpoints` that holds its :class:`_Offloaded`.
_ATTRIBUTE = "_flatpeak_offload"


def ring_of(layers: Sequence[torch.nn.Module]) -> _BoundaryRing:
    """The slot ring behind sequence ``layers`` under :func:`offload_checkpoints` (its
    ``ring.high_water_slots()``, ``ring.slots()`` and ``high_water_bytes`` for measurements)."""
    offload = getattr(layers[0], _ATTRIBUTE, None)
    if not isinstance(offload, _Offloaded):
        raise ValueError("ring_of: the sequence is not under offload_checkpoints")
    return offload.ring
