"""PagedKVConnector with vLLM's default multiprocessing: the connector's scheduler side in
the engine core process, its worker side in the worker process, the host tier's bytes in
a shared arena between them (SmolLM2, CPU, bf16, block 128).

Two peer engines (subprocesses, run_engine.py) start on the directory this process's
engine wrote, so one pair of engine starts covers: a warm restart (hits from disk in a
new process), two engines sharing a directory, hits after vLLM's own cache is reset, a
corrupted disk block (a miss), and the negative control."""
from __future__ import annotations

import pytest

import vllm_env as ve
from conftest import Proc, corrupt_block, root_slot

PREFIX = 4 * ve.BLOCK


def tokens_of(res):
    return [r[0] for r in res]


def cached_of(res):
    return [r[1] for r in res]


@pytest.fixture(scope="module")
def peers(engine, workdir):
    """Both peers' results: peer1 owns B (and gets D corrupted, and the negative control),
    peer2 owns C; each then reads the other's set."""
    llm, _, store, disk = engine
    for name in ("A", "D"):                         # on disk before the peers start (written through)
        assert llm.reset_prefix_cache()
        ve.generate(llm, ve.prompt_set(name))
    corrupt_block(disk, root_slot(disk, ve.prompt_set("D")[0]))
    barrier = workdir / "barrier-mp"
    barrier.mkdir()
    common = {"mode": "peer", "disk_dir": str(disk), "barrier": str(barrier), "warm_set": "A"}
    p1 = Proc(dict(common, own_set="B", other_set="C", corrupt_set="D", negative=True), workdir / "peer1.json")
    p2 = Proc(dict(common, own_set="C", other_set="B"), workdir / "peer2.json")
    return {"B": p1.result(), "C": p2.result()}


def test_mp_warm_restart_serves_disk_prefixes(peers, reference):
    for r in peers.values():
        assert all(c >= PREFIX for c in cached_of(r["warm"])), r["warm"]     # a new engine: only disk can hit
        assert tokens_of(r["warm"]) == tokens_of(reference["A"])


def test_mp_two_engines_share_a_directory(peers, reference):
    for own, other in (("B", "C"), ("C", "B")):
        r = peers[own]
        assert r["barrier_ok"]
        assert tokens_of(r["own"]) == tokens_of(reference[own])
        assert all(c >= PREFIX for c in cached_of(r["other"])), r["other"]   # the other engine's writes
        assert tokens_of(r["other"]) == tokens_of(reference[other])


def test_mp_hits_after_reset_match_reference(peers, reference):
    for own, r in peers.items():
        assert all(c >= PREFIX for c in cached_of(r["own_again"])), r["own_again"]
        assert tokens_of(r["own_again"]) == tokens_of(reference[own])


def test_mp_corrupted_disk_block_is_a_miss(peers, reference):
    r = peers["B"]["corrupt"]
    assert cached_of(r)[0] == 0, r             # (the others may hit what the first just computed)
    assert tokens_of(r) == tokens_of(reference["D"])


def test_mp_negative_control_shuffled_loads_change_outputs(peers, reference):
    r = peers["B"]
    assert all(c >= PREFIX for c in cached_of(r["shuffled"])), r["shuffled"]
    assert tokens_of(r["shuffled"]) != tokens_of(reference["B"])       # the loaded KV is really read
    assert all(c >= PREFIX for c in cached_of(r["unshuffled"]))
    assert tokens_of(r["unshuffled"]) == tokens_of(reference["B"])
