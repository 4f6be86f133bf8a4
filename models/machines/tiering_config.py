"""Generated KVCR tier configurations built by vLLM's own front door, against the reference's verdict.

Each case mutates a valid KVCR tier config (policy, router capabilities, control ports and the local
data-parallel rank that picks one, local DRAM slots, service socket/digest, operation/abandon
timeouts, a G3 file tier and its NIXL backend, the NIXL backends of local DRAM and the remote path,
KV events and their self-description) and builds vLLM's ``TieringOffloadingSpec``
with an fs tier before it. :func:`kvcr_config_error` says whether vLLM must refuse it and why; vLLM
must then raise that exception (naming the rule) from ``get_manager``, which shuts the fs tier it
had built down again (its pool threads end); an accepted config must build, and its manager shuts
down cleanly, having handed kvcr the control port at its local data-parallel rank, the local DRAM,
G3 tier, policy and inventory sink the reference says, and declaring and reporting KVCR's metrics
only with ``enable_telemetry`` (issue #22).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import threading

from kvref.impl.reference.offload.tiering.clock import VirtualClock
from kvref.spec.errors import InvalidFieldError
from kvref.impl.reference.offload.tiering.kvcr_config import kvcr_built_tier, kvcr_config_error

_KEYWORD = {"policy": "polic", "kvcr_service_socket_path": "kvcr_service_socket_path",
            "router_capabilities": "router capabilities", "self_describing_kv_events": "self_describing_kv_events",
            "control_ports": "control_ports", "secondary_g2_slots": "secondary_g2_slots",
            "operation_timeout_ms": "operation_timeout_ms", "abandon_timeout_ms": "abandon_timeout_ms",
            "g3": "G3", "backend": "backend"}
#: what a case varies, drawn in turn so that a short run reaches every rule
FAMILIES = ("any", "policy", "router_capabilities", "service", "self_describing", "control_ports", "dp_rank",
            "secondary_g2_slots", "timeouts", "g3", "events_off", "backend")


class ConfigDivergence(AssertionError):
    """vLLM accepted or refused a KVCR tier config differently from the reference's verdict."""


def _g3(rng: random.Random) -> dict:
    """kvcr's G3 (file) tier options: a file in a fresh directory (vLLM passes them to kvcr)."""
    from kvref.impl.vllm.scratch import scratch_dir

    g3 = {"paths": [os.path.join(scratch_dir("g3-"), "g3.bin")], "capacity_bytes_per_file": 1 << 16,
          "backend": rng.choice(("POSIX", "KVREF_NO_SUCH_BACKEND"))}
    if rng.random() < 0.15:
        del g3["paths"]
    return g3


def random_case(rng: random.Random, family: str | None = None) -> tuple[dict, bool, bool, int | None]:
    """(a KVCR tier config with 0-2 mutations, whether KV events are on, whether they are
    self-describing, the local data-parallel rank); ``family``: what to vary (default: drawn)."""
    from kvref.impl.vllm.tiering_kvcr import kvcr_tier_config

    cfg = kvcr_tier_config(rng.choice((1, 2, 3)), rng.choice(("lru", "fifo")), telemetry=rng.random() < 0.7)
    events, self_describing, dp = True, True, None
    family = family or rng.choice(FAMILIES)
    for what in [family] + ([rng.choice(FAMILIES)] if rng.random() < 0.25 else []):
        if what == "policy":
            cfg["policy"] = rng.choice((None, "g3_lru", "g3_fifo", "mru", "kvcr.policy.LRUPolicy",
                                        "kvcr.policy.PlacementAction", "kvref_missing_module.Policy"))
        elif what == "router_capabilities":
            cfg["router_capabilities"] = rng.choice(([], None, ["other"], ["router_hint", "other"]))
        elif what == "control_ports":
            cfg["control_ports"] = rng.choice(([], [cfg["control_ports"][0], 1], [0], [65536]))
        elif what == "dp_rank":  # a data-parallel engine: the port at its local rank
            dp = rng.choice((0, 1, 1, 2))
            ports = [rng.randint(1, 65535) for _ in range(rng.choice((dp + 1, dp + 1, dp, 3)))]
            if dp < len(ports):
                ports[dp] = cfg["control_ports"][0]
            if rng.random() < 0.2:
                ports[-1] = rng.choice((0, 65536))
            cfg["control_ports"] = ports
        elif what == "secondary_g2_slots":
            cfg["secondary_g2_slots"] = rng.choice((-1, 0))
        elif what == "service":  # both (kvref runs no KVCR service) or one of the pair
            pair = ("kvcr_service_socket_path", "compatibility_digest")
            for k in rng.choice((pair, pair, pair[:1], pair[1:])):
                cfg[k] = f"/nonexistent/kvref-kvcr-{os.getpid()}.sock" if k.startswith("kvcr") else "kvref"
        elif what == "timeouts":
            op = rng.choice((0, -1, 100))
            cfg["operation_timeout_ms"], cfg["abandon_timeout_ms"] = op, rng.choice((2 * op, 2 * op - 1, 10 ** 6))
        elif what == "g3":
            cfg["g3"] = _g3(rng)
            cfg["policy"] = rng.choice((None, "g3_lru", "g3_fifo", "lru"))
            if rng.random() < 0.2:
                cfg["secondary_g2_slots"] = 0
        elif what == "backend":  # a NIXL backend no machine has: KVCR fails once native work began
            cfg[rng.choice(("local_dram_backend", "remote_fw_dram_backend"))] = "KVREF_NO_SUCH_BACKEND"
            cfg["secondary_g2_slots"] = rng.choice((0, 1, 2))
        elif what == "events_off":
            events = False
        elif what == "self_describing":
            self_describing = False
            if rng.random() < 0.5:
                cfg["secondary_g2_slots"] = 0  # only the g3 tier or the service then needs it
                cfg["g3"] = _g3(rng)
    return cfg, events, self_describing, dp


