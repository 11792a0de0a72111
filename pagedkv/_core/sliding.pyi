from pagedkv._core.pool import BlockPool
from pagedkv._core.prefix import PrefixIndex
from pagedkv._core.tables import TablesBase

class SlidingWindowTables(TablesBase):
    """Sliding-window attention: ``window >= 1`` tokens, ``sinks`` in [0, window)."""
    def __init__(self, pool: BlockPool, block_size: int, index: PrefixIndex | None = None,
                 recent_blocks: int = 4, window: int | None = None, sinks: int = 0) -> None: ...
