"""``flatpeak.transformers.apply``: the loss and the experts of a transformers MoE causal LM,
patched in place (one call per model, as Liger-Kernel's ``apply_*``)."""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any, Optional, Union, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from ..torch import exclude_experts_from_ddp, linear_cross_entropy
from ..torch import offload_checkpoints as _offload_checkpoints
from ..torch._checks import FLOAT16_HINT
from ..torch._sharding import check_ep_mesh, own_experts, refuse_wrapped
from ._experts import EXPERTS_IMPLEMENTATION

#: The ``config.model_type`` values :func:`apply` patches.
SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "qwen3_next", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3",
                         "deepseek_v32", "glm4_moe", "minimax", "minimax_m2", "ernie4_5_moe", "hunyuan_v1_moe", "dots1",
                         "exaone_moe", "solar_open", "flex_olmo", "lfm2_moe", "afmoe")

IGNORE_INDEX = -100


def causal_lm_loss(hidden_states: torch.Tensor, lm_head: torch.nn.Linear, labels: Optional[torch.Tensor],
                   shift_labels: Optional[torch.Tensor] = None,
                   num_items_in_batch: Optional[Union[int, torch.Tensor]] = None,
                   budget_bytes: Optional[int] = None) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` without the logits: labels shifted inside (position ``t``
    predicts label ``t + 1``; ``shift_labels`` when given is used as is), ``ignore_index=-100``, the
    mean over the non-ignored labels, or the sum divided by ``num_items_in_batch`` when given (as
    under gradient accumulation)."""
    if shift_labels is None:
        if labels is None:
            raise ValueError("causal_lm_loss: pass labels or shift_labels")
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    shift_labels = shift_labels.to(hidden_states.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = cast(Tensor, linear_cross_entropy(hidden_states, lm_head.weight, shift_labels, lm_head.bias,
                                             reduction=reduction, ignore_index=IGNORE_INDEX,
                                             budget_bytes=budget_bytes))
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _loss_on(lm_head: torch.nn.Linear, hidden_states: Tensor, labels: Optional[Tensor],
             shift_labels: Optional[Tensor], num_items_in_batch, budget_bytes: Optional[int]) -> Tensor:
    """:func:`causal_lm_loss` on ``lm_head``'s weight, as a method of ``lm_head``."""
    return causal_lm_loss(hidden_states, lm_head, labels, shift_labels, num_items_in_batch, budget_bytes)


def _lm_head_loss(lm_head: torch.nn.Module):
    """The loss as a call of ``lm_head``: when FSDP2 shards ``lm_head`` as its own unit, its
    ``forward`` never runs (the loss reads the weight instead), so the loss is registered as one of
    its forward methods (``register_fsdp_forward_method``): FSDP unshards the weight around it and
    again for its backward. Otherwise ``lm_head``'s weight is read as it is (inside the root
    unit's forward, FSDP has it unsharded)."""
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

        if isinstance(lm_head, FSDPModule):
            if "flatpeak_loss" not in lm_head.__dict__:
                lm_head.__dict__["flatpeak_loss"] = types.MethodType(_loss_on, lm_head)
                register_fsdp_forward_method(lm_head, "flatpeak_loss")
            return getattr(lm_head, "flatpeak_loss")
    return types.MethodType(_loss_on, lm_head)


def _causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                       inputs_embeds=None, labels=None, use_cache=None, output_router_logits=None,
                       logits_to_keep=0, shift_labels=None, num_items_in_batch=None, return_dict=None, **kwargs):
    """The model's own causal-LM forward, with the loss computed from the hidden states: when
    labels are given, ``logits`` is ``None``; without them, the logits of ``logits_to_keep``."""
    from transformers.modeling_utils import slice_logits_to_keep

    patch = self._flatpeak_patch
    model_kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
    # Other names (a deprecated `past_key_values`) go to the model's own handling, warnings included.
    if cache is not None or "past_key_values" not in kwargs:
        model_kwargs["cache"] = cache
    if patch.router_logits:
        if output_router_logits is None:
            output_router_logits = self.config.output_router_logits
        model_kwargs["output_router_logits"] = output_router_logits
    outputs = self.model(**model_kwargs)
    hidden_states = outputs.last_hidden_state
    loss = logits = None
    if labels is not None or shift_labels is not None:
        loss = _lm_head_loss(self.lm_head)(hidden_states, labels, shift_labels, num_items_in_batch, patch.budget_bytes)
    else:
        logits = self.lm_head(slice_logits_to_keep(hidden_states, logits_to_keep))
    aux_loss = None
    if patch.load_balancing_loss is not None and output_router_logits:
        aux_loss = patch.load_balancing_loss(outputs.router_logits, self.num_experts, self.num_experts_per_tok,
                                             attention_mask)
        if loss is not None:
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    fields = dict(loss=loss, logits=logits, cache=outputs.cache, hidden_states=outputs.hidden_states,
                  attentions=outputs.attentions, router_logits=outputs.router_logits)
    if patch.router_logits:
        fields["aux_loss"] = aux_loss
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    out = MoeCausalLMOutputWithPast(**fields)
    return out.to_tuple() if return_dict is False else out


class _PatchedForward:
    """A patched model's ``forward`` (``model.forward``): :func:`_causal_lm_forward` on the model.
    An object rather than a bound method, so that the model pickles and loads (a method bound
    to a function its class lacks does not load); its signature is the forward's, which
    transformers' ``Trainer`` reads to keep dataset columns and loss keywords."""

    __signature__ = inspect.Signature(list(inspect.signature(_causal_lm_forward).parameters.values())[1:])

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _causal_lm_forward(self.model, *args, **kwargs)


class _Patch:
    """What :func:`apply` recorded on a model (``model._flatpeak_patch``)."""

    def __init__(self, model, loss: bool, experts: bool, group, budget_bytes: Optional[int]):
        self.loss, self.experts, self.group, self.budget_bytes = loss, experts, group, budget_bytes
        forward = type(model).forward
        self.router_logits = "output_router_logits" in inspect.signature(forward).parameters
        # The router's auxiliary loss, where the model's own forward adds one (some models return
        # their router logits and leave the loss to the trainer).
        self.load_balancing_loss = None
        if self.router_logits and _adds_aux_loss(forward):
            module = sys.modules[type(model).__module__]
            self.load_balancing_loss = getattr(module, "load_balancing_loss_func", None)
            if self.load_balancing_loss is None:
                raise ValueError(f"{type(model).__name__}: its forward adds the router's auxiliary loss, but its "
                                 f"module has no load_balancing_loss_func to compute it with")


def _adds_aux_loss(forward) -> bool:
    """Whether a causal LM's ``forward`` adds the router's auxiliary loss (it calls
    ``load_balancing_loss_func``); when its source cannot be read, assume it does."""
    try:
        return "load_balancing_loss_func" in inspect.getsource(forward)
    except (OSError, TypeError):
        return True


def _experts_modules(model):
    """Every experts module of the model (the ones transformers dispatches by
    ``experts_implementation``), with its name."""
    return [(name, m) for name, m in model.named_modules()
            if hasattr(m, "gate_up_proj") and hasattr(m, "down_proj") and hasattr(m, "_apply_gate")]


def _shard_experts(module: torch.nn.Module, name: str, group, ep_mesh) -> None:
    r"""Keeps this rank's slice ``r*E/P .. (r+1)*E/P - 1`` of the module's experts, the rest freed:
    plain rank-private tensors over ``group``, or ``DTensor``\ s ``Shard(0)`` on ``ep_mesh``."""
    import torch.distributed as dist

    experts = getattr(module, "gate_up_proj").shape[0]
    if ep_mesh is not None:
        world, rank = check_ep_mesh(ep_mesh, experts), ep_mesh.get_local_rank()
    else:
        world, rank = dist.get_world_size(group), dist.get_rank(group)
    if experts % world:
        raise ValueError(f"{name}: {experts} experts do not split over a group of {world} ranks "
                         f"(expert-parallel needs E divisible by the group size)")
    e_local = experts // world
    rows = slice(rank * e_local, (rank + 1) * e_local)
    slices = {}
    for param in ("gate_up_proj", "down_proj"):
        full = getattr(module, param)
        slices[param] = full.detach()[rows].clone().requires_grad_(full.requires_grad)
    own_experts(module, slices, group, ep_mesh)
    setattr(module, "_flatpeak_group", group)
    setattr(module, "_flatpeak_num_experts", experts)


def apply(model: torch.nn.Module, *, loss: bool = True, experts: bool = True, offload_checkpoints: bool = False,
          group: Optional["torch.distributed.ProcessGroup"] = None, budget_bytes: Optional[int] = None,
          expert_activations: str = "recompute", ep_mesh: Optional[Any] = None) -> torch.nn.Module:
    r"""Patches a transformers MoE causal LM in place and returns it.

    Args:
        model: a ``*ForCausalLM`` of a supported ``model_type`` (:data:`SUPPORTED_MODEL_TYPES`).
        loss: when ``labels`` (or ``shift_labels``) are given, the loss is
            :func:`flatpeak.torch.linear_cross_entropy` on the final hidden states and
            ``lm_head.weight``, with transformers' conventions (labels shifted inside,
            ``ignore_index=-100``, ``num_items_in_batch``); ``outputs.logits`` is then ``None``
            (no ``[batch, seq, vocab]`` tensor is made) and the full logits when no labels are given
            (so ``generate`` works). The router's auxiliary loss is still added.
        experts: every sparse-MoE block's experts run :func:`flatpeak.torch.moe_swiglu`
            (``experts_implementation="flatpeak"``). Shared experts stay dense.
        group: a ``torch.distributed`` process group of ``P`` ranks: each rank keeps only experts
            ``r*E/P .. (r+1)*E/P - 1`` of every experts module (the rest freed) and the dispatch
            runs expert-parallel over the group; every rank runs its own batch. The slices are
            plain tensors, registered as ignored by ``DistributedDataParallel`` (so ``DDP(model)``
            neither broadcasts rank 0's experts nor averages different experts' gradients) and
            marked rank-private (``StreamAdamW(process_group=)`` counts them once). Not for
            ``fully_shard``: use ``ep_mesh``.
        ep_mesh: instead of ``group``, a 1-D expert-parallel ``DeviceMesh`` (``world_mesh["ep"]``):
            the slices are ``DTensor``\ s ``Shard(0)`` on it (torchtitan's convention), so
            ``fully_shard`` over the experts on the mesh's other dimension shards them correctly
            and ``torch.distributed.checkpoint`` reshards them.
        offload_checkpoints: the decoder layers run under
            :func:`flatpeak.torch.offload_checkpoints` (checkpointed, each layer's input kept by
            sco's slot ring in host memory), as transformers' checkpointing function: the module
            tree and the parameter names stay the model's (``save_pretrained`` writes what
            ``from_pretrained`` reads, with or without flatpeak), a training forward leaves the
            KV cache alone (as under transformers' checkpointing), and the offload *is* the
            model's gradient checkpointing: ``gradient_checkpointing_enable()`` (what ``Trainer``
            calls for ``gradient_checkpointing=True``), before or after ``apply``, asks for what is
            already on and keeps the offload; ``gradient_checkpointing_disable()`` does not turn
            it off.
        budget_bytes: the working-set budget of the loss and the dispatch (default: theirs).
        expert_activations: what the experts' forward keeps for backward (``activations`` of
            :func:`flatpeak.torch.moe_swiglu`): ``"recompute"`` (nothing; the experts' memory is
            the plan's working set) or ``"save"`` (their rows and pre-activations, for a backward
            without recompute: faster, and memory that follows the routing).

    The patched model pickles (``torch.save(model)``, ``copy.deepcopy``) and loads; its
    ``forward`` keeps the model's keywords (deprecated ones such as ``past_key_values`` reach the
    model's own handling and its warnings).

    Raises:
        TypeError: a float16 parameter (the loss and the experts compute in bfloat16 or float32:
            load the model in bfloat16, or keep float32 weights under
            ``torch.autocast(dtype=torch.bfloat16)``).
        ValueError: an unsupported ``model_type``, a model that is not a causal LM, experts that
            are not SwiGLU in transformers' fused layout, or ``E`` not divisible by the group size.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported by flatpeak.transformers.apply; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if not (hasattr(model, "lm_head") and hasattr(model, "model")):
        raise ValueError(f"{type(model).__name__} is not a causal LM (no lm_head/model): pass the *ForCausalLM model")
    if getattr(model, "_flatpeak_patch", None) is not None:
        raise ValueError(f"{type(model).__name__} is already patched by flatpeak.transformers.apply")
    if expert_activations not in ("recompute", "save"):
        raise ValueError(f"expert_activations: expected 'recompute' or 'save', got {expert_activations!r}")
    if group is not None and ep_mesh is not None:
        raise ValueError("group and ep_mesh: pass one (the mesh carries its group)")
    refuse_wrapped(model, "flatpeak.transformers.apply")
    half = next((name for name, p in model.named_parameters() if p.dtype == torch.float16), None)
    if half is not None:
        raise TypeError(f"{type(model).__name__}: {half} is torch.float16; {FLOAT16_HINT}")
    patch = _Patch(model, loss, experts, group, budget_bytes)
    modules = _experts_modules(model)
    if experts:
        if not modules:
            raise ValueError(f"{type(model).__name__} has no experts modules (gate_up_proj/down_proj) to patch")
        from ._experts import _check_module

        for _, module in modules:
            _check_module(module)  # every module checked before any is changed
        if group is not None or ep_mesh is not None:
            for name, module in modules:
                _shard_experts(module, name, group, ep_mesh)
        if group is not None:
            exclude_experts_from_ddp(model)
        for _, module in modules:
            setattr(module, "_flatpeak_budget_bytes", budget_bytes)
            setattr(module, "_flatpeak_activations", expert_activations)
        getattr(model, "set_experts_implementation")(EXPERTS_IMPLEMENTATION)
    elif group is not None or ep_mesh is not None:
        raise ValueError("group= and ep_mesh= shard the experts: they need experts=True")
    if offload_checkpoints:
        layers = getattr(model.model, "layers", None)
        if not isinstance(layers, torch.nn.ModuleList):
            raise ValueError(f"{type(model).__name__}: no decoder layers (model.model.layers) to offload")
        _offload_checkpoints(layers)
    setattr(model, "_flatpeak_patch", patch)
    if loss:
        model.forward = _PatchedForward(model)
    return model
