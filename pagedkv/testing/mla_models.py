"""Tiny randomly initialised MLA models (Multi-head Latent Attention), built from a
config (no download): DeepSeek-V3, DeepSeek-V2 and GLM-4-MoE-Lite, each with a small
mixture of experts. transformers caches their latent (``update(kv_nope, k_rot)``), so
a :class:`~pagedkv.integrations.transformers.PagedCache` over an MLA ``PagedKVCache``
holds one latent row per token. Same seed, same weights; the global torch RNG is left
as it was.
"""
from __future__ import annotations

from pagedkv.testing.models import ByteTokenizer
from pagedkv.testing.sliding_models import _build

__all__ = ["tiny_deepseek_v3", "tiny_deepseek_v2", "tiny_glm4_moe_lite", "MLA_MODELS"]


def _common(tok, layers: int, rank: int, rope: int, config: dict | None) -> dict:
    return dict(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=rank,
                qk_rope_head_dim=rope, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                n_shared_experts=1, num_experts_per_tok=2, max_position_embeddings=4096,
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                initializer_range=0.1) | (config or {})


def tiny_deepseek_v3(seed: int = 0, layers: int = 3, dtype=None, kv_lora_rank: int = 128, rope: int = 16,
                     **config):
    """``(model, ByteTokenizer())``: DeepSeek-V3 (a dense first layer, then MoE; a q_lora
    projection; interleaved RoPE)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    tok = ByteTokenizer()
    hf = DeepseekV3Config(**_common(tok, layers, kv_lora_rank, rope, dict(
        q_lora_rank=48, n_group=2, topk_group=1, first_k_dense_replace=1) | config))
    return _build(DeepseekV3ForCausalLM, hf, seed, dtype), tok


def tiny_deepseek_v2(seed: int = 0, layers: int = 3, dtype=None, kv_lora_rank: int = 128, rope: int = 16,
                     **config):
    """``(model, ByteTokenizer())``: DeepSeek-V2 (V2-Lite style: no q_lora projection)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    tok = ByteTokenizer()
    hf = DeepseekV2Config(**_common(tok, layers, kv_lora_rank, rope, dict(
        q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=1) | config))
    return _build(DeepseekV2ForCausalLM, hf, seed, dtype), tok


def tiny_glm4_moe_lite(seed: int = 0, layers: int = 3, dtype=None, kv_lora_rank: int = 128, rope: int = 16,
                       **config):
    """``(model, ByteTokenizer())``: GLM-4-MoE-Lite (GLM-4.7-Flash's MLA)."""
    from transformers import Glm4MoeLiteConfig, Glm4MoeLiteForCausalLM

    tok = ByteTokenizer()
    hf = Glm4MoeLiteConfig(**_common(tok, layers, kv_lora_rank, rope, dict(
        q_lora_rank=48, n_group=1, topk_group=1, first_k_dense_replace=1) | config))
    return _build(Glm4MoeLiteForCausalLM, hf, seed, dtype), tok


#: name -> builder, for tests that run every MLA family
MLA_MODELS = {"deepseek_v3": tiny_deepseek_v3, "deepseek_v2": tiny_deepseek_v2, "glm4_moe_lite": tiny_glm4_moe_lite}
