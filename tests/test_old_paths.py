"""The flat layout's module paths still import, for one release (issue 23, layout by concept).

Each old path must give the very module object of its new home (so a class imported either way
is the same class and monkeypatching one patches the other) and warn with the new path named.
``pagedkv.config`` and ``pagedkv.store`` became packages: they must still hand out every public
name their old module had.
"""
from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

from pagedkv._moved import MOVED

# every old top-level module of the flat layout (0.1.0), listed here on purpose rather than read
# from MOVED, so dropping a redirect by mistake fails this test
# (``events`` was one of them: it is a real module at its 0.1 path again, see below)
OLD_MODULES = [
    "arguments", "block_keys", "buddy", "cache", "calibration", "chunking", "compaction",
    "distributed", "dtypes", "gguf_metadata", "group_data", "group_tables",
    "kvformat", "layer_groups", "memory_check", "namespaces", "offload", "op_checks",
    "planner", "pool_view", "prefill", "quant", "rotation", "seq_ids", "stats", "support",
    "threads", "window",
]
# 0.2 paths that moved in 0.3 (issue 34: the format below the ops, calibration above the
# manager, the events below the manager and the tiers), also listed on purpose
MOVED_02 = [
    "store.dtypes", "store.quant", "store.layer_format", "store.rotation", "store.format", "store.op_checks",
    "store.calibration", "manager.events",
]


@pytest.mark.parametrize("old", OLD_MODULES + MOVED_02)
def test_old_path_is_the_new_module(old):
    name = f"pagedkv.{old}"
    new = importlib.import_module(MOVED[name])
    sys.modules.pop(name, None)
    with pytest.warns(DeprecationWarning, match=f"{name} moved to {MOVED[name]}"):
        mod = importlib.import_module(name)
    assert mod is new
    assert mod.__spec__.name == MOVED[name]          # the real spec, not the alias's
    public = [n for n in vars(new) if not n.startswith("_")]
    assert public, name
    for attr in public:
        assert getattr(mod, attr) is getattr(new, attr)


def test_from_import_of_old_names():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from pagedkv.cache import PagedKVCache as old_cls
        from pagedkv.support import UnsupportedCombinationError as old_err
    from pagedkv import PagedKVCache
    from pagedkv.config.support import UnsupportedCombinationError

    assert old_cls is PagedKVCache and old_err is UnsupportedCombinationError


@pytest.mark.parametrize("package, module", [("pagedkv.config", "pagedkv.config.options"),
                                             ("pagedkv.store", "pagedkv.store.kvstore")])
def test_packages_keep_their_old_module_names(package, module):
    pkg, mod = importlib.import_module(package), importlib.import_module(module)
    public = [n for n in vars(mod) if not n.startswith("_")]
    assert len(public) > 5
    for attr in public:
        assert getattr(pkg, attr) is getattr(mod, attr), attr
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        pkg.no_such_name


def test_every_redirect_target_exists_and_is_listed():
    assert sorted(k.removeprefix("pagedkv.") for k in MOVED) == sorted(OLD_MODULES + MOVED_02)
    for new in MOVED.values():
        importlib.import_module(new)


def test_old_path_in_a_fresh_interpreter():
    """A user's first import being an old path (nothing of pagedkv loaded yet) must work too."""
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "try:\n    import pagedkv.window\nexcept DeprecationWarning as w:\n    print('warned', w)\n"
            "warnings.simplefilter('ignore')\n"
            "from pagedkv.group_tables import GroupTables; import pagedkv.groups.tables as t\n"
            "print(GroupTables is t.GroupTables)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "warned pagedkv.window moved to pagedkv.store.window" in out.stdout
    assert out.stdout.strip().endswith("True")


def test_renamed_names_keep_their_old_spelling():
    """Names that collided were renamed (docs/names.md); the 0.1 spellings still work."""
    from pagedkv import CacheConfig
    from pagedkv.tiers.swap import HostSwap

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from pagedkv.offload import HostTier
    assert HostTier is HostSwap
    cfg = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=8, num_blocks=8, block_size=4,
                      kv_dtype="int8", kv_sink_tokens=5)
    assert cfg.precise_sink_blocks == cfg.sink_blocks == 2


def test_events_is_home_again_at_its_01_path():
    """``pagedkv.events`` (0.1) -> ``pagedkv.manager.events`` (0.2) -> ``pagedkv.events`` (0.3):
    the 0.1 path imports without a warning, the 0.2 one redirects to the same module."""
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "import pagedkv.events as e\n"
            "from pagedkv import BlockStored\n"
            "print(e.BlockStored is BlockStored, e.__spec__.name)\n"
            "warnings.simplefilter('ignore')\n"
            "import pagedkv.manager.events as old\n"
            "print(old is e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "pagedkv.events", "True"]


def test_store_package_hands_out_its_moved_format_modules():
    """``from pagedkv.store import quant`` (0.2) still gives the format module, with the warning."""
    import pagedkv.format.quant as quant
    import pagedkv.store

    sys.modules.pop("pagedkv.store.quant", None)
    vars(pagedkv.store).pop("quant", None)     # an earlier import bound it on the package
    with pytest.warns(DeprecationWarning, match="pagedkv.store.quant moved to pagedkv.format.quant"):
        from pagedkv.store import quant as old
    assert old is quant
