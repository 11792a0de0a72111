"""The connector's settings, read from vLLM's ``kv_connector_extra_config``.

Every key is optional; an unknown key or a bad value raises a typed pagedkv error
naming the key, what was expected and what came (vLLM then refuses to start, which is
better than a connector that silently does something else)."""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

from pagedkv.config.remote import RemoteTierConfig
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError, expected

__all__ = ["ConnectorConfig", "STORAGE_FORMATS"]

#: how blocks are kept at rest (host and disk): vLLM's bf16 bytes, or quantized.
STORAGE_FORMATS = ("bf16", "int8", "fp8", "int4", "int2")


@dataclasses.dataclass(frozen=True)
class ConnectorConfig:
    """Args (``kv_connector_extra_config`` keys):
        host_blocks: blocks the host tier holds (0: no host tier; loads still pass
            through a host staging slot, so at least 1 is used when a disk is set).
        disk_dir: directory of the disk tier (None: no disk tier). Two engines may
            share one; each opens it only for the moment of a lookup or a write.
        disk_blocks: the disk tier's limit in blocks: its files start at 64 MiB (or the
            limit, if smaller) and grow on demand up to it; a reset gives the space back.
        disk_write: ``"through"`` (every stored block also goes to disk at once, so a
            crash or a restart loses nothing) or ``"back"`` (only host evictions go down).
        eviction: ``"lru"`` or ``"frequency"`` (pagedkv's tier policies).
        storage: one of :data:`STORAGE_FORMATS`.
        model_tag: names the weights (two models of one shape have different KV);
            default: vLLM's model path or name.
        lock_timeout_s: how long to wait for another engine's hold on the disk tier
            before counting a miss (or skipping a write); finite, at most a day.
        report_timeout_s: how long the scheduler side waits for the worker's report of
            a step's copies (it comes with that step's output). Past it, the step's
            pending saves are dropped (a later miss) and its loads' leases released, so
            a lost report (a worker that failed the step) cannot hold host slots for
            good; counted in ``PrefixStore.num_report_timeouts``. A report that comes
            later is ignored. Finite, > 0, at most a day.
        rotation_seed: the fp8 format's Hadamard sign seed (part of the format).
        remote: a remote tier shared by engines on many hosts (a Redis server or a
            Redis Cluster; :mod:`pagedkv.tiers.remote`): its URL or a mapping of
            :class:`~pagedkv.config.remote.RemoteTierConfig`'s fields. Lookups that the
            host and disk tiers cannot serve ask it (each block verified: tokens, chain
            link, format, checksum); committed blocks go to it in the background.
        transfer: ``"sync"`` (every layer copied before the forward and after it) or
            ``"layerwise"`` (loads overlap the forward layer by layer, saves run behind
            it on a background thread: :mod:`.vllm_layerwise`).
        transfer_depth: layer-wise copies queued at most (back-pressure beyond), >= 1.
        weak_hash: tests only: a 4-valued tier hash, so collisions happen constantly.
    """

    host_blocks: int = 256
    disk_dir: str | None = None
    disk_blocks: int = 1024
    disk_write: str = "through"
    eviction: str = "lru"
    storage: str = "bf16"
    model_tag: str | None = None
    lock_timeout_s: float = 5.0
    report_timeout_s: float = 60.0
    rotation_seed: int = 0x5EED
    transfer: str = "sync"
    transfer_depth: int = 4
    weak_hash: bool = False
    remote: str | dict | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ArgumentTypeError(expected("kv_connector_extra_config", "a mapping of settings (or None)",
                                             type(extra).__name__))
        extra = dict(extra)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted((k for k in extra if k not in names), key=repr)
        if unknown:
            raise InvalidArgumentError(expected("kv_connector_extra_config", f"keys among {sorted(names)}",
                                                f"unknown key {unknown[0]!r}"[:200]))
        cfg = cls(**extra)
        cfg._check()
        return cfg

    def _check(self) -> None:
        def bad(key, what):
            raise InvalidArgumentError(expected(f"kv_connector_extra_config[{key!r}]", what,
                                                repr(getattr(self, key))[:200]))
        for key, hi in (("host_blocks", 2**40), ("disk_blocks", 2**31 - 1), ("rotation_seed", 2**63 - 1)):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
                bad(key, f"an int in [0, {hi}]")
        if self.disk_dir is not None and (not isinstance(self.disk_dir, str) or not self.disk_dir):
            bad("disk_dir", "a directory path (str) or None")
        if self.disk_dir is not None and self.disk_blocks < 1:
            bad("disk_blocks", "an int >= 1 when disk_dir is set")
        if self.disk_dir is None and self.host_blocks < 1:
            bad("host_blocks", "an int >= 1 when there is no disk_dir (else nothing is stored)")
        if self.disk_write not in ("through", "back"):
            bad("disk_write", "'through' or 'back'")
        if self.transfer not in ("sync", "layerwise"):
            bad("transfer", "'sync' or 'layerwise'")
        td = self.transfer_depth
        if isinstance(td, bool) or not isinstance(td, int) or not 1 <= td <= 1024:
            bad("transfer_depth", "an int in [1, 1024]")
        if self.eviction not in ("lru", "frequency"):
            bad("eviction", "'lru' or 'frequency'")
        if self.storage not in STORAGE_FORMATS:
            bad("storage", f"one of {STORAGE_FORMATS}")
        if self.model_tag is not None and not isinstance(self.model_tag, str):
            bad("model_tag", "a str or None")
        for key, lo in (("lock_timeout_s", 0.0), ("report_timeout_s", None)):
            v = getattr(self, key)
            # a day at most: an infinite or absurd wait would hang a step for good
            ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v) and \
                (v >= 0 if lo is not None else v > 0) and v <= 86400
            if not ok:
                bad(key, "a finite number of seconds in " + ("[0, 86400]" if lo is not None else "(0, 86400]"))
        if not isinstance(self.weak_hash, bool):
            bad("weak_hash", "a bool")
        if self.remote is not None and not isinstance(self.remote, (str, dict)):
            bad("remote", "a URL (str), a mapping of RemoteTierConfig fields, or None")
        try:
            self.remote_config
        except (InvalidArgumentError, ArgumentTypeError) as e:
            raise type(e)(f"kv_connector_extra_config['remote']: {e}") from None

    @property
    def disk_path(self) -> str | None:
        return None if self.disk_dir is None else os.path.abspath(os.path.expanduser(self.disk_dir))

    @property
    def remote_config(self) -> RemoteTierConfig | None:
        return RemoteTierConfig.of(self.remote)

    @property
    def staging_blocks(self) -> int:
        # Disk hits are promoted through the host tier, so a disk-only setup keeps a small one.
        return self.host_blocks if self.host_blocks else 64
