"""The ``pagedkv`` command line: ``pagedkv <subcommand> [options]`` (also ``python -m pagedkv``).

Each subcommand lives in its own module, listed in :data:`SUBCOMMANDS`. A subcommand
module provides:

- ``HELP``: a one-line description;
- ``add_arguments(parser)``: declares its options on an ``argparse`` sub-parser;
- ``run(args) -> int``: does the work and returns the exit status.

Building the parser imports every listed module, so a subcommand module keeps its
heavy imports (transformers, a model) inside ``run``. To add a subcommand, add one
entry to ``SUBCOMMANDS``.
"""
from __future__ import annotations

import argparse
import importlib

#: subcommand name -> module implementing it
SUBCOMMANDS: dict[str, str] = {
    "plan": "pagedkv.cli.plan",
    "demo": "pagedkv.cli.demo",
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser per registered subcommand."""
    parser = argparse.ArgumentParser(prog="pagedkv", description="pagedkv: a paged KV cache for LLM inference")
    from pagedkv import __version__

    parser.add_argument("--version", action="version", version=f"pagedkv {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    sub.required = True
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point (``pagedkv = pagedkv.cli:main``)."""
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)
