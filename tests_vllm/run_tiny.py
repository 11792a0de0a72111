"""A vLLM engine on a tiny random model (tiny_models.py) in its own process, the engine
core in this one so the connector's store can be inspected: tensor parallel (``tp``: 2,
vLLM's "mp" executor, one worker process per rank) or a sliding-window model with the
hybrid allocator on. Modes: ``reference`` (no connector) and ``connector``: a cold pass,
hits after vLLM's cache is reset, the negative control, and (TP) one rank's shard of a
block corrupted on disk. Usage: ``python run_tiny.py ARGS_JSON OUT_JSON``."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

# vLLM for CPU binds each rank's OpenMP threads to a NUMA node by default and refuses two
# ranks on one node: one core each instead (replacing vllm_env's one-rank binding, which
# the test process may pass on).
os.environ["VLLM_CPU_OMP_THREADS_BIND"] = os.environ.get("PAGEDKV_VLLM_TP_BIND", "0|1")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, str(Path(__file__).parent))
import vllm_env as ve  # noqa: E402



def corrupt_shard(disk: Path, slot: int, rank: int, heads_per_rank: int, head_bytes: int) -> None:
    """Flip 4 bytes inside ``rank``'s heads of layer 0 in disk slot ``slot`` (bf16 storage:
    the record starts with the ``[L, H, bs, 2D]`` arena section)."""
    record = json.loads((disk / "meta.json").read_text())["record_bytes"]
    at = slot * record + rank * heads_per_rank * head_bytes + 100
    with open(disk / "blocks.bin", "r+b") as f:
        f.seek(at)
        b = f.read(4)
        f.seek(at)
        f.write(bytes(x ^ 0xFF for x in b))


def main() -> None:
    args = json.loads(sys.argv[1])
    out_path = Path(sys.argv[2])
    res: dict = {}
    model = args["model"]
    tp = int(args.get("tp", 1))
    par = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}
    t0 = time.monotonic()

    def fresh(name):
        assert llm.reset_prefix_cache()
        return ve.generate(llm, ve.prompt_set(name), logprobs=True)

    if args["mode"] == "reference":
        llm = ve.make_llm(connector=False, model=model, **par)
        res["start_s"] = time.monotonic() - t0
        res["A"] = ve.generate(llm, ve.prompt_set("A"), logprobs=True)
    else:
        disk = Path(args["disk_dir"])
        llm = ve.make_llm({"disk_dir": str(disk), "host_blocks": 64, "disk_blocks": 256}, model=model, **par)
        res["start_s"] = time.monotonic() - t0
        _, store = ve.engine_store(llm)
        res["cold"] = fresh("A")
        res["warm"] = fresh("A")
        res["host_hit_tokens"] = int(store.host.num_hit_tokens)
        ve.set_shuffle(llm, True)
        res["shuffled"] = fresh("A")
        ve.set_shuffle(llm, False)
        res["unshuffled"] = fresh("A")
        store.clear(disk=False)                  # the host tier emptied: hits come from disk
        disk_hits = store.num_disk_hit_tokens
        res["from_disk"] = fresh("A")
        res["disk_hit_tokens"] = int(store.num_disk_hit_tokens - disk_hits)
        res["store"] = {"tp_size": store.tp_size, "kv_heads": store.spec.kv_heads, "num_layers": store.spec.num_layers,
                        "format_tp": store.format.get("tp_size"), "tp_shards": store.format.get("tp_shards"),
                        "serving": store.serving}
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        res["groups"] = [[type(g.kv_cache_spec).__name__, len(g.layer_names)]
                         for g in sched.kv_cache_config.kv_cache_groups]
        res["hma_off"] = bool(llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager)
        if tp > 1:
            corrupt_one_shard(llm, store, disk, res)
        from pagedkv.integrations.vllm_connector import worker_stats
        res["worker_stats"] = [s for per in llm.collective_rpc(worker_stats) for s in per]
    res["total_s"] = time.monotonic() - t0
    out_path.write_text(json.dumps(res))


def corrupt_one_shard(llm, store, disk: Path, res: dict) -> None:
    """Rank 1's heads of set A's root block corrupted on disk (the host tier emptied first)."""
    from conftest import root_slot

    store.clear(disk=False)
    sp = store.spec
    h = sp.kv_heads // store.tp_size
    head_bytes = sp.block_size * 2 * sp.head_size * sp.dtype.itemsize
    corrupt_shard(disk, root_slot(disk, ve.prompt_set("A")[0]), 1, h, head_bytes)
    corrupt_before = store.num_disk_corrupt
    assert llm.reset_prefix_cache()
    res["corrupt"] = ve.generate(llm, ve.prompt_set("A"), logprobs=True)
    res["num_disk_corrupt"] = store.num_disk_corrupt - corrupt_before


if __name__ == "__main__":
    main()
