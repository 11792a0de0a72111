"""ops.seal_key_blocks: whole blocks' keys requantized per channel, on every backend the
machine runs, equal to the torch definition; bad input is refused before any write."""
import pytest
import torch
from backend_cases import make_backend

from pagedkv import ops
from pagedkv.errors import DTypeError, InvalidArgumentError, InvalidBlockError, ShapeError
from pagedkv.format.quant import quantize_key_block

NB, BS, H, D = 6, 4, 2, 8


def arenas(layout="NHD"):
    shape = (NB, 2, BS, H, D // 2) if layout == "NHD" else (NB, 2, H, BS, D // 2)
    g = torch.Generator().manual_seed(0)
    kv = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    ks = torch.randn(NB, H, D, generator=g).to(torch.bfloat16)
    kz = torch.randn(NB, H, D, generator=g).to(torch.bfloat16)
    return kv, ks, kz


def keys(m, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(m, BS, H, D, generator=g)
    k[..., 3] *= 30.0
    return k.to(dtype)


@pytest.mark.parametrize("backend", ["reference", "cpu", "emulated", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_sealed_blocks_hold_the_per_channel_codes_and_nothing_else_changes(backend, layout, dtype):
    kv, ks, kz = arenas(layout)
    before = [t.clone() for t in (kv, ks, kz)]
    k = keys(2, dtype)
    blocks = torch.tensor([4, 1])
    be = make_backend(backend)
    kv, blocks, k, ks, kz = (be.copy(t.contiguous()) for t in (kv, blocks, k, ks, kz))
    be.ops.seal_key_blocks(kv, blocks, k, ks, kz, layout=layout)
    kv, blocks, k, ks, kz = (t.cpu() for t in (kv, blocks, k, ks, kz))
    codes, s, z = quantize_key_block(k)
    if layout == "HND":
        codes = codes.transpose(1, 2)
    assert torch.equal(kv[blocks, 0], codes)
    assert torch.equal(ks[blocks], s) and torch.equal(kz[blocks], z)
    untouched = torch.tensor([0, 2, 3, 5])
    assert torch.equal(kv[untouched], before[0][untouched]) and torch.equal(kv[blocks, 1], before[0][blocks, 1])
    assert torch.equal(ks[untouched], before[1][untouched]) and torch.equal(kz[untouched], before[2][untouched])


def test_no_blocks_is_a_no_op():
    kv, ks, kz = arenas()
    before = [t.clone() for t in (kv, ks, kz)]
    ops.seal_key_blocks(kv, torch.empty(0, dtype=torch.int64), keys(0), ks, kz)
    assert all(torch.equal(a, b) for a, b in zip(before, (kv, ks, kz)))


def bad_cases():
    kv, ks, kz = arenas()
    good = dict(kv_layer=kv, blocks=torch.tensor([1, 2]), keys=keys(2), key_scale=ks, key_zero=kz)
    return [
        (dict(blocks=torch.tensor([1, NB])), InvalidBlockError, r"^blocks: expected block ids in \[0, 6\), got 6"),
        (dict(blocks=torch.tensor([-1, 2])), InvalidBlockError, r"^blocks: expected block ids in \[0, 6\), got -1"),
        (dict(blocks=torch.tensor([1, 2], dtype=torch.int32)), DTypeError, r"^blocks: expected dtype int64"),
        (dict(keys=keys(3)), ShapeError, r"^keys: expected shape \(2, 4, 2, 8\)"),
        (dict(keys=keys(2).to(torch.float64)), DTypeError, r"^keys: expected dtype float32, float16 or bfloat16"),
        (dict(key_scale=ks.float()), DTypeError, r"^key_scale: expected dtype bfloat16"),
        (dict(key_zero=None), InvalidArgumentError, r"^key_zero: expected a tensor when the other"),
        (dict(key_scale=None, key_zero=None), InvalidArgumentError, r"^key_scale: expected a bfloat16"),
        (dict(kv_layer=kv.view(torch.int8)), ShapeError, r"^kv_layer: expected an int4 \(uint8\) NHD layer view"),
        (dict(key_scale=ks[:, :, :4]), ShapeError, r"^key_scale: expected shape \(6, 2, 8\)"),
        (dict(kv_layer=kv[:, :, :, :0]), ShapeError, r"^kv_layer: expected a non-empty block_size, H and head_dim"),
    ], good


@pytest.mark.parametrize("i", range(11))
def test_bad_input_is_a_typed_error_and_changes_nothing(i):
    cases, good = bad_cases()
    change, err, match = cases[i]
    args = dict(good, **change)
    state = [t.clone() for t in (good["kv_layer"], good["key_scale"], good["key_zero"])]
    with pytest.raises(err, match=match):
        ops.seal_key_blocks(args["kv_layer"], args["blocks"], args["keys"], args["key_scale"], args["key_zero"])
    assert all(torch.equal(a, b) for a, b in zip(state, (good["kv_layer"], good["key_scale"], good["key_zero"])))
