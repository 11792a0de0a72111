"""A vLLM engine in its own process, with vLLM's default multiprocessing (engine core and
worker in processes of their own), for the tests that need one: ``reference`` (no
connector) and ``peer`` (a warm restart on a shared directory, an exchange with a second
peer, hits after a reset, optionally a corrupted block first and the negative control
last). Usage: ``python run_engine.py ARGS_JSON OUT_JSON``."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import vllm_env as ve  # noqa: E402


def wait_for(path: Path, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists():
            return True
        time.sleep(0.2)
    return False


def main() -> None:
    args = json.loads(sys.argv[1])
    out_path = Path(sys.argv[2])
    res: dict = {}
    if args["mode"] == "reference":
        llm = ve.make_llm(connector=False)
        for name in args["sets"]:
            res[name] = ve.generate(llm, ve.prompt_set(name), logprobs=True)
    else:  # peer: only what a client sees (outputs, cached tokens): the store is in another process
        llm = ve.make_llm(dict({"disk_dir": args["disk_dir"], "host_blocks": 64, "disk_blocks": 256},
                               **args.get("extra", {})))
        if args.get("corrupt_set"):              # first: its root block on disk was corrupted
            res["corrupt"] = ve.generate(llm, ve.prompt_set(args["corrupt_set"]))
        res["warm"] = ve.generate(llm, ve.prompt_set(args["warm_set"]))
        res["own"] = ve.generate(llm, ve.prompt_set(args["own_set"]))
        done = Path(args["barrier"]) / f"{args['own_set']}.done"
        done.write_text("1")
        ok = wait_for(Path(args["barrier"]) / f"{args['other_set']}.done", 600)
        res["barrier_ok"] = ok
        llm.reset_prefix_cache()                # never computed here: only the other's disk writes can hit
        res["other"] = ve.generate(llm, ve.prompt_set(args["other_set"]))
        llm.reset_prefix_cache()
        res["own_again"] = ve.generate(llm, ve.prompt_set(args["own_set"]))
        if args.get("negative"):
            ve.set_shuffle(llm, True)
            llm.reset_prefix_cache()
            res["shuffled"] = ve.generate(llm, ve.prompt_set(args["own_set"]))
            ve.set_shuffle(llm, False)
            llm.reset_prefix_cache()
            res["unshuffled"] = ve.generate(llm, ve.prompt_set(args["own_set"]))
        from pagedkv.integrations.vllm_connector import worker_stats
        res["worker_stats"] = [s for per in llm.collective_rpc(worker_stats) for s in per]
    out_path.write_text(json.dumps(res))


if __name__ == "__main__":
    main()
