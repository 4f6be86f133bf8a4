"""The ``kvref`` command line: ``verify`` (the main job), ``size``, ``prove``, ``explore``,
``mutants``, ``replay``, ``check-run``, ``watch``.

Subcommands live in their own modules (``kvref/cli/*.py``, issue #26), each exposing
``add_parser(subparsers)`` and ``run(args) -> int``; this file only wires them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: subcommand modules, in the order ``kvref --help`` lists them
SUBCOMMAND_MODULES = (
    "kvref.cli.verify",
    "kvref.cli.size",
    "kvref.cli.prove",
    "kvref.cli.explore",
    "kvref.cli.mutants",
    "kvref.cli.replay",
    "kvref.cli.check_run",
    "kvref.cli.watch",
    "kvref.cli.demo",  # a group: demo record (demo.py), demo publish (demo_publish.py)
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
#: the command ran but examined nothing (a watcher that received no batch, a trace with no step):
#: never reported as clean, and told apart from findings (issue #25: ``kvref watch`` with no
#: publisher said "OK: the stream obeyed every rule" and exited 0)
EXIT_NOTHING_CHECKED = 3
EXIT_INTERRUPTED = 130
#: stdout was closed by its reader (``kvref mutants --list | head -1``): what a shell reports for
#: a tool stopped by SIGPIPE (128 + 13); it used to be reported as an input error (2)
EXIT_BROKEN_PIPE = 141


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand; the one place that maps outcomes to exit statuses.

    * 0: ran, nothing found; 1: ran, findings (a failed check, a divergence, a counterexample);
    * 3: ran, but examined nothing (no batch arrived, an empty trace): nothing was checked;
    * 2: the input was rejected before or while reading it (usage, a bad value, a broken or
      unreadable file, an unwritable output path): any ``ValueError`` (kvref's ``KVRefError``
      family) or ``OSError`` a subcommand raises, reported as one line naming the field, the value
      and what is allowed, never a traceback;
    * 130: interrupted (Ctrl-C / SIGINT); a subcommand that writes reports writes a partial one
      first (``kvref verify``). A Ctrl-C that Python dropped (raised inside a garbage-collector
      callback) is raised again until the run takes it (:mod:`kvref.cli.interrupt`).
    """
    from kvref.cli.interrupt import sigint_reraised

    with sigint_reraised():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    from kvref.cli.interrupt import acknowledge

    try:
        parser = build_parser()
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: usage errors exit 2, --help/--version 0
        return exc.code if isinstance(exc.code, int) else EXIT_INPUT
    except KeyboardInterrupt:
        acknowledge()
        raw = list(sys.argv[1:] if argv is None else argv)
        _verify_json_when_interrupted_early(raw[:1] == ["verify"] and "--json" in raw, None)
        print("kvref: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    if not getattr(args, "_run", None):
        parser.print_usage(sys.stderr)
        print("kvref: error: a COMMAND is required (kvref --help lists them)", file=sys.stderr)
        return EXIT_INPUT
    try:
        check_parsed(parser, args)
        # vLLM's import-time warnings leaked from replay/mutants/size (issue #25); verify quiets itself
        # and demo record has a --verbose of its own, both showing the noise on request
        if args.command != "verify" and not (args.command == "demo" and getattr(args, "verbose", False)):
            from kvref.quiet import quiet_third_party

            quiet_third_party()
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        acknowledge()
        early = args.command == "verify" and not getattr(args, "report_written", False)
        _verify_json_when_interrupted_early(early and getattr(args, "json", False), args)
        _verify_junit_when_interrupted_early(early and getattr(args, "junit_xml", None), args)
        print(f"kvref {args.command}: interrupted (exit {EXIT_INTERRUPTED})", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `kvref ... | head`: the reader left; not an input error, no traceback at exit
        _stdout_to_devnull()
        return EXIT_BROKEN_PIPE
    except (ValueError, OSError) as exc:  # bad input: one clear line, no traceback
        print(f"kvref {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_INPUT


#: metavars and dests of options that name a file or folder (an empty value is no path)
_PATH_METAVARS = {"FILE", "PATH", "PNG", "DIR", "TRACE"}
_PATH_DESTS = {"out", "trace", "config"}


def check_parsed(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """What argparse lets through for every option of the subcommand, whatever its name:

    * ``--flag=--`` hands back ``[]`` for an option of one value (argparse drops the ``--``), which
      crashed ``.split`` in ``--against``/``--kinds`` and passed silently elsewhere;
    * an empty path (``--plot ''``, ``--from-json ''``) read as "not given": the plot silently not
      drawn, the saved campaign not read and a full campaign started instead.
    """
    from kvref.spec.errors import InvalidFieldError

    sub = next((a.choices.get(args.command) for a in parser._actions
                if isinstance(a, argparse._SubParsersAction)), None)
    for action in getattr(sub, "_actions", ()):
        if action.nargs == 0 or isinstance(action, argparse._HelpAction):
            continue
        flag = max(action.option_strings, key=len) if action.option_strings else action.dest.upper()
        value = getattr(args, action.dest, None)
        if action.nargs is None and isinstance(action, argparse._StoreAction) and isinstance(value, list):
            raise InvalidFieldError(flag, "--", "one value (write a value that starts with '-' as "
                                                f"{flag}=VALUE)")
        if value == "" and (str(action.metavar or "").upper() in _PATH_METAVARS or action.dest in _PATH_DESTS):
            raise InvalidFieldError(flag, value, "a path (an empty value names no file)")


def _verify_json_when_interrupted_early(needed: bool, args: argparse.Namespace | None) -> None:
    """``kvref verify --json`` stopped before its first check (still importing, reading the
    baseline): stdout still gets a report, ``"interrupted": true``, every selected check not run
    (it used to be empty, and ``| jq`` failed instead of saying "interrupted")."""
    if not needed:
        return
    from kvref.report import to_json

    print(to_json([], {"interrupted": True, "not_run": _selected_checks(args)}))


def _verify_junit_when_interrupted_early(needed, args: argparse.Namespace) -> None:
    """``kvref verify --junit-xml F`` stopped before its first check: F still says so (every
    selected check skipped as not run), so a CI system reads "interrupted", not a missing file."""
    if not needed:
        return
    from kvref.report import write_junit_xml

    try:
        write_junit_xml([], args.junit_xml, {"interrupted": True, "not_run": _selected_checks(args)})
    except OSError as exc:  # probed before the run; if it went away since, say so and keep exit 130
        print(f"kvref verify: --junit-xml not written: {exc}", file=sys.stderr)


def _selected_checks(args: argparse.Namespace | None) -> list[str]:
    if args is None:
        return []
    try:
        from kvref.checks import select_checks

        return [c.name for c in select_checks(only=args.only, skip=args.skip, mutants=args.mutants,
                                              against=args.against)]
    except (ValueError, ImportError, AttributeError):
        return []


def _stdout_to_devnull() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail again."""
    import os

    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError, AttributeError):  # not a real file (a test's capture)
        pass


def _one_line(exc: BaseException) -> str:
    """The error as one line; an ``OSError`` keeps its file name (``[Errno 2] ...: 'x.json'``)."""
    text = str(exc) or type(exc).__name__
    return " ".join(text.split()) if "\n" in text else text


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
