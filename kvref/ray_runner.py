"""Running kvref's independent units of work on Ray (issue #27): connect, probe, ship, merge.

A *unit* is a module-level function and its arguments (a check of ``kvref verify``, a mutant and
its checks, a vLLM source fault). :func:`run_units` ships each to a Ray worker as one task and
hands back one :class:`UnitOutcome` per unit, in the order given, whatever order they finish in,
so the commands merge them into the same table, JSON and JUnit report as a local run.

Failure rules (a distributed run must never read cleaner than a local one):

* a worker process that dies under a unit (OOM kill, segfault, ``os._exit``) is retried once by
  Ray (``max_retries=1``); a second death is an *error* of that unit, never a pass;
* a unit that raises is an error at once (an exception is deterministic: no retry);
* Ctrl-C cancels every unit still pending or running (``ray.cancel(force=True)``) and the
  outcome says which were cancelled, so the command writes its partial report and exits 130.

Ray is an optional extra (``pip install 'kvref[ray]'``): without it, ``--ray`` is an exit-2 error
saying how to install it. Before any unit runs, :func:`probe_workers` runs a task on every node
and compares its Python, kvref and vLLM versions with the driver's: a mismatch is an exit-2 error
(a worker with another vLLM would check something else than the report names). docs/ray.md.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvref.spec.errors import InvalidFieldError

#: the Ray release kvref is tested with (pyproject.toml's ``ray`` extra pins the same)
RAY_VERSION = "2.60.0"
INSTALL_HINT = f"Ray installed: pip install 'kvref[ray]' (or pip install ray=={RAY_VERSION})"
#: environment variables a locally started cluster hands to its workers (the Makefile's vLLM quieting)
FORWARDED_ENV = ("VLLM_TARGET_DEVICE", "VLLM_LOGGING_LEVEL", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                 "KVREF_PROFILE")
#: a JSON ``runtime_env`` (Ray's) applied to the job when connecting; docs/ray.md
RUNTIME_ENV_VARIABLE = "KVREF_RAY_RUNTIME_ENV"


def import_ray(address: str | None = "auto"):
    """Ray, or the one-line exit-2 error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise InvalidFieldError("--ray", address, INSTALL_HINT) from None
    return ray


def _runtime_env() -> dict | None:
    raw = os.environ.get(RUNTIME_ENV_VARIABLE)
    if raw is None:
        return None
    try:
        env = json.loads(raw)
    except ValueError as exc:
        raise InvalidFieldError(RUNTIME_ENV_VARIABLE, raw, f"a JSON object (Ray's runtime_env): {exc}") from None
    if not isinstance(env, dict):
        raise InvalidFieldError(RUNTIME_ENV_VARIABLE, raw, "a JSON object (Ray's runtime_env)")
    return env


def connect(address: str) -> str:
    """Join the Ray cluster at ``address`` (``auto``: a running one, else a local one on 127.0.0.1
    with this machine's CPUs). An already initialised Ray (a test's cluster) is used as it is.
    Returns how the cluster was reached, for the report."""
    if not isinstance(address, str) or not address.strip():
        raise InvalidFieldError("--ray", address, "a Ray address (host:port, ray://host:port) or 'auto'")
    ray = import_ray(address)
    if address != "auto":
        reachable(address)
    if ray.is_initialized():
        return "the Ray cluster this process had joined"
    env = _runtime_env()
    kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": "warning"}
    if env is not None:
        kwargs["runtime_env"] = env
    if address != "auto":
        try:
            ray.init(address=address, **kwargs)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise InvalidFieldError("--ray", address, f"a reachable Ray cluster ({type(exc).__name__}: "
                                                      f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
        return f"Ray cluster at {address}"
    running = _running_cluster()
    if running is not None:
        ray.init(address=running, **kwargs)
        return f"the running Ray cluster at {running} (auto)"
    local = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    if local:
        kwargs["runtime_env"] = {**(env or {}), "env_vars": {**local, **(env or {}).get("env_vars", {})}}
    loopback_only(ray)
    # ray.init() without an address joins RAY_ADDRESS when it is set: a stale one (passed over
    # above) hung the run for minutes instead of starting the local cluster
    os.environ.pop("RAY_ADDRESS", None)
    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", **kwargs)
    return "a local Ray cluster on 127.0.0.1 (auto)"


def _running_cluster() -> str | None:
    """``auto``: the address Ray would pick (``RAY_ADDRESS``, the last ``ray start``, any GCS
    process on this machine), if it accepts a connection. Ray itself would retry a stale or
    unreachable one for minutes (a GCS of another user's cluster that listens on 127.0.0.1 only is
    found by its process, at the machine's address); kvref then starts its own local cluster."""
    from ray._private.services import get_ray_address_from_environment

    try:
        found = get_ray_address_from_environment("auto", None)
    except ConnectionError:
        return None
    try:
        reachable(found)
    except InvalidFieldError:
        return None
    return found


#: Ray's switch that, off, makes a node's address the loopback one: without it Ray replaces
#: ``_node_ip_address="127.0.0.1"`` by the machine's reachable address and its GCS, raylet and
#: workers listen there (ray._private.services.resolve_ip_for_localhost)
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def loopback_only(ray) -> None:
    """A cluster this process starts listens and connects on 127.0.0.1 only: the switch in the
    environment (the GCS, raylet and workers it starts inherit it) and in Ray's constants (read at
    import, and Ray may already be imported)."""
    os.environ[LOOPBACK_SWITCH] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


#: how long a cluster's address may take to accept a connection before it is an input error
CONNECT_SECONDS = 5.0


def reachable(address: str) -> None:
    """A ``host:port`` (or ``ray://host:port``) that accepts a TCP connection within
    :data:`CONNECT_SECONDS`, else the exit-2 error at once: Ray itself retries an unreachable GCS
    for minutes before it gives up (``--ray 127.0.0.1:1`` ran 2 minutes)."""
    import socket

    rest = address.split("://", 1)[-1]
    host, sep, port = rest.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidFieldError("--ray", address, "a Ray address HOST:PORT (or ray://HOST:PORT), or 'auto'")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS).close()
    except OSError as exc:
        raise InvalidFieldError("--ray", address, f"a reachable Ray cluster (connecting failed: {exc})") from None


