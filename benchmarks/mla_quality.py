"""What each MLA latent format costs: attention output against the lossless cache.

Protocol: a tiny random-weight DeepSeek-V3 (``pagedkv.testing.mla_models``: 3 layers,
kv_lora_rank 128, qk_rope_head_dim 16, 4 query heads) run in one model dtype on real
text (the byte tokens of ``pydoc_data.topics.topics`` in sorted key order), teacher
forced: a prefill of ``--prefill`` tokens, then ``--decode`` decode steps, each through
a :class:`~pagedkv.integrations.transformers.PagedCache` over an MLA ``PagedKVCache`` of
the format under test. Every layer's attention output (after ``o_proj``) at every decode
step is compared with the same run through the lossless cache (the model dtype's own
rows): per (step, layer, token) row, ``|o - o_ref| / |o_ref|`` (2-norms). A decode step's
own token is at model precision in every format (transformers attends to the pass's
latent as computed), so the error is that of the history read back from the arena.

Prints one JSON line per (model dtype, format): max and mean relative error, and the
bytes per token per layer (kv_lora_rank 512 / rope 64, the formula, and this model's).
``--smoke``: a few tokens, only to prove the script runs.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.format.latent import LatentFormat
from pagedkv.integrations.transformers import PagedCache
from pagedkv.testing.mla_models import tiny_deepseek_v3

FORMATS = {"model": None, "fp8_e4m3": "fp8_e4m3", "int8": "int8", "int4": "int4"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def text_tokens(n: int, tok) -> torch.Tensor:
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))
    return torch.tensor([tok.encode(text, add_special_tokens=False)[:n]])


def attention_outputs(model, ids, prefill: int, kv_dtype, dtype) -> list[torch.Tensor]:
    """Per decode step, every layer's attention output ``[layers, hidden]`` (float64)."""
    cfg = CacheConfig.from_hf_config(model.config, num_blocks=-(-ids.shape[1] // 16) + 2, block_size=16,
                                     dtype=dtype, kv_dtype=kv_dtype)
    kv = PagedKVCache(cfg)
    seen: list[torch.Tensor] = []
    hooks = [layer.self_attn.register_forward_hook(lambda mod, args, out: seen.append(out[0][0, -1].double()))
             for layer in model.model.layers]
    steps = []
    try:
        with PagedCache(kv) as cache, torch.no_grad():
            cache.admit(ids[:, :prefill])
            model(ids[:, :prefill], past_key_values=cache, use_cache=True)
            for t in range(prefill, ids.shape[1]):
                seen.clear()
                model(ids[:, t:t + 1], past_key_values=cache, use_cache=True)
                steps.append(torch.stack(seen))
    finally:
        for h in hooks:
            h.remove()
    return steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--decode", type=int, default=128)
    args = ap.parse_args(argv)
    prefill, decode = (24, 4) if args.smoke else (args.prefill, args.decode)
    for dname, dtype in DTYPES.items():
        model, tok = tiny_deepseek_v3(dtype=dtype)
        ids = text_tokens(prefill + decode, tok)
        ref = attention_outputs(model, ids, prefill, None, dtype)
        for fname, kv_dtype in FORMATS.items():
            got = attention_outputs(model, ids, prefill, kv_dtype, dtype)
            rel = torch.cat([((g - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-30)) for g, r in zip(got, ref)])
            big = LatentFormat(kv_dtype or dname, dname, 512, 64).row_bytes
            tiny = LatentFormat(kv_dtype or dname, dname, model.config.kv_lora_rank,
                                model.config.qk_rope_head_dim).row_bytes
            print(json.dumps({"bench": "mla_quality", "model": "tiny deepseek_v3", "dtype": dname,
                              "format": fname if kv_dtype else dname, "prefill": prefill, "decode_steps": decode,
                              "rows": int(rel.numel()), "max_rel_error": float(rel.max()),
                              "mean_rel_error": float(rel.mean()), "bytes_per_token_layer_512_64": big,
                              "bytes_per_token_layer_this_model": tiny}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
