"""``pagedkv demo``: continuous batching over the paged cache gives per-request greedy answers."""
from __future__ import annotations

import argparse

import pytest
import torch
from transformers import DynamicCache

from pagedkv.cli import demo
from pagedkv.cli import build_parser, main
from pagedkv.errors import OutOfBlocksError

from model_fixtures import smollm2, tiny  # noqa: F401  (tests/ is on sys.path via conftest)


def args_for(**overrides) -> argparse.Namespace:
    args = build_parser().parse_args(["demo", "--model", "tiny", "--no-progress"])
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def reference_greedy(model, req) -> list:
    """The request alone, through DynamicCache: what continuous batching must reproduce."""
    ids = torch.tensor([req.prompt_ids])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=req.max_new_tokens,
                         do_sample=False, past_key_values=DynamicCache(config=model.config),
                         eos_token_id=model.generation_config.eos_token_id, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def run_serve(model, tok, **kw):
    args = args_for(**kw)
    kv = demo.build_kv(model, args)
    reqs = demo.make_requests(tok, args.requests, args.max_new_tokens, args.arrival_gap)
    return demo.serve(model, tok, reqs, kv, max_batch=args.max_batch), kv


def test_demo_subcommand_is_registered():
    args = build_parser().parse_args(["demo", "--requests", "3", "--kv-dtype", "int8", "--block-size", "8",
                                      "--num-blocks", "64"])
    assert (args.requests, args.kv_dtype, args.block_size, args.num_blocks, args.model) == (3, "int8", 8, 64, "smollm2")


def test_tiny_demo_prints_requests_and_summary(capsys):
    assert main(["demo", "--model", "tiny", "--requests", "4", "--max-new-tokens", "8", "--no-progress"]) == 0
    out = capsys.readouterr().out
    for rid in range(4):
        assert f"[{rid}] user: " in out
    assert out.count("    answer: ") == 4
    for key in ("throughput", "tokens/s", "prefix hit rate", "blocks used", "contiguous", "block map at peak"):
        assert key in out, key


@pytest.mark.parametrize("argv, message", [
    (["--kv-dtype", "fp4"], "kv_dtype: expected None, the model dtype (float32), or one of"),
    (["--block-size", "0"], "block_size: expected an int >= 1, got 0"),
    (["--requests", "0"], "--requests: expected an int >= 1, got 0"),
    (["--num-blocks", "2"], "out of KV blocks: request 0 needs"),
])
def test_bad_options_exit_2_with_the_message(argv, message, capsys):
    assert main(["demo", "--model", "tiny", "--no-progress", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv demo: error: ") and message in err, err


def test_continuous_batching_matches_each_request_alone(tiny):
    model, tok = tiny
    result, kv = run_serve(model, tok, requests=6, max_new_tokens=10, block_size=4, num_blocks=256, max_batch=4)
    assert result.max_batch_seen > 1                      # decode steps were batched
    assert max(r.arrival_step for r in result.requests) > 0  # requests joined mid-run
    assert all(r.cached_tokens > 0 for r in result.requests[1:])  # the shared system prompt
    for req in result.requests:
        assert req.output_ids == reference_greedy(model, req), req.rid
    kv.check_invariants()
    assert len(kv) == 0 and kv.stats().allocated_blocks == 0  # every request was freed


def test_admission_waits_for_blocks(tiny):
    model, tok = tiny
    # All arrive at once, but the blocks do not cover every worst case: some queue
    # until a running request finishes.
    result, kv = run_serve(model, tok, requests=5, max_new_tokens=8, block_size=16, num_blocks=22,
                           max_batch=8, arrival_gap=0)
    assert result.requests[0].admitted_step == 0
    assert max(r.admitted_step for r in result.requests) > 0
    assert all(len(r.output_ids) >= 1 for r in result.requests)
    kv.check_invariants()
    assert len(kv) == 0


def test_request_that_can_never_fit(tiny):
    model, tok = tiny
    with pytest.raises(OutOfBlocksError, match=r"out of KV blocks: request 0 needs \d+ block\(s\), \d+ free"):
        run_serve(model, tok, requests=1, max_new_tokens=8, block_size=16, num_blocks=4)


@pytest.mark.parametrize("kv", [["int8"], ["int4", "--kv-key-quant", "block"]], ids=["int8", "int4-block-keys"])
def test_quantized_kv_runs(tiny, kv):
    model, tok = tiny
    flags = build_parser().parse_args(["demo", "--model", "tiny", "--kv-dtype"] + kv)
    result, cache = run_serve(model, tok, requests=3, max_new_tokens=6, kv_dtype=flags.kv_dtype,
                              kv_key_quant=flags.kv_key_quant)
    assert cache.config.cache_dtype == kv[0] and cache.config.kv_key_quant == (kv[2] if len(kv) > 1 else "token")
    if cache.config.block_keys:   # the shared system prompt's full blocks were sealed
        assert bool(cache.store.key_scale.any())
    assert all(1 <= len(r.output_ids) <= r.max_new_tokens for r in result.requests)
    assert len(cache) == 0


@pytest.mark.model
@pytest.mark.slow
def test_smollm2_demo_answers_like_greedy_generate(smollm2):
    model, tok = smollm2
    result, kv = run_serve(model, tok, requests=5, max_new_tokens=24, block_size=16, num_blocks=256,
                           max_batch=8, arrival_gap=2)
    answers = {r.rid: tok.decode(r.output_ids, skip_special_tokens=True) for r in result.requests}
    assert "Tokyo" in answers[4]
    assert result.hit_rate > 0.4
    # Each answer equals the request served alone, at least until the first token
    # where batching's different float summation order could flip a near-tie.
    agree = []
    for req in result.requests:
        ref = reference_greedy(model, req)
        n = next((i for i, (a, b) in enumerate(zip(req.output_ids, ref)) if a != b), len(ref))
        agree.append(n / len(ref))
    print("greedy agreement per request:", agree)
    assert sum(agree) / len(agree) > 0.9, agree
    assert len(kv) == 0


def test_requests_admitted_together_are_prefilled_in_one_forward(tiny):
    model, tok = tiny
    # All arrive at once and fit: one batched prefill forward admits them, and each
    # answer is still the request's alone.
    result, kv = run_serve(model, tok, requests=5, max_new_tokens=6, block_size=4, num_blocks=512,
                           max_batch=8, arrival_gap=0)
    assert all(r.admitted_step == 0 for r in result.requests)
    assert result.prefill_forwards == 1
    for req in result.requests:
        assert req.output_ids == reference_greedy(model, req), req.rid
    assert len(kv) == 0


def test_prefill_groups_keep_padding_bounded():
    def req(rid, prompt, cached):
        r = demo.Request(rid, "u", list(range(prompt)), 4, 0)
        r.cached_tokens = cached
        return r

    miss, hits = req(0, 430, 0), [req(i, 430, 416) for i in range(1, 5)]
    groups = demo._prefill_groups([miss, *hits])
    assert [[r.rid for r in g] for g in groups] == [[0], [1, 2, 3, 4]]
    similar = [req(i, 30 + i, 0) for i in range(4)]
    assert len(demo._prefill_groups(similar)) == 1
