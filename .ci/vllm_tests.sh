#!/usr/bin/env bash
# The vLLM connector tests (tests_vllm/, marker `vllm`) in the vLLM venv; builds it first
# when missing (.ci/vllm_venv.sh). Runs one engine in-process plus three subprocess engines.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${PAGEDKV_VLLM_VENV:-.venv-vllm}
bash .ci/vllm_venv.sh
. "$venv/bin/activate"
# pytest's binary, not `python -m pytest`: the checkout must not shadow the installed pagedkv.
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} pytest -q -p no:cacheprovider tests_vllm "$@"
