"""vLLM's whole ``SimpleCPUOffloadConnector`` (SCHEDULER role, built from a ``VllmConfig``) against
the reference backend in the SimpleCPU offload world, op by op (#22): the transfers each step
asks for, the pools, the connector's per-request state and the world's content model
(:mod:`kvref.models.offload.simple_cpu_world`)."""

from __future__ import annotations

from kvref.models.offload.simple_cpu_world import BACKENDS, SimpleOffloadWorld
from kvref.models.offload.traces import apply_op
from kvref.models.offload.world_common import OffloadInvariantError


def _connector_backend(cfg, variant: str = "reference"):
    from kvref.impl.vllm.simple_offload_connector import SimpleCPUConnectorVllmBackend

    return SimpleCPUConnectorVllmBackend(cfg, variant)


BACKENDS.setdefault("vllm-connector", _connector_backend)


def run_simple_connector_traces(cases) -> dict:
    """Run ``cases`` (``(SimpleOffloadConfig, ops)``) on the reference and on vLLM's connector;
    raises :class:`OffloadInvariantError` / ``AssertionError`` at the first difference or broken
    invariant, with the trace position."""
    stats = {"traces": 0, "ops": 0}
    for i, (cfg, ops) in enumerate(cases):
        worlds = [SimpleOffloadWorld(cfg, b, allow_duplicates_within_event=True)
                  for b in ("reference", "vllm-connector")]
        stats["traces"] += 1
        for j, op in enumerate(ops):
            try:
                outs = [apply_op(w, op) for w in worlds]
            except (AssertionError, OffloadInvariantError) as exc:
                raise type(exc)(f"SimpleCPU trace {i} op {j} {op} on {cfg}: {exc}") from exc
            stats["ops"] += 1
            if outs[0] != outs[1] or worlds[0].observe() != worlds[1].observe():
                raise OffloadInvariantError(
                    f"SimpleCPU trace {i} op {j} {op} on {cfg}: reference and vLLM's SimpleCPUOffloadConnector differ: "
                    f"{outs[0]!r}"[:600] + f" / {outs[1]!r}"[:600])
    return stats
