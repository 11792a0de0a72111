"""What combines with what: the one support table.

Every capability that does not work in every cache configuration is listed here, and
every place that refuses a combination (the config's validation, a manager call, a
transfer) asks :func:`require`, so the refusal has one error type and one wording,
and the README's table is generated from the same rows (a test keeps them equal).

Two kinds of limits are listed. The columns: the model's attention layout, every layer
full attention, sliding-window layer groups (``layer_windows`` with at least one
sliding layer, see :mod:`pagedkv.groups.layers`), or MLA latent KV (``kv_lora_rank``:
one latent row per token, see :class:`pagedkv.groups.spec.MLASpec`). And a row's
``needs``: what else the configuration must hold for the capability (an option that
only means something with another, such as ``kv_window`` with a quantized
``kv_dtype``); :func:`require` refuses a configuration that uses the capability without
it, naming the option. A capability absent from the table works in every configuration.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedkv.errors import InvalidArgumentError, expected

__all__ = ["Capability", "CAPABILITIES", "UnsupportedCombinationError", "require", "supported",
           "markdown_table", "configuration_of", "LOW_BIT_DEFAULTS"]

FULL = "full attention"
GROUPS = "sliding-window layer groups"
MLA = "MLA latent KV"
CONFIGURATIONS = (FULL, GROUPS, MLA)


class UnsupportedCombinationError(InvalidArgumentError):
    """A capability was asked of a cache configuration it does not support (see
    :data:`pagedkv.config.support.CAPABILITIES`)."""


#: the options that only mean something with a quantized kv_dtype, with the value each
#: must keep without one, in the order a refusal names them
LOW_BIT_DEFAULTS: tuple[tuple[str, Callable[[Any], bool]], ...] = (
    ("kv_group_size", lambda v: v is None),
    ("kv_rotation", lambda v: not v),
    ("kv_key_quant", lambda v: v in (None, "token")),
    ("kv_key_bits", lambda v: v in (None, 4)),
    ("kv_window", lambda v: not v),
    ("kv_sink_tokens", lambda v: not v),
    ("kv_full_precision_layers", lambda v: not v),
    ("kv_full_precision_dtype", lambda v: v is None),
)


def _low_bit_without_kv_dtype(c) -> tuple[str, object] | None:
    if c.kv_dtype is not None:
        return None
    for name, default in LOW_BIT_DEFAULTS:
        if not default(getattr(c, name)):
            return name, repr(getattr(c, name))
    return None


@dataclass(frozen=True)
class Capability:
    name: str                 # the call or option, as a user writes it
    groups: bool              # works with sliding-window layer groups
    why: str = ""             # why not, where it does not
    full: bool = True         # works with full attention in every layer
    mla: bool = True          # works with MLA latent KV
    mla_why: str = ""         # why not, where it does not
    needs: str = ""           # what else the configuration must hold (the README's last column)
    #: what a refusal of ``needs`` says was expected of the option it names; ``{c.field}``
    #: places are filled from the configuration
    expected: str = ""
    #: ``config`` -> None, or the option that uses the capability without its ``needs``
    #: and the value to show (``got``)
    refused: Callable[[Any], tuple[str, object] | None] | None = None


#: the rows the configuration's validation asks for by name
PREFIX_TIERS = "prefix tiers (prefix_host_blocks, prefix_disk_dir, prefix_remote, warm restart)"
ATTENTION_SINKS = "attention_sinks (first positions every sliding-window layer keeps)"
LOW_BIT = ("low-bit options (kv_group_size, kv_rotation, kv_key_quant, kv_key_bits, kv_window, kv_sink_tokens, "
           "kv_full_precision_layers, kv_full_precision_dtype)")
GROUP_SIZE = "kv_group_size (scale groups)"
BLOCK_KEYS = "kv_key_quant='block' (int4/int2 keys requantized per channel over each full block)"
TP_PREFIX = "tensor parallelism with prefix caching (tp_size > 1)"
#: what latent (MLA) rows are not stored as (they have one format for every layer)
ROW_ONLY_FORMATS = "kv_rotation / kv_key_quant='block' / fp8_e5m2 / int3 / int2"


CAPABILITIES: tuple[Capability, ...] = (
    Capability("add_sequence / reserve / advance / commit / free (prefix caching)", True),
    Capability("write / gather / gather_pages (every kv_dtype, kv_window, kv_sink_tokens)", True, mla=False,
               mla_why="a latent row is K only: write(layer, slots, kv_c, k_pe) and gather_latent, in "
                       "bfloat16/float16/float32, fp8_e4m3, int8 or int4"),
    Capability("paged attention (attention)", True, mla=False,
               mla_why="the latent's absorbed-weight attention is mla_attention"),
    Capability("kv_window / kv_sink_tokens (model-precision rows beside quantized blocks)", True, mla=False,
               mla_why="the latent's positional slice is kept at model precision in the row itself"),
    Capability(ROW_ONLY_FORMATS, True, mla=False,
               mla_why="latent rows are stored in the model dtype, fp8_e4m3, int8 or int4"),
    Capability("mixing attention types with MLA layers", True, mla=False,
               mla_why="every layer of an MLA model stores a latent row"),
    Capability("fork / truncate / unreserve (beams, rollback, speculative decoding)", True),
    Capability("set_priority (priority eviction)", True),
    Capability("pin_prefix / unpin_prefix / match_prefix / can_admit", True),
    Capability("stats / sequence_info / num_blocks (per group and in total)", True),
    Capability("hold_window / slide_window", True),
    Capability("host swap (host_num_blocks, swap_out / swap_in)", True),
    Capability(PREFIX_TIERS, True,
               needs="enable_prefix_caching=True", expected="True with prefix tiers",
               refused=lambda c: ("enable_prefix_caching", False)
               if c.has_prefix_tiers and not c.enable_prefix_caching else None),
    Capability("kv_full_precision_layers (the layers sharing such a layer's arena slot are exact too)", True,
               mla=False, mla_why="one latent format for every layer"),
    Capability("relocate / compact (each block moves within its group)", True),
    Capability("send_sequence / recv_sequence (every block is sent; the receiver reuses no prefix)", True),
    Capability("send_prefix / recv_prefix (every group's whole cached chain is sent; what every group "
               "still holds is offered)", True),
    Capability(ATTENTION_SINKS, True, full=False, why="a full-attention layer attends to every position",
               mla=False, mla_why="an MLA layer attends to every position",
               expected="0 without sliding-window layers",
               refused=lambda c: ("attention_sinks", c.attention_sinks)
               if c.layer_windows is None and c.attention_sinks != 0 else None),
    Capability(LOW_BIT, True,
               needs="a quantized kv_dtype", expected="its default for an unquantized cache (kv_dtype=None)",
               refused=_low_bit_without_kv_dtype),
    Capability(GROUP_SIZE, True, needs="kv_dtype 'int4', 'int3' or 'int2'",
               expected="None unless kv_dtype is 'int4', 'int3' or 'int2'",
               refused=lambda c: ("kv_group_size", repr(c.kv_group_size))
               if c.kv_dtype not in (None, "int4", "int3", "int2") and c.kv_group_size is not None else None),
    Capability(BLOCK_KEYS, True,
               needs="kv_dtype 'int4' or 'int2'",
               expected="'token' for kv_dtype={c.kv_dtype!r} ('block' is int4 and int2 only)",
               refused=lambda c: ("kv_key_quant", repr("block"))
               if c.kv_dtype not in (None, "int4", "int2") and c.kv_key_quant == "block" else None),
    Capability(TP_PREFIX, True, needs="hash_seed (one for all ranks)",
               expected="an int shared by all ranks when tp_size > 1 (tp_size={c.tp_size})",
               refused=lambda c: ("hash_seed", None)
               if c.tp_size > 1 and c.enable_prefix_caching and c.hash_seed is None else None),
)
_BY_NAME = {c.name: c for c in CAPABILITIES}


def configuration_of(config) -> str:
    """The configuration (a column of the table) a ``CacheConfig`` is in."""
    if getattr(config, "kv_lora_rank", None) is not None:
        return MLA
    return GROUPS if getattr(config, "layer_groups", None) is not None else FULL


def _capability(name: str) -> Capability:
    cap = _BY_NAME.get(name)
    if cap is None:     # a caller named a row that is not in the table: a bug here
        raise KeyError(f"pagedkv.config.support has no capability {name!r}")
    return cap


def supported(name: str, configuration: str) -> bool:
    cap = _capability(name)
    if configuration == MLA:
        return cap.mla
    return cap.full if configuration == FULL else cap.groups


def require(name: str, config, *, configuration: str | None = None) -> None:
    """Raise :class:`UnsupportedCombinationError` when capability ``name`` does not
    work in ``config``'s configuration (or ``configuration`` when given), or when
    ``config`` uses it without what its row ``needs`` (the message then names the option)."""
    conf = configuration if configuration is not None else configuration_of(config)
    cap = _capability(name)
    # a call's row is asked when the call is made; an option's row (one with ``refused``)
    # is asked by the validation whether or not the option is used, and ``refused`` says
    # whether it is used where it does not work
    if cap.refused is None and not supported(name, conf):
        why = cap.mla_why if conf == MLA else cap.why
        raise UnsupportedCombinationError(
            f"{cap.name}: expected a cache with {FULL} in every layer ({why}), got {conf}; "
            "see pagedkv.config.support.CAPABILITIES")
    found = cap.refused(config) if cap.refused is not None else None
    if found is not None:
        option, got = found
        raise UnsupportedCombinationError(expected(option, cap.expected.format(c=config), got))


def markdown_table() -> str:
    """The table as the README shows it."""
    lines = [f"| capability | {FULL} | {GROUPS} | {MLA} | needs |", "|---|---|---|---|---|"]
    for c in CAPABILITIES:
        cells = ["yes" if ok else "no: " + c.why for ok in (c.full, c.groups)]
        cells.append("yes" if c.mla else "no: " + c.mla_why)
        lines.append(f"| {c.name} | {' | '.join(cells)} | {c.needs} |")
    return "\n".join(lines)


def update_readme(path: str) -> bool:
    """Rewrite the table between the README's markers; True when it changed."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start = text.index(_BEGIN) + len(_BEGIN) + 1
    end = text.index(_END)
    new = text[:start] + markdown_table() + "\n" + text[end:]
    if new != text:
        with open(path, "w", encoding="utf-8") as f:
            f.write(new)
    return new != text


_BEGIN = "<!-- support table: generated by pagedkv.config.support.markdown_table() -->"
_END = "<!-- end of support table -->"

if __name__ == "__main__":    # python -m pagedkv.config.support README.md
    import sys

    print("updated" if update_readme(sys.argv[1]) else "unchanged")
