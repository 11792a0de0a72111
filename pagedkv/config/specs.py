"""A config's layer-group specs, and what MLA adds to a config (see :mod:`pagedkv.groups.spec`).

:func:`build_specs` places every layer group of a :class:`~pagedkv.config.options.CacheConfig`
(its partition: one group, the sliding-window plan, or the MLA layers) with the
config's block geometry and format. :func:`validate_mla` checks and completes the
MLA fields (``kv_lora_rank``, ``qk_rope_head_dim``) and refuses, through the support
table, what latent rows do not combine with. :func:`mla_from_hf` reads them from a
Hugging Face config (DeepSeek V2/V3, Kimi K2, GLM-4-MoE-Lite, ...) and refuses a
sparse-attention indexer (DeepSeek V3.2/V4, GLM-MoE-DSA) at config time.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagedkv.config.support import ROW_ONLY_FORMATS, require
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError, expected
from pagedkv.format.latent import LatentFormat
from pagedkv.format.layer_format import LayerFormat
from pagedkv.groups.spec import FullAttentionSpec, KVSpec, MLASpec, check_pool

__all__ = ["build_specs", "validate_mla", "mla_from_hf", "INDEXER_FIELDS"]

#: config fields of a sparse-attention indexer (a second, per-token key cache pagedkv does not hold)
INDEXER_FIELDS = ("index_topk", "index_n_heads", "index_head_dim")


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArgumentTypeError(expected(name, "an int >= 1", repr(value)))
    if value < 1:
        raise InvalidArgumentError(expected(name, "an int >= 1", repr(value)))
    return value


def validate_mla(cfg: Any, put) -> None:
    """MLA fields of ``cfg``: both or neither; one latent "head" of ``kv_lora_rank +
    qk_rope_head_dim`` elements; no option latent rows do not have (support table).
    The latent format is checked (:class:`~pagedkv.format.latent.LatentFormat`) and its
    group size resolved into ``kv_group_size``."""
    r, p = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    if r is None and p is None:
        return
    if r is None or p is None:
        raise InvalidArgumentError(expected("kv_lora_rank", "kv_lora_rank and qk_rope_head_dim together (MLA)",
                                            f"kv_lora_rank={r!r}, qk_rope_head_dim={p!r}"))
    r, p = _int("kv_lora_rank", r), _int("qk_rope_head_dim", p)
    put("kv_lora_rank", r)
    put("qk_rope_head_dim", p)
    if cfg.num_kv_heads != 1:
        raise InvalidArgumentError(expected("num_kv_heads", "1 for MLA (one latent row per token, shared by "
                                            "every query head)", cfg.num_kv_heads))
    if cfg.head_dim != r + p:
        raise InvalidArgumentError(expected("head_dim", f"kv_lora_rank + qk_rope_head_dim = {r + p} for MLA",
                                            cfg.head_dim))
    if cfg.layout != "NHD":
        raise InvalidArgumentError(expected("layout", "'NHD' for MLA (one latent row per token)", repr(cfg.layout)))
    q = cfg.kv_dtype
    if q in ("fp8_e5m2", "int3", "int2") or cfg.kv_rotation or cfg.kv_key_quant not in (None, "token"):
        require(ROW_ONLY_FORMATS, cfg)
    if cfg.kv_window or cfg.kv_sink_tokens:
        require("kv_window / kv_sink_tokens (model-precision rows beside quantized blocks)", cfg)
    if cfg.kv_full_precision_layers:
        require("kv_full_precision_layers (the layers sharing such a layer's arena slot are exact too)", cfg)
    fmt = LatentFormat(q or cfg.dtype, cfg.dtype, r, p, cfg.kv_group_size)
    put("kv_group_size", fmt.group_size if q in ("int8", "int4") else None)
    put("kv_rotation", False)
    put("kv_window", 0)
    put("kv_sink_tokens", 0)
    put("kv_key_quant", "token")
    put("kv_full_precision_layers", ())


def layer_format(cfg: Any) -> LayerFormat:
    """The format of ``cfg``'s quantized layers (the model dtype unquantized)."""
    return LayerFormat.of_config(cfg)


def build_specs(cfg: Any) -> tuple[KVSpec, ...]:
    """One placed spec per layer group of ``cfg`` (checked to share one block geometry)."""
    geometry = dict(block_size=cfg.block_size, format=layer_format(cfg), model_dtype=cfg.dtype,
                    num_kv_heads=cfg.kv_heads_per_rank, head_dim=cfg.head_dim)
    layers = range(cfg.num_layers)     # not a tuple: the arenas' size is checked first (config.memory)
    if cfg.kv_lora_rank is not None and cfg.layer_groups is not None:
        require("mixing attention types with MLA layers", cfg)
    if cfg.kv_lora_rank is not None:
        specs: tuple[KVSpec, ...] = (MLASpec(0, layers, kv_lora_rank=cfg.kv_lora_rank,
                                             rope_dim=cfg.qk_rope_head_dim, **geometry),)
    elif cfg.layer_groups is None:
        specs = (FullAttentionSpec(0, layers, **geometry),)
    else:
        specs = tuple(g.placed(**geometry) for g in cfg.layer_groups.groups)
    check_pool(specs)
    return specs


def mla_from_hf(src: Mapping[str, Any]) -> dict[str, int] | None:
    """The MLA fields of a Hugging Face config (``kv_lora_rank`` present), or None.

    Refuses a sparse-attention indexer (DeepSeek V3.2/V4, GLM-MoE-DSA: ``index_topk``),
    whose own key cache and top-k selection pagedkv does not hold, and a latent
    without positional dimensions (``qk_rope_head_dim`` 0)."""
    r = src.get("kv_lora_rank")
    if r is None:
        return None
    for name in INDEXER_FIELDS:
        if src.get(name) is not None:
            from pagedkv.config.support import UnsupportedCombinationError

            raise UnsupportedCombinationError(expected(
                name, "an MLA model without a sparse-attention indexer (DeepSeek-V3.2/V4's lightning indexer "
                "keeps a key cache of its own and selects the top-k tokens; pagedkv holds the latent only)",
                f"{src.get(name)!r} (model_type {src.get('model_type')!r})"))
    p = src.get("qk_rope_head_dim")
    if p is None or (isinstance(p, int) and not isinstance(p, bool) and p < 1):
        raise InvalidArgumentError(expected("qk_rope_head_dim", "an int >= 1 beside kv_lora_rank (MLA)", repr(p)))
    return {"kv_lora_rank": _int("kv_lora_rank", r), "qk_rope_head_dim": _int("qk_rope_head_dim", p)}
