"""Event hashes a router can rely on: caches with the same ``hash_seed`` in two
processes publish the same signed 64-bit hashes and parent links for a prefix, in
every medium, whatever else each one cached first; ``block_hashes`` computes them from
tokens; another seed gives other hashes."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("msgspec", reason="the events extra: pip install 'pagedkv[events]'")

from pagedkv.errors import InvalidArgumentError  # noqa: E402
from pagedkv.kv_events import block_hashes  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
BS = 4
SHARED = list(range(1000, 1013))                       # three full blocks and a token
OTHER = list(range(5000, 5009))


def replicas(*runs):
    """Each process's runs (``[hash_seed, cache_salt, prompts]``) -> their decoded events;
    the processes run at once."""
    procs = [subprocess.Popen([sys.executable, os.path.join(HERE, "events_replica.py")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in runs]
    out = []
    for p, r in zip(procs, runs):
        stdout, stderr = p.communicate(json.dumps(r), timeout=300)
        assert p.returncode == 0, stderr[-4000:]
        out.append(json.loads(stdout))
    return out


def chains(events):
    """medium -> {block tokens: (hash, parent hash)} from the decoded BlockStored events."""
    out: dict = {}
    for e in events:
        if e["type"] != "BlockStored":
            continue
        parent, bs = e.get("parent_block_hash"), e["block_size"]
        for i, h in enumerate(e["block_hashes"]):
            assert isinstance(h, int) and -2**63 <= h < 2**63
            out.setdefault(e["medium"], {})[tuple(e["token_ids"][i * bs:(i + 1) * bs])] = (h, parent)
            parent = h
    return out


def shared_chain(chain):
    return [chain[tuple(SHARED[i * BS:(i + 1) * BS])] for i in range(len(SHARED) // BS)]


def test_two_processes_with_one_seed_publish_the_same_hashes_and_links():
    salts = (None, "tenant-3")
    a, b = replicas([[77, salt, [SHARED, OTHER]] for salt in salts] + [[78, None, [SHARED]]],
                    [[77, salt, [OTHER, OTHER[:5] + SHARED, SHARED]] for salt in salts])   # other ids, other order
    for i, salt in enumerate(salts):
        ca, cb = chains(a[i]), chains(b[i])
        want = block_hashes(SHARED, BS, 77, cache_salt=salt)
        links = list(zip(want, [None] + want[:-1]))
        for medium in ("GPU", "CPU"):                                       # the device and the host tier
            assert shared_chain(ca[medium]) == shared_chain(cb[medium]) == links, (salt, medium)
    assert not set(block_hashes(SHARED, BS, 77)) & set(block_hashes(SHARED, BS, 77, cache_salt="tenant-3"))
    other_seed = {h for h, _ in shared_chain(chains(a[2])["GPU"])}
    assert other_seed == set(block_hashes(SHARED, BS, 78)) and not other_seed & set(block_hashes(SHARED, BS, 77))


def test_block_hashes_refuses_what_a_cache_would_refuse():
    with pytest.raises(InvalidArgumentError, match="hash_seed"):
        block_hashes(SHARED, BS, None)
    with pytest.raises(InvalidArgumentError):
        block_hashes(SHARED, 0, 1)
    with pytest.raises(ValueError, match="integer token ids"):
        block_hashes([1.5, 2.0], BS, 1)
    assert block_hashes(np.asarray(SHARED, dtype=np.int64), BS, 5) == block_hashes(SHARED, BS, 5)
