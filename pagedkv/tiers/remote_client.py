"""The transport of a remote tier: the ``redis`` client (one server or a Redis Cluster),
pipelined batches, and the rules that bound how long a caller waits.

- Every call runs on a small pool of reader threads and the caller waits at most its
  deadline (``timeout_s``): a server that hangs, a dropped connection or a cluster node
  that went down mid-call costs a miss, never a hang. The sockets time out too, so the
  reader threads come back.
- After a failure the server is skipped for ``retry_after_s`` (doubling, at most 30 s,
  while failures go on): a down server costs one timeout, not one per request.
- Batches are pipelined (one round trip per batch; per node on a cluster) and answer
  per key: a key on a node that is down fails alone.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any
from urllib.parse import urlsplit

from pagedkv.config.remote import RemoteTierConfig
from pagedkv.errors import InvalidArgumentError, expected

__all__ = ["RemoteClient", "Unavailable"]

_MAX_BACKOFF_S = 30.0


class Unavailable(Exception):
    """The server did not answer in time, refused, or is being skipped after a failure
    (internal: the tier turns it into a miss)."""


def _redis():
    try:
        import redis
    except ImportError as e:       # the `remote` extra
        raise InvalidArgumentError(expected("prefix_remote", "the redis package (pip install 'pagedkv[remote]')",
                                            f"ImportError: {e}")) from None
    return redis


class RemoteClient:
    """One remote server or cluster, per :class:`~pagedkv.config.remote.RemoteTierConfig`."""

    def __init__(self, cfg: RemoteTierConfig, readers: int = 4):
        self.cfg = cfg
        self._redis = _redis()
        self._client: Any = None
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="pagedkv-remote")
        self._busy = threading.Semaphore(readers)
        self._open_until = 0.0
        self._backoff = 0.0
        self.num_errors = 0          # calls that failed or timed out
        self.last_error = ""

    # ---- connection -----------------------------------------------------------------------
    def _connect(self):
        with self._lock:
            if self._client is None:
                r, cfg = self._redis, self.cfg
                from redis.backoff import NoBackoff
                from redis.retry import Retry

                # one immediate retry on a dropped connection (a pooled socket the server
                # closed), none on a timeout: the caller's deadline is what bounds a call
                common: dict[str, Any] = dict(socket_timeout=cfg.timeout_s, socket_connect_timeout=cfg.timeout_s,
                                              retry=Retry(NoBackoff(), 1, supported_errors=(r.ConnectionError,)))
                if cfg.cluster:
                    from redis.cluster import ClusterNode, RedisCluster

                    u = urlsplit(cfg.url)
                    nodes = []
                    for part in u.netloc.rsplit("@", 1)[-1].split(","):
                        host, _, port = part.rpartition(":")
                        nodes.append(ClusterNode(host or "127.0.0.1", int(port or 6379)))
                    self._client = RedisCluster(startup_nodes=nodes, require_full_coverage=False,
                                                ssl=u.scheme.startswith("rediss"), username=u.username,
                                                password=u.password, **common)
                else:
                    self._client = r.Redis.from_url(cfg.url, **common)
            return self._client

    # ---- calls with a deadline ---------------------------------------------------------------------
    @property
    def available(self) -> bool:
        return time.monotonic() >= self._open_until

    def failed(self, why: str) -> None:
        self.num_errors += 1
        self.last_error = why[:300]
        self._backoff = min(_MAX_BACKOFF_S, max(self.cfg.retry_after_s, self._backoff * 2))
        self._open_until = time.monotonic() + self._backoff

    def succeeded(self) -> None:
        self._backoff = 0.0

    def submit(self, fn: Callable[..., Any], *args) -> Future:
        """Run ``fn(client, *args)`` on a reader thread (raises :class:`Unavailable` when
        the server is being skipped or every reader is busy)."""
        if not self.available:
            raise Unavailable("skipped after a failure")
        if not self._busy.acquire(blocking=False):
            raise Unavailable("every reader is busy")

        def run():
            try:
                return fn(self._connect(), *args)
            finally:
                self._busy.release()

        try:
            return self._pool.submit(run)
        except RuntimeError as e:      # shut down
            self._busy.release()
            raise Unavailable(str(e)) from None

    def wait(self, future: Future, deadline: float):
        """``future``'s result by ``deadline`` (monotonic), else :class:`Unavailable`."""
        try:
            out = future.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            self.failed("timed out")
            raise Unavailable("timed out") from None
        except Exception as e:
            self.failed(f"{type(e).__name__}: {e}")
            raise Unavailable(str(e)) from None
        self.succeeded()
        return out

    def call(self, fn: Callable[..., Any], *args, deadline: float | None = None):
        if deadline is None:
            deadline = time.monotonic() + self.cfg.timeout_s
        return self.wait(self.submit(fn, *args), deadline)

    def direct(self, fn: Callable[..., Any], *args):
        """Run ``fn(client, *args)`` on this thread (the writer's), counting failures."""
        if not self.available:
            raise Unavailable("skipped after a failure")
        try:
            out = fn(self._connect(), *args)
        except Exception as e:
            self.failed(f"{type(e).__name__}: {e}")
            raise Unavailable(str(e)) from None
        self.succeeded()
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            c, self._client = self._client, None
        if c is not None:
            try:
                c.close()
            except Exception:
                pass


