"""flatpeak as a transformers experts implementation: ``moe_swiglu`` on an experts module's own
``gate_up_proj`` and ``down_proj``, read in place."""

from __future__ import annotations

import torch
from torch import Tensor

from ..torch import moe_swiglu
from ..torch._sharding import expert_weights

#: The name ``experts_implementation=`` selects flatpeak by.
EXPERTS_IMPLEMENTATION = "flatpeak"

_SWIGLU_ACTIVATIONS = ("silu", "swish")


def _check_module(module: torch.nn.Module) -> None:
    """The layouts and activation ``moe_swiglu`` computes, or a ``ValueError`` naming what differs."""
    flags = {"has_bias": False, "is_transposed": False, "is_concatenated": True, "has_gate": True,
             "has_post_expert_norm": False}
    for name, wanted in flags.items():
        if getattr(module, name, wanted) != wanted:
            raise ValueError(f"{type(module).__name__}.{name} = {getattr(module, name)!r}: flatpeak's experts take "
                             f"{name}={wanted} (SwiGLU, gate_up_proj [E, 2I, H] with the gate's rows first, no bias)")
    act = getattr(getattr(module, "config", None), "hidden_act", "silu")
    if act not in _SWIGLU_ACTIVATIONS:
        raise ValueError(f"{type(module).__name__}: hidden_act={act!r}; flatpeak's experts compute SwiGLU "
                         f"(hidden_act in {_SWIGLU_ACTIVATIONS})")


def experts_forward(module: torch.nn.Module, hidden_states: Tensor, top_k_index: Tensor,
                    top_k_weights: Tensor) -> Tensor:
    """The experts module's forward as transformers calls an implementation: ``hidden_states
    [T, H]``, ``top_k_index [T, k]`` (global expert ids), ``top_k_weights [T, k]`` -> ``[T, H]``.
    Expert-parallel when :func:`flatpeak.transformers.apply` gave the module a group or a mesh."""
    _check_module(module)
    if top_k_weights.dtype not in (torch.float32, hidden_states.dtype):
        top_k_weights = top_k_weights.float()
    (gate_up, down), group = expert_weights(module, ("gate_up_proj", "down_proj"),
                                            getattr(module, "_flatpeak_group", None))
    out, stats = moe_swiglu(hidden_states.contiguous(), top_k_index, top_k_weights, gate_up, down, group=group,
                            num_experts=getattr(module, "_flatpeak_num_experts", None),
                            budget_bytes=getattr(module, "_flatpeak_budget_bytes", None),
                            activations=getattr(module, "_flatpeak_activations", "recompute"), return_stats=True)
    # The last call's MoEStats (routes per expert, rounds, receive high water, working set), for
    # load-balancing and measurements: `module.flatpeak_stats`.
    setattr(module, "flatpeak_stats", stats)
    return out


def register_experts_implementation() -> None:
    """Registers :func:`experts_forward` as ``experts_implementation="flatpeak"`` (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(EXPERTS_IMPLEMENTATION, experts_forward)
