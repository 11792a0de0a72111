from typing import Dict

POLICIES: Dict[str, int]
POLICY_NAMES: Dict[int, str]
