"""KV transfer between processes over torch.distributed point-to-point (gloo on CPU,
NCCL on GPU), for disaggregated prefill/decode and cross-instance prefix sharing.

Both ranks must have called ``torch.distributed.init_process_group``; each transfer is
a conversation between two ranks (``group`` selects a sub-group), every step bounded
by ``timeout`` seconds::

    # prefill rank                                  # decode rank
    send_sequence(cache, "req-1", dst=1,            got = recv_sequence(cache, src=0)
                  metadata={"next_token": t})       # got.seq_id is live: decode from here

    send_prefix(cache, system_prompt, dst=1)        recv_prefix(cache, src=0)

The two caches must store KV in the same format (model shape, KV heads of this
tensor-parallel rank, block size, dtypes, layout); a mismatch is refused by the
receiver and both sides raise :class:`~pagedkv.errors.TransferError`. So is any
failure on the way (a refusal, a dead peer, a timeout); the receiver is then left as
it was, with nothing half-registered and nothing leaked. See
:mod:`pagedkv.transfer.protocol` for the conversation and
:mod:`pagedkv.transfer.wire` for how KV crosses (layer by layer, scales included).
"""
from pagedkv.errors import TransferError
from pagedkv.transfer.prefix import block_hashes, recv_prefix, send_prefix
from pagedkv.transfer.sequence import ReceivedSequence, recv_sequence, send_sequence

__all__ = ["send_sequence", "recv_sequence", "ReceivedSequence", "send_prefix", "recv_prefix", "block_hashes",
           "TransferError"]
