"""``kvref verify``'s second process: checks that draw nothing from Hypothesis' constant pool run
ahead of their turn, beside the others (issue #22: the default run took 163 s on 2 cores, one
core idle; the proofs and CrossHair alone were 40 s of it).

What a check finds must not depend on where it ran. A seeded Hypothesis run draws the same inputs
in any process except for one thing: since 6.1xx Hypothesis mixes into its draws the constants in
the source of every *local* module loaded so far (``providers._get_local_constants``;
:mod:`kvref.ray_inputs` tells the story). The machine runners switch that pool off for their runs
(:mod:`kvref.models.hypothesis_runs.reproducible`), the proofs, CrossHair and the random.Random
checks never draw from Hypothesis, but ``run_generated``'s ``@given`` runs (planning, publication
masks, ...) do, so their inputs depend on which kvref modules the checks before them imported.
Hence:

* the second process runs only the checks :data:`kvref.checks.AHEAD` names, in their order, and
  counts every read of the constant pool while each runs; a check that read it is run again here
  (its inputs over there were not the ones the one-process run draws);
* when a check's row comes, in the checks' order, this process imports the local modules the check
  imported over there; a check here that reads the pool (:data:`kvref.checks.DRAWS_CONSTANTS`)
  waits for every row before it, so its pool is the one a one-process run has at that point;
* this process runs its other checks without waiting for the rows before them (they draw nothing
  from the pool; one that reads it all the same is run again once the rows before it are in);
* the second process starts with no local module this process has not loaded already (checked
  when it starts: otherwise every check runs here), and this module hides itself from the pool
  (a one-process run never imports it).

The report is the one-process report: rows in the checks' order (progress lines too), each with
the check's own time; ``--exitfirst`` stops at the first failing row in that order. A second
process that dies, or is behind, costs time only: its checks are waited for, or run here.
``kvref verify --jobs 1`` runs everything in one process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict

from .check_context import VerifyContext
from .report import CheckResult

#: the first line of the second process, before any check: the local modules it has loaded
READY = "ready"


def _hide_from_hypothesis() -> None:
    """Keep this module's constants out of this process' Hypothesis pool (a one-process run never
    loads it)."""
    try:
        from hypothesis.internal.conjecture import providers

        providers._seen_modules.add(id(sys.modules[__name__]))
    except (ImportError, AttributeError, KeyError):  # pragma: no cover - another Hypothesis version
        pass


_hide_from_hypothesis()


def local_modules() -> set[str]:
    """The names of the loaded modules whose constants Hypothesis collects (kvref's own)."""
    try:
        from hypothesis.internal.constants_ast import is_local_module_file
    except ImportError:  # pragma: no cover - another Hypothesis version: no pool to keep equal
        return set()
    out = set()
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if module is not None and path is not None and is_local_module_file(path):
            out.add(name)
    return out


def start_ahead(checks, ctx: VerifyContext, baseline: str | None, collect: bool,
                verbose: bool = False, on_failing=None, exitfirst: bool = False) -> "AheadRun | None":
    """The second process for ``checks`` (the run's order), or None where it gains nothing: no
    :data:`kvref.checks.AHEAD` check among them, or nothing else to run meanwhile."""
    from .checks import AHEAD

    order = [c.name for c in checks]
    names = [n for n in order if n in AHEAD]
    if not names or len(names) == len(order):
        return None
    return AheadRun(names, ctx, baseline, collect, verbose, on_failing, exitfirst)


class AheadRun:
    """The second process, seen from ``kvref verify``: :meth:`take` a check's result at its turn.

    Args:
        names: the checks it runs, in the run's order.
        ctx: the run's context (profile, seed, out dir, ...), the same for every check.
        baseline: the ``--baseline`` file or None; ``collect``: ``--update-baseline``'s search.
        verbose: ``-v`` (third-party log lines on its stderr, which goes to a file shown on a crash).
        on_failing: called with a failing result the moment it comes (from a reader thread), so a
            finding is said at once, ahead of the rows before it; its row still comes in order.
        exitfirst: ``--exitfirst``: it stops after its first failing check (no row after that one
            is reported), leaving the cores to the checks before it.
    """

    def __init__(self, names: list[str], ctx: VerifyContext, baseline: str | None, collect: bool,
                 verbose: bool = False, on_failing=None, exitfirst: bool = False) -> None:
        self.names = list(names)
        self._on_failing = on_failing
        self.notes: list[str] = []
        self._got: dict[str, dict] = {}
        self._closed = False
        self._ended = False
        self._log = tempfile.TemporaryFile(mode="w+", prefix="kvref_ahead_")
        spec = {"names": self.names, "ctx": asdict(ctx), "baseline": baseline, "collect": collect,
                "verbose": verbose, "exitfirst": exitfirst}
        import atexit

        atexit.register(self.close)  # a run that raised half-way leaves no second process behind
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from kvref.verify_ahead import child_main; child_main()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env)
        self._proc.stdin.write(json.dumps(spec) + "\n")
        self._proc.stdin.close()
        import queue
        import threading

        self._lines: queue.Queue = queue.Queue()  # read as they come: a full pipe would stall its checks
        threading.Thread(target=self._pump, name="kvref-ahead-reader", daemon=True).start()
        ready = self._read()
        if ready is None:
            self._give_up("the second process ended before its first check")
        else:
            extra = sorted(set(ready["modules"]) - set(sys.modules))
            if extra:  # its checks' modules would differ from this process' at their turn
                self._give_up("the second process loaded kvref modules this one had not "
                              f"({', '.join(extra[:3])}); every check runs here")

    def _pump(self) -> None:
        try:
            for line in self._proc.stdout:
                self._lines.put(line)
                if self._on_failing is not None and '"result"' in line:
                    result = CheckResult(**json.loads(line)["result"])
                    if result.failing:
                        try:
                            self._on_failing(result)
                        except Exception:  # noqa: BLE001 - a notice that failed; the row still comes
                            pass
        except (OSError, ValueError):  # closed under it by close()
            pass
        self._lines.put("")

    def _read(self, wait: bool = True) -> dict | None:
        """The next message; None when the process ended (or, with ``wait=False``, none is in)."""
        import queue

        while not self._closed:
            try:
                line = self._lines.get(timeout=0.5) if wait else self._lines.get_nowait()
            except queue.Empty:
                if not wait:
                    return None
                continue  # a short wait: Ctrl-C is taken between two
            if not line:
                self._ended = True
                return None
            return json.loads(line)
        return None

    def ready(self, name: str) -> bool:
        """Whether :meth:`take` of ``name`` would return at once."""
        while name not in self._got and not self._closed and not self._ended:
            msg = self._read(wait=False)
            if msg is None:
                break
            self._got[msg["name"]] = msg
        return name in self._got or self._closed or self._ended

    def _give_up(self, why: str) -> None:
        self.notes.append(why + self._stderr_tail())
        self.close()

    def _stderr_tail(self) -> str:
        try:
            self._log.seek(0)
            tail = self._log.read()[-600:].strip()
        except (OSError, ValueError):
            return ""
        return f" (its stderr ends: {tail})" if tail else ""

    def take(self, name: str) -> CheckResult | None:
        """``name``'s result, waiting for it; None when it must run here, in its turn (the second
        process died or read Hypothesis' constant pool while running it: :attr:`notes` says which).
        Before returning a result, imports the local modules the check imported over there."""
        while name not in self._got:
            msg = None if self._ended else self._read()
            if msg is None:
                if not self._closed:
                    self._give_up(f"the second process ended before {name} finished"
                                  f" (exit {self._proc.poll()})")
                return None
            self._got[msg["name"]] = msg
        msg = self._got.pop(name)
        import importlib

        for module in msg["modules"]:  # the pool of the checks after it: as if it had run here
            if module not in sys.modules:
                try:
                    importlib.import_module(module)
                except Exception:  # noqa: BLE001 - it imported there; a failure here is the check's own
                    pass
        if msg["pool_reads"]:
            self.notes.append(f"{name} drew Hypothesis constants in the second process "
                              f"({msg['pool_reads']} reads): run again here, in its turn")
            return None
        return CheckResult(**msg["result"])

    def close(self) -> None:
        """Stop the second process (a check it had not finished is not needed any more)."""
        if self._closed:
            return
        self._closed = True
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._log.close()


