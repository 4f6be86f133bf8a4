"""The ``kvref`` command line: ``verify`` (the main job), ``size``, ``prove``, ``explore``,
``mutants``, ``replay``, ``check-run``, ``watch``.

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
    "kvref.cli_check_run",
    "kvref.cli_watch",
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


#: exit statuses, the same for every subcommand: a CI job tells "vLLM is wrong" (1) from "the
#: input is wrong" (2) and from "the run was stopped" (130, the shell's code for SIGINT)
EXIT_OK = 0
EXIT_FINDINGS = 1
EXIT_INPUT = 2
EXIT_INTERRUPTED = 130


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; the one place that maps outcomes to exit statuses.

    * 0: ran, nothing found; 1: ran, findings (a failed check, a divergence, a counterexample);
    * 2: the input was rejected before or while reading it (usage, a bad value, a broken or
      unreadable file, an unwritable output path): any ``ValueError`` (kvref's ``KVRefError``
      family) or ``OSError`` a subcommand raises, reported as one line naming the field, the value
      and what is allowed, never a traceback;
    * 130: interrupted (Ctrl-C / SIGINT); a subcommand that writes reports writes a partial one
      first (``kvref verify``).
    """
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: usage errors exit 2, --help/--version 0
        return exc.code if isinstance(exc.code, int) else EXIT_INPUT
    except KeyboardInterrupt:
        print("kvref: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if not getattr(args, "_run", None):
        parser.print_usage(sys.stderr)
        print("kvref: error: a COMMAND is required (kvref --help lists them)", file=sys.stderr)
        return EXIT_INPUT
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print(f"kvref {args.command}: interrupted (exit {EXIT_INTERRUPTED})", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (ValueError, OSError) as exc:  # bad input: one clear line, no traceback
        print(f"kvref {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_INPUT


def _one_line(exc: BaseException) -> str:
    """The error as one line; an ``OSError`` keeps its file name (``[Errno 2] ...: 'x.json'``)."""
    text = str(exc) or type(exc).__name__
    return " ".join(text.split()) if "\n" in text else text


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
