#!/usr/bin/env bash
# Build the docs (docs/, mkdocs.yml) with warnings as errors: the API reference is
# generated from the docstrings, so a broken reference or docstring fails CI.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-docs
.venv-docs/bin/pip install -q "mkdocs==1.6.1" "mkdocstrings[python]==1.0.8" "mkdocstrings-python==2.0.11"
.venv-docs/bin/mkdocs build --strict
# the docstrings' Sphinx roles are rendered (docs/sphinx_roles.py): none may show raw
if grep -rlE ':(py:)?(func|meth|class|mod|attr|data|exc|obj|const):(`|<code>)' build/site --include='*.html'; then
  echo "docs: raw Sphinx roles on the pages above" >&2; exit 1
fi
grep -q 'id="pagedkv.ops.paged_attention.paged_attention"' build/site/api/ops/index.html \
  || { echo "docs: the data-ops page lacks paged_attention" >&2; exit 1; }
echo "docs: built into build/site"
