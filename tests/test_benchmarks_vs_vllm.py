"""benchmarks/vs_vllm.py at smoke size: it prints result lines, or one skip line when vLLM
cannot be imported; with vLLM, both sides of W2 end in the same state. vLLM is found
as the script finds it: ``$PAGEDKV_VLLM_PATH`` (a directory holding the ``vllm``
package), else a plain ``import vllm``."""
import json
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks")
SCRIPT = os.path.join(BENCH, "vs_vllm.py")


def run_lines(cmd):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def smoke():
    return run_lines([sys.executable, SCRIPT, "--smoke"])


def test_smoke_prints_results_or_the_skip_line(smoke):
    if "skipped" in smoke[0]:
        assert smoke == [{"bench": "vs_vllm", "skipped": smoke[0]["skipped"]}]
        assert smoke[0]["skipped"].startswith("vLLM not importable: ")
        return
    assert [(d["workload"], d.get("free_order"), d.get("vllm_prefix_caching", d.get("prefix_caching")))
            for d in smoke] == [
        ("W1", "allocation order", False), ("W1", "allocation order", True),
        ("W1", "tail first", False), ("W1", "tail first", True),
        ("W2", None, False), ("W2", None, True), ("W3", None, True)]
    for d in smoke:
        per_op = ("pagedkv_ns", "pagedkv_us", "vllm_ns", "vllm_us")
        ours, theirs = [v for k, v in sorted(d.items()) if k.startswith(per_op)]
        assert ours > 0 and theirs > 0
        assert d["ratio_vllm_over_pagedkv"] == pytest.approx(theirs / ours, rel=0.05, abs=0.1)
        assert d["goal_ratio"] == 20.0 and d["pass"] == (d["ratio_vllm_over_pagedkv"] >= 20.0)
    for d in smoke[:4]:
        assert d["all_blocks_free_after"] == {"pagedkv": True, "vllm": True}
    w3 = smoke[6]
    assert w3["pagedkv_hit_rate"] == w3["vllm_hit_rate"] == pytest.approx(49 * 1024 / (50 * 1280))


def test_w2_gives_both_sides_the_same_trace(smoke):
    if "skipped" in smoke[0]:
        pytest.skip(f"{smoke[0]['skipped']} (set PAGEDKV_VLLM_PATH to a directory holding vllm 0.33)")
    for d in (x for x in smoke if x["workload"] == "W2"):
        ours, theirs = d["pagedkv_end"], d["vllm_end"]
        assert ours["admitted"] == theirs["admitted"] > d["live_sequences"]   # requests finished and were replaced
        assert ours["finished"] == theirs["finished"] == ours["admitted"] - d["live_sequences"]
        assert ours["slot_tokens"] == theirs["slot_tokens"]
        assert ours["blocks_in_use"] == theirs["blocks_in_use"]   # no prompt shares a block in the smoke trace
        assert ours["hit_tokens"] == theirs["hit_tokens"] == 0
        assert d["same_trace"] is True   # also: every live sequence holds the same tokens


def test_without_vllm_it_prints_one_skip_line():
    # ``sys.modules["vllm"] = None`` makes ``import vllm`` fail even where vLLM is installed.
    code = ("import os, runpy, sys; os.environ.pop('PAGEDKV_VLLM_PATH', None); "
            f"sys.path.insert(0, {BENCH!r}); sys.modules['vllm'] = None; "
            f"sys.argv = [{SCRIPT!r}, '--smoke']; runpy.run_path({SCRIPT!r}, run_name='__main__')")
    lines = run_lines([sys.executable, "-c", code])
    assert len(lines) == 1 and lines[0]["bench"] == "vs_vllm"
    assert lines[0]["skipped"].endswith("import of vllm halted; None in sys.modules")
