"""KVEventPublisher: a cache's KV events on a ZMQ PUB socket, as vLLM publishes them.

Each :meth:`KVEventPublisher.publish` drains the cache's events
(:meth:`pagedkv.PagedKVCache.drain_events`) into one ``EventBatch``
(:mod:`pagedkv.kv_events.wire`) and hands it to a background thread, which sends the
multipart message ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian sequence
number (0, 1, ... per publisher), ``payload`` the msgpack batch. The thread keeps the
last ``buffer_steps`` batches for a ROUTER replay socket: a subscriber that missed
some sends the first sequence number it wants (8 bytes, big-endian, after an empty
delimiter frame) and gets ``[topic, seq, payload]`` for each kept batch from there,
then ``[b"", -1, b""]``.

The engine never waits on the network: a batch that finds the queue full is dropped,
and the next batch starts with ``AllBlocksCleared`` so a mirror starts over instead of
drifting. Socket errors are counted (``num_errors``), never raised into the engine.
"""
from __future__ import annotations

import queue
import threading
from collections import deque

from pagedkv.errors import InvalidArgumentError, expected
from pagedkv.events import AllBlocksCleared
from pagedkv.kv_events.wire import MEDIA, MLA_GROUP, STATE_GROUP, WIRE_FORMATS, batch, group_spec

__all__ = ["KVEventPublisher", "END_SEQ"]

#: the replay stream's end marker
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _modules():
    try:
        import msgspec
        import zmq
    except ImportError as e:        # the `events` extra
        raise InvalidArgumentError(expected("KVEventPublisher", "pyzmq and msgspec (pip install 'pagedkv[events]')",
                                            f"ImportError: {e}")) from None
    return zmq, msgspec


