"""A vLLM engine in its own process, for the tests that need one: ``reference`` (no
connector) and ``peer`` (a warm restart on a shared directory, then an exchange with a
second peer). Usage: ``python run_engine.py ARGS_JSON OUT_JSON``."""
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
    else:  # peer
        llm = ve.make_llm({"disk_dir": args["disk_dir"], "host_blocks": 64, "disk_blocks": 256})
        key, store = ve.engine_store(llm)
        res["warm"] = ve.generate(llm, ve.prompt_set(args["warm_set"]))
        res["own"] = ve.generate(llm, ve.prompt_set(args["own_set"]))
        done = Path(args["barrier"]) / f"{args['own_set']}.done"
        done.write_text("1")
        ok = wait_for(Path(args["barrier"]) / f"{args['other_set']}.done", 600)
        res["barrier_ok"] = ok
        store.clear(disk=False)            # host empty: the other's blocks can only come from disk
        llm.reset_prefix_cache()
        res["other"] = ve.generate(llm, ve.prompt_set(args["other_set"]))
        res["stats"] = [s.describe() for s in store.stats()]
        res["lock_misses"] = store.num_lock_misses
        res["disk_refused"] = store.disk_refused
        res["disk_hit_tokens"] = store.num_disk_hit_tokens
    out_path.write_text(json.dumps(res))


if __name__ == "__main__":
    main()
