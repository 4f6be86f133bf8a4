"""kvref.models.run_check — check a recorded vLLM run (``kvref check-run``).

:func:`check_trace` streams a run trace (:mod:`kvref.impl.run_trace`) once: every record goes to
the lock-step replay on the reference (:mod:`.replay`) and to the run properties
(:mod:`.properties`). :func:`write_reproducer` copies the trace up to a divergence into a small
trace of its own that reproduces it.
"""

from .check import CheckResult, check_trace, write_reproducer
from .properties import Finding, RunProperties
from .replay import Divergence, LockstepReplay
from .setup import RunSetup, setup_from_header

__all__ = ["CheckResult", "Divergence", "Finding", "LockstepReplay", "RunProperties", "RunSetup", "check_trace",
           "setup_from_header", "write_reproducer"]
