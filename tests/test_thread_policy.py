"""The CPU loops' thread policy (docs/threads.md): pagedkv's own setting, the per-thread
work minimum, and serial execution while the machine has no idle core.

Speed is measured in benchmarks/contention.py; these tests pin the decisions and that
every thread count gives the same bytes.
"""
import os
import subprocess
import sys

import pytest
import torch

import pagedkv
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError
from pagedkv.ops import cpu as cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.AVAILABLE, reason="the compiled CPU loops are not built")

CPUS = os.cpu_count() or 1


@pytest.fixture
def loops():
    from pagedkv.ops import _cpu_copy, _cpu_quant

    old_pkv, old_torch = pagedkv.get_num_threads(), torch.get_num_threads()
    yield _cpu_copy, _cpu_quant
    for mod in (_cpu_copy, _cpu_quant):
        mod._pretend_runnable(-1)
    pagedkv.set_num_threads(old_pkv)
    torch.set_num_threads(old_torch)


def test_set_num_threads_rejects_bad_values_and_keeps_the_setting():
    before = pagedkv.get_num_threads()
    with pytest.raises(InvalidArgumentError, match=r"n: expected an int >= 0 .*got -1"):
        pagedkv.set_num_threads(-1)
    with pytest.raises(ArgumentTypeError, match=r"n: expected an int >= 0, got str"):
        pagedkv.set_num_threads("2")
    with pytest.raises(ArgumentTypeError, match=r"got bool"):
        pagedkv.set_num_threads(True)
    assert pagedkv.get_num_threads() == before


def test_setting_round_trips_and_reaches_both_loop_modules(loops):
    copy, quant = loops
    pagedkv.set_num_threads(3)
    assert (pagedkv.get_num_threads(), copy.get_num_threads(), quant.get_num_threads()) == (3, 3, 3)
    pagedkv.set_num_threads(0)
    assert (pagedkv.get_num_threads(), copy.get_num_threads(), quant.get_num_threads()) == (0, 0, 0)


def test_small_calls_stay_serial_and_each_thread_gets_a_threshold_of_work(loops):
    copy, quant = loops
    pagedkv.set_num_threads(4)
    t = copy.PARALLEL_BYTES
    assert copy.planned_threads(t - 1) == 1
    assert copy.planned_threads(2 * t - 1) == 1          # two threads would each get less than t
    assert copy.planned_threads(2 * t) == 2
    assert copy.planned_threads(3 * t) == 3
    assert copy.planned_threads(100 * t) == 4            # the explicit setting caps it
    assert quant.planned_threads(16384 * 2 - 1) == 1
    assert quant.planned_threads(16384 * 2) == 2


def test_automatic_setting_goes_serial_on_a_busy_machine(loops):
    copy, quant = loops
    if CPUS < 2:
        pytest.skip("one CPU: every loop is serial")
    pagedkv.set_num_threads(0)
    torch.set_num_threads(2)
    big = 100 * copy.PARALLEL_BYTES
    for mod, work in ((copy, big), (quant, 100 * 16384)):
        mod._pretend_runnable(1)                  # only this thread runs: idle cores
        assert mod.planned_threads(work) == 2
        mod._pretend_runnable(CPUS)               # every core is busy besides ours
        assert mod.planned_threads(work) == 1
        mod._pretend_runnable(CPUS + 6)           # a loaded machine
        assert mod.planned_threads(work) == 1
    # an explicit count is the caller's decision, loaded or not
    pagedkv.set_num_threads(2)
    copy._pretend_runnable(CPUS + 6)
    assert copy.planned_threads(big) == 2


