"""``pagedkv plan`` / ``pagedkv demo`` with hostile configs and options (issue 25):
one line naming the error, exit status 2, never a traceback, never a hang."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from pagedkv.cli import build_parser, demo, main

from model_fixtures import tiny  # noqa: F401  (tests/ is on sys.path via conftest)

HF = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64)
SHAPE = ["--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "16"]
DEMO = ["demo", "--model", "tiny", "--no-progress", "--requests", "2", "--max-new-tokens", "2"]


def _config(tmp_path, name, obj=None, raw=None):
    path = tmp_path / name
    path.write_text(raw if raw is not None else json.dumps(obj))
    return str(path)


def _one_line_error(capsys, command, rc, message):
    assert rc == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert lines == [f"pagedkv {command}: error: {message}"], captured.err
    assert "Traceback" not in captured.out + captured.err


@pytest.mark.parametrize("make, message", [
    (lambda d: _config(d, "a.json", dict(HF, num_attention_heads=0)), "num_attention_heads: expected an int >= 1, got 0"),
    (lambda d: _config(d, "b.json", dict(HF, hidden_size="big")), "hidden_size: expected an int >= 1, got 'big'"),
    (lambda d: _config(d, "c.json", raw='{"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": NaN}'),
     "hidden_size: expected an int >= 1, got nan"),
    (lambda d: _config(d, "d.json", raw='{"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": Infinity}'),
     "hidden_size: expected an int >= 1, got inf"),
    (lambda d: _config(d, "e.json", dict(HF, hidden_size=[64])), "hidden_size: expected an int >= 1, got [64]"),
    (lambda d: _config(d, "f.json", dict(HF, model_type=["x"], sliding_window=4)), "model_type: expected a str, got ['x']"),
    (lambda d: _config(d, "g.json", dict(HF, text_config="/etc/passwd")),
     "text_config: expected a nested config (a JSON object), got '/etc/passwd'"),
    (lambda d: _config(d, "config.json", dict(HF, layer_types=["full_attention"] * 2, sliding_window=8,
                                               num_hidden_layers="2")),
     "num_hidden_layers: expected an int >= 1, got '2'"),
])
def test_plan_with_a_bad_model_config(tmp_path, capsys, make, message):
    rc = main(["plan", "--model-config", make(tmp_path), "--budget", "1GiB"])
    _one_line_error(capsys, "plan", rc, message)


def test_plan_with_deep_json_a_fifo_or_a_device(tmp_path, capsys):
    deep = _config(tmp_path, "deep.json", raw="[" * 100_000 + "]" * 100_000)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cases = [(deep, f"config: expected a JSON object nested as a model config is, got {deep!r} "
                    "(nested too deep to decode)"),
             (str(fifo), f"config: expected a regular file (config.json or GGUF), got {str(fifo)!r} (a FIFO)"),
             ("/dev/null", "config: expected a regular file (config.json or GGUF), got '/dev/null' (a device)")]
    for path, message in cases:
        out = {}
        t = threading.Thread(target=lambda: out.update(rc=main(["plan", "--model-config", path, "--budget", "1GiB"])),
                             daemon=True)
        t.start()
        t.join(30)
        assert not t.is_alive(), f"pagedkv plan blocked on {path}"
        _one_line_error(capsys, "plan", out["rc"], message)


@pytest.mark.parametrize("argv, message", [
    (["--budget", "9" * 5000], "memory_budget: expected a byte count below 2**63, got '" + "9" * 32
     + "'... (5000 characters)"),
    (["--budget", "1GiB", "--max-seq-len", str(10**30)], "max_seq_len: expected an int in [1, 2**63), got an int of 100 bits"),
    (["--budget", "1GiB", "--block-size", str(2**70)], "block_size: expected an int in [1, 2**63), got an int of 71 bits"),
])
def test_plan_with_huge_numbers(capsys, argv, message):
    _one_line_error(capsys, "plan", main(["plan", *SHAPE, *argv]), message)


@pytest.mark.parametrize("argv, message", [
    (["--num-blocks", "3000000000"], r"num_blocks: expected arenas that fit the \d+ bytes available on cpu, "
                                     r"got 3000000000 \(\d+ bytes needed\)"),
    (["--num-blocks", str(2**70)], r"num_blocks: expected an int in \[1, 2\*\*63\), got an int of 71 bits"),
    (["--seed", str(2**70)], r"shuffle_free_blocks: expected an int in \[0, 2\*\*63\), got an int of 71 bits"),
    (["--kv-sink-tokens", "-1"], r"kv_sink_tokens: expected an int >= 0, got -1"),
    (["--arrival-gap", "-1"], r"--arrival-gap: expected an int >= 0, got -1"),
])
def test_demo_with_bad_sizes(capsys, argv, message):
    import re

    assert main([*DEMO, *argv]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(f"pagedkv demo: error: {message}", lines[0]), captured.err
    assert "Traceback" not in captured.err


def test_demo_with_a_huge_arrival_gap_finishes(tiny):
    model, tok = tiny
    args = build_parser().parse_args([*DEMO, "--arrival-gap", str(10**12), "--requests", "3"])
    kv = demo.build_kv(model, args)
    requests = demo.make_requests(tok, args.requests, args.max_new_tokens, args.arrival_gap)
    out = {}
    t = threading.Thread(target=lambda: out.update(result=demo.serve(model, tok, requests, kv)), daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "serve() stepped through an idle engine one step at a time"
    result = out["result"]
    # each request is admitted at its own arrival step: the idle steps were skipped, not the arrivals
    assert [r.admitted_step for r in result.requests] == [i * 10**12 for i in range(3)]
    assert all(r.output_ids for r in result.requests)


def test_the_installed_command_exits_2_without_a_traceback(tmp_path):
    bad = _config(tmp_path, "config.json", dict(HF, hidden_size="big"))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for argv, message in [(["plan", "--model-config", bad, "--budget", "1GiB"],
                           "pagedkv plan: error: hidden_size: expected an int >= 1, got 'big'"),
                          ([*DEMO, "--num-blocks", "3000000000"], "pagedkv demo: error: num_blocks: expected arenas")]:
        proc = subprocess.run([sys.executable, "-m", "pagedkv", *argv], capture_output=True, text=True,
                              timeout=300, env=env, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.startswith(message) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "Traceback" not in proc.stderr
