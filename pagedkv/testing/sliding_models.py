"""Tiny randomly initialised models with sliding-window layers, built from a config
(no download): a Mistral (every layer slides) and a Gemma 2 (layers alternate sliding
and full attention). Same seed, same weights; the global torch RNG is left as it was.
"""
from __future__ import annotations

from pagedkv.testing.models import ByteTokenizer

__all__ = ["tiny_mistral", "tiny_gemma2", "tiny_gemma2_capped", "tiny_gemma3", "tiny_qwen2"]


def _common(tok, window: int, layers: int, init: float, config: dict | None = None) -> dict:
    return dict(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                sliding_window=window, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, tie_word_embeddings=True,
                initializer_range=init) | (config or {})   # init: greedy output does not collapse to one token


def _build(cls, config, seed: int, dtype):
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    return model.to(torch.float32 if dtype is None else dtype).eval()


def tiny_mistral(window: int = 8, seed: int = 0, layers: int = 2, dtype=None, **config):
    """``(model, ByteTokenizer())``: a Mistral whose every layer sees ``window`` tokens.
    ``config``: further ``MistralConfig`` fields (here and in the builders below, e.g.
    a smaller ``hidden_size`` for an assistant model)."""
    from transformers import MistralConfig, MistralForCausalLM

    tok = ByteTokenizer()
    return _build(MistralForCausalLM, MistralConfig(**_common(tok, window, layers, 0.4, config)), seed, dtype), tok


def tiny_gemma2(window: int = 8, seed: int = 0, layers: int = 4, dtype=None, **config):
    """``(model, ByteTokenizer())``: a Gemma 2 with ``layer_types`` alternating
    sliding (``window`` tokens) and full attention. Gemma 2's attention logit
    soft-capping and ``query_pre_attn_scalar`` are set through ``config``
    (``attn_logit_softcapping``, ``query_pre_attn_scalar``; defaults 50 and 16)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    tok = ByteTokenizer()
    types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    hf = Gemma2Config(**_common(tok, window, layers, 0.02, dict(layer_types=types, query_pre_attn_scalar=16)
                                | config))
    return _build(Gemma2ForCausalLM, hf, seed, dtype), tok


def tiny_gemma2_capped(window: int = 8, seed: int = 0, layers: int = 4, dtype=None, softcap: float = 3.0,
                       query_pre_attn_scalar: int = 40, qk_gain: float = 10.0, **config):
    """A :func:`tiny_gemma2` whose attention logit soft-capping and
    ``query_pre_attn_scalar`` (not ``head_dim``) change its output: the query and key
    projections are scaled by ``qk_gain``, so attention logits reach the cap. Greedy
    output differs without either, and does not collapse to one token."""
    import torch

    model, tok = tiny_gemma2(window, seed, layers, dtype, attn_logit_softcapping=softcap,
                             query_pre_attn_scalar=query_pre_attn_scalar, **config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(qk_gain)
            layer.self_attn.k_proj.weight.mul_(qk_gain)
    return model, tok


def tiny_gemma3(window: int = 8, seed: int = 0, layers: int = 6, dtype=None, **config):
    """``(model, ByteTokenizer())``: a text-only Gemma 3 with its 5 sliding : 1 full
    layer pattern (``window`` tokens)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tok = ByteTokenizer()
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    hf = Gemma3TextConfig(**_common(tok, window, layers, 0.02, dict(layer_types=types, query_pre_attn_scalar=16)
                                    | config))
    return _build(Gemma3ForCausalLM, hf, seed, dtype), tok


def tiny_qwen2(window: int = 8, seed: int = 0, layers: int = 4, dtype=None, **config):
    """``(model, ByteTokenizer())``: a Qwen2 whose upper layers slide (``window`` tokens,
    ``max_window_layers`` 2: layers 0-1 full attention, as Qwen2's config reads)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = ByteTokenizer()
    hf = Qwen2Config(**_common(tok, window, layers, 0.4, dict(use_sliding_window=True, max_window_layers=2)
                               | config))
    return _build(Qwen2ForCausalLM, hf, seed, dtype), tok
