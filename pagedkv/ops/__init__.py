"""pagedkv.ops."""
