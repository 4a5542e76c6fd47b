"""``StreamAdamW``: ``torch.optim.AdamW``'s update run by flatpeak's SIMD CPU kernel, in place.

The state lives in ``self.state[p]`` under torch's names (``step``, ``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq``), so ``state_dict()`` / ``load_state_dict()`` round-trip, into and out of
``torch.optim.AdamW`` too, and LR schedulers drive ``param_groups[i]["lr"]`` as usual.
"""

from __future__ import annotations

from itertools import chain
from typing import Any, Callable, Dict, List, Optional, Tuple, overload

import torch
from torch import Tensor

from .. import _flatpeak as _ext
from ._sharding import copies as _copies
from ._sharding import local as _local

#: What a step does with a non-finite gradient.
_ON_NONFINITE = ("skip", "raise", "ignore")

#: The state an offloaded (CUDA) parameter keeps in host memory, outside ``self.state``.
_OFFLOADED_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param")


def _placeholders(state: Dict[str, Any], amsgrad: bool) -> Dict[str, Any]:
    """An offloaded parameter's live state with an empty tensor under each key its offloaded state
    has (``state_dict()`` fills them): checkpoint loaders that pick the keys to load from the live
    ``optim.state`` (torchtitan's) then load all of it, not just ``step``."""
    for key in _OFFLOADED_KEYS:
        if key != "max_exp_avg_sq" or amsgrad:
            state.setdefault(key, torch.empty(0))
    return state


#: Param-group keys that are this run's settings, not state: a state dict leaves them out and
#: loading one keeps the live values.
_RUN_SETTINGS = ("max_norm", "replicated")

#: The keys of ``torch.optim.AdamW``'s param groups that this optimizer has no use for, with the
#: values that describe its update (written into its state dicts, so torch's AdamW loads them).
_TORCH_GROUP_KEYS = dict(foreach=None, capturable=False, differentiable=False, fused=None,
                         decoupled_weight_decay=True)


def _step_dtype() -> torch.dtype:
    """The dtype of a parameter's ``step`` tensor, torch.optim's rule: float64 when it is the
    default dtype, else float32 (so a state dict moves between this optimizer and torch's)."""
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _hyperparameters(group: Dict[str, Any]) -> Any:
    lr = group["lr"]
    return _ext.AdamWOptions(
        lr=float(lr.item() if isinstance(lr, torch.Tensor) else lr),
        betas=(float(group["betas"][0]), float(group["betas"][1])),
        eps=float(group["eps"]),
        weight_decay=float(group["weight_decay"]),
        amsgrad=bool(group["amsgrad"]),
        maximize=bool(group["maximize"]),
        max_norm=None if group["max_norm"] is None else float(group["max_norm"]),
    )


