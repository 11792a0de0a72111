#!/usr/bin/env bash
# gpu_check.sh - the one-command check to run first whenever an NVIDIA GPU is lent.
#
#   bash benchmarks/gpu_check.sh            # from the repository root
#
# On a machine with an NVIDIA GPU, in under 9 minutes (each step has its own time
# limit, 9 minutes in all; about 4 on an H200 host):
#   1. builds and installs pagedkv into the current Python (setup.py build_ext -j, then
#      pip without dependency resolution or network: torch with CUDA, cuda-python or
#      cuda-bindings, numpy, Cython, setuptools and pytest must already be there;
#      pytest-xdist, when there, runs the tests in 8 processes);
#   2. runs every test marked `cuda` (all the kernels, paged attention included,
#      against the CPU reference);
#   3. runs benchmarks/kernels.py and benchmarks/attention.py (on the CPU, then with
#      --device cuda);
#   4. prints one summary: the device, each step's status and time, the test counts
#      and every benchmark figure (JSON lines).
# Without a GPU it says so and exits 0 at once. The exit status is 0 when every step
# passed, 1 otherwise. Logs stay in $GPU_CHECK_LOGS (default: a temporary folder).
# PYTHON picks the interpreter; PAGEDKV_SKIP_BUILD=1 skips step 1.
#
#   bash benchmarks/gpu_check.sh --quick    # the attention check, in under 6 minutes
#
# --quick: a preflight of the environment that stops at the first thing missing (the GPU,
# torch with CUDA, cuda-python's driver and NVRTC, a C++ compiler for the emulation), the
# build, the attention tests marked `cuda` (the decode kernel equal to its host emulation
# bit for bit, and both kernels against the float64 definition), then the GPU time of
# decode attention in every K/V format, the decode kernel against the tiled one
# (benchmarks/attention.py --device cuda); it stops at the first failing step.
set -u
cd "$(dirname "$0")/.."
QUICK=0
[ "${1:-}" = "--quick" ] && QUICK=1
PY=${PYTHON:-python}
LOGS=${GPU_CHECK_LOGS:-$(mktemp -d -t pagedkv-gpu-check.XXXXXX)}
mkdir -p "$LOGS"
START=$(date +%s)

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu_check: no NVIDIA GPU here (nvidia-smi finds none); nothing to check"
  exit 0
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  echo "gpu_check: an NVIDIA GPU is present but torch cannot use it (torch.cuda.is_available() is False);"
  echo "gpu_check: install a CUDA build of torch, then run this again"
  exit 0
fi

if [ $QUICK = 1 ]; then
  preflight() {
    "$PY" - <<'PYEOF'
import shutil, sys
import torch
from cuda.bindings import driver, nvrtc
err, major, minor = nvrtc.nvrtcVersion()
assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, f"NVRTC: {err}"
assert driver.cuInit(0)[0] == driver.CUresult.CUDA_SUCCESS, "cuInit failed"
assert shutil.which("g++"), "no g++: the tests compare the GPU with the host emulation"
p = torch.cuda.get_device_properties(0)
print(f"preflight: {p.name}, {p.multi_processor_count} SMs, torch {torch.__version__}, NVRTC {major}.{minor}")
PYEOF
  }
  if ! preflight; then
    echo "gpu_check --quick: the preflight failed (above); fix the environment first"
    exit 1
  fi
fi

declare -a NAMES STATUS SECONDS_TAKEN
FAILED=0
step() {  # step NAME LIMIT_SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  local t0=$(date +%s) rc
  echo "gpu_check: $name (limit ${limit}s)..."
  timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  NAMES+=("$name")
  SECONDS_TAKEN+=($(( $(date +%s) - t0 )))
  if [ $rc -eq 0 ]; then
    STATUS+=("ok")
  elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    STATUS+=("timed out")
    FAILED=1
  else
    STATUS+=("failed (exit $rc)")
    FAILED=1
  fi
  return $rc
}

quick_done() {  # --quick: stop at the first failing step, with the summary
  [ $QUICK = 1 ] && [ $FAILED = 1 ] && summary && exit 1
  return 0
}

