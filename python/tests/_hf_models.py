"""Tiny transformers MoE models built from configs (never a download), for the
``flatpeak.transformers`` tests: hidden 64, 2 layers, 8 experts top-2, vocabulary 1000."""

from __future__ import annotations

VOCAB = 1000


def tiny_config(model_type: str, **overrides):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, tie_word_embeddings=False)
    if model_type == "qwen3_moe":
        cfg = dict(cls=tf.Qwen3MoeConfig, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                   decoder_sparse_step=1, mlp_only_layers=[])
    elif model_type == "qwen2_moe":
        cfg = dict(cls=tf.Qwen2MoeConfig, intermediate_size=128, moe_intermediate_size=32,
                   shared_expert_intermediate_size=64, num_experts=8)
    elif model_type == "mixtral":
        cfg = dict(cls=tf.MixtralConfig, intermediate_size=32, num_local_experts=8)
    elif model_type == "olmoe":
        cfg = dict(cls=tf.OlmoeConfig, intermediate_size=32, num_experts=8, eos_token_id=None, pad_token_id=None)
    elif model_type == "deepseek_v3":
        cfg = dict(cls=tf.DeepseekV3Config, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                   n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None,
                   kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4)
    elif model_type == "deepseek_v2":
        cfg = dict(cls=tf.DeepseekV2Config, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                   n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8,
                   qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4, head_dim=8)
    elif model_type == "glm4_moe":
        cfg = dict(cls=tf.Glm4MoeConfig, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                   n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, head_dim=16)
    elif model_type == "qwen3_next":
        # One gated-delta-net layer and one full-attention layer (transformers' torch fallbacks).
        cfg = dict(cls=tf.Qwen3NextConfig, intermediate_size=128, moe_intermediate_size=32,
                   shared_expert_intermediate_size=32, num_experts=8, head_dim=16, linear_key_head_dim=16,
                   linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                   layer_types=["linear_attention", "full_attention"])
    elif model_type == "minimax_m2":
        cfg = dict(cls=tf.MiniMaxM2Config, intermediate_size=32, num_local_experts=8, head_dim=16)
    elif model_type == "ernie4_5_moe":
        # Layer 0 dense, layer 1 sparse (ERNIE names its MoE keys moe_*).
        cfg = dict(cls=tf.Ernie4_5_MoeConfig, intermediate_size=128, moe_intermediate_size=32, moe_num_experts=8,
                   moe_k=2, moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_end_index=1)
    elif model_type == "deepseek_v32":
        cfg = dict(cls=tf.DeepseekV32Config, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                   n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
                   qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4, n_group=2, topk_group=1)
    elif model_type == "minimax":
        # One lightning-attention layer and one full-attention layer.
        cfg = dict(cls=tf.MiniMaxConfig, intermediate_size=32, num_local_experts=8, head_dim=16,
                   layer_types=["linear_attention", "full_attention"])
    elif model_type == "hunyuan_v1_moe":
        cfg = dict(cls=tf.HunYuanMoEV1Config, intermediate_size=32, num_experts=8, moe_topk=2, head_dim=16)
    elif model_type == "dots1":
        cfg = dict(cls=tf.Dots1Config, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                   n_shared_experts=1, first_k_dense_replace=1, head_dim=16)
    elif model_type == "exaone_moe":
        cfg = dict(cls=tf.ExaoneMoeConfig, intermediate_size=128, moe_intermediate_size=32, num_experts=8, head_dim=16)
    elif model_type == "solar_open":
        cfg = dict(cls=tf.SolarOpenConfig, intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8,
                   head_dim=16)
    elif model_type == "flex_olmo":
        cfg = dict(cls=tf.FlexOlmoConfig, intermediate_size=32, num_experts=8, pad_token_id=None, eos_token_id=None,
                   bos_token_id=None)
    elif model_type == "lfm2_moe":
        # Layer 0 a dense short-convolution layer, layer 1 a sparse attention layer.
        cfg = dict(cls=tf.Lfm2MoeConfig, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                   num_dense_layers=1, layer_types=["conv", "full_attention"])
    elif model_type == "afmoe":
        cfg = dict(cls=tf.AfmoeConfig, intermediate_size=128, moe_intermediate_size=32, num_experts=8, head_dim=16)
    else:
        raise ValueError(model_type)
    cls = cfg.pop("cls")
    return cls(**{**common, **cfg, **overrides})


def tiny_model(model_type: str, seed: int = 0, **overrides):
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).float()
    model.set_experts_implementation("eager")
    return model


def batch(seed: int, batch_size: int = 2, seq: int = 16):
    """input_ids and labels (some -100) of one batch."""
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch_size, seq), generator=g)
    labels = ids.clone()
    labels[torch.rand(batch_size, seq, generator=g) < 0.25] = -100
    return ids, labels


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))
