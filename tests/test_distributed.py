"""KV transfer between processes and tensor-parallel sharding: two ranks on 127.0.0.1
over gloo, each a subprocess running one scenario of ``dist_workers.py``."""
import json
import os
import socket
import subprocess
import sys

import pytest

from model_fixtures import smollm2  # noqa: F401  (the model must be available; fetched once)

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "dist_workers.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario: str, tmp_path, timeout: float = 180.0):
    """Both ranks' reports and exit codes; ranks still running at ``timeout`` are killed."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, WORKERS, scenario, str(r), str(port), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs, codes = [], []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            logs.append(out)
            codes.append(p.returncode)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    reports = []
    for r in range(2):
        path = tmp_path / f"rank{r}.json"
        reports.append(json.loads(path.read_text()) if path.exists() else {"ok": False, "log": logs[r]})
    return reports, codes


def assert_ok(report):
    assert report["ok"], report.get("traceback") or report.get("log")


def test_sequence_and_prefix_handoff_between_processes(tmp_path):
    (send, recv), _ = run_ranks("handoff", tmp_path)
    assert_ok(send)
    assert_ok(recv)
    assert recv["first"] == ["req", 21, 0, {"next_token": 5}]
    assert send["sent_full"] == 6                          # 5 full blocks + the partial one
    assert recv["registered_tokens"] == 20                 # its full blocks are reusable prefixes
    assert recv["decode_reserved"] == 22
    assert recv["second"] == ["again", 21, 8, None]        # the receiver had 2 blocks cached ...
    assert send["sent_partly_cached"] == 4                 # ... so only 4 crossed
    assert recv["int8_exact"] and recv["fp8_e4m3_exact"]   # quantized blocks move with their scales
    # and with their recent-window rows: the receiver reads the newest tokens exactly
    assert recv["int4_window_exact"] and recv["int4_window_differs_from_codes"]
    assert recv["int4_block_keys_exact"]                  # and block keys with their parameters
    # the first 4 tokens (sink) arrive exact, even where only the pin keeps them
    assert recv["int4_window_one_sequence_exact"]
    assert all(recv[f"{n}_sink_exact"] for n in ("int4_window", "int4_block_keys", "int4_window_one_sequence"))
    assert recv["int4_window_one_sequence_sink_kept"]      # 3 more blocks written after the handoff
    assert send["prefix_sent"] == recv["prefix_received"] == [4, 0]
    assert recv["prefix_hit"] == 16
    wide, small, exists = recv["refusals"]
    assert "KV format differs: arenas=" in wide
    assert "out of KV blocks" in small
    assert "already live" in exists
    assert [r.split(": ", 1)[0] for r in send["refused"]] == ["rank 1 refused the transfer"] * 3
    assert "seq_id: expected a live sequence id, got 'missing'" in send["abort"]
    assert recv["abort"].startswith("rank 0 aborted the transfer: seq_id: expected a live sequence id")
    assert recv["cached_unchanged"]


def test_a_sender_killed_mid_transfer_leaves_the_receiver_consistent(tmp_path):
    (send, recv), codes = run_ranks("killed", tmp_path)
    assert codes[0] == 17 and not (tmp_path / "rank0.json").exists()   # died mid-way, as arranged
    assert_ok(recv)
    assert "failed while receiving layer" in recv["error"]
    assert recv["cached_unchanged"] and recv["live"] == []
    assert recv["hit_after"] == 16                         # its own cached prefix still serves


def test_a_receiver_killed_mid_transfer_leaves_the_sender_consistent(tmp_path):
    (send, recv), codes = run_ranks("receiver_killed", tmp_path)
    assert codes[1] == 18 and not (tmp_path / "rank1.json").exists()   # died mid-way, as arranged
    assert_ok(send)
    assert send["error"].startswith("transfer with rank 1 failed while")
    assert send["prefix_error"].startswith("transfer with rank 1 failed while")
    assert send["live"] == send["live_after_prefix"] == ["req"]          # the private fork is gone
    assert send["num_tokens"] == 64
    assert send["cached_unchanged"]


def test_a_silent_sender_times_out_and_leaves_the_receiver_consistent(tmp_path):
    (send, recv), _ = run_ranks("timeout", tmp_path)
    assert_ok(recv)
    assert "Timed out" in recv["error"] and "receiving layer 0" in recv["error"]
    assert recv["cached_blocks"] == 0
    assert_ok(send)
    assert "rank 1" in send["error"]


def test_tensor_parallel_ranks_keep_identical_bookkeeping_and_concatenate_to_the_unsharded_cache(tmp_path):
    (r0, r1), _ = run_ranks("tp", tmp_path)
    assert_ok(r0)
    assert_ok(r1)
    assert r0["heads2_indices"] == [[0], [1]]
    assert r0["heads1_indices"] == [[0], [0]]              # fewer heads than ranks: replicated
    for heads in (2, 1):
        assert r0[f"heads{heads}_same_bookkeeping"]
        assert r0[f"heads{heads}_same_as_unsharded"]
        assert r0[f"heads{heads}_concat_equals_unsharded"]


@pytest.mark.model
def test_prefill_decode_handoff_on_smollm2_gives_the_same_greedy_tokens(tmp_path, smollm2):
    (r0, r1), _ = run_ranks("smollm2", tmp_path, timeout=600)
    assert_ok(r0)
    assert_ok(r1)
    assert r0["blocks_sent"] > 0
    assert r1["remote"] == r0["local"]
    assert len(set(r1["remote"])) > 1                     # a real continuation, not a stuck token


def test_hybrid_and_quantized_prefixes_hand_off_exactly_and_decode_the_same(tmp_path):
    """send_prefix with sliding-window layer groups (alternating, 5 sliding : 1 full),
    and with the sink and window rows of int4 block keys and int8: every group's chain
    travels, admissions on the receiver (the whole prompt, and a prompt sharing only its
    first two blocks, which a sliding group then reads in its window) read element for
    element what they read on the sender; tiny Gemma 3 and Qwen2 decode after a
    send_prefix hand-off exactly as DynamicCache."""
    (r0, r1), _ = run_ranks("hybrid_prefix", tmp_path, timeout=300)
    assert_ok(r0)
    assert_ok(r1)
    from dist_workers import PREFIX_CASES
    for i in range(len(PREFIX_CASES)):
        assert r0[f"sent_{i}"] == r1[f"received_{i}"] == 5 * r1[f"groups_{i}"], i   # 5 full blocks, each group
        assert r0[f"again_sent_{i}"] == r1[f"again_received_{i}"] == 0
        assert r1[f"reads_{i}"]["again_hit"] == r0[f"reads_{i}"]["again_hit"] == 20
        assert r1[f"reads_{i}"]["short_hit"] == r0[f"reads_{i}"]["short_hit"] == 8
        assert r1[f"reads_{i}"] == r0[f"reads_{i}"], f"case {i}: the receiver reads other KV"
    for name in ("gemma3", "qwen2"):
        assert r1[f"{name}_hit"] in (24, [24])
        assert r1[f"{name}_remote"] == r1[f"{name}_dynamic"] == r0[f"{name}_local"]
        assert len(set(r1[f"{name}_remote"][0][27:])) > 1


def test_hybrid_sequences_hand_off_exactly_and_sliding_models_decode_the_same(tmp_path):
    """Sliding-window layer groups (alternating, 5 sliding : 1 full, int4 with a window):
    every layer reads the same on both sides, decoding continues, and a later prefix hit
    on the receiver serves real KV; tiny Gemma 2 and Mistral give the same greedy tokens
    after a prefill -> decode hand-off as in one process."""
    (r0, r1), _ = run_ranks("hybrid", tmp_path, timeout=300)
    assert_ok(r0)
    assert_ok(r1)
    for i in range(3):
        assert r0[f"sent_{i}"] > 0
        assert r1[f"kv_{i}"] == r0[f"kv_{i}"], f"layout {i}: the receiver reads other KV"
        assert r1[f"cached_{i}"] == 0
        assert r1.get(f"rehit_exact_{i}", True)
    for name in ("gemma2", "mistral"):
        assert r1[f"{name}_remote"] == r0[f"{name}_local"]
        assert len(set(r0[f"{name}_local"])) > 1
