"""Old module paths of the flat layout, kept importable for one release.

pagedkv's modules moved into packages named for their concept (``pagedkv.manager``,
``pagedkv.store``, ``pagedkv.groups``, ``pagedkv.config``, ``pagedkv.sched``, ...). Engines
import about twenty of the old paths, so removing them at once would be an API break. A
meta-path finder maps each old path to its new module: ``import pagedkv.cache`` gives the very
module object ``pagedkv.manager.cache`` (same classes, so ``isinstance`` and monkeypatching
keep working), with a :class:`DeprecationWarning` that names the new path. One finder instead
of thirty stub files keeps the package's top level down to what is really there.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import ModuleType
from typing import Any

#: old module path -> new module path. ``pagedkv.config`` and ``pagedkv.store`` are packages
#: now; they re-export their old module's names themselves (see their ``__init__``).
#: ``pagedkv.events`` is a real module again (0.3): events are below both the manager and
#: the tiers, so the 0.1 path needs no redirect.
MOVED: dict[str, str] = {
    "pagedkv.cache": "pagedkv.manager.cache",
    "pagedkv.stats": "pagedkv.manager.stats",
    "pagedkv.threads": "pagedkv.manager.threads",
    "pagedkv.seq_ids": "pagedkv.manager.seq_ids",
    "pagedkv.namespaces": "pagedkv.manager.namespaces",
    "pagedkv.pool_view": "pagedkv.manager.pool_view",
    "pagedkv.compaction": "pagedkv.manager.compaction",
    "pagedkv.buddy": "pagedkv.manager.buddy",
    "pagedkv.arguments": "pagedkv.manager.arguments",
    "pagedkv.group_tables": "pagedkv.groups.tables",
    "pagedkv.group_data": "pagedkv.groups.data",
    "pagedkv.layer_groups": "pagedkv.groups.layers",
    "pagedkv.window": "pagedkv.store.window",
    "pagedkv.block_keys": "pagedkv.store.block_keys",
    "pagedkv.kvformat": "pagedkv.format.fingerprint",
    "pagedkv.quant": "pagedkv.format.quant",
    "pagedkv.rotation": "pagedkv.format.rotation",
    "pagedkv.dtypes": "pagedkv.format.dtypes",
    "pagedkv.calibration": "pagedkv.tools.calibration",
    "pagedkv.op_checks": "pagedkv.format.op_checks",
    "pagedkv.offload": "pagedkv.tiers.swap",
    "pagedkv.prefill": "pagedkv.sched.prefill",
    "pagedkv.chunking": "pagedkv.sched.chunking",
    "pagedkv.distributed": "pagedkv.transfer.distributed",
    "pagedkv.support": "pagedkv.config.support",
    "pagedkv.planner": "pagedkv.config.planner",
    "pagedkv.gguf_metadata": "pagedkv.config.gguf",
    "pagedkv.memory_check": "pagedkv.config.memory",
    # 0.2 paths that moved in 0.3 (issue 34: the format below the ops, the arena owner above)
    "pagedkv.store.dtypes": "pagedkv.format.dtypes",
    "pagedkv.store.quant": "pagedkv.format.quant",
    "pagedkv.store.layer_format": "pagedkv.format.layer_format",
    "pagedkv.store.rotation": "pagedkv.format.rotation",
    "pagedkv.store.format": "pagedkv.format.fingerprint",
    "pagedkv.store.op_checks": "pagedkv.format.op_checks",
    "pagedkv.store.calibration": "pagedkv.tools.calibration",
    "pagedkv.manager.events": "pagedkv.events",
}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(
            f"{spec.name} moved to {self.target}; the old path goes away in the next release",
            DeprecationWarning, stacklevel=2,
        )
        module = importlib.import_module(self.target)
        # importlib stamps the alias's spec onto the module it gets back; keep the real one
        self._real_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self._real_spec


class _MovedFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: object = None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())


def reexport(package: str, module: str):
    """A module ``__getattr__`` for a package that was a module in 0.1 (``pagedkv.config``,
    ``pagedkv.store``): a submodule not imported yet is imported (``from pkg import sub`` asks
    the package first), any other name is looked up in ``module`` (the old module's contents)
    when first asked for, so importing one sibling does not import them all."""
    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{package}.{name}":
                raise
        try:
            return getattr(importlib.import_module(module), name)
        except AttributeError:
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None
    return __getattr__
