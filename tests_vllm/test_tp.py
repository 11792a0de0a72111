"""PagedKVConnector under tensor parallelism: vLLM for CPU with ``tensor_parallel_size=2``
(the "mp" executor, one worker process per rank, each bound to one core) on a tiny random
Llama whose 2 KV heads split one per rank. Two engine starts in all (run_tiny.py): the
reference without the connector, then one engine with it that runs every case."""
from __future__ import annotations

import os

import pytest

import vllm_env as ve
from conftest import Proc
from tiny_models import save_tiny

PREFIX = 4 * ve.BLOCK


@pytest.fixture(scope="module")
def tp_runs(workdir):
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("tensor_parallel_size=2 binds each rank to a core of its own: needs 2 CPUs")
    model = save_tiny(workdir / "tiny-llama-tp")
    ref = Proc({"mode": "reference", "model": str(model), "tp": 2}, workdir / "tp-ref.json", script="run_tiny.py").result()
    got = Proc({"mode": "connector", "model": str(model), "tp": 2, "disk_dir": str(workdir / "tp-tier")},
               workdir / "tp-conn.json", script="run_tiny.py").result()
    return ref, got


def tokens_of(res):
    return [r[0] for r in res]


def test_tp2_greedy_equals_the_engine_without_the_connector_and_hits(tp_runs):
    ref, got = tp_runs
    want = tokens_of(ref["A"])
    assert len({tuple(t) for t in want}) == 3           # the prompts' suffixes lead to different tokens
    assert tokens_of(got["cold"]) == want
    # after vLLM's own cache was reset, the whole 4-block prefix comes from the connector
    assert [r[1] for r in got["warm"]] == [PREFIX] * 3
    assert tokens_of(got["warm"]) == want
    assert got["host_hit_tokens"] >= PREFIX
    for a, b in zip(got["warm"], ref["A"]):
        assert max(abs(x - y) for x, y in zip(a[2], b[2])) < 0.05      # logprobs too, not only argmax


def test_tp2_every_rank_holds_its_shard(tp_runs):
    _, got = tp_runs
    st = got["store"]
    assert st["serving"] and st["tp_size"] == 2 and st["format_tp"] == 2
    assert st["kv_heads"] == 2 and st["tp_shards"] == [[0, 0, 1], [1, 1, 1]]      # rank, first head, heads
    assert len(got["worker_stats"]) == 2 and all(w["refused"] is None for w in got["worker_stats"])
    # the negative control: loads shuffled across layers on both ranks change the output,
    # so what each rank loads is really read
    assert all(r[1] == PREFIX for r in got["shuffled"])
    assert tokens_of(got["shuffled"]) != tokens_of(got["warm"])


def test_tp2_one_corrupt_shard_is_a_miss_for_the_whole_block(tp_runs):
    ref, got = tp_runs
    assert got["num_disk_corrupt"] == 1                  # rank 1's heads of the root block, on disk
    assert got["corrupt"][0][1] == 0                     # no rank served it: recomputed
    assert tokens_of(got["corrupt"]) == tokens_of(ref["A"])
