"""Layer-wise copies on the connector's worker side: loads overlap the forward, saves run behind it.

With ``transfer="layerwise"`` vLLM's per-layer hooks drive the copies of a step:

- ``start_load_kv`` checks the step's ``(slot, block)`` pairs and queues the first
  ``depth`` layers' loads; ``wait_for_layer_load(layer)`` queues layer ``i + depth`` and
  blocks until layer ``i`` is in vLLM's tensor, so the forward of layer ``i`` runs while
  the next layers load.
- ``save_kv_layer(layer)`` (after that layer's attention wrote this step's KV) queues
  that layer's save; ``wait_for_save`` waits for the step's copies before vLLM may free
  or reuse a block, so nothing a later step writes can reach a slot.

One background thread runs the copies in order from a queue of at most ``depth`` jobs;
a save that finds it full waits (back-pressure, counted in ``num_backpressure``), so a
slow arena slows the forward instead of growing memory. A failed layer fails the whole
step's loads (a block is usable only with every layer) or saves; a layer the forward
never waited for is counted (``num_unwaited``) and its load reported failed, since the
forward may have read it before the copy: vLLM then recomputes those blocks or fails the
requests, as its ``kv_load_failure_policy`` says.
"""
from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

from pagedkv.errors import InternalError

__all__ = ["CopyQueue", "LayerCopies"]

log = logging.getLogger("pagedkv.vllm")


class _Job:
    __slots__ = ("done", "error", "fn")

    def __init__(self, fn: Callable[[], None]):
        self.fn, self.error, self.done = fn, None, threading.Event()


class CopyQueue:
    """One daemon thread running copies in submission order; at most ``depth`` waiting."""

    def __init__(self, depth: int):
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self.num_backpressure = 0
        self._thread = threading.Thread(target=self._run, name="pagedkv-vllm-copies", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                job.fn()
            except BaseException as e:      # reported through the job: the step fails over, the thread lives
                job.error = e
            finally:
                job.done.set()

    def submit(self, fn: Callable[[], None]) -> _Job:
        if not self._thread.is_alive():
            raise InternalError("pagedkv connector: the copy thread is closed")
        job = _Job(fn)
        if self._q.full():
            self.num_backpressure += 1
        self._q.put(job)
        return job

    def close(self, timeout: float = 30.0) -> None:
        if self._thread.is_alive():
            self._q.put(None)
            self._thread.join(timeout)


class LayerCopies:
    """One step's layer-wise loads and saves through ``mover`` (a :class:`.vllm_worker.BlockMover`)."""

    def __init__(self, mover, layer_names: Sequence[str], depth: int):
        self.mover = mover
        self.index = {name: i for i, name in enumerate(layer_names)}
        self.n = len(layer_names)
        self.depth = depth
        self.queue = CopyQueue(depth)
        self.num_unwaited = 0
        self._loads: list[_Job | None] = []
        self._waited: list[bool] = []
        self._load_args: tuple | None = None
        self._saves: list[_Job | None] = []
        self._save_args: tuple | None = None

    @property
    def num_backpressure(self) -> int:
        return self.queue.num_backpressure

    # ---- loads -------------------------------------------------------------------------
    def start_loads(self, sa, codec, pairs) -> None:
        """Check the step's ``(slot, block)`` pairs (a typed error: nothing queued) and
        queue the first ``depth`` layers."""
        if self._load_args is not None:
            raise InternalError("pagedkv connector: a step's loads started twice")
        slots, blocks = self.mover.load_pairs(sa, pairs)
        self._load_args = (sa, codec, slots, blocks)
        self._loads = [None] * self.n
        self._waited = [False] * self.n
        for i in range(min(self.depth, self.n)):
            self._queue_load(i)

    def _queue_load(self, i: int) -> None:
        if self._load_args is None or self._loads[i] is not None:
            return
        sa, codec, slots, blocks = self._load_args
        self._loads[i] = self.queue.submit(lambda: self.mover.load_layer(sa, codec, i, slots, blocks))

    def wait_layer(self, name: str) -> None:
        """Block until layer ``name``'s load is done (queueing the one ``depth`` ahead)."""
        i = self.index.get(name)
        if i is None or self._load_args is None:
            return
        if i + self.depth < self.n:
            self._queue_load(i + self.depth)
        self._queue_load(i)
        job = self._loads[i]
        if job is not None:
            job.done.wait()
        self._waited[i] = True

    def finish_loads(self) -> BaseException | None:
        """End of the step: wait for every queued load; the first error (None: all loaded)."""
        if self._load_args is None:
            return None
        err: BaseException | None = None
        for i, job in enumerate(self._loads):
            if job is not None:
                job.done.wait()
                err = err or job.error
            if not self._waited[i]:    # the forward may have read the block before the copy
                self.num_unwaited += 1
                err = err or InternalError(f"pagedkv connector: layer {i}'s load was never waited for")
        self._loads, self._load_args = [], None
        return err

    # ---- saves -------------------------------------------------------------------------
    def start_saves(self, sa, codec, pairs) -> None:
        """Check the step's ``(block, slot)`` pairs (a typed error: nothing queued)."""
        if self._save_args is not None:
            raise InternalError("pagedkv connector: a step's saves started twice")
        blocks, slots = self.mover.save_pairs(sa, pairs)
        self._save_args = (sa, codec, blocks, slots)
        self._saves = [None] * self.n

    @property
    def saving(self) -> bool:
        return self._save_args is not None

    def save_layer(self, name: str) -> None:
        i = self.index.get(name)
        if i is None or self._save_args is None or self._saves[i] is not None:
            return
        sa, codec, blocks, slots = self._save_args
        self._saves[i] = self.queue.submit(lambda: self.mover.save_layer(sa, codec, i, blocks, slots))

    def finish_saves(self) -> BaseException | None:
        """Wait for the step's saves; a layer the forward did not pass on is saved now
        (its KV is final once the forward is over)."""
        if self._save_args is None:
            return None
        sa, codec, blocks, slots = self._save_args
        err: BaseException | None = None
        for i, job in enumerate(self._saves):
            if job is None:
                try:
                    self.mover.save_layer(sa, codec, i, blocks, slots)
                except Exception as e:
                    err = err or e
                continue
            job.done.wait()
            err = err or job.error
        self._saves, self._save_args = [], None
        return err

    def close(self) -> None:
        self.finish_loads()
        self.finish_saves()
        self.queue.close()
