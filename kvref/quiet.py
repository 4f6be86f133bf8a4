"""Quiet by default: third-party log noise off unless ``--verbose``, progress lines that read well
in CI logs.

``make verify`` under ``--profile ci`` printed ~430 lines of vLLM/connector/Triton logging to
stderr (the OffloadingConnector's "cannot store chunks" for every refused store, the CPU
platform's "CPU backend prefers block_size…", "Triton is not installed…", transformers' RoPE
validation), burying kvref's own progress; and rich's ``console.log`` wrapped each progress line
at 80 columns with a ``cli/verify.py:60`` suffix when stderr was not a terminal (issue #16).
:func:`quiet_third_party` raises those libraries' log levels to ERROR and hides their Python
warnings; :func:`progress_console` is a stderr console that neither wraps nor names a source line.
Errors still show; kvref's own output is untouched.
"""

from __future__ import annotations

import logging
import os
import warnings

#: loggers of the libraries kvref drives; their INFO/WARNING lines are about *their* setup on this
#: machine (no GPU, no Triton), not about what kvref checks
NOISY_LOGGERS = ("vllm", "transformers", "torch", "triton", "xgrammar", "filelock", "urllib3", "huggingface_hub",
                 "nixl")
#: vLLM ERROR lines that report what kvref's checks plant on purpose (a connector's failed KV load
#: under ``failure_policy=fail``: conform-connector fails loads by design; a scripted grammar that
#: rejects a request's sampled tokens: conform-scheduler's structured-output traces), not a
#: problem of the run
PLANTED_ERRORS = ("Failing %d request(s) due to KV load failure", "Unexpected: grammar rejected tokens")
#: modules whose Python warnings are hidden by default
_NOISY_MODULES = r"(vllm|torch|transformers|triton|xgrammar|huggingface_hub)(\..*)?$"


#: whether :func:`quiet_third_party` silenced this process; a child process kvref spawns reads it
#: (:func:`quieted`) and silences itself the same way: the partial-tail traces' spawned child
#: printed 180 "cannot store chunks" lines into a quiet ``kvref verify`` (CI, stop 36)
_QUIETED = False


def quieted() -> bool:
    """Whether this process's third-party logging was silenced by :func:`quiet_third_party`."""
    return _QUIETED


def quiet_third_party(verbose: bool = False) -> None:
    """Silence third-party logging below ERROR and their warnings, unless ``verbose``.

    Sets ``VLLM_LOGGING_LEVEL=ERROR`` too: vLLM reads it when it configures its logger, at import
    and again when a config object re-applies logging, and subprocesses it spawns (architecture
    inspection) inherit it. With ``verbose`` nothing is changed, so a user's own
    ``VLLM_LOGGING_LEVEL`` applies.
    """
    global _QUIETED
    if verbose:
        return
    _QUIETED = True
    os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    # NIXL (the KVCR and P2P tiers' transfer library) configures its "nixl" logger at its first
    # get_logger, over any level set before, from NIXL_LOG_LEVEL: its "Backend UCX was
    # instantiated" / "Initialized NIXL agent" INFO lines came once per agent (69 of them in one
    # `--profile ci` run)
    os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    sched = logging.getLogger("vllm.v1.core.sched.scheduler")
    if not any(isinstance(f, _PlantedErrors) for f in sched.filters):
        sched.addFilter(_PlantedErrors())
    warnings.filterwarnings("ignore", module=_NOISY_MODULES)


class _PlantedErrors(logging.Filter):
    """Drops vLLM's ERROR records for the failures kvref plants (:data:`PLANTED_ERRORS`); any other
    record, ERROR or not, passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(PLANTED_ERRORS))


def progress_console():
    """A console on stderr for progress lines (``log``, ``status``, ``print``).

    In a terminal: rich, without the ``file.py:NN`` suffix. Elsewhere (a pipe, a CI log): one plain
    ``[HH:MM:SS] text`` line per call, never wrapped or padded (rich lays a log line out as an
    80-column grid when it cannot ask a terminal for its width), and no spinner.
    """
    import sys

    from rich.console import Console

    if sys.stderr.isatty():
        return Console(stderr=True, log_path=False)
    return _PlainConsole()


class _NoStatus:
    def update(self, *args, **kwargs) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


class _PlainConsole:
    """The subset of ``rich.console.Console`` kvref's progress uses, as plain unwrapped lines."""

    @staticmethod
    def _text(objects, markup: bool) -> str:
        text = " ".join(str(o) for o in objects)
        if markup:
            from rich.text import Text

            text = Text.from_markup(text).plain
        return text

    def log(self, *objects, markup: bool = True, **kwargs) -> None:
        import sys
        import time

        print(f"[{time.strftime('%H:%M:%S')}] {self._text(objects, markup)}", file=sys.stderr, flush=True)

    def print(self, *objects, markup: bool = True, **kwargs) -> None:
        import sys

        print(self._text(objects, markup), file=sys.stderr, flush=True)

    def status(self, *args, **kwargs) -> _NoStatus:
        return _NoStatus()
