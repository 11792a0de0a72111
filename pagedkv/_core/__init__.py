"""The Cython bookkeeping core: blocks, ref counts, tables, prefix index, eviction.

Nothing here touches tensors. The core decides *which* block; the KV store moves bytes.
"""
