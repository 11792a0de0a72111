"""The recurrent-state layers of a Hugging Face config: each layer's kind and the state
tensors one state layer holds (see :mod:`pagedkv.config.state`).

Layer kinds are read from ``layer_types`` (``"linear_attention"`` and ``"conv"`` keep a
state, ``"hybrid"`` a state and K/V, ``"full_attention"`` and ``"sliding_attention"`` K/V,
``"mlp"``/``"moe"`` nothing; the legacy ``"mamba"``/``"attention"`` too), Nemotron-H's
``hybrid_override_pattern``, Jamba's attention period and Bamba's attention indices, or
the model type (a pure Mamba: every layer a state; Falcon-H1: every layer both).

The state tensors of one layer, per family, as transformers' reference code caches
them (``update_conv_state`` / ``update_recurrent_state``):

- Mamba2 mixers (Mamba2, Bamba, Granite 4 / GraniteMoeHybrid, Falcon-H1, Nemotron-H,
  Zamba2): ``conv [intermediate + 2 * groups * d_state, d_conv]`` and
  ``ssm [heads, head_dim, d_state]``;
- Mamba1 mixers (Mamba, FalconMamba, Jamba): ``conv [intermediate, d_conv]`` and
  ``ssm [intermediate, d_state]``;
- Gated DeltaNet (Qwen3-Next, Qwen3.5): ``conv [2 * key_dim + value_dim, kernel]`` and
  ``ssm [value_heads, key_head_dim, value_head_dim]``;
- Kimi Delta Attention (Kimi-Linear): ``conv [3 * heads * head_dim, kernel]`` and
  ``ssm [heads, head_dim, head_dim]``;
- short convolutions (LFM2): ``conv [hidden, L_cache]`` only.

All float32 (transformers keeps the states in the model dtype; pagedkv stores float32 by
default, read back in the dtype asked). A model whose states transformers keeps in a
cache class of its own (MiniMax's lightning attention), or a layer type not listed, is
refused with a typed error naming the layer type.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagedkv.config.support import UnsupportedCombinationError
from pagedkv.errors import InvalidArgumentError, expected

__all__ = ["state_from_hf", "LAYER_TYPES", "STATE_FAMILIES"]

#: Hugging Face layer type -> (pagedkv layer kind, attention window or None)
LAYER_TYPES: dict[str, str] = {
    "full_attention": "attention", "attention": "attention", "sliding_attention": "attention",
    "linear_attention": "state", "mamba": "state", "conv": "state",
    "hybrid": "hybrid",
    "mlp": "none", "moe": "none", "dummy": "none",
}
_MAMBA2 = {"mamba2", "bamba", "granitemoehybrid", "falcon_h1", "nemotron_h", "zamba2"}
_MAMBA1 = {"mamba", "falcon_mamba", "jamba"}
_GDN = {"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"}
_KDA = {"kimi_linear"}
_CONV = {"lfm2", "lfm2_moe"}
#: the model types whose state tensors are read here
STATE_FAMILIES = tuple(sorted(_MAMBA2 | _MAMBA1 | _GDN | _KDA | _CONV))
#: model types whose linear layers keep their state in a cache class of their own
_OWN_CACHE = {"minimax": "MiniMax's lightning attention (transformers keeps it in MiniMaxCache, not a layered Cache)"}
_PURE_STATE = {"mamba", "mamba2", "falcon_mamba"}


def _get(src: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    for n in names:
        v = src.get(n)
        if v is not None:
            return v
    return default


def _int(src: Mapping[str, Any], *names: str, default: Any = None) -> int:
    v = _get(src, *names, default=default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < 1:
        raise InvalidArgumentError(expected(names[0], "an int >= 1 (a recurrent-state model's field)", repr(v)))
    return int(v)


def _types(src: Mapping[str, Any], num_layers: int) -> list[str] | None:
    """Hugging Face layer types, one per layer, or None when the config names none."""
    mt = src.get("model_type")
    types = _get(src, "layer_types", "layers_block_type")
    if types is not None:
        if isinstance(types, (str, bytes)) or not isinstance(types, Sequence):     # as the windows reader says
            raise InvalidArgumentError(expected("layer_types", f"a list of {num_layers} layer kinds",
                                                type(types).__name__))
        if len(types) != num_layers:
            raise InvalidArgumentError(expected("layer_types", f"{num_layers} entries (one per layer)", len(types)))
        return list(types)
    pattern = src.get("hybrid_override_pattern")
    if isinstance(pattern, str) and len(pattern) == num_layers:        # Nemotron-H: M mamba, * attention, - mlp, E moe
        code = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
        if all(c in code for c in pattern):
            return [code[c] for c in pattern]
    if mt == "jamba" and src.get("attn_layer_period") is not None:
        period, offset = _int(src, "attn_layer_period"), int(src.get("attn_layer_offset", 0))
        return ["attention" if i % period == offset else "mamba" for i in range(num_layers)]
    if mt == "bamba" and src.get("attn_layer_indices") is not None:
        at = set(src["attn_layer_indices"])
        return ["attention" if i in at else "mamba" for i in range(num_layers)]
    if mt in _PURE_STATE:
        return ["mamba"] * num_layers
    if mt == "falcon_h1":
        return ["hybrid"] * num_layers
    return None


def _tensors(src: Mapping[str, Any], mt: Any) -> list[tuple[str, tuple[int, ...], str]]:
    hidden = _int(src, "hidden_size", "d_model")
    if mt in _MAMBA2:
        heads = _int(src, "mamba_n_heads", "mamba_num_heads", "n_mamba_heads", "num_heads")
        d_state = _int(src, "mamba_d_state", "ssm_state_size", "state_size")
        d_conv = _int(src, "mamba_d_conv", "conv_kernel")
        groups = _int(src, "mamba_n_groups", "mamba_ngroups", "n_groups", default=1)
        expand = _get(src, "mamba_expand", "expand", default=2)
        if mt == "nemotron_h":
            head_dim = _int(src, "mamba_head_dim")
            inner = heads * head_dim
        else:
            d_ssm = _get(src, "mamba_d_ssm") if mt == "falcon_h1" else None
            inner = int(expand * hidden) if d_ssm is None else int(d_ssm)
            head_dim = _int(src, "mamba_d_head", "mamba_headdim", "head_dim") if mt != "zamba2" else inner // heads
        return [("conv", (inner + 2 * groups * d_state, d_conv), "float32"),
                ("ssm", (heads, head_dim, d_state), "float32")]
    if mt in _MAMBA1:
        d_state = _int(src, "mamba_d_state", "state_size")
        d_conv = _int(src, "mamba_d_conv", "conv_kernel")
        inner = int(_get(src, "mamba_expand", "expand", default=2) * hidden) if mt == "jamba" else \
            _int(src, "intermediate_size", default=int(_get(src, "expand", default=2) * hidden))
        return [("conv", (inner, d_conv), "float32"), ("ssm", (inner, d_state), "float32")]
    if mt in _GDN:
        kh, vh = _int(src, "linear_num_key_heads"), _int(src, "linear_num_value_heads")
        kd, vd = _int(src, "linear_key_head_dim"), _int(src, "linear_value_head_dim")
        k = _int(src, "linear_conv_kernel_dim")
        return [("conv", (2 * kh * kd + vh * vd, k), "float32"), ("ssm", (vh, kd, vd), "float32")]
    if mt in _KDA:
        heads, hd = _int(src, "linear_num_heads"), _int(src, "linear_head_dim")
        k = _int(src, "linear_conv_kernel_dim")
        return [("conv", (3 * heads * hd, k), "float32"), ("ssm", (heads, hd, hd), "float32")]
    return [("conv", (hidden, _int(src, "conv_L_cache")), "float32")]     # _CONV


def state_from_hf(src: Mapping[str, Any], num_layers: int) -> dict[str, Any] | None:
    """``{"layer_kinds", "state_tensors", "windows"}`` of a recurrent or hybrid model's
    config (``windows``: the attention window of each layer with K/V, 0 for full
    attention), or None for a model without recurrent-state layers."""
    types = _types(src, num_layers)
    if types is None:
        return None
    mt = src.get("model_type")
    kinds = []
    for i, t in enumerate(types):
        if t not in LAYER_TYPES:
            if any(LAYER_TYPES.get(x) in ("state", "hybrid") for x in types):
                raise UnsupportedCombinationError(expected(
                    "layer_types", "layer types pagedkv holds ('" + "', '".join(LAYER_TYPES) + "')",
                    f"{t!r} at index {i} (model_type {mt!r})"))
            return None       # an attention-only model with another layer type: the windows reader names it
        kinds.append(LAYER_TYPES[t])
    if not any(k in ("state", "hybrid") for k in kinds):
        return None
    if mt in _OWN_CACHE:
        bad = next(t for t in types if LAYER_TYPES[t] in ("state", "hybrid"))
        raise UnsupportedCombinationError(expected("layer_types", "recurrent-state layers transformers keeps in its "
                                                   "layered Cache", f"{bad!r} of model_type {mt!r}: "
                                                   f"{_OWN_CACHE[mt]}"))
    if mt not in STATE_FAMILIES:
        bad = next(t for t in types if LAYER_TYPES[t] in ("state", "hybrid"))
        raise UnsupportedCombinationError(expected(
            "layer_types", f"recurrent-state layers of a known family ({', '.join(STATE_FAMILIES)})",
            f"{bad!r} of model_type {mt!r}"))
    window = src.get("sliding_window")
    windows = []
    for t, k in zip(types, kinds):
        if k in ("attention", "hybrid"):
            windows.append(int(window) if t == "sliding_attention" and window else 0)
    return {"layer_kinds": tuple(kinds), "state_tensors": tuple(_tensors(src, mt)), "windows": tuple(windows)}
