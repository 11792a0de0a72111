"""Configuration: the cache's options (``options``), what combines (``support``), sizes and
the memory check (``memory``), the planner (``planner``) and GGUF metadata (``gguf``).

``from pagedkv.config import CacheConfig`` keeps working: names of the options module are
looked up lazily, so importing a sibling module does not import the whole configuration.
"""
from pagedkv._moved import reexport

__getattr__ = reexport(__name__, "pagedkv.config.options")
