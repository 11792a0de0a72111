"""``pagedkv demo``: a chat server in miniature, with continuous batching over a paged cache.

Eight chat requests (the default) share one system prompt and arrive a few engine
steps apart. Each engine step:

1. **admission**: arrived requests join while blocks last. ``add_sequence`` reports
   the prompt tokens already cached (the shared system prompt, after the first
   request), and only the rest is prefilled: the requests admitted in one step are
   prefilled together, in one batched forward (right-aligned rows; see
   :func:`_prefill_groups` for when very different lengths take two). Requests
   admitted together do not share each other's uncached prefix blocks;
2. **decode**: one batched forward computes the next token of every running
   request. Rows of different lengths are right-aligned in one rectangle with a
   padding mask (:meth:`PagedCache.select`); each layer reads its K/V straight from
   the blocks. That costs a few padding columns per row, and for a batch this
   small it is cheaper than one attention call per sequence;
3. **completion**: a request that emits end-of-turn or reaches its token budget is
   freed at once; its full blocks stay in the prefix cache.

Then it prints every request (prompt, answer, tokens, latency) and a summary:
throughput, prefix hit rate, blocks and bytes in use against a contiguous
max-length allocation per request, and the block map at peak use.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedkv.errors import InvalidArgumentError, OutOfBlocksError, PagedKVError, expected

if TYPE_CHECKING:   # the demo imports torch-backed modules lazily, so `--help` stays fast
    from pagedkv.manager.cache import PagedKVCache

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
    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)


@dataclass
class DemoResult:
    requests: list[Request]
    wall_s: float
    generated_tokens: int
    decode_steps: int
    prefill_forwards: int        # batched prefill forwards (one per group of admitted requests)
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
    p.add_argument("--arrival-gap", type=int, default=2, help="engine steps between request arrivals")
    p.add_argument("--seed", type=int, default=0, help="free-list shuffle seed (blocks out of order)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--gather", action="store_true",
                   help="attend over gathered K/V (the old path) instead of reading the pages (pagedkv attention)")


def _chat_ids(tokenizer, user: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys") and "input_ids" in ids:  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def make_requests(tokenizer, n: int, max_new_tokens: int, arrival_gap: int) -> list[Request]:
    """``n`` requests cycling through the prompts, with varied answer budgets."""
    out = []
    for i in range(n):
        user = USER_PROMPTS[i % len(USER_PROMPTS)]
        budget = max(1, max_new_tokens - (i % 3) * max_new_tokens // 4)
        out.append(Request(i, user, _chat_ids(tokenizer, user), budget, i * arrival_gap))
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
          progress: bool = False, paged: bool = True) -> DemoResult:
    """Run the engine loop until every request is answered; frees everything it admits,
    also when it fails."""
    import torch

    from pagedkv.integrations.transformers import PagedCache

    eos = {int(tokenizer.eos_token_id)}
    if paged:   # the registered attention reads the pages; PagedCache.update only writes
        from pagedkv.integrations import hf_attention

        model.set_attn_implementation(hf_attention.register())
    cache = PagedCache(kv, paged_attention=paged)
    pending = deque(sorted(requests, key=lambda r: r.arrival_step))
    waiting: deque = deque()
    running: list[Request] = []
    bar = _Progress(len(requests), progress)
    step = steps = generated = max_batch_seen = prefill_forwards = 0
    pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    peak_blocks, peak_map = -1, ""
    done = 0
    start = time.perf_counter()

    def emit(req: Request, logits_row) -> bool:
        """Append the greedy token; True when the request is complete."""
        tok = int(logits_row.argmax())
        req.output_ids.append(tok)
        if len(req.output_ids) == 1:
            req.first_token_at = time.perf_counter()
        return tok in eos or len(req.output_ids) >= req.max_new_tokens

    def finish(req: Request) -> None:
        nonlocal done
        req.finished_at = time.perf_counter()
        kv.free(req.rid)
        live.discard(req.rid)
        done += 1

    live = set()  # admitted, not finished: freed here if the loop fails
    try:
        with torch.no_grad():
            while pending or waiting or running:
                if not waiting and not running and pending[0].arrival_step > step:
                    step = pending[0].arrival_step   # an idle engine skips to the next arrival
                while pending and pending[0].arrival_step <= step:
                    req = pending.popleft()
                    req.arrived_at = time.perf_counter()
                    waiting.append(req)
                # admission: admit arrived requests while the batch and the blocks allow,
                # then prefill them together
                admitted: list[Request] = []
                while waiting and len(running) + len(admitted) < max_batch:
                    req = waiting[0]
                    # No preemption here, so admit only what can run to completion: the
                    # new request's worst case plus the growth the running (and just
                    # admitted) requests may still need. blocks_to_admit counts what its
                    # prefix hits revive from the free list, so the admission below
                    # cannot run out.
                    need = kv.blocks_to_admit(req.prompt_ids, len(req.prompt_ids) + req.max_new_tokens)
                    owed = sum(_blocks_needed(kv, len(r.prompt_ids) + r.max_new_tokens,
                                              len(kv.block_table(r.rid)) * kv.config.block_size)
                               for r in running + admitted)
                    if not kv.has_available_blocks(need + owed):
                        if not running and not admitted:
                            raise OutOfBlocksError(need, kv.stats().free_blocks, f"request {req.rid}")
                        break  # wait for a running request to finish and free its blocks
                    waiting.popleft()
                    req.admitted_step = step
                    req.cached_tokens = kv.add_sequence(req.rid, req.prompt_ids)
                    live.add(req.rid)
                    admitted.append(req)
                for group in _prefill_groups(admitted):
                    logits = _prefill(model, cache, group, pad_id)
                    prefill_forwards += 1
                    generated += len(group)
                    for i, req in enumerate(group):
                        if emit(req, logits[i, -1]):
                            finish(req)
                        else:
                            running.append(req)
                # decode: one batched forward over every running request
                if running:
                    ids = torch.tensor([[r.output_ids[-1]] for r in running])
                    mask, pos = cache.select([r.rid for r in running], 1)
                    cache.set_input_ids(ids)
                    logits = model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache).logits
                    max_batch_seen = max(max_batch_seen, len(running))
                    steps += 1
                    generated += len(running)
                    used = kv.stats().allocated_blocks
                    if used > peak_blocks:
                        peak_blocks, peak_map = used, kv.dump_block_map()
                    still = []
                    for i, req in enumerate(running):
                        if emit(req, logits[i, -1]):
                            finish(req)
                        else:
                            still.append(req)
                    running = still
                step += 1
                bar.update(done, len(running), generated)
    except BaseException:
        if live:
            kv.free(sorted(live))
        raise
    wall = time.perf_counter() - start
    bar.update(done, 0, generated, force=True)
    stats = kv.stats()
    bpt = kv.config.bytes_per_token
    context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    return DemoResult(
        requests=list(requests), wall_s=wall, generated_tokens=generated, decode_steps=steps,
        prefill_forwards=prefill_forwards,
        max_batch_seen=max_batch_seen, peak_blocks=max(peak_blocks, 0),
        peak_bytes=max(peak_blocks, 0) * kv.config.bytes_per_block, peak_block_map=peak_map,
        hit_rate=stats.hit_rate, contiguous_bytes=len(requests) * context * bpt,
        contiguous_tight_bytes=sum(len(r.prompt_ids) + r.max_new_tokens for r in requests) * bpt, kv=kv)


#: a prefill group grows while its padded rectangle (rows x longest new part) stays
#: within this many times its real new tokens
PREFILL_PADDING = 1.25


def _prefill_groups(admitted: list[Request]) -> list[list[Request]]:
    """The admitted requests in prefill groups, each one batched forward.

    A batched forward takes every row's longest new part, so one request that missed
    the prefix cache (hundreds of new tokens) next to several that hit it (a few dozen)
    would cost the hits the miss's length each; the requests, longest new part first,
    are cut where the padded area would pass :data:`PREFILL_PADDING` times the real
    one. Requests of similar length (the common case) take one forward."""
    order = sorted(admitted, key=lambda r: len(r.prompt_ids) - r.cached_tokens, reverse=True)
    groups: list[list[Request]] = []
    real = 0
    for req in order:
        new = len(req.prompt_ids) - req.cached_tokens
        if groups:
            longest = len(groups[-1][0].prompt_ids) - groups[-1][0].cached_tokens
            if longest * (len(groups[-1]) + 1) <= PREFILL_PADDING * (real + new):
                groups[-1].append(req)
                real += new
                continue
        groups.append([req])
        real = new
    return groups


def _prefill(model, cache, group: list[Request], pad_id: int):
    """One forward over the new prompt tokens of ``group``; returns logits ``[B, 1, V]``.

    Rows are right-aligned: row b's last columns are its new tokens; the columns
    before them (where another row's new part is longer) hold its last cached tokens,
    whose K/V is already stored and is not written again (:meth:`PagedCache.select`)."""
    import torch

    new = [len(r.prompt_ids) - r.cached_tokens for r in group]
    q = max(new)
    ids = torch.full((len(group), q), pad_id, dtype=torch.long)
    for i, req in enumerate(group):
        tail = req.prompt_ids[max(0, len(req.prompt_ids) - q):]
        ids[i, q - len(tail):] = torch.tensor(tail)
    mask, pos = cache.select([r.rid for r in group], new)
    cache.set_input_ids(ids)
    return model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache, logits_to_keep=1).logits


def _blocks_needed(kv, total_tokens: int, have_tokens: int) -> int:
    """Blocks still to allocate for a sequence of ``total_tokens`` holding ``have_tokens``'s blocks."""
    bs = kv.config.block_size
    return max(0, kv.config.blocks_for_tokens(total_tokens) - have_tokens // bs)


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
        print(f"    prompt {len(r.prompt_ids)} tokens ({r.cached_tokens} from the prefix cache), "
              f"{len(r.output_ids)} generated, first token {1000 * (r.first_token_at - r.arrived_at):.0f} ms, "
              f"latency {r.finished_at - r.arrived_at:.2f} s", file=out)
    c = kv.config
    print("\n=== summary ===", file=out)
    print(f"requests          {len(result.requests)}, {result.decode_steps} batched decode steps, "
          f"up to {result.max_batch_seen} at once, {result.prefill_forwards} batched prefill forwards", file=out)
    print(f"throughput        {result.generated_tokens} tokens in {result.wall_s:.2f} s = "
          f"{result.generated_tokens / max(result.wall_s, 1e-9):.1f} tokens/s", file=out)
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
        model, tokenizer = _load(args.model)
        kv = build_kv(model, args)
        requests = make_requests(tokenizer, args.requests, args.max_new_tokens, args.arrival_gap)
        result = serve(model, tokenizer, requests, kv, max_batch=args.max_batch,
                       progress=not args.no_progress and sys.stderr.isatty(), paged=not args.gather)
    except PagedKVError as e:
        print(f"pagedkv demo: error: {e}", file=sys.stderr)
        return 2
    report(result, tokenizer)
    kv.check_invariants()
    return 0
