"""pagedkv's attention registered in transformers' ``AttentionInterface``: read the pages.

Usage::

    from pagedkv.integrations import hf_attention
    hf_attention.register()                              # once: "pagedkv" is an attn_implementation
    model.set_attn_implementation("pagedkv")             # or from_pretrained(..., attn_implementation="pagedkv")
    with PagedCache(kv, paged_attention=True) as cache:  # update() then only writes
        model.generate(..., past_key_values=cache)

A :class:`~pagedkv.integrations.transformers.PagedCache` made with
``paged_attention=True`` writes each layer's new K/V and returns them tagged with a
*ticket* (the cache, the layer and the pass's page table); :func:`attention_forward`
then runs :meth:`pagedkv.manager.cache.PagedKVCache.attention` over the pages, with no gather
and no padded K/V tensor. Any call without a ticket (another cache, a layer the cache
still serves by gathering) runs transformers' SDPA attention unchanged, or, for a
model with attention logit soft-capping (Gemma 2), which SDPA refuses, the same
attention written out, so the registered name is safe to use everywhere. The cache checks that every ticket was
taken (a model whose attention is not "pagedkv" would otherwise attend only to the
new tokens) and raises otherwise.
"""
from __future__ import annotations

import torch

__all__ = ["NAME", "register", "attention_forward", "Ticket"]

#: the attn_implementation name registered by :func:`register`
NAME = "pagedkv"


class Ticket:
    """What a paged ``update`` hands to the attention of one layer: the pass's own K/V
    ``[B, H, q, D]`` ride along, read at model precision (not back from the arena)."""

    __slots__ = ("cache", "layer_idx", "plan", "taken", "key", "value")

    def __init__(self, cache, layer_idx: int, plan, key=None, value=None):
        self.cache = cache
        self.layer_idx = layer_idx
        self.plan = plan
        self.taken = False
        self.key = key
        self.value = value


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      sliding_window=None, softcap=None, **kwargs):
    """transformers' attention signature: ``query`` ``[B, Hq, q, D]``; returns
    ``([B, q, Hq, D], None)``."""
    ticket = getattr(key, "_pagedkv_ticket", None)
    if ticket is None and softcap:     # torch's SDPA has no soft-capping (Gemma 2): the plain math
        return _softcap_attention(query, key, value, attention_mask, scaling, softcap), None
    if ticket is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, softcap=softcap, **kwargs)
    ticket.taken = True
    out = ticket.cache.paged_attend(ticket, query, scaling, softcap)
    return out, None


def _softcap_attention(query, key, value, attention_mask, scaling, softcap):
    """Attention with logit soft-capping for a call without a ticket (e.g. the same model
    run with a ``DynamicCache``): ``[B, Hq, q, D]`` -> ``[B, q, Hq, D]``. The mask is
    what transformers' SDPA mask gives: boolean (True attends), additive, or None for
    plain causal attention over the last ``q`` keys."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    q, k = scores.shape[-2], scores.shape[-1]
    if attention_mask is None:
        attention_mask = torch.ones(q, k, dtype=torch.bool, device=query.device).tril(k - q)
    else:
        attention_mask = attention_mask[..., :k]
    if attention_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    else:
        scores = scores + attention_mask
    weights = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    weights = torch.nan_to_num(weights)   # a fully masked (padding) query row attends to nothing
    return torch.matmul(weights, value).transpose(1, 2).contiguous()


def register(name: str = NAME) -> str:
    """Register :func:`attention_forward` (and SDPA's mask) under ``name``; returns it."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionMaskInterface.register(name, sdpa_mask)
    except ImportError:  # pragma: no cover - transformers without a mask interface
        pass
    return name


def tag(key: torch.Tensor, ticket: Ticket) -> torch.Tensor:
    """``key`` carrying ``ticket`` (a plain attribute: transformers passes the tensor through)."""
    setattr(key, "_pagedkv_ticket", ticket)   # a plain attribute on the tensor
    return key
