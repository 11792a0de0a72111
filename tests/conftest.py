"""Shared test setup: tests run against the installed pagedkv, never the source tree."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)   # shared helpers: core_machines, model_fixtures

import pagedkv  # noqa: E402

if "OMP_NUM_THREADS" not in os.environ:
    # Tests assert behaviour, not speed. torch's OpenMP threads busy-wait at their
    # barriers, and on a machine loaded by other processes (a CI runner, a serving box)
    # that made the model tests 13-51x slower (issue 27); one thread each keeps a
    # loaded run within 2x of a quiet one. Tests of the parallel paths set their own
    # thread counts (pagedkv.set_num_threads).
    import torch

    torch.set_num_threads(1)

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


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.pagedkv_call_failed = report.failed


def _leftovers(kv) -> str:
    """What a cache still holds, or '' when every block is free (invariants checked)."""
    kv.check_invariants()
    stats = kv.stats()
    held = []
    if len(kv):
        held.append(f"{len(kv)} sequence(s) {kv.sequences()[:8]!r}")
    if stats.allocated_blocks:
        held.append(f"{stats.allocated_blocks} block(s) in use")
    if stats.swapped_sequences or stats.host_blocks_in_use:
        held.append(f"{stats.swapped_sequences} swapped-out sequence(s) on {stats.host_blocks_in_use} host block(s)")
    if stats.states is not None and stats.states.live_slots:
        held.append(f"{stats.states.live_slots} state slot(s) held by sequences")
    return ", ".join(held)


@pytest.fixture(autouse=True)
def _every_cache_ends_empty(request, monkeypatch):
    """Leak check in teardown: every PagedKVCache the test made (directly, through a
    PagedCache, an adapter or the demo) must end with its invariants intact and every
    block free: no live or swapped-out sequence, nothing in use. A test frees what it
    takes. Objects it dropped count as freed once collected (PagedCache frees its rows
    on finalization), so the check collects garbage before it reports. Skipped when the
    test itself failed (its own error says more)."""
    from pagedkv.manager.cache import PagedKVCache

    made = []
    real_init = PagedKVCache.__init__

    def recording_init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(PagedKVCache, "__init__", recording_init)
    yield
    if not made or getattr(request.node, "pagedkv_call_failed", False):
        return
    if any(_leftovers(kv) for kv in made):
        import gc

        gc.collect()
        problems = [f"cache #{i} ({kv!r}): {left}" for i, kv in enumerate(made) if (left := _leftovers(kv))]
        if problems:
            pytest.fail("the test left KV blocks behind:\n  " + "\n  ".join(problems), pytrace=False)
