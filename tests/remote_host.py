"""One "host" of the two-host remote-tier test: a fresh process that serves a chat with
SmolLM2 through a PagedCache whose cache has a remote tier, and reports its prefix hit
and its greedy tokens as JSON. Usage: ``python remote_host.py URL OUT.json``."""
import json
import sys

import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.integrations.transformers import PagedCache
from pagedkv.testing.models import load_smollm2


def main(url: str, out: str) -> None:
    model, tok = load_smollm2()
    ids = torch.tensor([json.loads(sys.stdin.read())])
    cfg = CacheConfig.from_hf_config(model.config, num_blocks=256, block_size=16, dtype=torch.float32,
                                     prefix_remote={"url": url, "timeout_s": 5.0}, prefix_tier_write="through")
    with PagedKVCache(cfg) as kv:
        with PagedCache(kv) as cache:
            hit = cache.admit(ids)
            tokens = model.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False,
                                    attention_mask=torch.ones_like(ids)).tolist()
        st = kv.stats()
        assert kv._tiers.remote.flush(30)
    with open(out, "w") as f:
        json.dump({"hit": [int(h) for h in hit], "tokens": tokens, "remote_hit_tokens": st.remote_hit_tokens}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