# ---- pipelined batches (run on a reader or the writer thread) ----------------------------------------
def _run(pipe) -> list:
    n = len(pipe)
    try:
        return pipe.execute(raise_on_error=False)
    except Exception as e:          # the whole batch failed (a cluster may raise as a whole)
        return [e] * n


def _in_order(res: list, keys: list[bytes], one) -> list:
    """A batch that failed as a whole (a cluster pipeline raises when one node is down)
    asked again key by key, in chain order, up to the first key that fails: the blocks
    before a dead node's first block are still served."""
    if len(keys) < 2 or not all(isinstance(r, Exception) for r in res):
        return res
    out: list = []
    for k in keys:
        try:
            out.append(one(k))
        except Exception as e:
            return out + [e] * (len(keys) - len(out))
    return out


def get_many(client, keys: list[bytes], ttl_ms: int | None) -> list:
    """Values (bytes, None when absent, or an exception per key), refreshing each TTL."""
    pipe = client.pipeline(transaction=False)
    for k in keys:
        if ttl_ms is None:
            pipe.get(k)
        else:
            pipe.getex(k, px=ttl_ms)
    return _in_order(_run(pipe), keys, client.get if ttl_ms is None else (lambda k: client.getex(k, px=ttl_ms)))


def exists_many(client, keys: list[bytes]) -> list:
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.exists(k)
    return _in_order(_run(pipe), keys, client.exists)


def set_many(client, items: list[tuple[bytes, bytes]], ttl_ms: int | None) -> list:
    pipe = client.pipeline(transaction=False)
    for k, v in items:
        pipe.set(k, v, px=ttl_ms)
    return _run(pipe)


def expire_many(client, keys: list[bytes], ttl_ms: int) -> list:
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.pexpire(k, ttl_ms)
    return _run(pipe)


def delete_matching(client, pattern: bytes, batch: int = 512) -> int:
    """Remove every key matching ``pattern`` (SCAN + UNLINK; on a cluster, every node)."""
    n = 0
    keys: list[bytes] = []
    for k in client.scan_iter(match=pattern, count=batch):
        keys.append(k)
        if len(keys) >= batch:
            n += _unlink(client, keys)
            keys = []
    if keys:
        n += _unlink(client, keys)
    return n


def _unlink(client, keys: list[bytes]) -> int:
    pipe = client.pipeline(transaction=False)
    for k in keys:
        pipe.unlink(k)
    return sum(int(r) for r in _run(pipe) if isinstance(r, int))
