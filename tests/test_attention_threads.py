"""The CPU attention loops follow pagedkv's thread policy (docs/threads.md): the setting,
at most one thread per ``_PARALLEL_WORK`` multiply-adds, the second core only while it is
idle, and the same bits on one thread as on many, however loaded the machine is."""
import os

import pytest
import torch

import pagedkv
from pagedkv.ops.paged_attention import CPU_AVAILABLE, paged_attention
from test_paged_attention import build

pytestmark = pytest.mark.skipif(not CPU_AVAILABLE, reason="the CPU attention loops are not built")

CPUS = os.cpu_count() or 1
WORK = 1 << 18     # _cpu_attention._PARALLEL_WORK: multiply-adds per thread at least


@pytest.fixture
def attn():
    from pagedkv.ops import _cpu_attention

    old_pkv, old_torch = pagedkv.get_num_threads(), torch.get_num_threads()
    yield _cpu_attention
    _cpu_attention._pretend_runnable(-1)
    pagedkv.set_num_threads(old_pkv)
    torch.set_num_threads(old_torch)


def test_the_setting_reaches_the_attention_loops(attn):
    pagedkv.set_num_threads(3)
    assert attn.get_num_threads() == 3
    assert attn.planned_threads(WORK * 2 - 1) == 1          # two threads would each get less
    assert attn.planned_threads(WORK * 100) == 3
    pagedkv.set_num_threads(0)
    assert attn.get_num_threads() == 0


def test_the_second_core_is_taken_only_while_idle(attn):
    if CPUS < 2:
        pytest.skip("one CPU: every loop is serial")
    pagedkv.set_num_threads(0)
    torch.set_num_threads(2)
    attn._pretend_runnable(1)                  # only this thread runs
    assert attn.planned_threads(WORK * 100) == 2
    attn._pretend_runnable(CPUS + 6)           # a loaded machine
    assert attn.planned_threads(WORK * 100) == 1


@pytest.mark.parametrize("fmt", ["float32", "int4"])
def test_one_thread_and_two_give_the_same_bits(attn, fmt):
    """A decode batch whose splits depend on the threads the call could take (batch 1:
    split for the threads), not on how many cores are idle."""
    gen = torch.Generator().manual_seed(0)
    args, kw, _ = build(fmt, "NHD", 64, 16, 3, 9, [900, 700], [1, 1], gen, rot=fmt == "int4")
    single = (args[0][:1], args[1], args[2][:2], args[3], args[4][:1], args[5][:2])
    torch.set_num_threads(2)
    pagedkv.set_num_threads(0)
    outs = []
    for runnable in (1, CPUS + 6):            # idle: 2 threads; loaded: 1
        attn._pretend_runnable(runnable)
        outs.append((paged_attention(*args, **kw), paged_attention(*single, **kw)))
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[1]))