def worker_versions() -> dict:
    """What a process runs kvref with: Python, kvref, vLLM (None: not installed) and Ray."""
    from importlib import metadata

    from kvref import __version__

    try:
        vllm = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        vllm = None
    import ray

    return {"python": platform.python_version(), "kvref": __version__, "vllm": vllm, "ray": ray.__version__,
            "host": platform.node()}


#: the fields that must agree between the driver and every worker
MATCHED = ("python", "kvref", "vllm")


def probe_workers(address: str) -> dict:
    """Run :func:`worker_versions` on every alive node; the driver's and the nodes' versions, or an
    exit-2 error naming the first node that differs (Python compared to major.minor)."""
    ray = import_ray(address)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = worker_versions()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    probe = ray.remote(num_cpus=0, max_retries=1)(worker_versions)
    refs = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
            for n in nodes]
    seen = ray.get(refs, timeout=300)
    check_versions(here, seen, address)
    return {"driver": here, "nodes": seen, "cpus": int(ray.cluster_resources().get("CPU", 0))}


def check_versions(here: dict, seen: list[dict], address: str) -> None:
    """Every node's :data:`MATCHED` versions equal the driver's (Python to major.minor), or the
    exit-2 error naming the first node that differs and what it runs."""
    for got in seen:
        for k in MATCHED:
            a, b = here[k], got[k]
            if k == "python":
                a, b = ".".join(a.split(".")[:2]), ".".join(b.split(".")[:2])
            if a != b:
                raise InvalidFieldError("--ray", address, f"workers that run the driver's {k} {here[k]} "
                                                          f"(node {got['host']} has {got[k]}); docs/ray.md: runtime_env")


def describe(info: dict) -> str:
    """One line for the report: where the units ran and with what."""
    d = info["driver"]
    return (f"on Ray: {len(info['nodes'])} node(s), {info['cpus']} CPU(s); workers checked: kvref {d['kvref']}, "
            f"vLLM {d['vllm'] or 'not installed'}, Python {d['python']}, Ray {d['ray']}")


def start(address: str) -> dict:
    """:func:`connect` then :func:`probe_workers`: the ``ray`` entry of a report."""
    ray = import_ray(address)
    owned = not ray.is_initialized()
    how = connect(address)
    try:
        info = probe_workers(address)
    except BaseException:
        if owned:
            ray.shutdown()
        raise
    info["address"] = address
    info["cluster"] = how
    info["owned"] = owned
    return info


def stop(info: dict) -> None:
    """After the run: leave the cluster (and end a local one this run started) if :func:`start`
    joined it; a Ray this process had joined before (a test's cluster) stays."""
    if info.get("owned"):
        import ray

        ray.shutdown()


