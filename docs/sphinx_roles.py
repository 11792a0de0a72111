"""A griffe extension for the API pages: Sphinx roles in docstrings become code spans.

The docstrings are Google style with Sphinx cross-reference roles (``:class:`~a.B```),
which help readers of the source and IDEs; mkdocstrings renders neither role nor target,
so without this the pages show the raw role. A role becomes the code span of its text:
``:func:`a.f``` -> ``a.f()``, ``:class:`~a.B``` -> ``B``, ``:mod:`t <a.b>``` -> ``t``.
Loaded by mkdocs.yml (``extensions``); the docs build (.ci/docs.sh) checks no role is left.
"""
from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?P<role>func|meth|class|mod|attr|data|exc|obj|const|ref):`(?P<body>[^`]+)`")
_CALLABLE = {"func", "meth"}


def _text(match: re.Match) -> str:
    body = match["body"].strip()
    explicit = re.fullmatch(r"(?P<title>.+?)\s*<(?P<target>[^>]+)>", body)
    if explicit:
        return f"`{explicit['title']}`"
    short = body.startswith("~")
    name = body.lstrip("~!.")
    if short:
        name = name.rsplit(".", 1)[-1]
    if match["role"] in _CALLABLE and not name.endswith(")"):
        name += "()"
    return f"`{name}`"


def render_roles(text: str) -> str:
    """``text`` with every Sphinx role replaced by its code span."""
    return _ROLE.sub(_text, text)


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = render_roles(obj.docstring.value)
