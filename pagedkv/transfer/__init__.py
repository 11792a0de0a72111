"""KV transfer between processes; the public entry points are in :mod:`pagedkv.transfer.distributed`."""
