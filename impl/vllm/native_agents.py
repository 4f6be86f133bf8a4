"""Give back the NIXL agents kvref's vLLM harnesses started, and with them their UCX threads
(issues #22/#26).

A NIXL agent with its UCX backend runs native progress threads that poll with a zero timeout
(``nixlUcxSharedThread::run``): about 0.15 of a core each, for as long as the agent exists. NIXL
has no call that stops them; the agent's native object is destroyed, and its threads joined, when
the last Python reference to it goes. Three things kept agents alive after the harness was done
with them, so that ``kvref verify --against vllm`` (conform-tiering, conform-p2p) and a
one-process test suite ran on with 1-2 cores busy:

* the P2P world's agent pool (:mod:`kvref.impl.vllm.p2p_nixl`), by design, until the process ends;
* kvcr keeps the core of a failed KVCR start-up for the life of the process
  (``kvcr.api._NONQUIESCENT_STARTUP_RESOURCES``), and the start-up failure its progress loop
  stored holds a traceback whose frames hold the loop's agent in their locals;
* vLLM keeps an import error at module level (``vllm.multimodal.media.audio``'s
  ``_torchcodec_import_exc``, torchcodec is not installed): its traceback holds every frame of
  the stack that first imported vLLM's multimodal package, with their locals, for the life of the
  process (the first P2P world of a process was one of them, with its agents).

:func:`release_native_agents` gives all of these back; :func:`native_agents_released` runs a block
of vLLM-facing work and releases afterwards (``kvref verify``'s checks, each test module).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
from collections.abc import Iterator

#: module-level exceptions vLLM keeps from its imports: (module, global)
_KEPT_IMPORT_ERRORS = (("vllm.multimodal.media.audio", "_torchcodec_import_exc"),)


def native_thread_ids() -> set[int]:
    """Kernel ids of this process's threads that Python did not start (NIXL's and UCX's among
    them); empty where ``/proc`` is not mounted."""
    try:
        tids = {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()
    return tids - {t.native_id for t in threading.enumerate()}


def live_nixl_agents() -> list[str]:
    """Names of the NIXL agents (``nixl_agent`` objects) still alive in this process."""
    cls = getattr(sys.modules.get("nixl._api"), "nixl_agent", None)  # the nixl_cu* build's, once imported
    if cls is None:  # NIXL was never imported: no agent exists
        return []
    # by the real type: isinstance asks an object's __class__, which lazy proxies on the heap answer
    # by importing (openai's module client imported half its package)
    return sorted(o.name for o in gc.get_objects() if issubclass(type(o), cls))


def drop_tracebacks(exc: BaseException | None) -> None:
    """Drop the tracebacks of ``exc`` and of the exceptions it chains (``__cause__``,
    ``__context__``): the exception keeps its type and message, its frames (and their locals) go."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        exc.__traceback__ = None
        if exc.__cause__ is not None:
            drop_tracebacks(exc.__cause__)
        exc = exc.__context__


def drop_import_tracebacks() -> int:
    """Drop the tracebacks of the import errors vLLM keeps at module level (module docstring);
    returns how many were dropped. Only modules already imported are looked at."""
    dropped = 0
    for module, name in _KEPT_IMPORT_ERRORS:
        exc = getattr(sys.modules.get(module), name, None)
        if isinstance(exc, BaseException) and exc.__traceback__ is not None:
            drop_tracebacks(exc)
            dropped += 1
    return dropped


def release_native_agents() -> int:
    """Give back every NIXL agent the P2P world's pool and KVCR start-ups left, and the frames vLLM's
    kept import errors hold; returns how many agents or loops were released. Call it when no P2P
    world and no tiering world is in use any more (a released world's agent is gone). Cheap when
    there is nothing to release: only modules already imported are looked at."""
    drop_import_tracebacks()
    released = 0
    p2p = sys.modules.get("kvref.impl.vllm.p2p_nixl")
    if p2p is not None:
        released += p2p.release_agents()
    kvcr = sys.modules.get("kvref.impl.vllm.tiering_kvcr")
    if kvcr is not None:
        released += kvcr.release_kvcr_agents()
    if released:
        gc.collect()  # a closed world and its agents form cycles
    return released


@contextlib.contextmanager
def native_agents_released() -> Iterator[None]:
    """Run the block, then :func:`release_native_agents` (also when the block raises)."""
    try:
        yield
    finally:
        release_native_agents()


__all__ = ["drop_import_tracebacks", "drop_tracebacks", "live_nixl_agents", "native_agents_released",
           "native_thread_ids", "release_native_agents"]
