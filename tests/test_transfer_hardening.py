"""Transfers between processes refuse what they cannot trust: a peer whose KV format
differs (every setting that changes a block's bytes; both sides raise TransferError
naming it), malformed headers and replies, truncated, corrupt or oversized payloads.
The honest side is left as it was: no live sequence, no block held, no prefix hit on
anything received. Two gloo ranks on 127.0.0.1 (see ``dist_workers.py``)."""
import pytest
import torch

from pagedkv.transfer.schema import check, integer, list_of_digits, optional, scalar
from pagedkv.transfer.wire import checksum, json_depth

from dist_workers import HOSTILE_PREFIX, HOSTILE_REPLIES, HOSTILE_SEQUENCE
from test_distributed import assert_ok, run_ranks
from test_kv_fingerprint import FORMAT_PAIRS


def test_every_format_pair_is_refused_on_both_sides_naming_each_setting(tmp_path):
    """Includes the issue's repro: send_sequence from kv_rotation=True to False was accepted
    and the receiver's keys were off by 4.2."""
    (send, recv), _ = run_ranks("formats", tmp_path)
    assert_ok(send)
    assert_ok(recv)
    for setting, _, _, diffs in FORMAT_PAIRS:
        for key in (setting, setting + "/prefix"):
            assert recv[key].startswith("refused the transfer from rank 0: KV format differs: "), recv[key]
            assert send[key].startswith("rank 1 refused the transfer: KV format differs: "), send[key]
            for name, (theirs, mine) in diffs.items():      # rank 0 wrote with the first value
                said = f"{name}={theirs!r} on the sender (rank 0), {mine!r} on the receiver"
                assert said in recv[key] and said in send[key], (said, recv[key])
        assert recv[setting + "/hit"] == 0                  # nothing was registered


EXPECTED_SEQUENCE = {
    "num_computed_abc": "field 'num_computed': expected an int in [0, 2147483647], got 'abc'",
    "num_computed_null": "field 'num_computed': expected an int in [0, 2147483647], got None",
    "num_computed_negative": "field 'num_computed': expected an int in [0, 2147483647], got -1",
    "num_computed_past_tokens": "num_computed=99 exceeds num_tokens=13",
    "num_tokens_true": "field 'num_tokens': expected an int in [0, 2147483647], got True",
    "num_tokens_str": "field 'num_tokens': expected an int in [0, 2147483647], got '13'",
    "num_tokens_2_40": "field 'num_tokens': expected an int in [0, 2147483647], got 1099511627776",
    "format_list": "KV format differs: kv_format=[1, 2] on the sender (rank 0)",
    "format_str": "KV format differs: kv_format='int8' on the sender (rank 0)",
    "format_missing": "KV format differs: kv_format=None on the sender (rank 0)",
    "priority_str": "field 'priority': expected an int in [0, 127], got 'high'",
    "priority_999": "field 'priority': expected an int in [0, 127], got 999",
    "cache_salt_list": "field 'cache_salt': expected a str of at most 65536 characters, got ['a']",
    "adapter_dict": "field 'adapter_id': expected null, a str, a number or a bool, got {'a': 1}",
    "seq_id_list": "field 'seq_id': expected null, a str or a 64-bit int, got [1]",
    "seq_id_missing": "header: field 'seq_id' missing",
    "header_a_list": "not a pagedkv transfer header",
    "header_not_json": "waiting for the header: a message that is not JSON (corrupt stream)",
    "header_not_utf8": "waiting for the header: a message that is not JSON (corrupt stream)",
    "header_nested_100000": "waiting for the header: a message nested deeper than 64 (corrupt stream)",
    "magic_wrong": "not a pagedkv transfer header",
    "version_99": "protocol version 99, this side speaks 2",
    "kind_prefix": "a 'prefix' transfer, this side expects 'sequence'",
    "tokens_3_of_13": "receiving tokens: 12 bytes where 52 were announced (corrupt stream)",
    "tokens_short_frame_lies": "receiving tokens: data whose checksum does not match its frame (corrupt stream)",
    "tokens_more_than_announced": "receiving tokens: 80 bytes where 52 were announced (corrupt stream)",
    # a short payload is refused even when the receive buffer held the missing bytes already
    "tokens_short_frame_lies_stale_memory":
        "receiving tokens: data whose checksum does not match its frame (corrupt stream)",
    "header_short_frame_lies_stale_memory":
        "waiting for the header: a message whose checksum does not match its frame (corrupt stream)",
    "blocks_1_of_4": "receiving layer 0: 256 bytes where 1024 were announced (4 block(s)) (corrupt stream)",
    "blocks_1_of_4_frame_lies": "receiving layer 0: data whose checksum does not match its frame (corrupt stream)",
    "blocks_bit_flipped": "receiving layer 0: data whose checksum does not match its frame (corrupt stream)",
    "blocks_more_than_announced": "receiving layer 0: 2048 bytes where 1024 were announced (4 block(s)) "
                                  "(corrupt stream)",
}
EXPECTED_PREFIX = {
    "tokens_3_of_16": "receiving tokens: 12 bytes where 64 were announced (corrupt stream)",
    "blocks_1_of_4": "receiving layer 0: 256 bytes where 1024 were announced (4 block(s)) (corrupt stream)",
    "blocks_bit_flipped": "receiving layer 0: data whose checksum does not match its frame (corrupt stream)",
    "hashes_a_str": "field 'hashes': expected a list of 4 decimal hash strings, got '123'",
    "hashes_wrong_count": "field 'hashes': expected a list of 4 decimal hash strings, got ['1']",
    "num_tokens_not_whole_blocks": "header: num_tokens=13 is not whole blocks of 4",
}
EXPECTED_REPLIES = {
    "no_start_block": "reply: field 'start_block' missing",
    "start_block_str": "reply: field 'start_block': expected an int in [0, 4], got '3'",
    "start_block_true": "reply: field 'start_block': expected an int in [0, 4], got True",
    "start_block_negative": "reply: field 'start_block': expected an int in [0, 4], got -1",
    "start_block_99": "reply: field 'start_block': expected an int in [0, 4], got 99",
    "ok_1": "reply: field 'ok': expected True, got 1",
    "reply_a_list": "reply: expected a JSON object, got list",
    "reply_nested_100000": "a message nested deeper than 64 (corrupt stream)",
}


