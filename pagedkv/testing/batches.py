"""Left-padded batches, as a generate() caller builds them for a decoder-only model."""
from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["left_pad"]


def left_pad(rows: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)``, each ``[len(rows), longest row]``: every row
    right-aligned after ``pad_id`` padding, the mask 0 over the padding."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + list(r) for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask
