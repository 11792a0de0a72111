"""MLA latent KV ops: :func:`write_latent`, :func:`gather_latent`, :func:`mla_attention`.

Each takes a :class:`~pagedkv.ops.views.LatentView` (one MLA layer: its row format
and arena) and a ``backend``:

- ``"auto"`` (default): ``"cuda"`` for a CUDA arena, ``"cpu"`` otherwise;
- ``"cpu"``: torch on the CPU: rows encoded and decoded by the format's definition
  (:meth:`~pagedkv.format.latent.LatentFormat.encode`), attention in float32, sequence
  by sequence;
- ``"reference"``: the float64 definition (:mod:`pagedkv.ops.latent_reference`);
- ``"cuda"``: the kernels of ``cuda/latent_rows.cu`` and ``cuda/latent_attention.cu`` (:mod:`pagedkv.kernels.latent_plans`).

Every backend runs the same checks first, with the same errors.
"""
from __future__ import annotations

import torch

from pagedkv.errors import DeviceError, InvalidArgumentError, expected
from pagedkv.ops import latent_reference as ref
from pagedkv.ops.views import LatentView

__all__ = ["LatentView", "write_latent", "gather_latent", "mla_attention", "LATENT_BACKENDS"]

LATENT_BACKENDS = ("auto", "cpu", "cuda", "reference")


def _backend(backend: str, view: object) -> str:
    if backend not in LATENT_BACKENDS:
        raise InvalidArgumentError(expected("backend", "one of " + ", ".join(map(repr, LATENT_BACKENDS)),
                                            repr(backend)))
    data = getattr(view, "data", None)
    cuda = isinstance(data, torch.Tensor) and data.device.type == "cuda"
    if backend == "auto":
        return "cuda" if cuda else "cpu"
    if backend == "cpu" and cuda:
        raise DeviceError(expected("view.data", "a CPU tensor for the 'cpu' backend", data.device))  # type: ignore[union-attr]
    return backend


def _kernels():
    from pagedkv.kernels import ops as kops

    return kops


def write_latent(view: LatentView, slot_mapping: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, *,
                 backend: str = "auto") -> None:
    """Store latent rows: ``kv_c`` ``[N, R]`` and ``k_pe`` ``[N, P]`` (one model dtype) at
    ``slot_mapping`` ``[N]`` int64 (negative slots are skipped), encoded in the view's
    format. A slot past the arena is refused on the CPU (before any write); the kernels
    skip it."""
    name = _backend(backend, view)
    if name == "cuda":
        _kernels().write_latent(view, slot_mapping, kv_c, k_pe)
        return
    ref.write(view, slot_mapping, kv_c, k_pe)     # the CPU ops are the definition, vectorized


def gather_latent(view: LatentView, indptr, indices, seq_lens, *, out_dtype: torch.dtype | None = None,
                  backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``(kv_c [T, R], k_pe [T, P])``: the first ``seq_lens[b]`` tokens of every sequence
    of the CSR tables (``indptr`` ``[B + 1]``, ``indices``, ``seq_lens`` ``[B]``: int32
    tensors on the arena's device, or NumPy integer arrays), sequence after sequence,
    decoded into ``out_dtype`` (default: the model dtype)."""
    name = _backend(backend, view)
    if name == "cuda":
        return _kernels().gather_latent(view, indptr, indices, seq_lens, out_dtype=out_dtype)
    return ref.gather(view, indptr, indices, seq_lens, out_dtype)


def mla_attention(view: LatentView, q_nope: torch.Tensor, q_pe: torch.Tensor, indptr, indices, seq_lens,
                  q_indptr, *, sm_scale: float, num_splits: int | None = None, out: torch.Tensor | None = None,
                  backend: str = "auto") -> torch.Tensor:
    """Absorbed-weight MLA attention over the latent rows, read in place.

    Args:
        view: the layer.
        q_nope: ``[Nq, Hq, R]``: each head's query already multiplied by its ``W_UK``
            (the "absorbed" query, in the latent space).
        q_pe: ``[Nq, Hq, P]``: the RoPE part of each head's query, same dtype.
        indptr: the CSR page table's row offsets (as :func:`gather_latent`).
        indices: its block ids.
        seq_lens: each sequence's token count.
        q_indptr: ``[B + 1]``: sequence ``b``'s queries are ``q[q_indptr[b]:q_indptr[b+1]]``,
            its last tokens (causal among themselves).
        sm_scale: the logit scale (MLA: ``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``).
        num_splits: CUDA: key splits per query (flash-decoding; default from the sizes).
        out: optional contiguous ``[Nq, Hq, R]`` of ``q_nope.dtype``.

    Returns:
        ``[Nq, Hq, R]`` in ``q_nope.dtype``: per head, the attention-weighted ``c_kv``
        (multiply by ``W_UV`` for the head's value output).
    """
    name = _backend(backend, view)
    if name == "cuda":
        return _kernels().mla_attention(view, q_nope, q_pe, indptr, indices, seq_lens, q_indptr, sm_scale=sm_scale,
                                        num_splits=num_splits, out=out)
    a = ref.check_attention(view, q_nope, q_pe, indptr, indices, seq_lens, q_indptr, sm_scale, num_splits, out,
                            read_values=True)
    return ref.attend(a, q_nope, q_pe, torch.float64 if name == "reference" else torch.float32)