summary() {
  echo
  echo "================ pagedkv GPU check: summary ================"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | sed 's/^/device: /'
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" 2>/dev/null
  for i in "${!NAMES[@]}"; do
    printf '%-16s %-18s %4ss\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECONDS_TAKEN[$i]}"
  done
  for t in cuda-tests attention-tests; do
    if [ -f "$LOGS/$t.log" ]; then
      echo "$t: $(grep -E '(passed|failed|error|skipped|deselected)' "$LOGS/$t.log" | tail -1)"
      grep -E '^(FAILED|ERROR) ' "$LOGS/$t.log" | head -20
    fi
  done
  if [ -f "$LOGS/kernels-bench.log" ]; then
    echo "--- kernels-bench figures"
    grep -E '^\{' "$LOGS/kernels-bench.log" || tail -5 "$LOGS/kernels-bench.log"
  fi
  for b in attention-bench attention-cuda; do
    if [ -f "$LOGS/$b.log" ]; then
      echo "--- $b figures (one line per shape and format)"
      "$PY" - "$LOGS/$b.log" <<'PYEOF' || tail -5 "$LOGS/$b.log"
import json, sys
text = open(sys.argv[1]).read()
doc, _ = json.JSONDecoder().raw_decode(text[text.index('{\n'):])
keep = ("shape", "format", "device", "paged_ns", "gather_sdpa_ns", "paged_over_gather", "paged_over_paged_fp32",
        "paged_GBps", "memcpy_GBps", "paged_over_memcpy_bw", "bytes", "decode_us", "tiled_us", "decode_over_tiled",
        "limit_us", "decode_peak_fraction", "read_us", "over_fp16", "decode_host_us", "decode_error")
print(json.dumps(dict(threads=doc["threads"])))
for r in doc["results"]:
    print(json.dumps({k: (round(r[k], 3) if isinstance(r[k], float) else r[k]) for k in keep if k in r}))
PYEOF
    fi
  done
  echo "total: $(( $(date +%s) - START ))s; logs in $LOGS"
}

if [ $QUICK = 1 ]; then
  if [ "${PAGEDKV_SKIP_BUILD:-0}" != "1" ]; then
    step build 140 bash -c '"$0" setup.py -q build_ext -j "$(nproc)" && "$0" -m pip install --no-deps --no-build-isolation -q .' "$PY"
    quick_done
  fi
  XDIST=()
  "$PY" -c "import xdist" >/dev/null 2>&1 && XDIST=(-n 8)
  step attention-tests 120 env OMP_NUM_THREADS=2 PYTHONSAFEPATH=1 "$PY" -m pytest -q -m cuda -p no:cacheprovider -rfE \
    "${XDIST[@]}" tests/test_decode_attention.py tests/test_paged_attention_kernels.py
  quick_done
  step attention-cuda 90 "$PY" benchmarks/attention.py --device cuda
  summary
  exit $FAILED
fi

if [ "${PAGEDKV_SKIP_BUILD:-0}" != "1" ]; then
  # build_ext -j compiles the extensions side by side (a serial pip build took over
  # 2 minutes on a 16-core H200 host); pip then installs what it built
  step build 180 bash -c '"$0" setup.py -q build_ext -j "$(nproc)" && "$0" -m pip install --no-deps --no-build-isolation -q .' "$PY"
fi
# the tests import the installed package: run them from outside the checkout's package dir
# PYTHONSAFEPATH keeps the checkout off sys.path (xdist's workers inherit it); xdist,
# when installed, spreads the tests over 8 processes that share the NVRTC disk cache
XDIST=()
"$PY" -c "import xdist" >/dev/null 2>&1 && XDIST=(-n 8)
step cuda-tests 180 env OMP_NUM_THREADS=2 PYTHONSAFEPATH=1 "$PY" -m pytest -q -m cuda -p no:cacheprovider -rfE "${XDIST[@]}" tests
step kernels-bench 45 "$PY" benchmarks/kernels.py
if [ -f benchmarks/attention.py ]; then
  step attention-bench 30 "$PY" benchmarks/attention.py
  step attention-cuda 90 "$PY" benchmarks/attention.py --device cuda
fi

summary
exit $FAILED
