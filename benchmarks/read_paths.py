"""What each read path loses on held-out text: the gather path against the paged path (JSON).

    OMP_NUM_THREADS=1 python benchmarks/read_paths.py       # issue 33's protocol
    python benchmarks/read_paths.py --smoke                  # the tiny random Llama, for CI

Protocol (issue 33): SmolLM2-135M in float32; tokens 16,384-24,575 of the pydoc corpus
(``pagedkv.testing.quality.text_ids``; no test reads them); windows of 1,024 tokens with
stride 512, each prefilled in chunks of 256; every reader compared with float32
``DynamicCache`` fed the same chunks (:func:`pagedkv.testing.quality.compare_readers`).
For each KV format, the gather path (``PagedCache`` hands the model its gathered K/V)
and the paged path (``PagedCache(paged_attention=True)``, pagedkv's attention over the
pages, the pass's own K/V as computed) must read the same data, so their figures agree.

``--design-b`` adds, for the int4 format, the other design issue 33 offered: the pass's
rows read exact from the window arena (kept there until the pass ends: the arena is
sized for the window plus a chunk) instead of from the pass's own tensors. It reads the
same values (the figures match), at the cost of a window arena that holds every
in-flight sequence's pass, and it exists only where a window arena does (int4/int3,
block keys).

One JSON line per reader: perplexity, its increase over float32 (%), mean KL (nats per
scored token) and top-1 agreement against float32, and the paged path's KL over the
gather path's.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import torch

#: KV formats measured: name -> CacheConfig options (the issue's int4 row keeps layer 18 in fp32)
FORMATS = {
    "fp32": {},
    "int8": dict(kv_dtype="int8"),
    "int4_blockkeys_sink4_window128_fp18": dict(kv_dtype="int4", kv_key_quant="block", kv_sink_tokens=4,
                                                kv_window=128, kv_full_precision_layers=(18,)),
}


def _kv_factory(model, num_blocks: int, cls=None, **options):
    from pagedkv.config.options import CacheConfig
    from pagedkv.manager.cache import PagedKVCache

    def make():
        cfg = CacheConfig.from_hf_config(model.config, num_blocks=num_blocks, block_size=16, dtype=torch.float32,
                                         **dict(dict(kv_window_sequences=1), **options) if options else {})
        return (cls or PagedKVCache)(cfg)
    return make


def _design_b():
    """A PagedKVCache whose paged attention reads the pass's rows from the window arena
    (design (b)), for one sequence at a time: the window's recent rows are extended by
    the pass's rows instead of taking them from ``k_new``/``v_new``."""
    from pagedkv.manager.cache import PagedKVCache
    from pagedkv.ops import ExactRows, paged_attention

    class PassInWindow(PagedKVCache):
        def attention(self, layer, q, indptr, indices, seq_lens, q_indptr, *, k_new=None, v_new=None,
                      pending=None, **options):
            store = self.store
            main, i = store._where[layer]
            if not main:    # a model-precision layer: nothing to keep exact
                return super().attention(layer, q, indptr, indices, seq_lens, q_indptr, k_new=k_new, v_new=v_new,
                                         pending=pending, **options)
            w = store.window
            extra = int(np.asarray(pending.cpu()).max())     # one sequence: its pass's rows
            with w.lock:
                exact = ExactRows(w.data[i], w.slot_of, w.valid[i], w.window + extra, w.sink)
                return paged_attention(q, store.layer(layer), indptr, indices, seq_lens, q_indptr,
                                       layout=store.layout, kv_scale=store.layer_scales(layer)[0],
                                       kv_zero=store.layer_scales(layer)[1], key_scale=store.layer_key_params(layer)[0],
                                       key_zero=store.layer_key_params(layer)[1], rotation_signs=store.rotation_signs,
                                       exact_rows=exact, layer_format=store.layer_format(layer), **options)
    return PassInWindow


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny random model, short text (CI)")
    ap.add_argument("--start", type=int, default=16_384, help="first corpus token (held out from the tests)")
    ap.add_argument("--tokens", type=int, default=8_192)
    ap.add_argument("--only", nargs="*", choices=sorted(FORMATS), help="formats to run (default: all)")
    ap.add_argument("--design-b", action="store_true", help="also the int4 pass rows read from the window arena")
    a = ap.parse_args(argv)
    from pagedkv.testing.quality import Reader, compare_readers, text_ids

    if a.smoke:
        from pagedkv.testing.models import tiny_llama

        model, _ = tiny_llama(seed=0)
        ids = torch.randint(3, model.config.vocab_size, (1, 128), generator=torch.Generator().manual_seed(0))
        window, stride, chunk, name = 64, 32, 16, "tiny-random-llama"
        # the tiny model's 2 layers, and windows of 64: a precision window of 8
        formats = {k: {kk: (8 if kk == "kv_window" else vv) for kk, vv in v.items()
                       if kk != "kv_full_precision_layers"} for k, v in FORMATS.items()}
    else:
        from pagedkv.testing.models import load_smollm2

        model, tok = load_smollm2()
        ids = text_ids(tok, a.tokens, a.start)
        window, stride, chunk, name = 1024, 512, 256, "SmolLM2-135M"
        formats = FORMATS
    formats = {k: v for k, v in formats.items() if a.only is None or k in a.only}
    blocks = window // 16 + 8
    readers = [Reader("fp32_dynamic_cache", None)]
    for fmt, options in formats.items():
        for paged in (False, True):
            readers.append(Reader(f"{fmt}_{'paged' if paged else 'gather'}", _kv_factory(model, blocks, **options),
                                  paged))
    if a.design_b:
        for fmt, options in formats.items():
            if options.get("kv_window"):   # the pass's chunk fits the arena beside the window
                wide = dict(options, kv_window_sequences=-(-(options["kv_window"] + chunk) // options["kv_window"]))
                readers.append(Reader(f"{fmt}_paged_design_b", _kv_factory(model, blocks, _design_b(), **wide), True))
    model.eval()
    res = compare_readers(model, ids, readers, window=window, stride=stride, chunk=chunk,
                          on_window=lambda b, e: print(f"read_paths: window {b}:{e}", file=sys.stderr, flush=True))
    base = res["fp32_dynamic_cache"]["perplexity"]
    for r in readers:
        q = res[r.name]
        row = dict(bench="read_paths", model=name, reader=r.name, tokens=ids.shape[1], start=a.start,
                   window=window, stride=stride, chunk=chunk, perplexity=round(q["perplexity"], 4),
                   perplexity_increase_pct=round(100 * (q["perplexity"] - base) / base, 4),
                   kl_nats=float(f"{q['kl']:.4g}"), top1=round(q["top1"], 5), seconds=round(q["seconds"], 1))
        gather = res.get(r.name.replace("_paged_design_b", "_gather").replace("_paged", "_gather"))
        if r.paged and gather is not None and gather["kl"] > 0:
            row["kl_over_gather"] = round(q["kl"] / gather["kl"], 4)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
