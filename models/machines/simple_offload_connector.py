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


# --------------------------------------------------------------------------------------------
# The connector's construction path: kv_connector_extra_config -> budget, pool size, mode, backend


def random_connector_extra(rng, cfg) -> tuple[dict, bool, int | None]:
    """A ``kv_connector_extra_config`` for ``cfg``'s GPU pool as users write them — budgets for the
    server or per rank, explicit or agreed block counts (some too large or not positive ints), the
    store mode, the cpu or disk backend (with and without its path and capacity), disk-only keys
    under "cpu", numbers as strings — with prefix caching on or off and the workers' agreed count.
    Budgets stay small (a pool of at most ~80 blocks) so every accepted one is built."""
    page = 8 * cfg.block_size  # the GPU spec's page: K and V, one head of size 1, float32
    extra: dict = {}
    explicit = rng.random() < 0.4
    if explicit:
        extra["num_cpu_blocks"] = rng.choice([1, 3, 8, 40, 5, 1, 0, True, "4", 300])
    agreed = rng.choice([None, None, 2, 17]) if rng.random() < 0.5 else None
    small = not explicit and agreed is None  # the budget sizes the pool: keep it small
    if small or rng.random() < 0.7:
        extra["cpu_bytes_to_use"] = rng.choice([0, page, page * cfg.world_size * rng.randint(1, 60),
                                                str(page * 12 * cfg.world_size)])
    if rng.random() < 0.25:
        extra["cpu_bytes_to_use_per_rank"] = rng.choice([page * rng.randint(0, 50), str(page * 5)])
    if rng.random() < 0.05:
        extra["cpu_bytes_to_use"] = "lots"
    if rng.random() < 0.5:
        extra["lazy_offload"] = rng.choice([True, False, 0, 1])
    backend = rng.choice([None, "cpu", "cpu", "disk", "disk", "disk", "nvme"])
    if backend is not None:
        extra["kv_offload_backend"] = backend
    if backend == "disk" or rng.random() < 0.2:  # disk keys, also under "cpu" (ignored there)
        if rng.random() < 0.9:
            extra["disk_path"] = "/nonexistent/kvref-disk" if rng.random() < 0.9 else ""
        extra["disk_capacity_bytes"] = page * rng.randint(1, 70) if rng.random() < 0.85 else rng.choice([0, -page])
        if rng.random() < 0.5:
            extra["disk_buffer_slots"] = rng.choice([0, 1, 3, "2"])
        if rng.random() < 0.5:
            extra["use_page_cache"] = rng.choice([True, False])
    if "cpu_bytes_to_use" not in extra and "cpu_bytes_to_use_per_rank" not in extra and not explicit \
            and agreed is None and backend != "disk":
        extra["cpu_bytes_to_use"] = page * 4
    return extra, rng.random() < 0.9, agreed


def compare_connector_construction(cfg, extra: dict, prefix_caching: bool, agreed: int | None) -> str | None:
    """Build vLLM's connector (scheduler and worker roles) and the reference's settings (and, for
    the scheduler role, the reference offload scheduler) from one configuration; None when every
    observable agrees, else what differs."""
    from kvref.impl.reference.offload.simple_cpu_connector_config import simple_cpu_connector_settings
    from kvref.impl.reference.offload.simple_cpu_offload_scheduler import SimpleCPUOffloadScheduler
    from kvref.impl.reference.offload.simple_cpu_connector_config import simple_cpu_role_answers
    from kvref.impl.vllm.simple_offload_connector import build_simple_cpu_connector, role_answers

    def handler_built(conn) -> bool:  # offloading on (prefix caching): the role's own side exists
        return conn.scheduler_manager is not None or conn.worker_handler is not None

    page = 8 * cfg.block_size
    where = f"{cfg} extra={extra} prefix_caching={prefix_caching} agreed={agreed}"
    for role in ("scheduler", "worker"):
        try:
            ref = simple_cpu_connector_settings(extra, world_size=cfg.world_size, enable_prefix_caching=prefix_caching,
                                                num_gpu_blocks=cfg.num_gpu_blocks,
                                                gpu_total_bytes=page * cfg.num_gpu_blocks,
                                                aligned_num_cpu_blocks=agreed, check_capacity=role == "scheduler")
        except ValueError as exc:
            ref = exc
        try:
            conn, _ = build_simple_cpu_connector(cfg, extra, role, enable_prefix_caching=prefix_caching,
                                                 aligned_num_cpu_blocks=agreed)
        except ValueError as exc:
            conn = exc
        if isinstance(ref, ValueError) or isinstance(conn, ValueError):
            if isinstance(ref, ValueError) != isinstance(conn, ValueError):
                return f"{role} role, {where}: reference {ref!r}, vLLM {conn!r}"
            continue
        if handler_built(conn):
            answers, want_answers = role_answers(conn, role, cfg), simple_cpu_role_answers(role)
            if answers != want_answers:
                return f"{role} role, {where}: the other role's calls answer {answers}, reference {want_answers}"
        handler = conn.scheduler_manager if role == "scheduler" else conn.worker_handler
        if (handler is None) != (not prefix_caching) or (conn.worker_handler if role == "scheduler"
                                                          else conn.scheduler_manager) is not None:
            return f"{role} role, {where}: vLLM built {conn.scheduler_manager!r} / {conn.worker_handler!r}"
        got_source = conn._cache_hit_source.name
        if got_source != ref.cache_hit_source:
            return f"{role} role, {where}: cache hit source {got_source}, reference {ref.cache_hit_source}"
        if handler is None:
            continue
        if role == "worker":
            got = (handler.cpu_capacity_bytes, handler._num_cpu_blocks_override, handler.disk_mode, handler.disk_path,
                   handler.disk_capacity_bytes, handler.disk_buffer_slots, handler.use_page_cache)
            want = (ref.cpu_capacity_per_rank, ref.num_cpu_blocks_override, ref.disk_mode, ref.disk_path,
                    ref.disk_capacity_bytes, ref.disk_buffer_slots, ref.use_page_cache)
        else:
            mine = SimpleCPUOffloadScheduler(cfg.kvref_groups(), ref.num_cpu_blocks, cfg.max_model_len, cfg.block_size,
                                             cfg.block_size, lazy_offload=ref.lazy_offload, world_size=cfg.world_size,
                                             max_num_batched_tokens=cfg.max_num_batched_tokens)
            mine.check_invariants()
            got = (handler.num_cpu_blocks, handler.cpu_block_pool.get_num_free_blocks(), handler._lazy_mode,
                   handler._target_free, str(handler.kv_event_medium), handler._expected_worker_count)
            want = (mine.num_cpu_blocks, mine.cpu_block_pool.get_num_free_blocks(), mine.lazy, mine._target_free,
                    ref.kv_event_medium, mine.world_size)
        if got != want:
            return f"{role} role, {where}: vLLM {got}, reference {want}"
    return None


