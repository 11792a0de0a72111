"""The KV store: the arenas that hold every layer's K/V (``kvstore``), the recent-token
window (``window``) and block keys (``block_keys``). It owns the tensors and calls the data
ops on them; what the bytes mean (dtypes, quantization, rotation, the layer format, the
format fingerprint, the ops' argument checks) is :mod:`pagedkv.format`, below the ops.

``from pagedkv.store import KVStore`` keeps working: names of the ``kvstore`` module are looked
up lazily, so importing ``pagedkv.store.window`` does not import the arenas. The format
modules' 0.2 paths (``pagedkv.store.dtypes``...) import through :mod:`pagedkv._moved`.
"""
from pagedkv._moved import reexport

__getattr__ = reexport(__name__, "pagedkv.store.kvstore")
