"""Run test files in this process, then report what they left running (kvref issues #22/#26).

Usage: ``python scripts/native_thread_probe.py [--idle S] TEST_FILE [pytest args...]``

A leaked NIXL agent keeps its UCX progress threads polling with a zero timeout for the rest of
the process: they show up as extra native threads (``/proc/self/task``, named ``nixl``/``ucx``
threads) and as CPU time while the process is otherwise idle. The probe prints, after the pytest
run: the pytest exit code, the native thread count before and after, the names of the threads that
appeared (by ``comm``), and the CPU seconds the process used over ``--idle`` seconds of doing
nothing (a clean run leaves ~0; one leaked agent costs about 0.15 of a core).
"""

from __future__ import annotations

import collections
import os
import sys
import time


def native_threads() -> collections.Counter:
    """``comm`` name -> how many of this process's threads carry it."""
    names = collections.Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names[f.read().strip()] += 1
        except OSError:  # the thread ended meanwhile
            pass
    return names


def thread_ticks() -> dict[int, int]:
    """tid -> CPU clock ticks (user + system) each of this process's threads has used."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return out


def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def main(argv: list[str]) -> int:
    idle = 3.0
    if argv[:1] == ["--idle"]:
        idle, argv = float(argv[1]), argv[2:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    import pytest

    before = native_threads()
    rc = pytest.main(["-q", "-p", "no:cacheprovider", *argv])
    import gc

    gc.collect()
    after = native_threads()
    import threading

    py_tids = {t.native_id for t in threading.enumerate()}
    t0, c0, w0 = thread_ticks(), cpu_seconds(), time.monotonic()
    time.sleep(idle)
    t1, used, wall = thread_ticks(), cpu_seconds() - c0, time.monotonic() - w0
    hz = os.sysconf("SC_CLK_TCK")
    busy = sum(1 for tid, ticks in t1.items() if (ticks - t0.get(tid, 0)) / hz > 0.05 * wall)
    grown = after - before
    print(f"probe: pytest rc={rc} threads {sum(before.values())} -> {sum(after.values())} "
          f"(python {len(py_tids)}, native-only {len(t1) - len(py_tids & set(t1))}) new={dict(sorted(grown.items()))} "
          f"busy(>5% core)={busy} idle cpu {used:.2f}s over {wall:.1f}s = {used / wall:.2f} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