class KVEventPublisher:
    """Publish ``cache``'s KV events (see the module docstring).

    Args:
        cache: a :class:`~pagedkv.PagedKVCache` with ``enable_kv_events=True``.
        endpoint: the PUB address; bound when it has a wildcard (``tcp://*:5557``,
            ``tcp://127.0.0.1:0`` picks a port: see :attr:`endpoint`) or is ``ipc://``
            or ``inproc://``, else connected.
        replay_endpoint: the ROUTER address for replays (bound), or None.
        topic: the first frame of every message (llm-d reads ``kv@<pod>@<model>``).
        data_parallel_rank: carried in every batch (None: left out).
        media: pagedkv medium -> wire medium (default :data:`~pagedkv.kv_events.wire.MEDIA`).
        wire_format: ``"map"`` (vLLM 0.32) or ``"array"`` (older vLLM, positional events).
        buffer_steps: batches kept for replay.
        hwm: the PUB socket's high-water mark.
        max_queue: batches waiting for the thread before one is dropped.
    """

    def __init__(self, cache, endpoint: str = "tcp://*:5557", *, replay_endpoint: str | None = None,
                 topic: str = "", data_parallel_rank: int | None = None, media: dict[str, str] | None = None,
                 wire_format: str = "map", buffer_steps: int = 10_000, hwm: int = 100_000, max_queue: int = 10_000):
        zmq, msgspec = _modules()
        if not getattr(cache.config, "enable_kv_events", False):
            raise InvalidArgumentError(expected("cache", "a PagedKVCache with enable_kv_events=True", "events off"))
        if wire_format not in WIRE_FORMATS:
            raise InvalidArgumentError(expected("wire_format", " or ".join(map(repr, WIRE_FORMATS)), repr(wire_format)))
        for name, v, low in (("buffer_steps", buffer_steps, 1), ("hwm", hwm, 0), ("max_queue", max_queue, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise InvalidArgumentError(expected(name, f"an int >= {low}", repr(v)))
        self.cache = cache
        self.topic = topic.encode("utf-8")
        self.rank = data_parallel_rank
        self.media = dict(MEDIA, **(media or {}))
        self.wire_format = wire_format
        plan = cache.config.layer_groups
        self.groups = [group_spec(g.window) for g in plan.groups] if plan is not None else [group_spec(0)]
        if getattr(cache.config, "kv_lora_rank", None) is not None:   # every layer stores a latent row
            self.groups = [MLA_GROUP]
        if getattr(cache.config, "state_spec", None) is not None:   # the snapshots' group, after the attention's
            self.groups.append(STATE_GROUP)
        self._encode = msgspec.msgpack.Encoder().encode
        self._queue: queue.Queue[bytes | threading.Event | None] = queue.Queue(maxsize=max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lost = False
        self.num_batches = 0          # batches sent
        self.num_dropped = 0          # batches dropped (queue full)
        self.num_errors = 0           # sends or replays that failed
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self._thread: threading.Thread | None = threading.Thread(target=self._run, args=(zmq, endpoint, replay_endpoint, hwm),
                                        name="pagedkv-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise InvalidArgumentError(expected("endpoint", "addresses ZMQ can bind or connect",
                                                f"{type(self._error).__name__}: {self._error}")) from None

    # ---- the engine's side ---------------------------------------------------------------------
    def publish(self, events: list | None = None) -> int:
        """Send the cache's pending events (or ``events``) as one batch; returns how many
        wire events it held (0: nothing sent)."""
        if self._thread is None:
            raise InvalidArgumentError(expected("KVEventPublisher", "an open publisher", "closed"))
        if events is None:
            events = self.cache.drain_events()
        if self._lost:
            events = [AllBlocksCleared()] + list(events)
        if not events:
            return 0
        row = batch(events, media=self.media, groups=self.groups, wire_format=self.wire_format,
                    data_parallel_rank=self.rank)
        try:
            self._queue.put_nowait(self._encode(row))
            self._lost = False
        except queue.Full:
            self.num_dropped += 1
            self._lost = True
            return 0
        return len(row[1])

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued batch was sent (True) or ``timeout`` passed."""
        done = threading.Event()
        try:
            self._queue.put(done, timeout=timeout)     # a marker the thread sets once it got there
        except queue.Full:
            return False
        return done.wait(timeout)

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to ``timeout``), then close the sockets."""
        t = self._thread
        if t is None:
            return
        self._thread = None
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        t.join(timeout)

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the thread --------------------------------------------------------------------------------
    def _run(self, zmq, endpoint: str, replay_endpoint: str | None, hwm: int) -> None:
        ctx = zmq.Context.instance()
        pub = replay = None
        try:
            pub = ctx.socket(zmq.PUB)
            pub.set_hwm(hwm)
            if "*" in endpoint or endpoint.endswith(":0") or endpoint.startswith(("ipc://", "inproc://")):
                pub.bind(endpoint)
                self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                pub.connect(endpoint)
            if replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.bind(replay_endpoint)
                self.replay_endpoint = replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception as e:
            self._error = e
            for s in (pub, replay):
                if s is not None:
                    s.close(linger=0)
            self._ready.set()
            return
        self._ready.set()
        seq = 0
        try:
            while True:
                if replay is not None and replay.poll(0):
                    self._serve_replay(replay)
                try:
                    item = self._queue.get(timeout=0.02)
                except queue.Empty:
                    continue
                if item is None:
                    break
                if isinstance(item, threading.Event):
                    item.set()
                    continue
                try:
                    pub.send_multipart((self.topic, seq.to_bytes(8, "big"), item))
                    self._buffer.append((seq, item))
                    self.num_batches += 1
                    seq += 1
                except Exception:
                    self.num_errors += 1
        finally:
            pub.close(linger=100)
            if replay is not None:
                replay.close(linger=0)

    def _serve_replay(self, replay) -> None:
        try:
            frames = replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                return                      # not a replay request: ignored
            client, _, start = frames
            first = int.from_bytes(start, "big", signed=True)
            for s, payload in list(self._buffer):
                if s >= first:
                    replay.send_multipart((client, b"", self.topic, s.to_bytes(8, "big"), payload))
            replay.send_multipart((client, b"", b"", END_SEQ, b""))
        except Exception:
            self.num_errors += 1
