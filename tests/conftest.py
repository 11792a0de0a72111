"""Shared test setup: tests run against the installed pagedkv, never the source tree."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)   # shared helpers: core_machines, model_fixtures

import pagedkv  # noqa: E402

_SRC = os.path.dirname(HERE)
if os.environ.get("PAGEDKV_ALLOW_SOURCE_TREE") != "1" and os.path.dirname(
        os.path.dirname(os.path.abspath(pagedkv.__file__))) == _SRC:
    raise pytest.UsageError(
        f"pagedkv was imported from the source tree ({pagedkv.__file__}); the tests must run "
        "against the installed package: `pip install .` and run `pytest` (not `python -m pytest`) "
        "from the repository root, or set PAGEDKV_ALLOW_SOURCE_TREE=1 for an in-place dev build.")


@pytest.fixture(scope="session", autouse=True)
def _run_outside_the_source_tree(tmp_path_factory):
    """Subprocesses started by tests (``python -c``, ``python -m pagedkv``) put their
    working directory first on sys.path; from the repository root that would import the
    uncompiled source tree instead of the installed package. Work from a scratch folder."""
    old = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(old)