class StreamAdamW(torch.optim.Optimizer):
    r"""AdamW with ``torch.optim.AdamW``'s constructor, update and state, on CPU parameters.

    The update (decoupled weight decay, bias corrections in float64, AMSGrad's running max of
    the raw second moment, ``maximize``) is torch's, in torch's order of float32 operations; it
    is run by flatpeak's runtime-dispatched SIMD kernel over all cores, in place on the
    parameters and on the state tensors.

    One difference from torch: before any parameter is touched, the step checks every gradient
    (one pass, the sum of squares in float64); if any element is NaN or infinite, the step is
    skipped -- parameters, moments and step counts are left exactly as they were --,
    :attr:`last_step_skipped` is set and :attr:`skipped_steps` counts it. :meth:`step` returns
    the closure's loss, as torch's optimizers do.

    ``max_norm`` clips gradients as ``torch.nn.utils.clip_grad_norm_(params, max_norm)`` before
    the update would (every gradient scaled by ``min(1, max_norm / (norm + 1e-6))``, the norm
    over all parameters of all groups, which must agree on it), from that same pass: the
    gradients themselves are not modified. :attr:`last_grad_norm` is the norm before clipping,
    what ``clip_grad_norm_`` returns.

    ``process_group`` (a ``torch.distributed`` process group): the ranks that each hold part of
    the model (FSDP2's shards, expert-parallel experts, DDP's replicas) take **one** decision
    per step. Each rank sums its gradients' squares, weighting each element so that it counts
    once over the group (a ``DTensor``'s ``Replicate`` mesh dimensions, and copies of its mesh in
    the group, divide it out; a plain tensor counts as replicated over the group unless it is
    rank-private: the expert slices :class:`~flatpeak.torch.MoEExperts` and
    ``flatpeak.transformers.apply(group=)`` own are marked so, and a param group may say
    ``"replicated": False``); one exchange of a few words carries every rank's sum; every rank
    adds them in rank order and decides from the same numbers, so :attr:`last_grad_norm`, the
    clip coefficient, :attr:`last_step_skipped`, :attr:`skipped_steps` and every
    ``state["step"]`` are bitwise equal on every rank. A ``Partial`` gradient is refused (reduce
    it first). Bad input on one rank (or ranks stepping with different ``max_norm``) raises on
    every rank, nothing written. ``None``: each process decides from its own gradients (right
    when they are equal on every rank, as DDP's are).

    ``DTensor`` parameters (FSDP2's ``fully_shard``): each rank steps its local shard in place;
    the state tensors are ``DTensor``\ s with the parameter's mesh and placements (what
    ``torch.optim.AdamW`` keeps), so ``torch.distributed.checkpoint`` reshards them. Ranks whose
    shard is empty take part.

    ``on_nonfinite="raise"`` raises ``RuntimeError`` (on every rank of the group, naming the
    ranks whose gradients are not finite) instead of skipping; nothing is written either way.
    ``on_nonfinite="ignore"`` checks nothing the step does not need: without ``max_norm`` it
    makes no statistics pass (4 bytes per float32 parameter less to read: the update alone) and
    updates as ``torch.optim.AdamW`` and DeepSpeed's CPU Adam do, a NaN or infinity reaching the
    parameter elements whose gradients hold it, and :attr:`last_grad_norm` is NaN; with
    ``max_norm`` the norm is read anyway and a non-finite one skips the step as under ``"skip"``.
    ``threads``: the CPU update's threads (default ``torch.get_num_threads()``, what ``torchrun``
    sets per rank, so ranks sharing a machine do not each spread over every core).

    CPU parameters are contiguous float32 tensors with dense float32 gradients, or bfloat16 ones
    with bfloat16 gradients and an fp32 master copy (mixed precision, as DeepSpeed's CPU Adam
    keeps one): the master lives in ``state[p]["master_param"]`` with fp32 moments, the update
    runs on it, and ``p`` receives it rounded to bfloat16 (nearest even). ``state_dict()``
    carries the master; loading one without it (torch's own AdamW's) starts it from ``p``. CUDA
    parameters (float32 or bfloat16; the ``cuda`` build) are offloaded: each keeps an fp32 master
    copy and its moments in host memory, and its step is stream-adamw's bucket pipeline (D2H of
    gradients, CPU AdamW, H2D of parameters, through pinned staging). ``state_dict()`` carries
    their state under torch's names plus ``master_param``.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 max_norm: Optional[float] = None, process_group: Optional[Any] = None,
                 on_nonfinite: str = "skip", threads: Optional[int] = None):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, max_norm=max_norm)
        _hyperparameters(defaults)  # a bad hyperparameter fails here, naming its value
        if on_nonfinite not in _ON_NONFINITE:
            raise ValueError(f"on_nonfinite: expected \"skip\", \"raise\" or \"ignore\", got {on_nonfinite!r}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads: expected None or an int >= 1, got {threads!r}")
        super().__init__(params, defaults)
        #: The process group whose ranks take one decision per step (``None``: this process alone).
        self.process_group = process_group
        #: ``"skip"`` or ``"raise"``: what a non-finite gradient does.
        self.on_nonfinite = on_nonfinite
        #: The CPU update's threads (``None``: ``torch.get_num_threads()`` at each step).
        self.threads = threads
        #: Steps skipped for non-finite gradients so far.
        self.skipped_steps = 0
        #: Whether the last :meth:`step` was skipped for a non-finite gradient.
        self.last_step_skipped = False
        #: The global gradient norm of the last :meth:`step`, before clipping (``nan`` before the
        #: first, and non-finite when it was skipped).
        self.last_grad_norm = float("nan")
        #: Seconds of the last :meth:`step`'s two passes: ``"statistics"`` (Σg², the non-finite
        #: check and, over a group, the agreement) and ``"update"`` (the AdamW update; 0 when
        #: skipped). Empty before the first step.
        self.last_step_times: Dict[str, float] = {}
        #: Elements per bucket of the offloaded step of a CUDA parameter.
        self.bucket_elems = 1 << 22
        self._cuda: Dict[Tensor, Any] = {}

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("bucket_elems", 1 << 22)
        self.__dict__.setdefault("skipped_steps", 0)
        self.__dict__.setdefault("last_step_skipped", False)
        self.__dict__.setdefault("last_grad_norm", float("nan"))
        self.__dict__.setdefault("last_step_times", {})
        self.__dict__.setdefault("_cuda", {})
        self.__dict__.setdefault("process_group", None)
        self.__dict__.setdefault("on_nonfinite", "skip")
        self.__dict__.setdefault("threads", None)
        # A state dict of torch's own AdamW has no `max_norm`: the groups keep this optimizer's.
        defaults = self.__dict__.get("defaults", {})
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            group.setdefault("max_norm", defaults.get("max_norm"))
        # Older torch checkpoints keep a step as a Python number: torch.optim.AdamW loads them as
        # the tensor it uses today, and so does this optimizer (load_state_dict comes here).
        for state in self.state.values():
            if "step" in state and not isinstance(state["step"], torch.Tensor):
                state["step"] = torch.tensor(float(state["step"]), dtype=_step_dtype())

    def _state_of(self, p: torch.Tensor, amsgrad: bool):
        """``p``'s state, made at its first step: float32 moments (and, for a bfloat16 ``p``, its
        float32 master copy, from ``p``; moments loaded in bfloat16 are widened)."""
        state = self.state[p]
        zeros = lambda: torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)  # noqa: E731
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=_step_dtype())
            state["exp_avg"] = zeros()
            state["exp_avg_sq"] = zeros()
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = zeros()
        if p.dtype == torch.bfloat16:
            if "master_param" not in state:
                state["master_param"] = p.detach().to(torch.float32, copy=True).contiguous()
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if key in state and state[key].dtype != torch.float32:
                    state[key] = state[key].to(torch.float32)
        return state

    def _offloaded(self, p: torch.Tensor, group):
        """The offloaded optimizer of CUDA parameter ``p`` (the ``cuda`` build), made at its first
        step with the fp32 master copy taken from ``p``; ``None`` without the build (the step then
        refuses ``p``, saying how to build it)."""
        if not _ext.CUDA:
            return None
        opt = self._cuda.get(p)
        if opt is None:
            shard = _local(p.detach())
            master = shard.to("cpu", torch.float32).reshape(-1).contiguous()
            opt = _ext.CudaAdamW(shard, master, _hyperparameters(group), self.bucket_elems)
            self._cuda[p] = opt
        return opt

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One AdamW step of every parameter with a gradient; returns the closure's loss (``None``
        without one). A non-finite gradient skips the step (see the class docs):
        :attr:`last_step_skipped` says whether this one was."""
        loss = None
        self.last_step_skipped = False
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pg = self.process_group
        threads = self.threads if self.threads is not None else torch.get_num_threads()
        try:
            batches, offloaded, device = self._prepare()
        except Exception as e:
            if pg is not None:
                # The group's other ranks are entering the step's agreement: enter it with this
                # rank's refusal, so they raise too instead of waiting, then raise it here.
                _ext.adamw_step([], [], group=pg, on_nonfinite=self.on_nonfinite, threads=threads, refused=e)
            raise
        if pg is None and not offloaded and not any(params for _, params, _ in batches):
            return loss
        # One step of the crate over every parameter: it checks every tensor of every group, sums
        # the squares of every gradient (these and the offloaded ones; over the group, each
        # element once) and decides: a non-finite one skips the step (or raises), touching
        # nothing; otherwise it updates every parameter and advances its step counter
        # (`state["step"]` of a CPU parameter; its own, for an offloaded one).
        decision = _ext.adamw_step(batches, offloaded, group=pg, on_nonfinite=self.on_nonfinite, threads=threads)
        self.last_grad_norm = decision.grad_norm
        self.last_step_times = {"statistics": decision.statistics_seconds, "update": decision.update_seconds}
        if decision.skipped:
            self.skipped_steps += 1
            self.last_step_skipped = True
            return loss
        for p, _ in device:
            state = self.state[p]
            state.setdefault("step", torch.tensor(0.0, dtype=_step_dtype()))
            state["step"] += 1
        return loss

    def _prepare(self) -> Tuple[List[Any], List[Any], List[Any]]:
        """The step's arguments: every param group's CPU parameters (their local shards) with
        their state, in classes of equal copies over the process group; the offloaded CUDA
        parameters; and those CUDA parameters with their groups."""
        pg = self.process_group
        host, device = False, []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if p.grad.is_sparse:
                        raise TypeError("StreamAdamW does not support sparse gradients")
                    if p.is_cuda:
                        device.append((p, group))
                    else:
                        host = True
        if not host and not device and pg is None:
            return [], [], []
        # The offloaded step copies gradients on its own streams: torch's work that produced them
        # must be done first (a wait on each device's current stream, not on the whole device).
        for dev in {p.device for p, _ in device}:
            torch.cuda.current_stream(dev).synchronize()
        offloaded = []
        for p, group in device:
            n = _copies(p, p.grad, pg, group.get("replicated", True))
            offloaded.append((self._offloaded(p, group), _local(p), _local(p.grad), _hyperparameters(group), n))
            _placeholders(self.state[p], bool(group["amsgrad"]))
        batches: List[Any] = []
        for group in self.param_groups:
            amsgrad = bool(group["amsgrad"])
            options = _hyperparameters(group)
            classes: Dict[int, List[Any]] = {}
            for p in group["params"]:
                if p.grad is None or p.is_cuda:
                    continue
                n = _copies(p, p.grad, pg, group.get("replicated", True))
                state = self._state_of(p, amsgrad)
                # A bfloat16 parameter steps its float32 master and takes the rounded result.
                master, model = (state["master_param"], p) if p.dtype == torch.bfloat16 else (p, None)
                classes.setdefault(n, []).append((
                    _local(master), _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]),
                    _local(state["max_exp_avg_sq"]) if amsgrad else None, state["step"],
                    None if model is None else _local(model)))
            # Every group is passed, with its options (its clipping), parameters or not.
            for n, params in (classes or {1: []}).items():
                batches.append((options, params, n))
        return batches, offloaded, device

    def state_dict(self) -> Dict[str, Any]:
        """torch's state dict; a CUDA parameter's offloaded state appears under torch's names
        (CPU fp32 tensors shaped like the parameter, or like this rank's shard of a ``DTensor``)
        plus ``master_param``, its fp32 master copy. Between calls its live ``self.state[p]`` holds
        empty placeholders under those names (the state itself is in host memory, offloaded), so
        a loader that reads the keys from the live state loads all of them."""
        for p, opt in self._cuda.items():
            amsgrad = any(p is q and g["amsgrad"] for g in self.param_groups for q in g["params"])
            shape = _local(p).shape
            fresh = lambda shape=shape: torch.empty(shape, dtype=torch.float32)  # noqa: E731
            master, exp_avg, exp_avg_sq = fresh(), fresh(), fresh()
            max_sq = fresh() if amsgrad else None
            step = opt.export_into(master.view(-1), exp_avg.view(-1), exp_avg_sq.view(-1),
                                   None if max_sq is None else max_sq.view(-1))
            state = self.state[p]
            state.update(step=torch.tensor(float(step), dtype=_step_dtype()), exp_avg=exp_avg,
                         exp_avg_sq=exp_avg_sq, master_param=master)
            if max_sq is not None:
                state["max_exp_avg_sq"] = max_sq
        sd = super().state_dict()
        # The snapshot lives on in `sd` only. torch's state_dict shares each parameter's state
        # dict with `self.state` (it does not copy them): give each CUDA parameter a new one
        # rather than emptying the one `sd` holds.
        for p in self._cuda:
            live = {k: v for k, v in self.state[p].items() if k not in _OFFLOADED_KEYS}
            amsgrad = any(p is q and g["amsgrad"] for g in self.param_groups for q in g["params"])
            self.state[p] = _placeholders(live, amsgrad)
        # The groups as torch's AdamW writes them, so either optimizer loads the other's state
        # (torch.distributed.checkpoint asks a checkpoint for every key the loader has): torch's
        # keys with the values that describe this update, and none of this run's settings.
        for group in sd["param_groups"]:
            for key in _RUN_SETTINGS:
                group.pop(key, None)
            for key, value in _TORCH_GROUP_KEYS.items():
                group.setdefault(key, value)
        return sd

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """torch's ``load_state_dict``; a CUDA parameter's state goes into its offloaded optimizer
        (the master copy from ``master_param`` when present, else from the parameter). The
        float32 state of a bfloat16 parameter (moments, master) is kept in float32: torch's own
        loading would cast it to the parameter's dtype. This run's settings (``max_norm``, a
        group's ``replicated``) stay as they are: a state dict does not carry them."""
        settings = [{k: g[k] for k in _RUN_SETTINGS if k in g} for g in self.param_groups]
        super().load_state_dict(state_dict)
        for group, kept in zip(self.param_groups, settings):
            for key in _RUN_SETTINGS:
                group.pop(key, None)
            group.update(kept)
        saved_ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for saved_id, p in zip(saved_ids, params):
            saved = state_dict["state"].get(saved_id, {})
            if p.dtype != torch.bfloat16:
                continue
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "master_param"):
                if key in saved:
                    self.state[p][key] = saved[key].detach().to("cpu", torch.float32, copy=True)
        self._cuda.clear()
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p, {})
                if not p.is_cuda or "exp_avg" not in state:
                    continue
                opt = self._offloaded(p, group)
                flat = lambda t: _local(t.detach()).to("cpu", torch.float32).reshape(-1).contiguous()  # noqa: E731
                master = state.pop("master_param", p)
                max_sq = state.pop("max_exp_avg_sq", None)
                opt.import_from(int(state["step"].item()), flat(master), flat(state.pop("exp_avg")),
                                flat(state.pop("exp_avg_sq")), None if max_sq is None else flat(max_sq))
                _placeholders(state, bool(group["amsgrad"]))
