"""What combines with what: the one support table.

Every capability that does not work in every cache configuration is listed here, and
every place that refuses a combination (the config's validation, a manager call, a
transfer) asks :func:`require`, so the refusal has one error type and one wording,
and the README's table is generated from the same rows (a test keeps them equal).

The configuration axis today is the model's attention layout: every layer full
attention, sliding-window layer groups (``layer_windows`` with at least one sliding
layer, see :mod:`pagedkv.groups.layers`), or MLA latent KV (``kv_lora_rank``: one
latent row per token, see :class:`pagedkv.groups.spec.MLASpec`). A capability absent
from the table works in every configuration.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import InvalidArgumentError

__all__ = ["Capability", "CAPABILITIES", "UnsupportedCombinationError", "require", "supported",
           "markdown_table", "configuration_of"]

FULL = "full attention"
GROUPS = "sliding-window layer groups"
MLA = "MLA latent KV"
CONFIGURATIONS = (FULL, GROUPS, MLA)


class UnsupportedCombinationError(InvalidArgumentError):
    """A capability was asked of a cache configuration it does not support (see
    :data:`pagedkv.config.support.CAPABILITIES`)."""


@dataclass(frozen=True)
class Capability:
    name: str                 # the call or option, as a user writes it
    groups: bool              # works with sliding-window layer groups
    why: str = ""             # why not, where it does not
    mla: bool = True          # works with MLA latent KV
    mla_why: str = ""         # why not, where it does not


CAPABILITIES: tuple[Capability, ...] = (
    Capability("add_sequence / reserve / advance / commit / free (prefix caching)", True),
    Capability("write / gather / gather_pages (every kv_dtype, kv_window, kv_sink_tokens)", True, mla=False,
               mla_why="a latent row is K only: write(layer, slots, kv_c, k_pe) and gather_latent, in "
                       "bfloat16/float16/float32, fp8_e4m3, int8 or int4"),
    Capability("paged attention (attention)", True, mla=False,
               mla_why="the latent's absorbed-weight attention is mla_attention"),
    Capability("kv_window / kv_sink_tokens (model-precision rows beside quantized blocks)", True, mla=False,
               mla_why="the latent's positional slice is kept at model precision in the row itself"),
    Capability("kv_rotation / kv_key_quant='block' / fp8_e5m2 / int3", True, mla=False,
               mla_why="latent rows are stored in the model dtype, fp8_e4m3, int8 or int4"),
    Capability("mixing attention types with MLA layers", True, mla=False,
               mla_why="every layer of an MLA model stores a latent row"),
    Capability("fork / truncate / unreserve (beams, rollback, speculative decoding)", True),
    Capability("set_priority (priority eviction)", True),
    Capability("pin_prefix / unpin_prefix / match_prefix / can_admit", True),
    Capability("stats / sequence_info / num_blocks (per group and in total)", True),
    Capability("hold_window / slide_window", True),
    Capability("host swap (host_num_blocks, swap_out / swap_in)", True),
    Capability("prefix tiers (prefix_host_blocks, prefix_disk_dir, warm restart)", True),
    Capability("kv_full_precision_layers (the layers sharing such a layer's arena slot are exact too)", True,
               mla=False, mla_why="one latent format for every layer"),
    Capability("relocate / compact (each block moves within its group)", True),
    Capability("send_sequence / recv_sequence (every block is sent; the receiver reuses no prefix)", True),
    Capability("send_prefix / recv_prefix (every group's whole cached chain is sent; what every group "
               "still holds is offered)", True),
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
    return configuration == FULL or cap.groups


def require(name: str, config, *, configuration: str | None = None) -> None:
    """Raise :class:`UnsupportedCombinationError` when capability ``name`` does not
    work in ``config``'s configuration (or ``configuration`` when given)."""
    conf = configuration if configuration is not None else configuration_of(config)
    if not supported(name, conf):
        cap = _capability(name)
        why = cap.mla_why if conf == MLA else cap.why
        raise UnsupportedCombinationError(
            f"{cap.name}: expected a cache with {FULL} in every layer ({why}), got {conf}; "
            "see pagedkv.config.support.CAPABILITIES")


def markdown_table() -> str:
    """The table as the README shows it."""
    lines = [f"| capability | {FULL} | {GROUPS} | {MLA} |", "|---|---|---|---|"]
    for c in CAPABILITIES:
        lines.append(f"| {c.name} | yes | {'yes' if c.groups else 'no: ' + c.why} | "
                     f"{'yes' if c.mla else 'no: ' + c.mla_why} |")
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
