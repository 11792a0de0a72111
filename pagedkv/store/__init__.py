"""The KV store and its formats: arenas (``kvstore``), dtypes and the format fingerprint
(``dtypes``, ``format``), quantization and rotation (``quant``, ``rotation``), the recent-token
window (``window``), block keys (``block_keys``), layer calibration (``calibration``) and the
checks every data op makes of its tensors against the format (``op_checks``).

``from pagedkv.store import KVStore`` keeps working: names of the ``kvstore`` module are looked
up lazily, so importing ``pagedkv.store.dtypes`` does not import the arenas.
"""
from pagedkv._moved import reexport

__getattr__ = reexport(__name__, "pagedkv.store.kvstore")
