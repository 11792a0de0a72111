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
    assert (args.token_budget, args.no_prefix_sharing) == (demo.TOKEN_BUDGET, False)
    args = build_parser().parse_args(["demo", "--token-budget", "0", "--no-prefix-sharing"])
    assert (args.token_budget, args.no_prefix_sharing) == (0, True)


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
    (["--token-budget", "16"], "--token-budget: expected 0 or an int > --max-batch (16), got 16"),
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
    # All arrive at once and fit; without prefix sharing or a token budget (the loop
    # before issue 33) one batched prefill forward admits them, and each answer is
    # still the request's alone.
    args = args_for(requests=5, max_new_tokens=6, block_size=4, num_blocks=512, max_batch=8, arrival_gap=0)
    kv = demo.build_kv(model, args)
    reqs = demo.make_requests(tok, 5, 6, 0)
    result = demo.serve(model, tok, reqs, kv, max_batch=8, token_budget=None, share_prefixes=False)
    assert all(r.admitted_step == 0 for r in result.requests)
    assert result.prefill_forwards == 1
    assert result.prefill_tokens == sum(len(r.prompt_ids) for r in reqs)   # each its own copy
    for req in result.requests:
        assert req.output_ids == reference_greedy(model, req), req.rid
    assert len(kv) == 0


def test_prefill_groups_keep_padding_bounded():
    from pagedkv.sched.batching import PrefillWork, prefill_groups

    def chunk(rid, prompt, cached):
        return PrefillWork(rid, cached, prompt - cached, prompt)

    miss, hits = chunk(0, 430, 0), [chunk(i, 430, 416) for i in range(1, 5)]
    groups = prefill_groups([miss, *hits])
    assert [[w.request_id for w in g] for g in groups] == [[0], [1, 2, 3, 4]]
    similar = [chunk(i, 30 + i, 0) for i in range(4)]
    assert len(prefill_groups(similar)) == 1