def _build_retrying_port_races(build, cfg: dict, self_describing: bool, want, events: bool = True,
                               dp_local_rank: int | None = None):
    """vLLM's world for ``cfg``. A config the reference accepts whose free control port another
    process took between ``_free_port()`` and KVCR's bind (EADDRINUSE: a suite running beside a
    ``kvref verify``) is built again on a fresh port, at most twice: the race is the machine's,
    not a verdict on the config."""
    from kvref.impl.vllm.tiering_kvcr import _free_port

    more = {} if events and dp_local_rank is None else {"enable_events": events,
                                                       "data_parallel_rank_local": dp_local_rank}
    for attempt in range(3):
        try:
            return build(2, [{"type": "fs", "n_read_threads": 1, "n_write_threads": 1}, cfg], VirtualClock(),
                         self_describing_events=self_describing, **more)
        except Exception as exc:  # noqa: BLE001 - the caller compares it with the reference's verdict
            if want is not None or attempt == 2 or "Address already in use" not in str(exc):
                raise
            cfg["control_ports"][dp_local_rank or 0] = _free_port()
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises


def run_config_cases(seed: int, n: int, families: tuple[str, ...] = FAMILIES) -> dict:
    """``n`` generated cases, their ``families`` drawn in turn; returns counts of accepted and
    refused configs (per rule)."""
    from kvref.impl.vllm.tiering import build_vllm_tiering

    rng = random.Random(f"conform-tiering-config-{seed}")
    out = {"configs": 0, "configs_accepted": 0, "configs_refused": 0}
    if not families or any(f not in FAMILIES for f in families):
        raise InvalidFieldError("families", families, f"a non-empty tuple of {FAMILIES}")
    start = rng.randrange(len(families))
    with _quiet("vllm.v1.kv_offload.tiering.kvcr.manager", "vllm.v1.kv_offload.cpu.shared_offload_region"):
        for i in range(n):
            _run_case(build_vllm_tiering, rng, families[(start + i) % len(families)], out)
    return out


@contextlib.contextmanager
def _quiet(*names: str):
    """vLLM's warnings that a generated config draws on purpose (KVCR DRAM without events, the buffers
    kept mapped after a KVCR startup failure) stay out of the check's output."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def _run_case(build_vllm_tiering, rng: random.Random, family: str, out: dict) -> None:
    """One generated case of ``family``: vLLM builds it or refuses it as the reference says."""
    cfg, events, self_describing, dp = random_case(rng, family)
    want = kvcr_config_error(cfg, events, self_describing, dp)
    about = f"KVCR config {cfg} (events {events}, self-describing {self_describing}, local DP rank {dp})"
    threads = {t.ident for t in threading.enumerate()}
    from kvref.impl.vllm.tiering_kvcr import kvcr_built, retained_native_buffers

    retained = retained_native_buffers()
    try:
        world = _build_retrying_port_races(build_vllm_tiering, cfg, self_describing, want, events, dp)
    except Exception as exc:  # noqa: BLE001 - compared with the reference's verdict
        # after a startup failure native work may still write into the primary view and local DRAM:
        # vLLM keeps both mapped for the life of the process
        kept = retained_native_buffers() - retained
        keep = (1 + (cfg.get("secondary_g2_slots", 0) > 0)) if want and want[0] == "KVCRStartupError" else 0
        if kept != keep:
            raise ConfigDivergence(f"{about} refused ({type(exc).__name__}: {exc}); vLLM kept {kept} native "
                                   f"buffers mapped, the reference {keep}") from None
        names = {c.__name__ for c in type(exc).__mro__}
        if want is None or want[0] not in names or (
                want[0] == "ValueError" and _KEYWORD[want[1]].lower() not in str(exc).lower()):
            raise ConfigDivergence(f"{about}: reference {want}, vLLM raised {type(exc).__name__}: {exc}") from None
        left = [t.name for t in threading.enumerate() if t.ident not in threads and t.is_alive()
                and t.name.startswith(("fs", "kvref", "vllm"))]
        out["configs_refused"] += 1
        out[f"refused_{want[1]}"] = out.get(f"refused_{want[1]}", 0) + 1
        if left:
            raise ConfigDivergence(f"{about} refused, but threads of the tiers built before it "
                                   f"are still running: {left}")
    else:
        try:
            got = kvcr_built(world.tiers[1])
            got["metrics"] = tuple(sorted(k for k in world.metric_definitions() if k.startswith("vllm:kvcr_")))
            got["reports_stats"] = any(k.startswith("vllm:kvcr_") for k in world.take_stats())
            expected = None if want is not None else kvcr_built_tier(cfg, events, world.tiers[1].block_size_bytes, dp)
        finally:
            world.shutdown()
        if want is not None:
            raise ConfigDivergence(f"{about}: reference refuses it ({want}), vLLM built it")
        if got != expected:
            raise ConfigDivergence(f"{about}: vLLM gave KVCR {got}, the reference {expected}")
        out["configs_accepted"] += 1
    finally:
        if cfg.get("g3"):
            for path in cfg["g3"].get("paths", ()):
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    out["configs"] += 1
