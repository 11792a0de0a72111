"""``pagedkv plan``: size a KV cache for a model and a memory budget (see :mod:`pagedkv.config.planner`)."""
from __future__ import annotations

import argparse
import json
import sys

from pagedkv.config.options import CacheConfig
from pagedkv.config.planner import plan_cache_config, plan_config
from pagedkv.errors import InvalidArgumentError, PagedKVError, expected

HELP = "size a KV cache: blocks, tokens and full-length sequences that fit a memory budget"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the ``plan`` subcommand's arguments."""
    shape = parser.add_argument_group("model shape (a config.json, or the three numbers)")
    shape.add_argument("--model-config", metavar="PATH", help="HF config.json (or its directory)")
    shape.add_argument("--num-layers", type=int, metavar="N")
    shape.add_argument("--num-kv-heads", type=int, metavar="N")
    shape.add_argument("--head-dim", type=int, metavar="N")
    shape.add_argument("--kv-lora-rank", type=int, metavar="N",
                       help="MLA: the latent's compressed elements (with --qk-rope-head-dim; one KV head of "
                            "kv_lora_rank + qk_rope_head_dim)")
    shape.add_argument("--qk-rope-head-dim", type=int, metavar="N", help="MLA: the latent's positional elements")
    parser.add_argument("--budget", required=True, help="memory budget, e.g. 4GiB, 512MB, 1073741824")
    parser.add_argument("--max-seq-len", type=int, metavar="TOKENS", help="full sequence length to plan for")
    parser.add_argument("--block-size", type=int, default=16, metavar="TOKENS")
    parser.add_argument("--dtype", default="fp16", help="model dtype: fp32, fp16 (default), bf16")
    parser.add_argument("--kv-dtype", default=None,
                        help="cache dtype: same as --dtype (default), fp8, fp8_e5m2, int8, int4, int3, int2")
    parser.add_argument("--kv-key-quant", default=None, choices=("token", "block"),
                        help="int4/int2 keys: per token (int4 default) or per channel over each full block "
                             "(int2 default)")
    parser.add_argument("--kv-group-size", type=int, default=None, metavar="N",
                        help="int4/int3/int2 elements per scale group along head_dim")
    parser.add_argument("--kv-window", type=int, default=None, metavar="TOKENS",
                        help="newest tokens per sequence kept in model precision (int4/int3/int2 default 128)")
    parser.add_argument("--kv-window-sequences", type=int, default=None, metavar="N",
                        help="sequences whose window and sink rows the window arena holds at once")
    parser.add_argument("--kv-sink-tokens", type=int, default=None, metavar="TOKENS",
                        help="leading tokens per sequence kept in model precision (int4/int3/int2 default 4)")
    parser.add_argument("--layout", default="NHD", choices=("NHD", "HND"))
    parser.add_argument("--attention-sinks", type=int, default=0, metavar="TOKENS",
                        help="leading tokens every sliding-window layer keeps (StreamingLLM sinks)")
    states = parser.add_argument_group("recurrent-state layers (Mamba2, Gated DeltaNet, ...: a hybrid --model-config)")
    states.add_argument("--state-budget", default=None,
                        help="the state pool's bytes, beside --budget (default: --budget is split so each "
                             "--max-seq-len sequence gets its blocks, its state and its periodic snapshots)")
    states.add_argument("--state-slots", type=int, default=None, metavar="N",
                        help="the state pool's slots (live states and snapshots), instead of --state-budget")
    states.add_argument("--state-checkpoint-every", type=int, default=None, metavar="BLOCKS",
                        help="blocks between periodic state snapshots (default 16)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Execute ``pagedkv plan``; returns the exit status."""
    explicit = (args.num_layers, args.num_kv_heads, args.head_dim)
    opts = dict(memory_budget=args.budget, block_size=args.block_size, dtype=args.dtype,
                kv_dtype=args.kv_dtype, layout=args.layout, attention_sinks=args.attention_sinks,
                kv_key_quant=args.kv_key_quant, kv_sink_tokens=args.kv_sink_tokens,
                kv_group_size=args.kv_group_size, kv_window=args.kv_window)
    if args.kv_window_sequences is not None:    # the config's default otherwise
        opts["kv_window_sequences"] = args.kv_window_sequences
    try:
        if args.model_config is not None:
            if any(v is not None for v in explicit):
                raise InvalidArgumentError(
                    expected("--model-config", "no --num-layers/--num-kv-heads/--head-dim beside it", "both")
                )
            del opts["memory_budget"]
            cfg = plan_cache_config(args.model_config, args.budget, args.max_seq_len, state_budget=args.state_budget,
                                    state_slots=args.state_slots,
                                    state_checkpoint_every=args.state_checkpoint_every, **opts)
        elif all(v is not None for v in explicit):
            mla = dict(kv_lora_rank=args.kv_lora_rank, qk_rope_head_dim=args.qk_rope_head_dim)
            cfg = CacheConfig(num_layers=explicit[0], num_kv_heads=explicit[1], head_dim=explicit[2],
                              **{k: v for k, v in mla.items() if v is not None}, **opts)
        else:
            raise InvalidArgumentError(
                expected("--model-config", "a path, or all of --num-layers/--num-kv-heads/--head-dim", "neither")
            )
        result = plan_config(cfg, args.max_seq_len)
    except PagedKVError as e:
        print(f"pagedkv plan: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict()) if args.json else result.format())
    return 0
