#!/usr/bin/env bash
# ruff and mypy on the package, with the configuration in pyproject.toml ([tool.ruff],
# [tool.mypy]); exits non-zero on any finding. The tools are pinned: a new release adds
# rules and inference, and CI must not turn red on a day nothing here changed (bump the
# pins on purpose, fixing what the new versions report).
# PYTHON: the interpreter of a venv with pagedkv's dependencies (mypy reads numpy's and
# torch's types from it); the pinned tools are installed into that venv.
# RUFF_PATHS: what ruff checks (the package; tests/, benchmarks/ and fuzz/ are not clean yet).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
RUFF_VERSION=0.17.6
MYPY_VERSION=2.4.1
"$py" -m pip install -q "ruff==$RUFF_VERSION" "mypy==$MYPY_VERSION"
read -r -a ruff_paths <<< "${RUFF_PATHS:-pagedkv}"
status=0     # both run, so one CI run reports every finding
echo "+ ruff $RUFF_VERSION check ${ruff_paths[*]}"
"$py" -m ruff check "${ruff_paths[@]}" || status=1
echo "+ mypy $MYPY_VERSION (files from [tool.mypy]: pagedkv)"
"$py" -m mypy || status=1
exit $status