def test_hostile_peers_get_transfer_errors_and_leave_the_honest_side_unchanged(tmp_path):
    (send, recv), codes = run_ranks("hostile", tmp_path)
    # both ranks' tracebacks: the one that failed first is often not rank 0, which then
    # only sees its peer's connection close
    assert send["ok"] and recv["ok"], "\n\n".join(
        f"rank {r}: {rep.get('traceback') or rep.get('log') or 'ok'}" for r, rep in enumerate((send, recv)))
    assert codes == [0, 0]                      # neither process aborted
    assert set(EXPECTED_SEQUENCE) == {n for n, _ in HOSTILE_SEQUENCE}
    assert set(EXPECTED_PREFIX) == {n for n, _ in HOSTILE_PREFIX}
    assert set(EXPECTED_REPLIES) == {n for n, _ in HOSTILE_REPLIES}
    for kind, expected in (("sequence", EXPECTED_SEQUENCE), ("prefix", EXPECTED_PREFIX)):
        for name, message in expected.items():
            got = recv[kind][name]
            assert got.startswith("refused the transfer from rank 0: ") and message in got, (name, got)
            assert recv["unchanged"][f"{kind}/{name}"], name        # no sequence, no block, no hit
            assert send[kind][name] == {"ok": False, "reason": got.split("rank 0: ", 1)[1]}, name
    for name, message in EXPECTED_REPLIES.items():
        got = send["sender"][name]
        assert got.startswith("transfer with rank 1: waiting for the receiver's allocation: ") and message in got
        assert send["sender"][name + "/unchanged"], name
        assert recv["replies"][name] == f"rank 0 aborted the transfer: {got}"    # the sender told it
    assert send["after"] == 4 and recv["after"] == 13          # the pair is still in step


# ---- the pieces, in one process ------------------------------------------------------------------
def test_json_depth_skips_strings_and_escapes():
    assert json_depth(b'{"a": "[[[[", "b": [1, {"c": "\\\\\\"["}]}') == 3
    assert json_depth(b'["\\\\", ["a\\""]]') == 2
    assert json_depth(b"[" * 100000 + b"]" * 100000) == 100000
    assert json_depth(b'"x"') == 0


def test_checksum_sees_a_flipped_bit_and_a_truncation():
    t = torch.arange(64, dtype=torch.float32)
    c = checksum(t)
    u = t.clone()
    u.view(torch.uint8)[7] ^= 1
    assert checksum(u) != c
    assert checksum(t[:63]) != c
    assert checksum(t.clone()) == c


def test_schema_never_takes_a_bool_for_an_int():
    fields = {"n": integer(0, 10), "p": optional(integer(0, 3)), "a": scalar, "h": list_of_digits(2)}
    good = {"n": 3, "p": None, "a": "x", "h": ["1", "22"]}
    assert check(good, fields, "m") is None
    assert check(dict(good, n=True), fields, "m") == "m: field 'n': expected an int in [0, 10], got True"
    assert check(dict(good, n=3.0), fields, "m") == "m: field 'n': expected an int in [0, 10], got 3.0"
    assert check(dict(good, h=["1", "-2"]), fields, "m").startswith("m: field 'h': expected a list of 2")
    assert check(dict(good, a=[1]), fields, "m") == "m: field 'a': expected null, a str, a number or a bool, got [1]"
    assert check({"n": 1}, fields, "m") == "m: field 'p' missing"
    assert check([1], fields, "m") == "m: expected a JSON object, got list"


def test_metadata_a_peer_would_refuse_is_refused_before_sending():
    from pagedkv.errors import InvalidArgumentError
    from pagedkv.transfer.protocol import jsonable
    deep = []
    for _ in range(100):
        deep = [deep]
    with pytest.raises(InvalidArgumentError, match=r"metadata: expected JSON of at most \d+ bytes and nesting 32"):
        jsonable("metadata", deep)
    assert jsonable("metadata", {"next_token": 5}) == {"next_token": 5}