@dataclass
class UnitOutcome:
    """What came back for one unit: its value, or why it has none."""

    key: Any
    value: Any = None
    #: None: ran to the end; else why not (the worker died twice, the unit raised, Ctrl-C)
    error: str | None = None
    cancelled: bool = False
    seconds: float = 0.0
    #: the local modules the unit's worker had loaded when it finished (kvref.ray_inputs)
    modules: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class Unit:
    """One independent piece of work: ``fn(*args)`` on a worker (``fn`` at module level)."""

    key: Any
    fn: Callable[..., Any]
    args: tuple = ()


@dataclass
class RunOutcome:
    outcomes: list[UnitOutcome] = field(default_factory=list)
    interrupted: bool = False
    #: the Ray object refs of the units, in order (a cancelled one raises TaskCancelledError on get)
    refs: list = field(default_factory=list)


def _call(fn, args, modules):
    """On the worker (a fresh process): the Hypothesis inputs of the driver's process
    (:mod:`kvref.ray_inputs`), logging quieted like the CLI's, then the unit."""
    from kvref.quiet import quiet_third_party
    from kvref.ray_inputs import align_with, local_modules

    align_with(modules)
    quiet_third_party(False)
    value = fn(*args)
    return {"value": value, "modules": local_modules()}


def run_units(units: Sequence[Unit], on_done: Callable[[UnitOutcome], bool | None] | None = None,
              max_retries: int = 1, modules: list[str] | None = None) -> RunOutcome:
    """Ship every unit, wait, and return one outcome per unit in the order of ``units``.

    Each unit runs in a fresh worker process (``max_calls=1``: nothing a previous unit imported,
    patched or cached leaks into it) whose Hypothesis inputs are those of a process that loaded
    ``modules`` (default: this driver's, :func:`kvref.ray_inputs.local_modules`).

    ``on_done(outcome)`` is called on the driver as each unit finishes; returning True stops the
    run (``--exitfirst``): the others are cancelled. A ``KeyboardInterrupt`` (Ctrl-C, or raised by
    ``on_done``) cancels everything still out and returns with ``interrupted`` set; the units
    without a value say "cancelled".
    """
    ray = import_ray()
    from ray.exceptions import RayTaskError, TaskCancelledError

    from kvref.ray_inputs import local_modules

    if modules is None:
        modules = local_modules()
    remote = ray.remote(num_cpus=1, max_retries=max_retries, retry_exceptions=False, max_calls=1)(_call)
    t0 = time.perf_counter()
    refs = [remote.remote(u.fn, u.args, modules) for u in units]
    index = {ref: i for i, ref in enumerate(refs)}
    outcomes: list[UnitOutcome | None] = [None] * len(units)
    pending = list(refs)
    interrupted = stopped = False
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in done:
                i = index[ref]
                out = UnitOutcome(units[i].key, seconds=time.perf_counter() - t0)
                try:
                    got = ray.get(ref)
                    out.value, out.modules = got["value"], got["modules"]
                except RayTaskError as exc:  # the unit itself raised: deterministic, not retried
                    cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                    lines = str(cause).strip().splitlines()
                    out.error = f"the unit raised {type(cause).__name__}: {lines[0] if lines else ''}"[:500]
                except TaskCancelledError:
                    out.error, out.cancelled = "cancelled", True
                except ray.exceptions.RayError as exc:  # the worker died (after max_retries retries), lost node
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    out.error = (f"{type(exc).__name__} on Ray after {max_retries + 1} attempt(s): {first}")[:500]
                outcomes[i] = out
                if on_done is not None and on_done(out):
                    stopped = True
            if stopped:
                break
    except KeyboardInterrupt:
        from kvref.cli.interrupt import acknowledge

        acknowledge()  # taken: the partial report is written, not interrupted again
        interrupted = True
    for ref in pending:
        ray.cancel(ref, force=True)
    why = "interrupted (Ctrl-C): cancelled on Ray before it finished" if interrupted else \
        "not run: an earlier unit failed (--exitfirst)"
    final = [o if o is not None else UnitOutcome(u.key, error=why, cancelled=True)
             for o, u in zip(outcomes, units)]
    return RunOutcome(final, interrupted, refs)


def add_argument(p) -> None:
    """``--ray [ADDRESS]`` on a command's parser (absent: the local run, unchanged)."""
    p.add_argument("--ray", nargs="?", const="auto", default=None, metavar="ADDRESS",
                   help="run the work as units on Ray (ADDRESS of a cluster, or auto: a running one, else a "
                        "local one on 127.0.0.1); needs pip install 'kvref[ray]'; docs/ray.md")
