"""PagedKVConnector with vLLM's hybrid allocator on: a tiny random Gemma-3 whose layers
alternate sliding window (256 tokens, two blocks) and full attention, so vLLM keeps two
KV cache groups with block tables of their own and hands the window's skipped blocks out
as null blocks. Two engine starts (run_tiny.py): the reference without the connector,
then one engine with it for every case."""
from __future__ import annotations

import pytest

import vllm_env as ve
from conftest import Proc
from tiny_models import save_tiny

PREFIX = 4 * ve.BLOCK
WINDOW = 2 * ve.BLOCK


@pytest.fixture(scope="module")
def hma_runs(workdir):
    model = save_tiny(workdir / "tiny-gemma3", "gemma3", sliding_window=WINDOW,
                      layer_types=["sliding_attention", "full_attention"])
    ref = Proc({"mode": "reference", "model": str(model)}, workdir / "hma-ref.json", script="run_tiny.py").result()
    got = Proc({"mode": "connector", "model": str(model), "disk_dir": str(workdir / "hma-tier")},
               workdir / "hma-conn.json", script="run_tiny.py").result()
    return ref, got


def tokens_of(res):
    return [r[0] for r in res]


def test_the_hybrid_allocator_stays_on_with_two_groups(hma_runs):
    _, got = hma_runs
    assert got["hma_off"] is False
    assert got["groups"] == [["SlidingWindowSpec", 1], ["FullAttentionSpec", 1]]
    assert got["store"]["serving"] and got["store"]["num_layers"] == 2
    assert [w["refused"] for w in got["worker_stats"]] == [None]
    # hits of 4 blocks with a 2-block window: the window's group held null blocks the loads skipped
    assert got["worker_stats"][0]["num_absent_skipped"] > 0


def test_greedy_equals_the_engine_without_the_connector_and_the_prefix_hits(hma_runs):
    ref, got = hma_runs
    want = tokens_of(ref["A"])
    assert len({tuple(t) for t in want}) == 3
    for run in ("cold", "warm", "unshuffled", "from_disk"):
        assert tokens_of(got[run]) == want, run
    assert [r[1] for r in got["warm"]] == [PREFIX] * 3       # after vLLM's own cache was reset
    assert [r[1] for r in got["from_disk"]] == [PREFIX] * 3
    assert got["host_hit_tokens"] >= PREFIX and got["disk_hit_tokens"] >= PREFIX
    for a, b in zip(got["warm"], ref["A"]):
        assert max(abs(x - y) for x, y in zip(a[2], b[2])) < 0.05


def test_negative_control_shuffled_loads_change_the_output(hma_runs):
    _, got = hma_runs
    assert all(r[1] == PREFIX for r in got["shuffled"])
    assert tokens_of(got["shuffled"]) != tokens_of(got["warm"])
