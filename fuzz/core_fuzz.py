"""Long randomized run of the Cython core against its pure-Python model.

Each operation (add with prefix lookup, reserve, advance, commit with and without token
ids, fork, free, pin/unpin, reset, priority changes, and hostile input: unknown or
repeated ids, negative, huge and overflowing counts, wrong dtypes, out-of-range blocks)
is applied to both (every other run over a sliding-window table, which releases blocks
that leave its window, with hold/slide operations); array arguments reach the core in random layouts (big-endian,
reversed, strided, lists), and some calls get arrays that a second thread rewrites
while the call runs (the core must act on one consistent snapshot);
they must agree on the result or raise the same typed error with the state unchanged.
After every operation the core's cheap counters are compared with the model; every
``--check-every`` operations the full state (ref counts, per-list eviction order,
block tables, cached blocks) is compared and ``check_invariants()`` audits DESIGN.md's
invariants. Every prefix hit is checked against a ground-truth record of which
(namespace, token prefix) each slot's KV was computed for.

On a failure the script prints the seed, the operation number and a replayable
snapshot (``BlockPool.__getstate__``) and exits 1.

Progress: a JSON line every ``--progress-every`` operations (``progress_ops``, seconds,
ops/s), and on SIGTERM or SIGINT a last line ``{"result": "interrupted", "ops": N, ...}``
with the operations completed and checked, so a run cut short still reports its count
(exit 128 + the signal number).

Usage: ``python fuzz/core_fuzz.py --ops 10000000 [--seed N] [--policy lru|priority|adaptive|frequency|all]``
"""
from __future__ import annotations

import argparse
import json
import pickle
import signal
import sys
import threading
import time

import numpy as np

from pagedkv._core.pool import BlockPool
from pagedkv._core.prefix import PrefixIndex
from pagedkv._core.tables import BlockTables
from pagedkv.errors import PagedKVError
from pagedkv.testing.core_model import PyBlockPool, PyTables

POLICIES = ["lru", "priority", "adaptive", "frequency"]


class Mismatch(Exception):
    pass


class Rewriter:
    """A thread that keeps flipping an array between two contents. Calls that receive
    it race with the flips; the GIL is released inside the core's loops, which is where
    a re-read would pick up a value that was never validated."""

    def __init__(self):
        self.target = None
        self.a = self.b = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def aim(self, target, a, b):
        self.target, self.a, self.b = target, a, b

    def run(self):
        flip = False
        while not self.stop.is_set():
            t = self.target
            if t is None:
                time.sleep(0.001)
                continue
            flip = not flip
            t[:] = self.a if flip else self.b

    def close(self):
        self.stop.set()
        self.thread.join()


def relayout(arr, rng):
    """The same values in a random layout: native, big-endian, reversed, strided or a list."""
    kind = int(rng.integers(0, 5))
    if kind == 0:
        return arr
    if kind == 1:
        return arr.astype(arr.dtype.newbyteorder(">"))
    if kind == 2:
        return arr[::-1].copy()[::-1]
    if kind == 3:
        wide = np.zeros(2 * len(arr), dtype=arr.dtype)
        wide[1::2] = arr
        return wide[1::2]
    return arr.tolist()


