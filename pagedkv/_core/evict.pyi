
POLICIES: dict[str, int]
POLICY_NAMES: dict[int, str]
