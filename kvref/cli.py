"""The ``kvref`` command line: ``verify`` (the main job), ``size``, ``prove``, ``explore``,
``mutants``, ``replay``.

Subcommands live in their own modules (``kvref/cli_*.py``), each exposing
``add_parser(subparsers)`` and ``run(args) -> int``; this file only wires them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand modules, in the order ``kvref --help`` lists them
SUBCOMMAND_MODULES = (
    "kvref.cli_verify",
    "kvref.cli_size",
    "kvref.cli_prove",
    "kvref.cli_explore",
    "kvref.cli_mutants",
    "kvref.cli_replay",
)


def build_parser() -> argparse.ArgumentParser:
    from kvref import VLLM_VERSION, __version__

    parser = argparse.ArgumentParser(
        prog="kvref",
        description=f"kvref {__version__}: a formally checked, executable reference of vLLM "
                    f"{VLLM_VERSION}'s KV-cache management.")
    parser.add_argument("--version", action="version", version=f"kvref {__version__} (vLLM {VLLM_VERSION} semantics)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        module = importlib.import_module(name)
        p = module.add_parser(sub)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    try:
        return int(args._run(args) or 0)
    except ValueError as exc:  # bad input: one clear line, no traceback
        print(f"kvref {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