class Fuzzer:
    def __init__(self, seed: int, policy: str, rewriter: Rewriter, num_blocks: int = 48, block_size: int = 4,
                 window: int = 0, sinks: int = 0):
        self.rng = np.random.default_rng(seed)
        self.nb, self.bs = num_blocks, block_size
        order = np.random.default_rng(seed).permutation(num_blocks).tolist()
        self.index = PrefixIndex(block_size, num_blocks, hash_seed=seed)
        self.pool = BlockPool(num_blocks, policy, low_watermark=0.2, high_watermark=0.4,
                              shuffle_seed=seed, index=self.index)
        self.window = window
        self.tables = BlockTables(self.pool, block_size, self.index, window=window, sinks=sinks)
        self.mpool = PyBlockPool(num_blocks, policy, low_watermark=0.2, high_watermark=0.4, order=order)
        self.model = PyTables(self.mpool, block_size, window=window, sinks=sinks)
        self.keys: list = []
        self.next_key = 0
        self.kv: dict = {}
        self.ns: dict = {}
        self.errors = 0
        self.rewriter = rewriter

    # -- helpers -------------------------------------------------------------------------
    def both(self, fast, slow):
        try:
            a, ea = fast(), None
        except PagedKVError as e:
            a, ea = None, type(e)
        try:
            b, eb = slow(), None
        except PagedKVError as e:
            b, eb = None, type(e)
        if ea != eb:
            raise Mismatch(f"core raised {ea}, model raised {eb}")
        if ea is not None:
            self.errors += 1
        return a, b, ea

    def pick(self, k):
        n = min(k, len(self.keys))
        idx = self.rng.choice(len(self.keys), size=n, replace=False)
        return [self.keys[i] for i in idx]

    def record_writes(self, keys, before_reserved, slots):
        off = 0
        for k in keys:
            toks = self.tables.tokens(k).tolist()
            n = self.tables.num_reserved(k) - before_reserved[k]
            for j in range(n):
                pos = before_reserved[k] + j
                slot = slots[off + j]
                self.kv[slot] = (self.ns[k], tuple(toks[:pos + 1])) if pos < len(toks) else ("?", slot, pos)
            off += n

    def apply_copies(self, copies):
        mc = self.model.copies
        if [tuple(c) for c in copies] != mc:
            raise Mismatch(f"copy-on-write pairs differ: {copies} vs {mc}")
        mc.clear()
        for src, dst in copies:
            for o in range(self.bs):
                v = self.kv.get(src * self.bs + o)
                if v is None:
                    self.kv.pop(dst * self.bs + o, None)
                else:
                    self.kv[dst * self.bs + o] = v

    # -- operations ----------------------------------------------------------------------
    def op_add(self):
        r = self.rng
        prompt = r.integers(0, 3, r.integers(0, 16)).tolist()
        ns = int(r.integers(0, 2))
        k = self.next_key
        self.next_key += 1
        a, b, err = self.both(lambda: self.tables.add(k, np.array(prompt, np.int32), ns, ns * 7919, -1),
                              lambda: self.model.add(k, prompt, ns))
        if a != b:
            raise Mismatch(f"prefix hit {a} vs model {b}")
        self.keys.append(k)
        self.ns[k] = ns
        blocks = self.tables.blocks(k).tolist()
        for p in range(a):
            if blocks[p // self.bs] < 0:
                continue      # left the sliding window at once
            if self.kv.get(blocks[p // self.bs] * self.bs + p % self.bs) != (ns, tuple(prompt[:p + 1])):
                raise Mismatch(f"prefix hit returned wrong KV at position {p}")

    def op_reserve(self):
        keys = self.pick(int(self.rng.integers(1, 5)))
        counts = self.rng.integers(0, 7, len(keys)).tolist()
        before = {k: self.tables.num_reserved(k) for k in keys}
        k_arr = relayout(np.array(keys, np.int64), self.rng)
        c_arr = relayout(np.array(counts, np.int64), self.rng)
        a, b, err = self.both(lambda: self.tables.reserve(k_arr, c_arr).tolist(),
                              lambda: self.model.reserve(keys, counts))
        if err is None:
            if a != b:
                raise Mismatch("slots differ")
            self.apply_copies(self.tables.take_copies().tolist())
            self.pending_writes(keys, before, a)

    def pending_writes(self, keys, before, slots):
        # KV is written by the forward pass right after reserve
        off = 0
        for k in keys:
            n = self.tables.num_reserved(k) - before[k]
            known = self.tables.tokens(k).tolist()
            for j in range(n):
                pos = before[k] + j
                slot = slots[off + j]
                self.kv[slot] = (self.ns[k], tuple(known[:pos + 1])) if pos < len(known) else ("?", slot, pos)
            off += n

    def op_commit(self):
        live = [k for k in self.keys if self.tables.num_reserved(k) > self.tables.num_computed(k)]
        if not live:
            return
        keys = [live[i] for i in self.rng.choice(len(live), size=min(3, len(live)), replace=False)]
        counts = [int(self.rng.integers(1, self.tables.num_reserved(k) - self.tables.num_computed(k) + 1)) for k in keys]
        ids = None
        if self.rng.random() < 0.7:
            ids = []
            for k, n in zip(keys, counts):
                known = self.tables.tokens(k).tolist()
                c = self.tables.num_computed(k)
                ids += [known[p] if p < len(known) else int(self.rng.integers(0, 3)) for p in range(c, c + n)]
        # positions beyond the known ids were written with unknown content: fix up the
        # ground truth to what the ids now say only where the core learns them
        k_arr = relayout(np.array(keys, np.int64), self.rng)
        c_arr = relayout(np.array(counts, np.int64), self.rng)
        t_arr = None if ids is None else relayout(np.array(ids, np.int32), self.rng)
        held = {k: self.tables.blocks(k).tolist() for k in keys}   # a sliding commit may release some
        self.both(lambda: self.tables.commit(k_arr, c_arr, t_arr),
                  lambda: self.model.commit(keys, counts, ids))
        if ids is not None:
            off = 0
            for k, n in zip(keys, counts):
                c = self.tables.num_computed(k) - n
                known = self.tables.tokens(k).tolist()
                blocks = held[k]
                for p in range(c, c + n):
                    slot = blocks[p // self.bs] * self.bs + p % self.bs
                    if self.kv.get(slot, ("?",))[0] == "?" and p < len(known):
                        self.kv[slot] = (self.ns[k], tuple(known[:p + 1]))
                off += n

    def op_advance(self):
        keys = self.pick(int(self.rng.integers(1, 5)))
        ids = []
        for k in keys:
            known = self.tables.tokens(k).tolist()
            pos = self.tables.num_reserved(k)
            ids.append(known[pos] if pos < len(known) else int(self.rng.integers(0, 3)))
        before = {k: self.tables.num_reserved(k) for k in keys}
        k_arr = relayout(np.array(keys, np.int64), self.rng)
        t_arr = relayout(np.array(ids, np.int32), self.rng)
        a, b, err = self.both(lambda: self.tables.advance(k_arr, t_arr).tolist(),
                              lambda: self.model.advance(keys, ids))
        if err is None:
            if a != b:
                raise Mismatch("advance slots differ")
            self.apply_copies(self.tables.take_copies().tolist())
            self.pending_writes(keys, before, a)

    def op_window(self):
        """Hold a sliding window for a rollback, stop holding, or release what left it."""
        keys = self.pick(int(self.rng.integers(1, 4)))
        k_arr = relayout(np.array(keys, np.int64), self.rng)
        if self.rng.random() < 0.3:
            self.both(lambda: self.tables.slide(k_arr), lambda: self.model.slide(keys))
        else:
            hold = bool(self.rng.random() < 0.5)
            self.both(lambda: self.tables.hold_window(k_arr, hold), lambda: self.model.hold_window(keys, hold))

    def op_fork(self):
        src = self.pick(1)[0]
        dst = self.next_key
        self.next_key += 1
        _, _, err = self.both(lambda: self.tables.fork(src, dst), lambda: self.model.fork(src, dst))
        if err is None:
            self.keys.append(dst)
            self.ns[dst] = self.ns[src]

    def op_free(self):
        keys = self.pick(int(self.rng.integers(1, 4)))
        k_arr = relayout(np.array(keys, np.int64), self.rng)
        self.both(lambda: self.tables.remove(k_arr), lambda: self.model.remove(keys))
        for k in keys:
            self.keys.remove(k)

    def op_hostile(self):
        r = self.rng
        choice = int(r.integers(0, 9))
        before = self.snapshot()
        if choice == 0:
            keys = r.integers(-3, self.next_key + 3, 3).tolist()
            fast = lambda: self.tables.remove(np.array(keys, np.int64))  # noqa: E731
            slow = lambda: self.model.remove(keys)  # noqa: E731
            if all(k in self.keys for k in keys) and len(set(keys)) == 3:
                return
        elif choice == 1:
            keys = self.pick(2) or [0]
            keys = keys + keys[:1]
            fast = lambda: self.tables.reserve(np.array(keys, np.int64), 1)  # noqa: E731
            slow = lambda: self.model.reserve(keys, 1)  # noqa: E731
        elif choice == 2:
            keys = self.pick(1) or [0]
            fast = lambda: self.tables.reserve(np.array(keys, np.int64), np.array([-1], np.int64))  # noqa: E731
            slow = lambda: self.model.reserve(keys, [-1])  # noqa: E731
        elif choice == 3:
            ids = r.integers(-2, self.nb + 2, 3).tolist()
            fast = lambda: self.pool.touch(np.array(ids, np.int32))  # noqa: E731
            slow = lambda: self.mpool.touch(ids)  # noqa: E731
        elif choice == 4:
            keys = self.pick(1) or [0]
            fast = lambda: self.tables.commit(np.array(keys, np.int64), 10_000)  # noqa: E731
            slow = lambda: self.model.commit(keys, 10_000)  # noqa: E731
        elif choice == 6:
            # huge counts whose block totals overflow 32 (and 64) bits
            keys = self.pick(3) or [0]
            big = [int(r.choice([2**31, 2**40, 2**62, 2**63 - 1])) for _ in keys]
            fast = lambda: self.tables.reserve(relayout(np.array(keys, np.int64), r), np.array(big, np.int64))  # noqa: E731
            slow = lambda: self.model.reserve(keys, big)  # noqa: E731
        elif choice == 7:
            keys = self.pick(2) or [0]
            big = int(r.choice([2**62, 2**63 - 1]))
            fast = lambda: self.tables.commit(np.array(keys, np.int64), np.full(len(keys), big, np.int64))  # noqa: E731
            slow = lambda: self.model.commit(keys, [big] * len(keys))  # noqa: E731
        elif choice == 8:
            keys = self.pick(1) or [0]
            fast = lambda: self.tables.reserve(keys[0], 2**63)  # noqa: E731
            slow = lambda: self.model.reserve(keys, 2**63)  # noqa: E731
        else:
            try:
                self.tables.reserve(np.array(self.keys[:1] or [0], np.int32), 1)  # wrong dtype
            except (TypeError, ValueError) as e:
                if not isinstance(e, PagedKVError):
                    raise Mismatch(f"untyped error {e!r}")
            else:
                raise Mismatch("an int32 key array was accepted")
            if self.snapshot() != before:
                raise Mismatch("a rejected call changed the state")
            return
        _, _, err = self.both(fast, slow)
        if err is not None and self.snapshot() != before:
            raise Mismatch("a failed call changed the state")
        if err is None and choice == 0:
            for k in keys:
                self.keys.remove(k)
        if err is None and choice == 3:
            # the touch was legal: give the references back so only sequences hold refs
            self.both(lambda: self.pool.free(np.array(ids, np.int32)), lambda: self.mpool.free(ids))

    def op_torn(self):
        """reserve() with a counts array another thread flips between all-ones and
        all-2**40: the call must act on one snapshot (all ones: slots like the model's;
        anything else: refused, state unchanged), never on a mix of checked and unchecked
        values."""
        keys = self.pick(3)
        if not keys:
            return
        counts = np.ones(len(keys), dtype=np.int64)
        before = self.snapshot()
        reserved = {k: self.tables.num_reserved(k) for k in keys}
        self.rewriter.aim(counts, 1, 2**40)
        if self.rng.random() < 0.5:
            time.sleep(0)           # let the rewriter run first: the snapshot may see any mix
        try:
            slots = self.tables.reserve(np.array(keys, np.int64), counts)
        except PagedKVError:
            slots = None
        finally:
            self.rewriter.aim(None, 0, 0)
        if slots is None:
            if self.snapshot() != before:
                raise Mismatch("a torn reserve that failed changed the state")
            return
        expect = self.model.reserve(keys, [1] * len(keys))
        if slots.tolist() != expect:
            raise Mismatch("a torn reserve used values other than its snapshot")
        self.apply_copies(self.tables.take_copies().tolist())
        self.pending_writes(keys, reserved, slots.tolist())

    def op_pin(self):
        prompt = self.rng.integers(0, 3, self.rng.integers(4, 13)).tolist()
        ns = int(self.rng.integers(0, 2))
        blocks = self.index.match(np.array(prompt, np.int32), ns, ns * 7919).tolist()
        if blocks != self.model.match(prompt, ns):
            raise Mismatch("match() differs")
        if self.rng.random() < 0.5:
            self.both(lambda: self.pool.pin(np.array(blocks, np.int32)), lambda: self.mpool.pin(blocks))
        else:
            self.both(lambda: self.pool.unpin(np.array(blocks, np.int32)), lambda: self.mpool.unpin(blocks))

    def op_reset(self):
        def slow():
            self.mpool.reset_cache()
            for b in list(self.model.reg):
                self.model._unregister(b)
        self.both(self.pool.reset_cache, slow)

    def op_priority(self):
        k = self.pick(1)[0]
        cls = int(self.rng.integers(0, 3))
        self.both(lambda: self.tables.set_priority(k, cls, 0, self.bs * 2),
                  lambda: self.model.set_priority(k, cls, 0, self.bs * 2))

    # -- checks --------------------------------------------------------------------------
    def snapshot(self):
        return (np.asarray(self.pool.ref_cnt).tolist(), self.pool.free_lists(),
                {k: self.tables.blocks(k).tolist() for k in self.keys})

    def cheap_check(self):
        p, m = self.pool, self.mpool
        if (p.num_free_blocks, p.num_evictions, p.num_allocations) != (m.num_free_blocks, m.num_evictions, m.num_allocations):
            raise Mismatch("pool counters differ from the model")

    def full_check(self):
        self.tables.check_invariants()
        if (np.asarray(self.pool.ref_cnt).tolist() != self.mpool.ref
                or self.pool.free_lists() != [list(lst) for lst in self.mpool.lists]):
            raise Mismatch("pool state differs from the model")
        for k in self.keys:
            if self.tables.blocks(k).tolist() != self.model.rows[k].blocks:
                raise Mismatch(f"block table of {k} differs")
        if sorted(self.index.cached_blocks().tolist()) != sorted(self.model.reg):
            raise Mismatch("cached blocks differ")

    OPS = ["add", "add", "reserve", "reserve", "advance", "advance", "commit", "commit", "fork",
           "free", "free", "hostile", "pin", "priority", "torn"]

    def step(self):
        if not self.keys:
            self.op_add()
            return
        name = self.OPS[int(self.rng.integers(0, len(self.OPS)))]
        if name == "add" and len(self.keys) > 24:
            name = "free"
        if self.rng.random() < 0.002:
            name = "reset"
        elif self.window and self.rng.random() < 0.05:
            name = "window"
        getattr(self, "op_" + name)()


def main(argv=None):
    ap = argparse.ArgumentParser(description="fuzz the Cython core against its pure-Python model")
    ap.add_argument("--ops", type=int, default=200_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", default="all", choices=POLICIES + ["all"])
    ap.add_argument("--check-every", type=int, default=200)
    ap.add_argument("--smoke", action="store_true", help="a short run (CI)")
    ap.add_argument("--restart-every", type=int, default=20_000, help="ops before a fresh cache and seed")
    ap.add_argument("--progress-every", type=int, default=100_000, help="ops between progress lines")
    args = ap.parse_args(argv)
    if args.ops < 0 or args.progress_every < 1 or args.restart_every < 1 or args.check_every < 1:
        ap.error("--ops must be >= 0; --progress-every, --restart-every and --check-every >= 1")
    if args.smoke:
        args.ops = min(args.ops, 5_000)
        args.restart_every = min(args.restart_every, 2_500)   # a full-attention run and a sliding one
    policies = POLICIES if args.policy == "all" else [args.policy]
    sys.setswitchinterval(1e-5)   # let the rewriter thread interleave with the core's calls
    rewriter = Rewriter()
    old = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return run_all(args, policies, rewriter)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        rewriter.close()


class Interrupted(BaseException):
    """SIGTERM/SIGINT: not an Exception, so the failure handler does not take it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum, frame):
    raise Interrupted(signum)


def _line(**fields) -> None:
    print(json.dumps(fields), flush=True)


def run_all(args, policies, rewriter):
    t0 = time.perf_counter()
    done = errors = 0           # ops completed and checked in finished runs, typed errors seen there
    run = 0
    i = 0
    fz = None

    def stats(ops):
        sec = time.perf_counter() - t0
        return dict(seconds=round(sec, 1), ops_per_s=round(ops / sec) if sec > 0 else None)

    try:
        while done < args.ops:
            seed = args.seed * 1_000_003 + run
            policy = policies[run % len(policies)]
            window = sinks = 0
            if run % 2:       # every other run slides
                wr = np.random.default_rng(seed)
                window = int(wr.integers(1, 13))
                sinks = int(wr.integers(0, window)) if wr.random() < 0.5 else 0
            fz = Fuzzer(seed, policy, rewriter, window=window, sinks=sinks)
            n = min(args.restart_every, args.ops - done)
            i = 0
            try:
                for i in range(n):
                    fz.step()
                    fz.cheap_check()
                    if i % args.check_every == 0:
                        fz.full_check()
                    if (done + i + 1) % args.progress_every == 0:
                        _line(progress_ops=done + i + 1, **stats(done + i + 1))
                i = n
                fz.full_check()
            except Exception as e:  # noqa: BLE001 - report any failure with a replay snapshot
                _line(result="FAIL", seed=seed, policy=policy, window=window, op=i,
                      error=f"{type(e).__name__}: {e}", ops_before=done + i)
                snap = pickle.dumps(fz.pool.__getstate__())
                with open(f"fuzz-failure-{seed}.pkl", "wb") as f:
                    f.write(snap)
                print(f"snapshot written to fuzz-failure-{seed}.pkl (BlockPool.__setstate__ replays it)",
                      file=sys.stderr)
                return 1
            done += n
            errors += fz.errors
            run += 1
            fz = None
    except Interrupted as stop:
        # ops of the run in progress count up to the last one that finished its checks
        ops = done + i
        _line(result="interrupted", signal=signal.Signals(stop.signum).name, ops=ops,
              typed_errors_checked=errors + (fz.errors if fz is not None else 0), runs=run, **stats(ops))
        return 128 + stop.signum
    _line(result="ok", ops=done, typed_errors_checked=errors, runs=run, **stats(done))
    return 0


if __name__ == "__main__":
    sys.exit(main())
