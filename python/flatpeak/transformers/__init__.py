"""flatpeak for Hugging Face ``transformers`` MoE models: one call patches a causal-LM model in place.

``apply(model)`` makes the loss :func:`flatpeak.torch.linear_cross_entropy` on the final hidden
states (the ``[batch, seq, vocab]`` logits are never made when ``labels`` are given) and runs every
sparse-MoE block's experts through :func:`flatpeak.torch.moe_swiglu` (PipelinedLLEP), optionally
expert-parallel over a ``torch.distributed`` group. Importing this module also registers flatpeak
as a transformers experts implementation, so ``from_pretrained(..., experts_implementation=
"flatpeak")`` selects the experts alone.

Supported ``model_type`` (:data:`SUPPORTED_MODEL_TYPES`): ``qwen3_moe``, ``qwen2_moe``, ``qwen3_next``,
``mixtral``, ``olmoe``, ``deepseek_v2``, ``deepseek_v3``, ``deepseek_v32``, ``glm4_moe``, ``minimax``,
``minimax_m2``, ``ernie4_5_moe``, ``hunyuan_v1_moe``, ``dots1``, ``exaone_moe``, ``solar_open``,
``flex_olmo``, ``lfm2_moe`` and ``afmoe``
(transformers 5.x, whose experts modules hold ``gate_up_proj [E, 2I, H]`` and ``down_proj
[E, H, I]``).
"""

from __future__ import annotations

from ._apply import SUPPORTED_MODEL_TYPES, apply
from ._experts import EXPERTS_IMPLEMENTATION, register_experts_implementation

register_experts_implementation()

__all__ = ["apply", "SUPPORTED_MODEL_TYPES", "EXPERTS_IMPLEMENTATION", "register_experts_implementation"]
