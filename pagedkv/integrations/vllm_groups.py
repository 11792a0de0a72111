"""The connector's view of vLLM's KV cache groups and parallel setup.

vLLM hands the connector a ``KVCacheConfig``: one group per kind of layer (with its
hybrid allocator on, full-attention and sliding-window layers are separate groups, each
with a block table of its own; off, one group). :func:`spec_of` turns it into the shape
of a stored block (every layer, in model order, so blocks stored with the hybrid
allocator on or off are the same) and each layer's group; :func:`group_ids` and
:func:`per_block` name a request's blocks the way the copies take them (one id, or one
per group, ``-1`` where a sliding window gave its block back). :func:`parallel_size`
reads the tensor-parallel size and refuses what the connector cannot serve.
"""
from __future__ import annotations

from pagedkv.integrations.vllm_worker import KVSpec

__all__ = ["group_ids", "parallel_size", "per_block", "spec_of"]


def parallel_size(vllm_config) -> tuple[int, str | None]:
    """The tensor-parallel size, and why the connector cannot serve the parallel setup."""
    pc = getattr(vllm_config, "parallel_config", None)
    tp = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    pp = int(getattr(pc, "pipeline_parallel_size", 1) or 1)
    if pp > 1:
        return tp, (f"pipeline_parallel_size={pp}: each stage holds other layers; the pagedkv connector "
                    "serves tensor parallelism only")
    return tp, None


#: vLLM KV cache specs whose blocks the connector stores (the others: MLA, Mamba, ... refused)
_SPECS = ("FullAttentionSpec", "SlidingWindowSpec")


def _layer_key(name: str) -> tuple[int, ...]:
    """The numbers in a layer's name (``model.layers.3.self_attn.attn`` -> ``(3,)``)."""
    return tuple(int(p) for p in name.split(".") if p.isdigit())


def spec_of(kv_cache_config) -> tuple[KVSpec | None, str | None, list[str], list[int] | None]:
    """The KV spec of every layer's blocks, the layers in model order and each layer's
    group (None: one group), or why the connector serves nothing.

    Under vLLM's hybrid allocator full-attention and sliding-window layers are groups of
    their own (one block table each); a stored block holds every layer, in model order,
    so blocks stored with the hybrid allocator on or off are the same."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if not groups:
        return None, "vLLM gave no KV cache groups", [], None
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    odd = [k for k in kinds if k not in _SPECS]
    if odd:
        return None, (f"KV cache spec {odd[0]} (groups: {', '.join(kinds)}): the pagedkv connector serves "
                      f"{' and '.join(_SPECS)} layers only"), [], None
    spec = groups[0].kv_cache_spec
    shape = (spec.num_kv_heads, spec.block_size, spec.head_size, spec.dtype)
    for g in groups:
        sp = g.kv_cache_spec
        if (sp.num_kv_heads, sp.block_size, sp.head_size, sp.dtype) != shape:
            return None, (f"KV cache groups of different shapes ({type(sp).__name__}: heads {sp.num_kv_heads}, "
                          f"block {sp.block_size}, head size {sp.head_size}, {sp.dtype}; first group: {shape})"), [], None
        head_v = getattr(sp, "head_size_v", None)
        if head_v not in (None, sp.head_size):
            return None, f"head_size_v={head_v} differs from head_size={sp.head_size}", [], None
    named = [(n, gi) for gi, g in enumerate(groups) for n in g.layer_names]
    if len({n for n, _ in named}) != len(named):
        return None, "a layer in two KV cache groups", [], None
    named.sort(key=lambda x: _layer_key(x[0]))        # stable: layers of one number keep the group order
    names = [n for n, _ in named]
    # one block id per group (a tuple) once a group may hold no block: a sliding window
    grouped = len(groups) > 1 or kinds[0] != "FullAttentionSpec"
    layer_groups = [gi for _, gi in named] if grouped else None
    return KVSpec(len(names), *shape), None, names, layer_groups


def group_ids(blocks) -> list[list[int]]:
    """Per KV cache group, the request's block ids (vLLM's ``KVCacheBlocks``), -1 where
    the group holds vLLM's null block (a sliding window's skipped blocks)."""
    return [[-1 if getattr(b, "is_null", False) else int(b.block_id) for b in group] for group in blocks.blocks]


def per_block(ids: list[list[int]], start: int, stop: int, grouped: bool) -> list:
    """Blocks ``start..stop`` as the metadata names them: one id, or a tuple per group."""
    if not grouped:
        return ids[0][start:stop]
    return [tuple(g[i] for g in ids) for i in range(start, stop)]
