"""pagedkv.integrations."""
