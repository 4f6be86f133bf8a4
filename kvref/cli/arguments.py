"""Checks every subcommand runs on its arguments *before* any work starts.

An output path that cannot be written used to fail after every check had run (a traceback, and
the results lost); a size that cannot fit in memory or time used to hang or exhaust memory. These
helpers turn both into an :class:`~kvref.spec.errors.InvalidFieldError` up front, naming the flag,
the value and what is allowed; ``kvref.cli.main`` maps that to exit status 2.
"""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any

from kvref.spec.errors import InvalidFieldError

#: the most processes ``--workers`` may ask for: more than any machine kvref targets has cores, and
#: each forked worker holds a copy of the search's frontier
MAX_WORKERS = 256
#: Hypothesis examples per machine run (``kvref mutants --budget``): 10**6 is days of work already
MAX_BUDGET = 1_000_000
#: seconds any time limit may name (a solver timeout, an explorer bound): one week
MAX_SECONDS = 7 * 24 * 3600.0


def check_writable_file(flag: str, path: Any) -> str:
    """``path`` can be created or overwritten as a file: its folder exists (or can be made) and
    takes a new file, and it is not a folder. Probed by creating and removing a scratch file next
    to it, because ``os.access`` says yes to root for read-only mounts and ``/proc``."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise InvalidFieldError(flag, path, "a file path")
    if os.path.isdir(path):
        raise InvalidFieldError(flag, path, "a file path, not a folder")
    folder = os.path.dirname(os.path.abspath(path))
    _probe_dir(flag, path, folder)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise InvalidFieldError(flag, path, "a file this user may overwrite")
    if not os.path.exists(path):  # the name itself (too long, not allowed here): made and removed again
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            os.unlink(path)
        except FileExistsError:  # made meanwhile by someone else: writable as far as we can tell
            pass
        except OSError as exc:
            raise InvalidFieldError(flag, path, f"a file name this folder takes ({exc.strerror or exc})") from None
    return path


def check_writable_dir(flag: str, path: Any) -> str:
    """``path`` is, or can be made, a folder that takes new files. Nothing is left behind: a folder
    that did not exist is made only to probe it and removed again (a passing run writes nothing)."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise InvalidFieldError(flag, path, "a folder path")
    if os.path.exists(path) and not os.path.isdir(path):
        raise InvalidFieldError(flag, path, "a folder (it is an existing file)")
    _probe_dir(flag, path, os.path.abspath(path))
    return path


def _probe_dir(flag: str, given: str, folder: str) -> None:
    made = []
    probe = folder
    while not os.path.exists(probe):
        made.append(probe)
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        raise InvalidFieldError(flag, given, f"a path under a folder ({probe} is a file)")
    try:
        for d in reversed(made):
            os.mkdir(d)
        fd, scratch = tempfile.mkstemp(dir=folder, prefix=".kvref-probe-")
        os.close(fd)
        os.unlink(scratch)
    except OSError as exc:
        raise InvalidFieldError(flag, given, f"a writable location ({exc.strerror or exc})") from None
    finally:
        for d in made:
            try:
                os.rmdir(d)
            except OSError:
                pass


def check_seconds(flag: str, value: Any, *, allow_none: bool = True) -> float | None:
    """A positive, finite number of seconds, at most :data:`MAX_SECONDS` (``inf``/``nan`` have
    no meaning as a time limit and used to crash the conversion to milliseconds)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 < value <= MAX_SECONDS:
        raise InvalidFieldError(flag, value, f"a number of seconds in (0, {MAX_SECONDS:g}]")
    return float(value)


def check_count(flag: str, value: Any, *, minimum: int, maximum: int, why: str = "",
                allow_none: bool = False) -> int | None:
    """An int in ``[minimum, maximum]``; ``why`` says where the upper limit comes from."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise InvalidFieldError(flag, value, f"an int in [{minimum}, {maximum}]" + (f" ({why})" if why else ""))
    return value


class JsonStdout:
    """``--json``: while the run goes, anything printed to stdout (a library's warning, a progress
    line, Hypothesis' "spent more than five minutes shrinking") goes to stderr instead; the JSON
    document alone is written to the real stdout with :meth:`emit`, so ``kvref ... --json | jq``
    always parses. Disabled (``enabled=False``) it changes nothing."""

    def __init__(self, enabled: bool) -> None:
        import sys

        self.enabled = enabled
        self._stdout = sys.stdout

    def __enter__(self) -> JsonStdout:
        import sys

        self._stdout = sys.stdout
        if self.enabled:
            sys.stdout = sys.stderr
        return self

    def __exit__(self, *exc: object) -> None:
        import sys

        if self.enabled:
            sys.stdout = self._stdout

    def emit(self, text: str) -> None:
        self._stdout.write(text + "\n")
        self._stdout.flush()
