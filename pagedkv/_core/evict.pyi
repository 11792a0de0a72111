from typing import List, Optional

POLICIES: dict
FREQUENCY_BUCKETS: int

class Evictor:
    num_blocks: int
    nbuckets: int
    low_blocks: int
    high_blocks: int
    num_batches: int
    last_batch: int
    max_batch: int
    def __init__(self, num_blocks: int, policy: str = "lru", priority_classes: int = 3,
                 low_watermark: float = 0.05, high_watermark: float = 0.15) -> None: ...
    @property
    def policy_name(self) -> Optional[str]: ...
    def list_sizes(self) -> List[int]: ...
    def order(self) -> List[List[int]]: ...