@pytest.mark.parametrize("setting", [1, 2, 3])
def test_every_thread_count_moves_the_same_bytes(loops, setting):
    copy, _ = loops
    copy._pretend_runnable(1)
    torch.manual_seed(0)
    h, d, bs, nb = 4, 64, 16, 256
    layer = torch.zeros(nb, 2, bs, h, d)
    slots = torch.randperm(nb * bs)[:2048].to(torch.int64)
    k, v = torch.randn(2048, h, d), torch.randn(2048, h, d)
    pagedkv.set_num_threads(setting)
    assert copy.planned_threads(2 * k.numel() * 4) == min(setting, 2 * k.numel() * 4 // copy.PARALLEL_BYTES)
    pagedkv.ops.write_kv(layer, slots, k, v)
    expect = torch.zeros_like(layer)
    pagedkv.ops.write_kv(expect, slots, k, v, backend="reference")
    assert torch.equal(layer, expect)
    table = torch.randperm(nb).to(torch.int32)
    indptr = torch.tensor([0, nb], dtype=torch.int32)
    lens = torch.tensor([nb * bs], dtype=torch.int32)
    got = pagedkv.ops.gather_kv(layer, indptr, table, lens)
    ref = pagedkv.ops.gather_kv(layer, indptr, table, lens, backend="reference")
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_env_var_sets_the_count_and_a_bad_value_is_refused(tmp_path):
    code = "import pagedkv; print(pagedkv.get_num_threads())"
    env = dict(os.environ, PAGEDKV_NUM_THREADS="3")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "3", out.stderr
    env["PAGEDKV_NUM_THREADS"] = "many"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode != 0
    assert "PAGEDKV_NUM_THREADS: expected an int >= 0" in out.stderr and "'many'" in out.stderr


@pytest.fixture
def attention():
    from pagedkv.ops import _cpu_attention, _threads

    old_pkv, old_torch = pagedkv.get_num_threads(), torch.get_num_threads()
    yield _cpu_attention
    _threads._pretend_runnable(-1)
    pagedkv.set_num_threads(old_pkv)
    torch.set_num_threads(old_torch)


def _attention_call(seed=0, seq=1024, bs=16, hkv=4, hq=16, d=64):
    """One decode query over ``seq`` float32 keys: ``seq * hq * d`` multiply-adds."""
    g = torch.Generator().manual_seed(seed)
    nb = seq // bs
    layer = torch.randn(nb, 2, bs, hkv, d, generator=g)
    q = torch.randn(1, hq, d, generator=g)
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32)  # noqa: E731
    tables = (i32([0, nb]), torch.randperm(nb, generator=g).to(torch.int32), i32([seq]), i32([0, 1]))
    return q, layer, tables, seq * hq * d


def test_the_thread_setting_reaches_cpu_attention(attention):
    """pagedkv.set_num_threads sets the threads of the attention loops too (issue 34: they
    followed OpenMP's count alone), read back through one policy for every loop."""
    from pagedkv.ops import _cpu_copy, _cpu_quant

    big = 100 * (1 << 18)                       # 100 pieces of attention work
    torch.set_num_threads(1)
    for n in (3, 2, 1):
        pagedkv.set_num_threads(n)
        assert pagedkv.get_num_threads() == n
        assert attention.planned_threads(big) == n
        assert (_cpu_copy.get_num_threads(), _cpu_quant.get_num_threads()) == (n, n)
    pagedkv.set_num_threads(4)
    assert attention.planned_threads(2 * (1 << 18) - 1) == 1     # each thread gets a piece of work
    assert attention.planned_threads(2 * (1 << 18)) == 2
    pagedkv.set_num_threads(0)                                     # follows torch's count
    assert attention.planned_threads(big) == 1


def test_cpu_attention_result_does_not_depend_on_idle_cores(attention):
    """Under the automatic setting the attention loops take threads only for idle cores, and
    the split plan follows the setting, not the load: the same call gives the same bits on 2
    threads and on 1."""
    if CPUS < 2:
        pytest.skip("one CPU: every loop is serial")
    q, layer, tables, work = _attention_call()
    pagedkv.set_num_threads(0)
    torch.set_num_threads(2)
    from pagedkv.ops import _threads

    outs = []
    for runnable, threads in ((1, 2), (CPUS + 6, 1)):
        _threads._pretend_runnable(runnable)
        assert attention.planned_threads(work) == threads
        outs.append(pagedkv.ops.paged_attention(q, layer, *tables, backend="cpu"))
    assert torch.equal(outs[0], outs[1])
    ref = pagedkv.ops.paged_attention(q, layer, *tables, backend="reference")
    torch.testing.assert_close(outs[0], ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("setting", [1, 2, 3])
def test_cpu_attention_at_every_thread_setting_matches_the_reference(attention, setting):
    from pagedkv.ops import _threads

    _threads._pretend_runnable(1)
    q, layer, tables, work = _attention_call(seed=setting)
    pagedkv.set_num_threads(setting)
    assert attention.planned_threads(work) == min(setting, work // (1 << 18))
    got = pagedkv.ops.paged_attention(q, layer, *tables, backend="cpu")
    ref = pagedkv.ops.paged_attention(q, layer, *tables, backend="reference")
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
