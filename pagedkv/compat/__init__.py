"""pagedkv.compat."""
