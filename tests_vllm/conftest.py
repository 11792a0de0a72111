"""The vLLM connector tests: run by ``.ci/vllm_tests.sh`` in the vLLM venv
(``.ci/vllm_venv.sh`` builds it); the main ``pytest -q`` does not collect this folder.

One engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so a test reaches the
connector's store) serves the cases that swap or inspect the store; a reference engine
without the connector and two peer engines with vLLM's default multiprocessing (engine
core and worker in processes of their own: warm restart, a shared directory, hits,
negative control, a corrupted block) run as subprocesses."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
# This process's engine only; the subprocesses get vLLM's default (see Proc).
_ENV = dict(os.environ)
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

try:
    import vllm_env as ve   # sets the environment before vllm is imported
    import vllm  # noqa: F401
except ImportError as exc:   # pragma: no cover - the main venv
    ve = None
    _why = f"vllm is not importable ({exc}); run .ci/vllm_venv.sh then .ci/vllm_tests.sh"


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: needs the vLLM venv (.ci/vllm_venv.sh)")


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.vllm)
        if ve is None:
            item.add_marker(pytest.mark.skip(reason=_why))


class Proc:
    def __init__(self, args: dict, out: Path, script: str = "run_engine.py"):
        self.out = out
        self.p = subprocess.Popen([sys.executable, str(HERE / script), json.dumps(args), str(out)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_ENV)

    def result(self, timeout: float = 900) -> dict:
        log, _ = self.p.communicate(timeout=timeout)
        if self.p.returncode != 0 or not self.out.exists():
            raise AssertionError(f"engine subprocess failed ({self.p.returncode}):\n{log[-4000:]}")
        return json.loads(self.out.read_text())


@pytest.fixture(scope="session")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="session")
def reference_proc(workdir):
    if not ve.MODEL_DIR.exists():
        pytest.fail(f"{ve.MODEL_DIR} is missing: run .ci/vllm_venv.sh")
    return Proc({"mode": "reference", "sets": ["A", "B", "C", "D"]}, workdir / "reference.json")


@pytest.fixture(scope="session")
def engine(workdir, reference_proc):
    """``(llm, key, store, disk_dir)``: SmolLM2 with the connector (host 64 blocks + disk)."""
    disk = workdir / "tier"
    llm = ve.make_llm({"disk_dir": str(disk), "host_blocks": 64, "disk_blocks": 256})
    key, store = ve.engine_store(llm)
    assert store is not None and store.serving, "the worker side did not report vLLM's KV usable"
    return llm, key, store, disk


@pytest.fixture(scope="session")
def reference(reference_proc):
    return {k: [tuple(r) for r in v] for k, v in reference_proc.result().items()}


def root_slot(disk, tokens):
    """The disk slot holding the first block of ``tokens``."""
    from pagedkv.tiers.chain import slot_dtype

    recs = np.fromfile(disk / "index.bin", dtype=slot_dtype(ve.BLOCK))
    hit = [s for s in np.flatnonzero(recs["valid"] == 1).tolist()
           if recs["parent"][s] == -1 and np.array_equal(recs["tokens"][s], tokens[:ve.BLOCK])]
    assert len(hit) == 1, hit
    return hit[0]


def corrupt_block(disk, slot):
    record = json.loads((disk / "meta.json").read_text())["record_bytes"]
    with open(disk / "blocks.bin", "r+b") as f:
        f.seek(slot * record + 100)
        b = f.read(4)
        f.seek(slot * record + 100)
        f.write(bytes(x ^ 0xFF for x in b))
