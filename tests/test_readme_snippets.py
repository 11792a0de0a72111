"""Every ```python block of README.md runs, as a user would paste it.

Each block is written to a file in a scratch folder (outside the source tree, so it
imports the installed pagedkv) and run in its own interpreter with a time limit; the
blocks assert what they print where it matters. The `pagedkv plan` commands of the
README's bash blocks run too, word for word, against a Qwen3-0.6B-shaped config.json.
"""
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
TIMEOUT_S = 600   # generous: CI machines can be loaded many times over

if not README.is_file():   # e.g. tests run from an unpacked wheel without the README
    pytest.skip("README.md is not beside the tests", allow_module_level=True)

TEXT = README.read_text(encoding="utf-8")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
BLOCKS = [(m.group(1), m.group(2), TEXT.count("\n", 0, m.start()) + 1) for m in FENCE.finditer(TEXT)]
PYTHON = [(body, line) for lang, body, line in BLOCKS if lang in ("python", "py", "python3")]


def _run(args, cwd, timeout=TIMEOUT_S):
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_readme_has_python_blocks_and_no_unlabelled_ones():
    assert len(PYTHON) >= 5
    unlabelled = [line for lang, _, line in BLOCKS if lang == ""]
    assert unlabelled == [], f"README.md code blocks without a language at lines {unlabelled}"


@pytest.mark.parametrize("body,line", PYTHON, ids=[f"README.md:{line}" for _, line in PYTHON])
def test_python_block_runs(body, line, tmp_path):
    script = tmp_path / f"readme_{line}.py"
    script.write_text(body, encoding="utf-8")
    proc = _run([sys.executable, str(script)], cwd=tmp_path)
    assert proc.returncode == 0, (
        f"README.md block at line {line} failed (exit {proc.returncode}):\n"
        f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")


QWEN3_06B = {   # the shape of seed 004's example (the figures the README quotes)
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "hidden_size": 1024,
    "max_position_embeddings": 40960, "torch_dtype": "bfloat16", "vocab_size": 151936,
}
PLAN_LINES = [ln.strip() for lang, body, _ in BLOCKS if lang in ("bash", "sh", "console")
              for ln in body.splitlines() if ln.strip().startswith("pagedkv plan")]


def test_readme_plan_commands_paste_and_run(tmp_path):
    assert PLAN_LINES, "README.md shows no `pagedkv plan` command"
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_06B), encoding="utf-8")
    for cmd in PLAN_LINES:
        argv = shlex.split(cmd, comments=True)
        proc = _run([sys.executable, "-m", "pagedkv", *argv[1:]], cwd=tmp_path, timeout=300)
        assert proc.returncode == 0, f"`{cmd}` failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        assert "GiB" in proc.stdout or "GB" in proc.stdout, proc.stdout