def compare_find_in_multi(rng, cfg, extra: dict) -> str | None:
    """A worker's MultiConnector with or without a SimpleCPU child among scripted ones: vLLM must
    find exactly that child (the worker asks it for the pool size the ranks agreed on; before its
    KV caches are registered it has none)."""
    from kvref.impl.vllm.simple_offload_connector import find_simple_cpu_in_multi

    n = rng.randint(0, 2)
    position = rng.choice([None, *range(n + 1)]) if n else 0  # a MultiConnector has at least one child
    got = find_simple_cpu_in_multi(cfg, extra, position, n)
    if got != (position, None):
        return f"MultiConnector of {n} scripted children + SimpleCPU at {position}: vLLM found {got}"
    return None


def run_connector_construction(seed: int, n: int) -> dict:
    """``n`` generated configurations through :func:`compare_connector_construction`; raises
    :class:`OffloadInvariantError` at the first difference."""
    import random

    from kvref.models.offload.simple_cpu_world import SimpleOffloadConfig

    rng = random.Random(f"simple-cpu-construction-{seed}")
    stats = {"configs": 0, "refused": 0, "sized_from_bytes": 0, "disk": 0, "in_multi": 0}
    from kvref.impl.reference.offload.simple_cpu_connector_config import simple_cpu_connector_settings

    for _ in range(n):
        cfg = SimpleOffloadConfig.random(rng)
        extra, prefix_caching, agreed = random_connector_extra(rng, cfg)
        bad = compare_connector_construction(cfg, extra, prefix_caching, agreed)
        if bad:
            raise OffloadInvariantError(f"SimpleCPUOffloadConnector construction: {bad}")
        stats["configs"] += 1
        try:
            s = simple_cpu_connector_settings(extra, world_size=cfg.world_size, enable_prefix_caching=prefix_caching,
                                              num_gpu_blocks=cfg.num_gpu_blocks,
                                              gpu_total_bytes=8 * cfg.block_size * cfg.num_gpu_blocks,
                                              aligned_num_cpu_blocks=agreed)
        except ValueError:
            stats["refused"] += 1
            continue
        stats["disk"] += s.disk_mode
        if s.num_cpu_blocks is not None and not s.disk_mode and rng.random() < 0.3:
            bad = compare_find_in_multi(rng, cfg, extra)
            if bad:
                raise OffloadInvariantError(f"SimpleCPUOffloadConnector in a MultiConnector: {bad}")
            stats["in_multi"] += 1
        stats["sized_from_bytes"] += s.num_cpu_blocks is not None and s.num_cpu_blocks_override is None and agreed is None
    return stats


def run_sizing_agreement(seed: int, n: int) -> dict:
    """``n`` generated rank sets (1-3 ranks, each with its own pool size) agree on the pool size in
    vLLM's forked, gloo-connected ranks exactly as the reference says; raises
    :class:`OffloadInvariantError` at the first difference."""
    import random

    from kvref.impl.reference.offload.simple_cpu_connector_config import agreed_num_cpu_blocks as want
    from kvref.impl.vllm.simple_offload_sizing import agreed_num_cpu_blocks as got
    from kvref.impl.vllm.simple_offload_sizing import unsynced_num_cpu_blocks as unsynced

    rng = random.Random(f"simple-cpu-sizing-{seed}")
    lone_rng = random.Random(f"simple-cpu-sizing-lone-{seed}")  # apart from the rank sets' draws
    stats = {"rank_sets": 0, "ranks": 0, "lone": 0}
    for _ in range(n):
        counts = [rng.choice([1, 3, 40, rng.randint(1, 200)]) for _ in range(rng.randint(1, 3))]
        if len(counts) == 1 and lone_rng.random() < 0.5:  # a lone worker without a process group
            lone = unsynced(counts[0])
            if lone is not None and [lone] != want(counts):
                raise OffloadInvariantError(f"a lone SimpleCPU worker without torch.distributed sized {counts} as "
                                            f"{lone}, reference {want(counts)}")
            stats["lone"] += lone is not None
        answers, expected = got(counts), want(counts)
        if answers != expected:
            raise OffloadInvariantError(f"SimpleCPU ranks with pools {counts} agreed on {answers}, reference {expected}")
        stats["rank_sets"] += 1
        stats["ranks"] += len(counts)
    return stats
