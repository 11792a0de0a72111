"""The vLLM connector tests: run by ``.ci/vllm_tests.sh`` in the vLLM venv
(``.ci/vllm_venv.sh`` builds it); the main ``pytest -q`` does not collect this folder.

One engine (with the connector, engine core in this process) serves most cases; a
reference engine without the connector and two peer engines (warm restart, a shared
directory) run as subprocesses."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

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
    def __init__(self, args: dict, out: Path):
        self.out = out
        self.p = subprocess.Popen([sys.executable, str(HERE / "run_engine.py"), json.dumps(args), str(out)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

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
    return Proc({"mode": "reference", "sets": ["A", "B", "C"]}, workdir / "reference.json")


@pytest.fixture(scope="session")
def engine(workdir, reference_proc):
    """``(llm, key, store, disk_dir)``: SmolLM2 with the connector (host 64 blocks + disk)."""
    disk = workdir / "tier"
    llm = ve.make_llm({"disk_dir": str(disk), "host_blocks": 64, "disk_blocks": 256})
    key, store = ve.engine_store(llm)
    assert store is not None and store.serving, "the connector did not register vLLM's KV"
    return llm, key, store, disk


@pytest.fixture(scope="session")
def reference(reference_proc):
    return {k: [tuple(r) for r in v] for k, v in reference_proc.result().items()}
