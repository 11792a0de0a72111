"""What combines with what: the one support table.

Every capability that does not work in every cache configuration is listed here, and
every place that refuses a combination (the config's validation, a manager call, a
transfer) asks :func:`require`, so the refusal has one error type and one wording,
and the README's table is generated from the same rows (a test keeps them equal).

The configuration axis today is the model's attention layout: every layer full
attention, or sliding-window layer groups (``layer_windows`` with at least one
sliding layer, see :mod:`pagedkv.layer_groups`). A capability absent from the table
works in every configuration.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from pagedkv.errors import InvalidArgumentError

__all__ = ["Capability", "CAPABILITIES", "UnsupportedCombinationError", "require", "supported",
           "markdown_table", "configuration_of"]

FULL = "full attention"
GROUPS = "sliding-window layer groups"
CONFIGURATIONS = (FULL, GROUPS)


class UnsupportedCombinationError(InvalidArgumentError):
    """A capability was asked of a cache configuration it does not support (see
    :data:`pagedkv.support.CAPABILITIES`)."""


@dataclass(frozen=True)
class Capability:
    name: str                 # the call or option, as a user writes it
    groups: bool              # works with sliding-window layer groups
    why: str = ""             # why not, where it does not


CAPABILITIES: Tuple[Capability, ...] = (
    Capability("add_sequence / reserve / advance / commit / free (prefix caching)", True),
    Capability("write / gather / gather_pages (every kv_dtype, kv_window, kv_sink_tokens)", True),
    Capability("fork / truncate / unreserve (beams, rollback, speculative decoding)", True),
    Capability("set_priority (priority eviction)", True),
    Capability("pin_prefix / unpin_prefix / match_prefix / can_admit", True),
    Capability("stats / sequence_info / num_blocks (per group and in total)", True),
    Capability("hold_window / slide_window", True),
    Capability("host swap (host_num_blocks, swap_out / swap_in)", False,
               "the host tier's swap tables hold one block table per sequence"),
    Capability("prefix tiers (prefix_host_blocks, prefix_disk_dir)", False,
               "a tier record holds one block of every layer"),
    Capability("kv_full_precision_layers", False,
               "a block's layer slots hold different layers in each group, so one precision serves all"),
    Capability("relocate / compact", False, "block moves are planned over one block table"),
    Capability("send_sequence / recv_sequence / send_prefix / recv_prefix", False,
               "a transfer moves one block table per sequence"),
)
_BY_NAME = {c.name: c for c in CAPABILITIES}


def configuration_of(config) -> str:
    """The configuration (a column of the table) a ``CacheConfig`` is in."""
    return GROUPS if getattr(config, "layer_groups", None) is not None else FULL


def _capability(name: str) -> Capability:
    cap = _BY_NAME.get(name)
    if cap is None:     # a caller named a row that is not in the table: a bug here
        raise KeyError(f"pagedkv.support has no capability {name!r}")
    return cap


def supported(name: str, configuration: str) -> bool:
    cap = _capability(name)
    return configuration == FULL or cap.groups


def require(name: str, config, *, configuration: Optional[str] = None) -> None:
    """Raise :class:`UnsupportedCombinationError` when capability ``name`` does not
    work in ``config``'s configuration (or ``configuration`` when given)."""
    conf = configuration if configuration is not None else configuration_of(config)
    if not supported(name, conf):
        cap = _capability(name)
        raise UnsupportedCombinationError(
            f"{cap.name}: expected a cache with {FULL} in every layer ({cap.why}), got {conf}; "
            "see pagedkv.support.CAPABILITIES")


def markdown_table() -> str:
    """The table as the README shows it."""
    lines = [f"| capability | {FULL} | {GROUPS} |", "|---|---|---|"]
    for c in CAPABILITIES:
        lines.append(f"| {c.name} | yes | {'yes' if c.groups else 'no: ' + c.why} |")
    return "\n".join(lines)
