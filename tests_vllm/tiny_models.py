"""Tiny random-weight models saved with ``save_pretrained`` for the vLLM tests that need a
shape SmolLM2 lacks (KV heads to shard over two ranks, sliding-window layers). They use
SmolLM2's tokenizer, so the prompt sets of :mod:`vllm_env` apply. Untied embeddings and a
wide initialisation give greedy tokens that vary with the context and win by a margin
(a tied random model repeats its last token, whatever the KV)."""
from __future__ import annotations

from pathlib import Path

import vllm_env as ve

COMMON = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 2048,
          "tie_word_embeddings": False, "initializer_range": 0.2}


def save_tiny(out: Path, family: str = "llama", **overrides) -> Path:
    """A random ``family`` model in ``out``: ``llama``, ``mistral`` (every layer within
    ``sliding_window``), ``gemma2``/``gemma3`` (sliding-window and full layers alternate)."""
    import torch
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(str(ve.MODEL_DIR))
    cls_cfg, cls_model = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                          "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
                          "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM),
                          "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM)}[family]
    cfg = cls_cfg(**dict(COMMON, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         **overrides))
    torch.manual_seed(0)
    model = cls_model(cfg).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out
