"""KVEventSubscriber: reads KV events as vLLM publishes them (pagedkv's or vLLM's own).

It connects a SUB socket to a publisher (and, optionally, a DEALER socket to its
replay endpoint), decodes each ``[topic, seq, payload]`` message's ``EventBatch`` and
turns every event into a plain dict with its ``"type"`` and named fields, whether the
publisher wrote events as maps (vLLM 0.32, pagedkv's default) or as positional arrays
(older vLLM). A gap in the sequence numbers is filled from the replay endpoint when
there is one, so batches come out in order, each once.
"""
from __future__ import annotations

import time

from pagedkv.errors import InvalidArgumentError, expected
from pagedkv.kv_events.publisher import END_SEQ, _modules

__all__ = ["KVEventSubscriber", "event_fields"]

_POSITIONAL = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                    "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def event_fields(event) -> dict:
    """A wire event (a tagged map or a tagged positional array) as a dict with ``"type"``."""
    if isinstance(event, dict):
        return dict(event)
    if isinstance(event, (list, tuple)) and event and event[0] in _POSITIONAL:
        names = _POSITIONAL[event[0]]
        out = {"type": event[0]}
        out.update(zip(names, event[1:]))
        return out
    raise InvalidArgumentError(expected("event", "a tagged KV event (map or array)", repr(event)[:200]))


class KVEventSubscriber:
    """Read one publisher's batches (see the module docstring).

    Args:
        endpoint: the publisher's PUB address.
        replay_endpoint: its ROUTER address (None: gaps are not filled).
        topic: the topic to subscribe to ("" for all).
    """

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = ""):
        zmq, msgspec = _modules()
        self._zmq = zmq
        self._decode = msgspec.msgpack.decode
        ctx = zmq.Context.instance()
        self._sub = ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        self._sub.connect(endpoint)
        self._replay = None
        if replay_endpoint is not None:
            self._replay = ctx.socket(zmq.DEALER)
            self._replay.connect(replay_endpoint)
        self.next_seq = 0            # the first sequence number not yet returned
        self._caught_up = replay_endpoint is None

    def _batch(self, seq: int, payload: bytes) -> tuple[int, float, list[dict], int | None]:
        row = self._decode(payload)
        return seq, float(row[0]), [event_fields(e) for e in row[1]], (row[2] if len(row) > 2 else None)

    def replay(self, start: int, timeout: float = 5.0) -> list[tuple[int, float, list[dict], int | None]]:
        """Batches ``start, start + 1, ...`` the publisher still keeps."""
        if self._replay is None:
            return []
        self._replay.send_multipart((b"", start.to_bytes(8, "big", signed=True)))
        out = []
        deadline = time.monotonic() + timeout
        while self._replay.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            frames = self._replay.recv_multipart()[1:]            # the empty delimiter first
            seq_bytes, payload = frames[-2], frames[-1]          # [topic, seq, payload] or [seq, payload]
            if seq_bytes == END_SEQ:
                break
            out.append(self._batch(int.from_bytes(seq_bytes, "big"), payload))
        return out

    def poll(self, timeout: float = 0.0) -> list[tuple[int, float, list[dict], int | None]]:
        """``(seq, ts, events, data_parallel_rank)`` of every batch that arrived (waiting
        up to ``timeout`` seconds for the first), in order; a gap is replayed, and so is,
        at the first poll, what was published before the subscription took hold."""
        out = []
        if not self._caught_up:      # what was published before this subscription took hold
            self._caught_up = True
            for b in self.replay(self.next_seq):
                if b[0] >= self.next_seq:
                    out.append(b)
                    self.next_seq = b[0] + 1
            if out:
                timeout = 0.0
        wait = int(timeout * 1000)
        while self._sub.poll(wait):
            wait = 0
            _, seq_bytes, payload = self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq > self.next_seq:
                for b in self.replay(self.next_seq):
                    if self.next_seq <= b[0] < seq:
                        out.append(b)
                        self.next_seq = b[0] + 1
            if seq >= self.next_seq:
                out.append(self._batch(seq, payload))
                self.next_seq = seq + 1
        return out

    def close(self) -> None:
        for s in (self._sub, self._replay):
            if s is not None:
                s.close(linger=0)
