"""Two engine processes, two "hosts", share a chat's prefix through one Redis Cluster:
the second process's admission hits the remote tier and its greedy tokens equal the
first's and DynamicCache's."""
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import DynamicCache

from model_fixtures import SYSTEM_PROMPT, chat_ids, smollm2  # noqa: F401
from redis_fixtures import redis_cluster  # noqa: F401

HERE = os.path.dirname(os.path.abspath(__file__))


def host(url, ids, out):
    r = subprocess.run([sys.executable, os.path.join(HERE, "remote_host.py"), url, str(out)], input=json.dumps(ids),
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.model
@pytest.mark.slow
def test_a_second_host_hits_the_first_hosts_prefix_with_identical_greedy_tokens(redis_cluster, smollm2, tmp_path):
    model, tok = smollm2
    ids = chat_ids(tok, "Name three prime numbers.", system=SYSTEM_PROMPT * 3)
    x = torch.tensor([ids])
    want = model.generate(x, past_key_values=DynamicCache(config=model.config), max_new_tokens=12, do_sample=False,
                          attention_mask=torch.ones_like(x)).tolist()
    first = host(redis_cluster.url, ids, tmp_path / "a.json")
    second = host(redis_cluster.url, ids, tmp_path / "b.json")
    full = (len(ids) - 1) // 16 * 16
    assert first["hit"] == [0] and first["tokens"] == want
    assert second["hit"] == [full] and second["remote_hit_tokens"] == full
    assert second["tokens"] == want
    assert sum(n.client().dbsize() for n in redis_cluster.nodes) >= full // 16