# ---- issue 33 item 2: prefixes shared within a step, a token budget per step ----------------
def shared_hits(requests, block_size):
    """Per request, in admission order: the full blocks it shares with a request admitted
    before it (what a hit can give it when each shared block is computed once)."""
    out = []
    for i, r in enumerate(requests):
        cap = (len(r.prompt_ids) - 1) // block_size * block_size
        best = 0
        for e in requests[:i]:
            n = next((k for k, (a, b) in enumerate(zip(r.prompt_ids, e.prompt_ids)) if a != b),
                     min(len(r.prompt_ids), len(e.prompt_ids)))
            best = max(best, min(n // block_size * block_size, cap))
        out.append(best)
    return out


@pytest.mark.parametrize("budget", [None, 512, 40])
def test_burst_computes_each_shared_block_once(tiny, budget):
    model, tok = tiny
    bs = 4
    args = args_for(requests=6, max_new_tokens=6, block_size=bs, num_blocks=1024, arrival_gap=0)
    kv = demo.build_kv(model, args)
    reqs = demo.make_requests(tok, 6, 6, 0)
    result = demo.serve(model, tok, reqs, kv, max_batch=8, token_budget=budget)
    order = sorted(reqs, key=lambda r: (r.admitted_step, r.rid))
    hits = shared_hits(order, bs)
    assert [r.cached_tokens for r in order] == hits
    assert order[0].cached_tokens == 0 and all(h >= 168 for h in hits[1:])   # the 170-byte shared system prompt
    # every prompt token outside a hit was computed exactly once, and counted as a miss
    assert result.prefill_tokens == sum(len(r.prompt_ids) for r in reqs) - sum(hits)
    stats = kv.stats()
    assert (stats.hit_tokens, stats.query_tokens) == (sum(hits), sum(len(r.prompt_ids) for r in reqs))
    assert result.hit_rate == pytest.approx(sum(hits) / sum(len(r.prompt_ids) for r in reqs))
    for req in reqs:
        assert req.output_ids == reference_greedy(model, req), req.rid
    kv.check_invariants()
    assert len(kv) == 0 and stats.allocated_blocks == 0


def test_burst_first_tokens_do_not_wait_for_the_whole_batch(tiny):
    model, tok = tiny
    # A budget of 40 tokens a step: the leader's 219-token prompt takes 6 steps, the
    # others' ~20-token tails one or two each. The first tokens come out step by step,
    # and the requests answered first decode while the later ones still prefill.
    args = args_for(requests=6, max_new_tokens=8, block_size=4, num_blocks=1024, arrival_gap=0)
    kv = demo.build_kv(model, args)
    reqs = demo.make_requests(tok, 6, 8, 0, varied_budgets=False)
    log = []
    result = demo.serve(model, tok, reqs, kv, max_batch=8, token_budget=40,
                        on_step=lambda step, b: log.append((step, {r.rid: len(r.output_ids) for r in reqs})))
    firsts = sorted(r.first_token_step for r in reqs)
    assert firsts[0] < firsts[-1]
    last_prefill_step = max(r.first_token_step for r in reqs)
    tokens_then = dict(log)[last_prefill_step - 1]
    assert max(tokens_then.values()) >= 2       # someone was decoding before the last prompt was done
    assert result.prefill_forwards > len(reqs)   # the long prompt went in chunks
    for req in reqs:
        assert req.output_ids == reference_greedy(model, req), req.rid
    assert len(kv) == 0


def test_cancelled_leader_hands_its_prefix_over(tiny):
    from pagedkv.sched.batching import ATTACHED, PREFILLING

    model, tok = tiny
    bs = 4
    args = args_for(requests=4, max_new_tokens=6, block_size=bs, num_blocks=1024, arrival_gap=0)
    kv = demo.build_kv(model, args)
    reqs = demo.make_requests(tok, 4, 6, 0)
    seen = {}

    def cancel_leader(step, batcher):
        if step == 1:       # the leader has committed two 40-token chunks of its prompt
            seen["states"] = [batcher.state(r.rid) for r in reqs]
            seen["leaders"] = [batcher.leader(r.rid) for r in reqs[1:]]
            seen["committed"] = kv.num_tokens(0)
            batcher.cancel(0)

    result = demo.serve(model, tok, reqs, kv, max_batch=8, token_budget=40, on_step=cancel_leader)
    assert seen["states"] == [PREFILLING, ATTACHED, ATTACHED, ATTACHED]
    assert seen["leaders"] == [0, 0, 0]
    committed = seen["committed"]
    assert committed == 80
    leader, rest = reqs[0], reqs[1:]
    assert leader.cancelled and leader.output_ids == [] and leader.first_token_step == -1
    # the first follower took over: it hit what the cancelled leader had committed and
    # computed the rest of the shared prefix, which the others then hit
    assert rest[0].cached_tokens == committed
    assert [r.cached_tokens for r in rest[1:]] == shared_hits(rest, bs)[1:]
    assert result.prefill_tokens == committed + sum(len(r.prompt_ids) - r.cached_tokens for r in rest)
    for req in rest:
        assert req.output_ids == reference_greedy(model, req), req.rid
    kv.check_invariants()
    assert len(kv) == 0 and kv.stats().allocated_blocks == 0


@pytest.mark.model
def test_smollm2_burst_equals_generate(smollm2):
    model, tok = smollm2
    # fp32, all four at once, prompts chunked by a 24-token budget: each answer is the
    # request's own greedy generate, token for token.
    args = argparse.Namespace(num_blocks=128, block_size=16, kv_dtype=None, kv_key_quant=None, kv_sink_tokens=None,
                              seed=0)
    kv = demo.build_kv(model, args)
    reqs = demo.make_requests(tok, 4, 8, 0, varied_budgets=False)
    result = demo.serve(model, tok, reqs, kv, max_batch=4, token_budget=24)
    assert [r.cached_tokens for r in reqs] == [0, 32, 32, 32]
    assert result.prefill_tokens == sum(len(r.prompt_ids) for r in reqs) - 96
    for req in reqs:
        assert req.output_ids == reference_greedy(model, req), req.rid
    assert len(kv) == 0
