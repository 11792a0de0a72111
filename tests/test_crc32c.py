"""CRC-32C, the remote tier's value checksum: RFC 3720's test vectors, the crc32
instruction path equal to the table path for every length and alignment, continuation,
typed errors; a value's tag is the CRC-32C of its header and record as sent."""
import os

import numpy as np
import pytest

from pagedkv._core.crc import HARDWARE, crc32c
from pagedkv.errors import InvalidArgumentError


@pytest.mark.parametrize("portable", [False, True])
def test_known_vectors(portable):
    assert crc32c(b"123456789", portable=portable) == 0xE3069283
    assert crc32c(bytes(32), portable=portable) == 0x8A9136AA            # RFC 3720 B.4
    assert crc32c(b"\xff" * 32, portable=portable) == 0x62A8AB43
    assert crc32c(bytes(range(32)), portable=portable) == 0x46DD794E
    assert crc32c(bytes(range(31, -1, -1)), portable=portable) == 0x113FDB5C
    assert crc32c(b"", portable=portable) == 0


def test_the_instruction_and_the_tables_agree_at_every_length_and_alignment():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 3 * 8192 * 2 + 100, dtype=np.uint8).tobytes()
    for n in (1, 7, 8, 9, 63, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 1, 2 * 3 * 8192 + 13):
        for off in (0, 1, 5):
            b = memoryview(data)[off:off + n]
            want = crc32c(b, portable=True)
            assert crc32c(b) == want, (n, off, HARDWARE)
            assert crc32c(b[n // 3:], crc32c(b[:n // 3])) == want            # continued
    arr = np.frombuffer(data, dtype=np.uint16)[:1000]
    assert crc32c(arr) == crc32c(arr.tobytes())                              # any buffer, as bytes


def test_bad_arguments_are_typed_errors():
    with pytest.raises(InvalidArgumentError, match="crc"):
        crc32c(b"x", -1)
    with pytest.raises(InvalidArgumentError, match="crc"):
        crc32c(b"x", 2**32)
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        crc32c(np.zeros(10, dtype=np.uint8)[::2])
    with pytest.raises(TypeError):
        crc32c("text")


def test_a_value_tag_is_the_crc32c_of_what_is_sent_and_version_1_values_are_foreign():
    from pagedkv.tiers.remote_wire import WIRE_VERSION, Wire
    from pagedkv.tiers.verify import ROOT_DIGEST

    w = Wire("t", b"f" * 16, 4, 64)
    buf = np.frombuffer(os.urandom(w.value_bytes), dtype=np.uint8).copy()
    tokens = np.arange(4, dtype=np.int32)
    value = bytes(w.encode_into(buf, b"d" * 16, ROOT_DIGEST, tokens))
    hb = w.header_bytes
    assert value[4] == WIRE_VERSION == 2
    assert int.from_bytes(value[hb - 4:hb], "little") == crc32c(value[hb:], crc32c(value[:hb - 4]))
    assert w.decode(value, b"d" * 16, ROOT_DIGEST, tokens)[1] == ""
    old = bytearray(value)
    old[4] = 1
    assert w.decode(bytes(old), b"d" * 16, ROOT_DIGEST, tokens) == (None, "foreign")
