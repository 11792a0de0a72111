"""CacheConfig.sequence_bits_per_element: every stored byte of one sequence, per element."""
import pytest

from pagedkv import CacheConfig
from pagedkv.errors import ArgumentTypeError, InvalidArgumentError

SHAPE = dict(num_layers=2, num_kv_heads=1, head_dim=64, block_size=16, num_blocks=64, dtype="float32")


def test_an_unquantized_cache_stores_model_bits_in_whole_blocks():
    cfg = CacheConfig(**SHAPE)
    assert [cfg.sequence_bits_per_element(n) for n in (16, 4096)] == [32.0, 32.0]
    # a sequence holds whole blocks: 17 tokens take two blocks of 16
    assert cfg.sequence_bits_per_element(17) == pytest.approx(32.0 * 32 / 17, rel=1e-12)
    assert CacheConfig(**dict(SHAPE, dtype="float16")).sequence_bits_per_element(96) == 16.0


def test_every_byte_counts_codes_scales_key_params_model_precision_layers_and_the_window_share():
    cfg = CacheConfig(**SHAPE, kv_dtype="int4", kv_key_quant="block", kv_window=0, kv_window_sequences=4,
                      kv_full_precision_layers=(1,))
    # per token: layer 0 stores K and V rows of 32 code bytes + a float32 scale and zero
    # (one group of 64) = 80 bytes; layer 1 stores 2 x 64 float32 = 512 bytes. Per block:
    # layer 0's block-key parameters, bfloat16 scale and zero per channel = 256 bytes.
    block = 16 * (80 + 512) + 256
    # one sequence's share of the window arena: layer 0's staging block (block keys) and
    # its sink block, in float32 (2 x 16 x 64 x 4 bytes) plus a validity byte per token
    window = 2 * (2 * 16 * 64 * 4 + 16)
    for tokens, blocks in ((160, 10), (161, 11), (1, 1)):
        elements = tokens * 2 * 2 * 64
        assert cfg.sequence_bits_per_element(tokens) == pytest.approx(8 * (blocks * block + window) / elements,
                                                                       rel=1e-12)
    # a recent window of 128 tokens adds ceil(128 / 16) = 8 blocks to the share
    w128 = CacheConfig(**SHAPE, kv_dtype="int4", kv_key_quant="block", kv_window=128,
                       kv_full_precision_layers=(1,))
    assert w128.sequence_bits_per_element(160) == pytest.approx(
        8 * (10 * block + window + 8 * (2 * 16 * 64 * 4 + 16)) / (160 * 2 * 2 * 64), rel=1e-12)


def test_long_sequences_approach_the_quantized_blocks_bits():
    cfg = CacheConfig(**dict(SHAPE, num_layers=4), kv_dtype="int4", kv_key_quant="block", kv_window=128)
    bits = [cfg.sequence_bits_per_element(n) for n in (256, 1024, 8192, 1 << 20)]
    assert bits == sorted(bits, reverse=True)
    assert cfg.bits_per_element == 6.0 < bits[-1] < 6.01      # the window share fades; the blocks stay
    assert bits[1] > 11.0        # at 1,024 tokens the float32 window is most of a 6-bit sequence's bytes


@pytest.mark.parametrize("tokens, err", [(0, InvalidArgumentError), (-5, InvalidArgumentError),
                                         (1.5, ArgumentTypeError), (True, ArgumentTypeError),
                                         ("8", ArgumentTypeError)])
def test_refuses_a_bad_length(tokens, err):
    with pytest.raises(err, match=r"^num_tokens: expected an int >= 1, got "):
        CacheConfig(**SHAPE, kv_dtype="int4").sequence_bits_per_element(tokens)


def test_refuses_layer_groups():
    cfg = CacheConfig(**dict(SHAPE, num_layers=4), kv_dtype="int4", layer_windows=(8, 0, 8, 0))
    with pytest.raises(InvalidArgumentError, match=r"^config: expected a cache without layer groups"):
        cfg.sequence_bits_per_element(64)
