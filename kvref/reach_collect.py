"""Running checks under coverage.py, restricted to vLLM's KV-cache modules (issue #22).

:class:`ReachCollector` starts coverage.py in branch mode over the files of
:mod:`kvref.reach_modules` only, switches coverage's dynamic context to the name of each check
before it runs (so every executed line knows under which check it ran), and combines the data of
processes the checks start through :mod:`multiprocessing` (the explorer's forked workers:
coverage's ``concurrency = multiprocessing`` starts a collector in each child, which saves its data
file when the child's ``run`` returns; a worker the parent terminates loses its data — those
workers run only the reference, never vLLM). Threads are measured too (``thread``).

For the functions a change touches (``--changed-since``), :class:`CallCounter` also counts how many
times each is entered, per check: coverage.py records *whether* a line ran, not how often.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import Counter

#: the context of lines run before the first check (module imports done by kvref itself)
NO_CHECK = "(before any check)"


def _rc_text(files: tuple[str, ...], data_file: str, context: str = "") -> str:
    """A coverage.py config file: the forked children read it (``COVERAGE_RCFILE``) when they
    start, and take the check running then as their (static) context."""
    include = "\n".join(f"    {f}" for f in files)
    return ("[run]\nbranch = True\nparallel = True\nconcurrency =\n    thread\n    multiprocessing\n"
            f"data_file = {data_file}\ninclude =\n{include}\n"
            "disable_warnings =\n    no-data-collected\n    module-not-imported\n"
            + (f"context = {context}\n" if context else ""))


class ReachCollector:
    """coverage.py over ``files`` with one dynamic context per check; data under ``data_dir``."""

    def __init__(self, files: tuple[str, ...], data_dir: str) -> None:
        import coverage

        os.makedirs(data_dir, exist_ok=True)
        for name in os.listdir(data_dir):  # a previous run's data must not be combined into this one
            if name.startswith(".coverage"):
                os.remove(os.path.join(data_dir, name))
        self.data_dir = data_dir
        self.data_file = os.path.join(data_dir, ".coverage")
        self.rc_file = os.path.join(data_dir, "coveragerc")
        with open(self.rc_file, "w", encoding="utf-8") as fh:
            fh.write(_rc_text(files, self.data_file))
        self.files = files
        #: listed modules already imported before measurement began (their module-level lines
        #: ran unmeasured: reported, so a low module-level figure is not misread)
        self.imported_before: list[str] = []
        self.cov = coverage.Coverage(config_file=self.rc_file, messages=False)
        self.running = False

    def start(self) -> None:
        loaded = {os.path.realpath(getattr(m, "__file__", "") or "") for m in list(sys.modules.values())}
        self.imported_before = sorted(f for f in self.files if f in loaded)
        self._rcfile_env = os.environ.get("COVERAGE_RCFILE")
        self.cov.start()
        self.running = True

    def enter(self, check: str) -> None:
        """Lines run from now on are attributed to ``check`` (in processes it forks too)."""
        self.cov.switch_context(check)
        with open(self.rc_file, "w", encoding="utf-8") as fh:
            fh.write(_rc_text(self.files, self.data_file, check))

    def stop(self):
        """Stop, save and combine every process's data; returns coverage's ``Coverage`` for reports."""
        if self.running:
            self.cov.stop()
            _unpatch_multiprocessing(self._rcfile_env)
            self.running = False
            self.cov.save()
            self.cov.combine(data_paths=[self.data_dir], keep=False)
            self.cov.save()
        return self.cov


def _unpatch_multiprocessing(rcfile_env: str | None) -> None:
    """Undo coverage.py's ``concurrency = multiprocessing`` patch once measuring stopped.

    coverage.py patches ``multiprocessing`` for the rest of the process (children start a collector
    reading ``COVERAGE_RCFILE``); kvref measures one run, so processes forked afterwards (a test
    suite's explorer workers) must not start one, and a second run in the same process must patch
    anew with its own config. Best effort: a coverage.py whose internals differ is left as it is.
    """
    import multiprocessing
    import multiprocessing.process

    try:
        from coverage import multiproc
    except ImportError:  # pragma: no cover - coverage.py moved it
        return
    marker = getattr(multiproc, "PATCHED_MARKER", None)
    if marker is None or not hasattr(multiprocessing, marker):
        return
    original = getattr(multiproc, "original_bootstrap", None)
    if original is not None:
        multiprocessing.process.BaseProcess._bootstrap = original  # type: ignore[attr-defined]
    try:
        from multiprocessing import spawn

        wrapper = spawn.get_preparation_data
        cells = dict(zip(wrapper.__code__.co_freevars, wrapper.__closure__ or ()))
        if "original_get_preparation_data" in cells:
            spawn.get_preparation_data = cells["original_get_preparation_data"].cell_contents
    except (ImportError, AttributeError):  # pragma: no cover - no spawn support
        pass
    delattr(multiprocessing, marker)
    if rcfile_env is None:
        os.environ.pop("COVERAGE_RCFILE", None)
    else:
        os.environ["COVERAGE_RCFILE"] = rcfile_env


class CallCounter:
    """Counts entries into chosen functions, per check, with a profile hook (``sys.setprofile``).

    Args:
        targets: ``{absolute file: {co_firstlineno: qualified name}}``; ``co_firstlineno`` is the
            line of the first decorator, else of the ``def``.
    """

    def __init__(self, targets: dict[str, dict[int, str]]) -> None:
        self.targets = {os.path.realpath(f): lines for f, lines in targets.items()}
        self.counts: Counter[tuple[str, str, str]] = Counter()  # (file, function, check) -> calls
        self.check = NO_CHECK
        self._real: dict[str, str] = {}

    def _hook(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        name = code.co_filename
        real = self._real.get(name)
        if real is None:
            real = self._real[name] = os.path.realpath(name)
        lines = self.targets.get(real)
        if lines is not None:
            qual = lines.get(code.co_firstlineno)
            if qual is not None:
                self.counts[(real, qual, self.check)] += 1

    def start(self) -> None:
        if self.targets:
            sys.setprofile(self._hook)
            threading.setprofile(self._hook)

    def enter(self, check: str) -> None:
        self.check = check

    def stop(self) -> None:
        if self.targets:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]

    def calls(self, path: str, qual: str) -> dict[str, int]:
        """Calls of ``qual`` in ``path`` per check."""
        real = os.path.realpath(path)
        return {c: n for (f, q, c), n in sorted(self.counts.items()) if f == real and q == qual}
