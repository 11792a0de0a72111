"""pagedkv.kernels."""
