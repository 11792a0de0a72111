"""What a stored block's bytes mean: the dtypes table (``dtypes``), quantization and rotation
(``quant``, ``rotation``), one layer's format (``layer_format``), the cache's format
fingerprint (``fingerprint``) and the checks every data op makes of its tensors against the
format (``op_checks``, ``attention_checks``); MLA latent rows (``latent``) and their checks
(``latent_checks``).

This package sits below the data ops (:mod:`pagedkv.ops`, :mod:`pagedkv.kernels`) and the
configuration, and imports nothing of pagedkv but :mod:`pagedkv.errors`.
"""
