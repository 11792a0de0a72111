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
still serves by gathering) runs transformers' SDPA attention unchanged, so the
registered name is safe to use everywhere. The cache checks that every ticket was
taken (a model whose attention is not "pagedkv" would otherwise attend only to the
new tokens) and raises otherwise.
"""
from __future__ import annotations

import torch

__all__ = ["NAME", "register", "attention_forward", "Ticket"]

#: the attn_implementation name registered by :func:`register`
NAME = "pagedkv"


class Ticket:
    """What a paged ``update`` hands to the attention of one layer."""

    __slots__ = ("cache", "layer_idx", "plan", "taken")

    def __init__(self, cache, layer_idx: int, plan):
        self.cache = cache
        self.layer_idx = layer_idx
        self.plan = plan
        self.taken = False


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      sliding_window=None, softcap=None, **kwargs):
    """transformers' attention signature: ``query`` ``[B, Hq, q, D]``; returns
    ``([B, q, Hq, D], None)``."""
    ticket = getattr(key, "_pagedkv_ticket", None)
    if ticket is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, softcap=softcap, **kwargs)
    ticket.taken = True
    out = ticket.cache.paged_attend(ticket, query, scaling, softcap)
    return out, None


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
