"""pagedkv: a paged KV-cache library for LLM inference engines."""
from pagedkv.errors import *  # noqa: F401,F403

__version__ = "0.1.0"
