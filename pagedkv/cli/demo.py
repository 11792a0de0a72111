"""``pagedkv demo``: a chat server in miniature, with continuous batching over a paged cache.

Eight chat requests (the default) share one system prompt and arrive a few engine
steps apart (``--arrival-gap 0``: all at once). The engine steps are planned by
:class:`~pagedkv.sched.batching.ContinuousBatcher`; each step:

1. **admission**: arrived requests join while the batch and the blocks allow.
   ``add_sequence`` reports the prompt tokens already cached (the shared system
   prompt, after the first request). A request that shares uncached prefix blocks
   with one being prefilled waits for it (it is *attached*) and is admitted once
   those blocks are committed, hitting them: each shared block is computed once, also
   for requests that arrive together;
2. **prefill**: prompt chunks within the step's token budget (``--token-budget``,
   after one token per decoding request), batched in right-aligned rows (see
   :func:`~pagedkv.sched.batching.prefill_groups` for when very different lengths
   take two forwards). A long prompt is prefilled over several steps, so the
   decoding requests and the requests behind it do not wait for all of it; a chunk
   that ends a prompt gives the request's first token;
3. **decode**: one batched forward computes the next token of every request past its
   prompt. Rows of different lengths are right-aligned in one rectangle with a
   padding mask (:meth:`PagedCache.select`); each layer reads its K/V straight from
   the blocks. That costs a few padding columns per row, and for a batch this
   small it is cheaper than one attention call per sequence;
4. **completion**: a request that emits end-of-turn or reaches its token budget is
   freed at once; its full blocks stay in the prefix cache.

Then it prints every request (prompt, answer, tokens, latency) and a summary:
throughput, time to first token, prefix hit rate, blocks and bytes in use against a
contiguous max-length allocation per request, and the block map at peak use.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedkv.errors import InternalError, InvalidArgumentError, PagedKVError, expected

if TYPE_CHECKING:   # the demo imports torch-backed modules lazily, so `--help` stays fast
    from pagedkv.manager.cache import PagedKVCache
    from pagedkv.sched.batching import ContinuousBatcher

HELP = "serve concurrent chat requests with continuous batching over a paged KV cache"

SYSTEM_PROMPT = (
    "You are a helpful assistant for a systems programming team. Answer in one or two "
    "short sentences, be concrete and accurate, and do not repeat the question."
)
USER_PROMPTS = [
    "What is a KV cache in a transformer?",
    "Why do operating systems use paging?",
    "Name a sorting algorithm with O(n log n) worst case.",
    "What does a mutex protect against?",
    "What is the capital of Japan?",
    "Explain copy-on-write in one sentence.",
    "What is the difference between a process and a thread?",
    "Give one tip for writing fast Python code.",
    "What is a hash collision?",
    "Why is cache locality important for performance?",
    "What does LRU stand for?",
    "What is a race condition?",
]


@dataclass
class Request:
    rid: int
    user: str
    prompt_ids: list[int]
    max_new_tokens: int
    arrival_step: int
    admitted_step: int = -1
    arrived_at: float = 0.0
    first_token_at: float = 0.0
    finished_at: float = 0.0
    arrived_cpu: float = 0.0        # the serving thread's CPU time (time.thread_time) at arrival
    first_token_cpu: float = 0.0    # ... and at the first token
    first_token_step: int = -1
    cached_tokens: int = 0
    cancelled: bool = False
    output_ids: list[int] = field(default_factory=list)

    @property
    def ttft_cpu(self) -> float:
        """Time to first token in the serving thread's CPU seconds (meaningful on a loaded
        machine when the model runs on one thread)."""
        return self.first_token_cpu - self.arrived_cpu


@dataclass
class DemoResult:
    requests: list[Request]
    wall_s: float
    generated_tokens: int
    decode_steps: int
    prefill_forwards: int        # batched prefill forwards (one per group of chunks)
    prefill_tokens: int          # prompt tokens computed (prefix hits and padding columns excluded)
    max_batch_seen: int
    peak_blocks: int
    peak_bytes: int
    peak_block_map: str
    hit_rate: float
    contiguous_bytes: int       # requests x max context x bytes/token
    contiguous_tight_bytes: int  # requests x (prompt + max_new_tokens) x bytes/token
    kv: PagedKVCache


#: requests decoding at once, by default. On a CPU a decode step's time is mostly the model's
#: weights read once per step (SmolLM2-135M, one thread: linear layers 67% of the demo
#: workload's time, attention 3%), so a wider batch is nearly free per token: 16 requests
#: arriving two steps apart served 50.4 tokens per CPU-second at 16 against 41.4 at 8.
MAX_BATCH = 16

#: tokens one engine step computes at most, by default (one per decoding request, the
#: rest prompt chunks). On one CPU thread SmolLM2-135M prefills about 250 tokens per
#: second, so a decoding request waits at most about two seconds for a step, while a
#: 412-token system prompt still goes through in one chunk.
TOKEN_BUDGET = 512


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=["smollm2", "tiny"], default="smollm2",
                   help="SmolLM2-135M-Instruct (fetched once) or a tiny random Llama (offline)")
    p.add_argument("--requests", type=int, default=8, help="chat requests to serve (default 8)")
    p.add_argument("--max-new-tokens", type=int, default=40, help="token budget of the longest answer")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks in the arena (default 256)")
    p.add_argument("--kv-dtype", default=None,
                   help="KV storage: model dtype (default), fp8, fp8_e5m2, int8, int4 or int3")
    p.add_argument("--kv-key-quant", default=None, choices=("token", "block"),
                   help="int4 keys: per token (default) or per channel over each full block")
    p.add_argument("--kv-sink-tokens", type=int, default=None,
                   help="leading tokens per sequence kept in model precision (int4/int3 default 4)")
    p.add_argument("--max-batch", type=int, default=MAX_BATCH,
                   help=f"most requests decoding at once (default {MAX_BATCH})")
    p.add_argument("--arrival-gap", type=int, default=2,
                   help="engine steps between request arrivals (0: all at once)")
    p.add_argument("--token-budget", type=int, default=TOKEN_BUDGET,
                   help=f"most tokens an engine step computes: decode tokens plus prompt chunks (default "
                        f"{TOKEN_BUDGET}; 0: no budget, every admitted prompt prefilled whole)")
    p.add_argument("--no-prefix-sharing", action="store_true",
                   help="requests admitted together each compute the prefix they share (the old loop)")
    p.add_argument("--seed", type=int, default=0, help="free-list shuffle seed (blocks out of order)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--gather", action="store_true",
                   help="attend over gathered K/V (the old path) instead of reading the pages (pagedkv attention)")


def _chat_ids(tokenizer, user: str, system_prompt: str | None = None) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM_PROMPT if system_prompt is None else system_prompt},
                {"role": "user", "content": user}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys") and "input_ids" in ids:  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def make_requests(tokenizer, n: int, max_new_tokens: int, arrival_gap: int, *,
                  system_prompt: str | None = None, varied_budgets: bool = True) -> list[Request]:
    """``n`` requests cycling through the prompts, with varied answer budgets (or
    ``max_new_tokens`` each), sharing ``system_prompt`` (default :data:`SYSTEM_PROMPT`)."""
    out = []
    for i in range(n):
        user = USER_PROMPTS[i % len(USER_PROMPTS)]
        budget = max(1, max_new_tokens - (i % 3) * max_new_tokens // 4) if varied_budgets else max_new_tokens
        out.append(Request(i, user, _chat_ids(tokenizer, user, system_prompt), budget, i * arrival_gap))
    return out


class _Progress:
    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.last = total, enabled, 0.0

    def update(self, done: int, running: int, tokens: int, force: bool = False) -> None:
        now = time.perf_counter()
        if not self.enabled or (not force and now - self.last < 0.1):
            return
        self.last = now
        width = 30
        fill = width * done // max(1, self.total)
        sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {done}/{self.total} done, "
                         f"{running} running, {tokens} tokens")
        sys.stderr.flush()
        if force:
            sys.stderr.write("\n")


def serve(model, tokenizer, requests: list[Request], kv, *, max_batch: int = MAX_BATCH,
          token_budget: int | None = TOKEN_BUDGET, share_prefixes: bool = True, progress: bool = False,
          paged: bool = True, on_step: Callable[[int, ContinuousBatcher], Any] | None = None) -> DemoResult:
    """Run the engine loop until every request is answered (or cancelled); frees
    everything it admits, also when it fails.

    ``token_budget``/``share_prefixes``: see :class:`~pagedkv.sched.batching.ContinuousBatcher`
    (``token_budget=None, share_prefixes=False`` is the loop before both: every admitted
    prompt prefilled whole, each computing its own copy of a prefix it shares with
    another request admitted in the same step). ``on_step(step, batcher)`` runs after
    each engine step (a caller may cancel requests through ``batcher.cancel``)."""
    import torch

    from pagedkv.integrations.transformers import PagedCache
    from pagedkv.sched.batching import ContinuousBatcher

    eos = {int(tokenizer.eos_token_id)}
    if paged:   # the registered attention reads the pages; PagedCache.update only writes
        from pagedkv.integrations import hf_attention

        model.set_attn_implementation(hf_attention.register())
    cache = PagedCache(kv, paged_attention=paged)
    batcher = ContinuousBatcher(kv, max_batch=max_batch, token_budget=token_budget, share_prefixes=share_prefixes)
    by_id = {r.rid: r for r in requests}
    pending = deque(sorted(requests, key=lambda r: r.arrival_step))
    bar = _Progress(len(requests), progress)
    step = steps = generated = max_batch_seen = prefill_forwards = prefill_tokens = 0
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    peak_blocks, peak_map = -1, ""
    done = 0
    start = time.perf_counter()

    def emit(req: Request, logits_row) -> None:
        """Append the greedy token; the request is finished at end-of-turn or its budget."""
        nonlocal generated, done
        tok = int(logits_row.argmax())
        req.output_ids.append(tok)
        generated += 1
        if len(req.output_ids) == 1:
            req.first_token_at, req.first_token_cpu, req.first_token_step = time.perf_counter(), time.thread_time(), step
        if tok in eos or len(req.output_ids) >= req.max_new_tokens:
            req.finished_at = time.perf_counter()
            batcher.finish(req.rid)
            done += 1

    try:
        with torch.no_grad():
            while pending or len(batcher):
                if not len(batcher) and pending[0].arrival_step > step:
                    step = pending[0].arrival_step   # an idle engine skips to the next arrival
                while pending and pending[0].arrival_step <= step:
                    req = pending.popleft()
                    req.arrived_at, req.arrived_cpu = time.perf_counter(), time.thread_time()
                    batcher.submit(req.rid, req.prompt_ids, req.max_new_tokens)
                plan = batcher.schedule()
                for rid in plan.cancelled:
                    by_id[rid].cancelled = True
                    by_id[rid].finished_at = time.perf_counter()
                    done += 1
                for rid, cached in plan.admitted:
                    by_id[rid].admitted_step, by_id[rid].cached_tokens = step, cached
                if not plan.num_tokens and len(batcher):
                    raise InternalError(f"the batcher planned an empty step with {len(batcher)} requests left: a bug")
                # prefill: the step's chunks, one batched forward per group
                for group in plan.prefill:
                    logits = _prefill(model, cache, [(by_id[w.request_id], w) for w in group], pad_id)
                    prefill_forwards += 1
                    prefill_tokens += sum(w.num_tokens for w in group)
                    for i, w in enumerate(group):
                        if w.last:
                            emit(by_id[w.request_id], logits[i, -1])
                # decode: one batched forward over every request past its prompt
                if plan.decode:
                    running = [by_id[rid] for rid in plan.decode]
                    ids = torch.tensor([[r.output_ids[-1]] for r in running])
                    mask, pos = cache.select(plan.decode, 1)
                    cache.set_input_ids(ids)
                    logits = model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache).logits
                    max_batch_seen = max(max_batch_seen, len(running))
                    steps += 1
                    used = kv.stats().allocated_blocks
                    if used > peak_blocks:
                        peak_blocks, peak_map = used, kv.dump_block_map()
                    for i, req in enumerate(running):
                        emit(req, logits[i, -1])
                if on_step is not None:
                    on_step(step, batcher)
                step += 1
                bar.update(done, len(batcher), generated)
    except BaseException:
        batcher.close()
        raise
    wall = time.perf_counter() - start
    bar.update(done, 0, generated, force=True)
    stats = kv.stats()
    bpt = kv.config.bytes_per_token
    context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    return DemoResult(
        requests=list(requests), wall_s=wall, generated_tokens=generated, decode_steps=steps,
        prefill_forwards=prefill_forwards, prefill_tokens=prefill_tokens,
        max_batch_seen=max_batch_seen, peak_blocks=max(peak_blocks, 0),
        peak_bytes=max(peak_blocks, 0) * kv.config.bytes_per_block, peak_block_map=peak_map,
        hit_rate=stats.hit_rate, contiguous_bytes=len(requests) * context * bpt,
        contiguous_tight_bytes=sum(len(r.prompt_ids) + r.max_new_tokens for r in requests) * bpt, kv=kv)


def _prefill(model, cache, rows: list, pad_id: int):
    """One forward over prefill chunks ``rows`` (``(Request, PrefillWork)`` pairs);
    returns logits ``[B, 1, V]`` (each row's last position).

    Rows are right-aligned: row b's last columns are its chunk; the columns before them
    (where another row's chunk is longer) hold the tokens just before its chunk, whose
    K/V is already stored and is not written again (:meth:`PagedCache.select`)."""
    import torch

    q = max(w.num_tokens for _, w in rows)
    ids = torch.full((len(rows), q), pad_id, dtype=torch.long)
    for i, (req, w) in enumerate(rows):
        tail = req.prompt_ids[max(0, w.end - q):w.end]
        ids[i, q - len(tail):] = torch.tensor(tail)
    mask, pos = cache.select([w.request_id for _, w in rows], [w.num_tokens for _, w in rows])
    cache.set_input_ids(ids)
    return model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache, logits_to_keep=1).logits


def _load(name: str):
    if name == "tiny":
        from pagedkv.testing.models import tiny_llama

        return tiny_llama(seed=0)
    from pagedkv.testing.models import load_smollm2

    return load_smollm2()


def build_kv(model, args):
    import torch

    from pagedkv.config.options import CacheConfig
    from pagedkv.manager.cache import PagedKVCache

    cfg = CacheConfig.from_hf_config(model.config, num_blocks=args.num_blocks, block_size=args.block_size,
                                     dtype=torch.float32, kv_dtype=args.kv_dtype, kv_key_quant=args.kv_key_quant,
                                     kv_sink_tokens=args.kv_sink_tokens, shuffle_free_blocks=args.seed)
    return PagedKVCache(cfg)


def report(result: DemoResult, tokenizer, out=None) -> None:
    from pagedkv.config.options import format_bytes

    out = sys.stdout if out is None else out  # looked up late, so captured stdout works

    def short(text: str, n: int) -> str:
        text = " ".join(text.split())
        return text if len(text) <= n else text[: n - 3] + "..."

    kv = result.kv
    print(f"system prompt: {short(SYSTEM_PROMPT, 100)}", file=out)
    for r in result.requests:
        answer = tokenizer.decode(r.output_ids, skip_special_tokens=True)
        print(f"\n[{r.rid}] user: {short(r.user, 100)}", file=out)
        print(f"    answer: {short(answer, 300)}", file=out)
        if r.cancelled:
            print(f"    cancelled after {len(r.output_ids)} tokens", file=out)
            continue
        print(f"    prompt {len(r.prompt_ids)} tokens ({r.cached_tokens} from the prefix cache), "
              f"{len(r.output_ids)} generated, first token {1000 * (r.first_token_at - r.arrived_at):.0f} ms, "
              f"latency {r.finished_at - r.arrived_at:.2f} s", file=out)
    c = kv.config
    answered = [r for r in result.requests if r.output_ids]
    ttft = sorted(r.first_token_at - r.arrived_at for r in answered)
    print("\n=== summary ===", file=out)
    print(f"requests          {len(result.requests)}, {result.decode_steps} batched decode steps, "
          f"up to {result.max_batch_seen} at once, {result.prefill_forwards} batched prefill forwards", file=out)
    print(f"throughput        {result.generated_tokens} tokens in {result.wall_s:.2f} s = "
          f"{result.generated_tokens / max(result.wall_s, 1e-9):.1f} tokens/s", file=out)
    if ttft:
        print(f"first token       median {1000 * ttft[len(ttft) // 2]:.0f} ms, slowest {1000 * ttft[-1]:.0f} ms "
              f"after arrival", file=out)
    print(f"prefill           {result.prefill_tokens} of {sum(len(r.prompt_ids) for r in result.requests)} "
          f"prompt tokens computed", file=out)
    print(f"prefix hit rate   {100 * result.hit_rate:.1f}% of prompt tokens", file=out)
    print(f"kv storage        {c.cache_dtype}, block size {c.block_size}, {c.resolved_num_blocks} blocks "
          f"({format_bytes(c.total_bytes)} arena)", file=out)
    print(f"blocks used       {result.peak_blocks} at peak = {format_bytes(result.peak_bytes)}", file=out)
    print(f"contiguous        {format_bytes(result.contiguous_bytes)} for {len(result.requests)} x max context; "
          f"{format_bytes(result.contiguous_tight_bytes)} for prompt + max new tokens each", file=out)
    if result.contiguous_bytes:
        print(f"paged / contiguous {100 * result.peak_bytes / result.contiguous_bytes:.2f}% (max context), "
              f"{100 * result.peak_bytes / max(1, result.contiguous_tight_bytes):.1f}% (tight)", file=out)
    print("block map at peak (. free  # in use  + shared  c cached  p pinned):", file=out)
    print(result.peak_block_map, file=out)


def run(args: argparse.Namespace) -> int:
    """Execute ``pagedkv demo``; returns the exit status (2 on a pagedkv error)."""
    try:
        for name in ("requests", "max_new_tokens", "max_batch"):
            if getattr(args, name) < 1:
                raise InvalidArgumentError(expected("--" + name.replace("_", "-"), "an int >= 1", getattr(args, name)))
        if args.arrival_gap < 0:
            raise InvalidArgumentError(expected("--arrival-gap", "an int >= 0", args.arrival_gap))
        if args.token_budget != 0 and args.token_budget <= args.max_batch:
            raise InvalidArgumentError(expected("--token-budget", f"0 or an int > --max-batch ({args.max_batch})",
                                                args.token_budget))
        model, tokenizer = _load(args.model)
        kv = build_kv(model, args)
        requests = make_requests(tokenizer, args.requests, args.max_new_tokens, args.arrival_gap)
        result = serve(model, tokenizer, requests, kv, max_batch=args.max_batch,
                       token_budget=args.token_budget or None, share_prefixes=not args.no_prefix_sharing,
                       progress=not args.no_progress and sys.stderr.isatty(), paged=not args.gather)
    except PagedKVError as e:
        print(f"pagedkv demo: error: {e}", file=sys.stderr)
        return 2
    report(result, tokenizer)
    kv.check_invariants()
    return 0
