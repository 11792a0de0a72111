#!/usr/bin/env bash
# Build the docs (docs/, mkdocs.yml) with warnings as errors: the API reference is
# generated from the docstrings, so a broken reference or docstring fails CI.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-docs
.venv-docs/bin/pip install -q "mkdocs==1.6.1" "mkdocstrings[python]==1.0.8" "mkdocstrings-python==2.0.11"
.venv-docs/bin/mkdocs build --strict
echo "docs: built into build/site"
