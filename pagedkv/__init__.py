"""pagedkv: a paged KV-cache library for LLM inference engines.

The bookkeeping core (``pagedkv._core``) is Cython and needs only NumPy; the KV store,
the data ops and the model integrations need torch (``pip install pagedkv[torch]``).
"""
from pagedkv._moved import install as _install_moved_paths
from pagedkv.errors import *  # noqa: F401,F403

_install_moved_paths()

__version__ = "0.2.0"

try:
    from pagedkv._core.pool import BlockPool
except ImportError as exc:  # pragma: no cover - depends on how pagedkv was imported
    import os as _os

    _here = _os.path.dirname(_os.path.abspath(__file__))
    if _os.path.exists(_os.path.join(_here, "..", "setup.py")):
        raise ImportError(
            f"pagedkv is being imported from its source tree ({_here}) without compiled "
            "extensions. Run from outside the checkout after `pip install .`, or build in "
            "place with `python setup.py build_ext --inplace`."
        ) from exc
    raise

from pagedkv._core.prefix import PrefixIndex  # noqa: E402
from pagedkv._core.tables import BlockTables  # noqa: E402
from pagedkv.config.options import CacheConfig  # noqa: E402
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from pagedkv.manager.cache import PagedKVCache  # noqa: E402
from pagedkv.manager.stats import CacheStats  # noqa: E402
from pagedkv.manager.threads import _from_env as _threads_from_env  # noqa: E402
from pagedkv.manager.threads import get_num_threads, set_num_threads  # noqa: E402

_threads_from_env()

__all__ = [
    "BlockPool", "PrefixIndex", "BlockTables", "PagedKVCache", "CacheConfig", "CacheStats",
    "BlockStored", "BlockRemoved", "AllBlocksCleared",
    "set_num_threads", "get_num_threads", "__version__",
]