class _PoolReads:
    """Counts this process' reads of Hypothesis' constant pool (what a check's inputs depend on
    besides its seed). ``reproducible.same_inputs_in_every_process`` swaps the counter out for
    its empty pool, and back: the runs that switch the pool off are not counted."""

    def __init__(self) -> None:
        self.count = 0
        self._providers = None

    def __enter__(self) -> "_PoolReads":
        try:
            from hypothesis.internal.conjecture import providers
        except ImportError:  # pragma: no cover - another Hypothesis version: nothing to count
            return self
        self._providers, pool = providers, providers._get_local_constants

        def counted():
            self.count += 1
            return pool()

        self._pool = pool
        providers._get_local_constants = counted
        return self

    def __exit__(self, *exc) -> None:
        if self._providers is not None:
            self._providers._get_local_constants = self._pool


# --------------------------------------------------------------------------------------------
# the second process


def child_main() -> None:
    """Entry point of the second process: a JSON spec on stdin, one JSON line per check on stdout
    (what it found, the local modules it imported, how often it read the constant pool)."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the checks print goes to stderr, never into the protocol
    sys.stdout = sys.stderr
    spec = json.loads(sys.stdin.readline())
    try:
        _run_child(spec, out)
    except KeyboardInterrupt:  # Ctrl-C reaches the whole process group; kvref verify reports it
        os._exit(130)


def _run_child(spec: dict, out) -> None:
    from .baseline import Baseline
    from .checks import check_named
    from .quiet import quiet_third_party
    from .verify import run_check

    out.write(json.dumps({"name": READY, "modules": sorted(local_modules())}) + "\n")
    quiet_third_party(spec["verbose"])
    ctx = VerifyContext(**spec["ctx"])
    baseline = Baseline.load(spec["baseline"]) if spec["baseline"] else Baseline()
    seen = local_modules()
    with _PoolReads() as reads:
        for name in spec["names"]:
            before = reads.count
            result = run_check(check_named(name), ctx, baseline, collect=spec["collect"])
            now = local_modules()
            modules = sorted(now - seen)
            seen = now
            out.write(json.dumps({"name": name, "result": asdict(result), "modules": modules,
                                  "pool_reads": reads.count - before}) + "\n")
            if result.failing and spec.get("exitfirst"):
                break


# --------------------------------------------------------------------------------------------
# kvref verify's loop with the second process


def run_verify_ahead(checks, ahead: AheadRun, run_here, report, started,
                     early=None) -> tuple[list, CheckResult | None]:
    """``kvref verify``'s loop with ``ahead`` running :attr:`AheadRun.names` meanwhile:
    ``(rows in the checks' order, the interrupted row or None)``.

    Args:
        run_here: ``run_here(check) -> CheckResult`` (``run_check`` with the run's context and baseline).
        report: ``report(result) -> bool``, called once per row in the checks' order (it logs the row);
            True stops the run after that row (``--exitfirst`` at a failing one).
        started: ``started(index, check)`` when a check starts in this process.
        early: ``early(result)`` for a failing check here whose row waits for rows before it.
    """
    from .checks import DRAWS_CONSTANTS
    from .report import ERROR

    order = [c.name for c in checks]
    done: dict[str, CheckResult] = {}
    rows: list[CheckResult] = []
    stop = [False]

    def flush(upto: int) -> None:
        """Report the rows that are in, in order; wait for the second process' rows before ``upto``."""
        while len(rows) < len(checks) and not stop[0]:
            check = checks[len(rows)]
            if check.name in ahead.names:
                if len(rows) >= upto and not ahead.ready(check.name):
                    return
                result = ahead.take(check.name)
                if result is None:  # it drew from the pool over there, or the process is gone: here, now
                    started(len(rows) + 1, check)
                    result = run_here(check)
            elif check.name in done:
                result = done.pop(check.name)
            else:
                return
            rows.append(result)
            stop[0] = report(result)

    current = checks[0]
    try:
        with _PoolReads() as reads:
            for i, check in enumerate(checks):
                if check.name in ahead.names:
                    continue
                current = check
                # a check that draws from the pool waits for every row before it (their modules)
                flush(i if check.name in DRAWS_CONSTANTS else 0)
                if stop[0]:
                    break
                behind = len(rows) < i  # rows before it still out: its pool lacks their modules
                before = reads.count
                started(i + 1, check)
                result = run_here(check)
                if behind and reads.count > before:  # it drew from a pool short of them: again, in its turn
                    ahead.notes.append(f"{check.name} drew Hypothesis constants before the rows ahead of it were "
                                       "in: run again in its turn (kvref.checks.DRAWS_CONSTANTS should name it)")
                    flush(i)
                    if stop[0]:
                        break
                    result = run_here(check)
                done[check.name] = result
                if result.failing and len(rows) < i and early is not None:
                    early(result)
                flush(0)
                if stop[0]:
                    break
            else:
                current = checks[-1]
                flush(len(checks))
    except KeyboardInterrupt:
        from .cli.interrupt import acknowledge

        acknowledge()  # taken: the partial report is written, not interrupted again
        name = checks[len(rows)].name if len(rows) < len(checks) else current.name
        interrupted = CheckResult(name, ERROR, "interrupted (Ctrl-C) before it finished")
        return rows + [interrupted], interrupted
    finally:
        ahead.close()
    return rows, None
