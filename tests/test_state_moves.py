"""A recurrent state moves with its sequence: swap to the host and back, export/import,
and send_sequence / send_prefix to another process (prefill there, decode here)."""
import pytest
import torch

from pagedkv import CacheConfig, PagedKVCache
from pagedkv.errors import InvalidArgumentError
from pagedkv.testing.state_model import state_of

BS = 4
A = list(range(1, 11))


def config(**kw):
    base = dict(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BS, num_blocks=16, dtype="float32",
                layer_kinds=("state", "attention", "state"), state_tensors=[("conv", (3, 4)), ("ssm", (2, 2, 2))],
                state_slots=8, state_checkpoint_every=2)
    return CacheConfig(**(base | kw))


def step(kv, sid, tokens, n, write=True):
    pos = kv.num_tokens(sid)
    kv.reserve(sid, n)
    if write:
        for layer in range(2):
            kv.write_state(sid, layer, state_of(kv.config.state_spec, [tokens[:pos + n]], layer))
    kv.commit(sid, n)


def assert_state(kv, sid, tokens):
    for layer in range(2):
        got = kv.read_state(sid, layer)
        want = state_of(kv.config.state_spec, [tokens], layer)
        for name in got:
            assert torch.equal(got[name], want[name]), (name, len(tokens))


@pytest.mark.parametrize("chunks", [(4, 4, 2), (4, 4)], ids=["off-boundary", "on-boundary"])
def test_swap_carries_the_state(chunks):
    with PagedKVCache(config(host_num_blocks=8)) as kv:
        n = sum(chunks)
        kv.add_sequence("a", A[:n])
        for c in chunks:
            step(kv, "a", A, c)
        kv.swap_out("a")
        kv._groups.snapshots.clear()          # nothing on the device to fall back on
        kv.swap_in("a")
        assert kv.state_positions("a").tolist() == [n]
        assert_state(kv, "a", A[:n])          # before: the initial state after n tokens
        if n % BS == 0:                       # a swap-in on a boundary files the right snapshot
            assert kv.add_sequence("b", A[:n] + [77]) == n
            assert_state(kv, "b", A[:n])
            kv.free("b")
        step(kv, "a", A + [5], 1)
        assert_state(kv, "a", (A + [5])[:n + 1])
        kv.free("a")
        kv.check_invariants()


def test_a_state_written_past_its_commit_is_not_swapped_out():
    with PagedKVCache(config(host_num_blocks=8)) as kv:
        kv.add_sequence("a", A)
        step(kv, "a", A, 4)
        kv.reserve("a", 2)
        kv.write_state("a", 0, state_of(kv.config.state_spec, [A[:6]], 0))
        with pytest.raises(InvalidArgumentError, match="commit or unreserve"):
            kv.swap_out("a")
        assert kv.num_tokens("a") == 4            # still live on the device, unchanged
        kv.unreserve("a")
        kv.swap_out("a")
        kv.swap_in("a")
        assert_state(kv, "a", A[:4])
        kv.free("a")
        kv.check_invariants()


def test_export_and_import_state():
    with PagedKVCache(config()) as kv, PagedKVCache(config()) as other:
        kv.add_sequence("a", A)
        step(kv, "a", A, 10)
        data = kv.export_state("a")
        assert len(data) == kv.state_nbytes() == kv.config.state_spec.slot_bytes()
        other.add_sequence("b", A)
        with pytest.raises(InvalidArgumentError, match="reserved this step"):
            other.import_state("b", data)
        other.reserve("b", 10)
        with pytest.raises(InvalidArgumentError, match="bytes"):
            other.import_state("b", data[:-1])
        other.import_state("b", data)
        other.commit("b", 10)
        assert_state(other, "b", A)
        kv.add_sequence("c")
        assert kv.export_state("c") == bytes(kv.state_nbytes())      # the initial state
        kv.free(["a", "c"])
        other.free("b")


def test_prefill_there_decode_here_carries_the_state(tmp_path):
    """send_sequence and send_prefix between two processes (gloo on 127.0.0.1): the
    receiver's state is the sender's, bit for bit, and decoding continues from it."""
    from test_distributed import assert_ok, run_ranks

    (send, recv), _ = run_ranks("states", tmp_path)
    assert_ok(send)
    assert_ok(recv)
    assert "commit or unreserve the step" in send["refused"]       # a state written past its commit
    assert recv["aborted"].startswith("rank 0 aborted the transfer: seq_id: expected a sequence whose state")
    assert send["left"] == recv["left"] == 0                       # nothing leaked on either side
    assert recv["received"] == ["req", 10, 0]
    assert send["sent"] == 3
    assert recv["state_exact"] and recv["kv_exact"]          # before: the initial state after 10 tokens
    assert recv["decoded_state_exact"]
    # the receiver had A's chain (8 tokens: the same first 2 blocks as B) but no snapshot at 8
    assert send["prefix_sent"] == recv["prefix_received"] == 2
    assert recv["prefix_hit"] == 8
    assert recv["prefix_state_exact"] and recv["prefix_kv_exact"]


def test_a_sequence_with_nothing_computed_swaps_out_and_in_again():
    # found by the tiered state machine: the swap-in of a sequence with no computed token
    # left its (initial) state marked written, so the next swap_out refused it
    with PagedKVCache(config(host_num_blocks=8)) as kv:
        kv.add_sequence("a", [1])
        for _ in range(2):
            kv.swap_out("a")
            kv.swap_in("a")
        assert kv.state_positions("a").tolist() == [0]
        step(kv, "a", [1], 1)
        assert_state(kv, "a", [1])
        kv.free("a")
        kv.check_invariants()
