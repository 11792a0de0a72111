"""Tiny randomly initialised recurrent and hybrid models, built from a config (no
download), that transformers runs on a CPU with its reference PyTorch code: Mamba2 and
FalconMamba (every layer a state), Bamba, GraniteMoeHybrid (Granite 4), Jamba,
Nemotron-H, Zamba2, Qwen3-Next, Qwen3.5 and Kimi-Linear (state layers beside attention
layers), Falcon-H1 (both in every layer) and LFM2 (short convolutions beside
attention). Same seed, same weights; the global torch RNG is left as it was.

:data:`STATE_MODELS` maps a family name to its builder; :data:`REFUSED` lists the
families pagedkv refuses, with the layer type its error names.
"""
from __future__ import annotations

from pagedkv.testing.models import ByteTokenizer
from pagedkv.testing.sliding_models import _build

__all__ = ["tiny_state_model", "STATE_MODELS", "REFUSED", "state_config"]

_MAMBA2_FIELDS = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_expand=1,
                      mamba_d_conv=4, mamba_chunk_size=8)
_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4)

#: family -> (config class, model class, fields beyond the common ones)
_FAMILIES: dict[str, tuple[str, str, dict]] = {
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(num_heads=4, head_dim=16, state_size=8, n_groups=1,
                                                         expand=1, conv_kernel=4, chunk_size=8)),
    "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM", dict(state_size=8, expand=1, conv_kernel=4)),
    "bamba": ("BambaConfig", "BambaForCausalLM", dict(attn_layer_indices=[1], **_MAMBA2_FIELDS)),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                         dict(layer_types=["mamba", "attention", "mamba"], num_local_experts=2,
                              num_experts_per_tok=1, **_MAMBA2_FIELDS)),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", dict(mamba_d_ssm=None, **_MAMBA2_FIELDS)),
    "jamba": ("JambaConfig", "JambaForCausalLM", dict(attn_layer_period=2, attn_layer_offset=1,
                                                      expert_layer_period=2, expert_layer_offset=1, num_experts=2,
                                                      num_experts_per_tok=1, mamba_d_state=8, mamba_d_conv=4,
                                                      mamba_expand=1)),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(hybrid_override_pattern="M*M", mamba_num_heads=4,
                                                                   mamba_head_dim=16, ssm_state_size=8, n_groups=1,
                                                                   expand=1, conv_kernel=4, chunk_size=8)),
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM", dict(mamba_d_state=8, mamba_d_conv=4, mamba_expand=1,
                                                         n_mamba_heads=4, num_mem_blocks=1, chunk_size=8,
                                                         layers_block_type=["mamba", "hybrid", "mamba"])),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(layer_types=["linear_attention", "full_attention", "linear_attention"], num_experts=2,
                        num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32, **_GDN)),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                dict(layer_types=["linear_attention", "full_attention", "linear_attention"], **_GDN)),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM",
                    dict(layer_types=["linear_attention", "full_attention", "linear_attention"], kv_lora_rank=16,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, linear_head_dim=16,
                         linear_num_heads=4, moe_intermediate_size=32, num_experts=2, num_experts_per_token=1)),
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(layer_types=["conv", "full_attention", "conv"], conv_L_cache=3)),
}

#: families refused, with the layer type the refusal names
REFUSED = {"minimax": ("MiniMaxConfig", "linear_attention")}


def state_config(family: str, tok: ByteTokenizer | None = None, **config):
    """The transformers config of a tiny ``family`` model (3 layers, hidden 64)."""
    import transformers

    tok = tok or ByteTokenizer()
    if family in REFUSED:
        cls, fields = REFUSED[family][0], dict(layer_types=["linear_attention", "full_attention", "linear_attention"],
                                               num_local_experts=2, num_experts_per_tok=1, block_size=16)
    else:
        cls, _, fields = _FAMILIES[family]
    common = dict(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  initializer_range=0.1)
    return getattr(transformers, cls)(**(common | fields | config))


def tiny_state_model(family: str, seed: int = 0, dtype=None, **config):
    """``(model, ByteTokenizer())``: a tiny random ``family`` model (see :data:`STATE_MODELS`)."""
    import transformers

    tok = ByteTokenizer()
    return _build(getattr(transformers, _FAMILIES[family][1]), state_config(family, tok, **config), seed, dtype), tok


#: family name -> builder (``seed``, ``dtype``, config fields)
STATE_MODELS = {name: (lambda name: lambda **kw: tiny_state_model(name, **kw))(name) for name in _FAMILIES}
