"""Generated KVCR tier configurations built by vLLM's own front door, against the reference's verdict.

Each case mutates a valid KVCR tier config (policy, router capabilities, control ports, local DRAM
slots, service socket/digest, self-describing events) and builds vLLM's ``TieringOffloadingSpec``
with an fs tier before it. :func:`kvcr_config_error` says whether vLLM must refuse it and why; vLLM
must then raise that exception (naming the rule) from ``get_manager``, which shuts the fs tier it
had built down again (its pool threads end); an accepted config must build, and its manager shuts
down cleanly (issue #22).
"""

from __future__ import annotations

import random
import threading

from kvref.impl.reference.offload.tiering.clock import VirtualClock
from kvref.impl.reference.offload.tiering.kvcr_config import kvcr_config_error

_KEYWORD = {"policy": "polic", "kvcr_service_socket_path": "kvcr_service_socket_path",
            "router_capabilities": "router capabilities", "self_describing_kv_events": "self_describing_kv_events",
            "control_ports": "control_ports", "secondary_g2_slots": "secondary_g2_slots"}


class ConfigDivergence(AssertionError):
    """vLLM accepted or refused a KVCR tier config differently from the reference's verdict."""


def random_case(rng: random.Random) -> tuple[dict, bool]:
    """(a KVCR tier config with 0-2 mutations, whether self-describing events are on)."""
    from kvref.impl.vllm.tiering_kvcr import kvcr_tier_config

    cfg = kvcr_tier_config(rng.choice((1, 2, 3)), rng.choice(("lru", "fifo")))
    self_describing = True
    for _ in range(rng.choice((0, 1, 1, 2))):
        what = rng.randrange(7)
        if what == 0:
            cfg["policy"] = rng.choice((None, "g3_lru", "g3_fifo", "mru", "kvcr.policy.LRUPolicy",
                                        "kvcr.policy.PlacementAction", "kvref_missing_module.Policy"))
        elif what == 1:
            cfg["router_capabilities"] = rng.choice(([], None, ["other"], ["router_hint", "other"]))
        elif what == 2:
            cfg["control_ports"] = rng.choice(([], [cfg["control_ports"][0], 1], [0], [65536]))
        elif what == 3:
            cfg["secondary_g2_slots"] = rng.choice((-1, 0))
        elif what == 4:
            cfg[rng.choice(("kvcr_service_socket_path", "compatibility_digest"))] = "kvref"
        else:
            self_describing = False
    return cfg, self_describing


def _build_retrying_port_races(build, cfg: dict, self_describing: bool, want):
    """vLLM's world for ``cfg``. A config the reference accepts whose free control port another
    process took between ``_free_port()`` and KVCR's bind (EADDRINUSE: a suite running beside a
    ``kvref verify``) is built again on a fresh port, at most twice: the race is the machine's,
    not a verdict on the config."""
    from kvref.impl.vllm.tiering_kvcr import _free_port

    for attempt in range(3):
        try:
            return build(2, [{"type": "fs", "n_read_threads": 1, "n_write_threads": 1}, cfg], VirtualClock(),
                         self_describing_events=self_describing)
        except Exception as exc:  # noqa: BLE001 - the caller compares it with the reference's verdict
            if want is not None or attempt == 2 or "Address already in use" not in str(exc):
                raise
            cfg["control_ports"] = [_free_port()]
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns or raises


def run_config_cases(seed: int, n: int) -> dict:
    """``n`` generated cases; returns counts of accepted and refused configs (per rule)."""
    from kvref.impl.vllm.tiering import build_vllm_tiering

    rng = random.Random(f"conform-tiering-config-{seed}")
    out = {"configs": 0, "configs_accepted": 0, "configs_refused": 0}
    for _ in range(n):
        cfg, self_describing = random_case(rng)
        want = kvcr_config_error(cfg, True, self_describing)
        threads = {t.ident for t in threading.enumerate()}
        try:
            world = _build_retrying_port_races(build_vllm_tiering, cfg, self_describing, want)
        except Exception as exc:  # noqa: BLE001 - compared with the reference's verdict
            names = {c.__name__ for c in type(exc).__mro__}
            if want is None or want[0] not in names or (
                    want[0] == "ValueError" and _KEYWORD[want[1]] not in str(exc)):
                raise ConfigDivergence(f"KVCR config {cfg} (self-describing events {self_describing}): "
                                       f"reference {want}, vLLM raised {type(exc).__name__}: {exc}") from None
            left = [t.name for t in threading.enumerate() if t.ident not in threads and t.is_alive()
                    and t.name.startswith(("fs", "kvref", "vllm"))]
            out["configs_refused"] += 1
            out[f"refused_{want[1]}"] = out.get(f"refused_{want[1]}", 0) + 1
            if left:
                raise ConfigDivergence(f"KVCR config {cfg} refused, but threads of the tiers built before it "
                                       f"are still running: {left}")
        else:
            world.shutdown()
            if want is not None:
                raise ConfigDivergence(f"KVCR config {cfg} (self-describing events {self_describing}): "
                                       f"reference refuses it ({want}), vLLM built it")
            out["configs_accepted"] += 1
        out["configs"] += 1
    return out
