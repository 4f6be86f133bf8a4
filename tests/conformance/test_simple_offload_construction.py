"""vLLM's ``SimpleCPUOffloadConnector`` built from generated ``kv_connector_extra_config``s in both
roles vs the reference's reading of them (issue #22): the per-rank budget, the pool's size (from
bytes, explicit, or the workers' agreed count), the store mode, the backend, and the refusals. The
generator reaches each kind, and a planted sizing fault in vLLM's own class is caught."""

from __future__ import annotations

import pytest

from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def run():
    require_vllm()
    from kvref.models.machines.simple_offload_connector import run_connector_construction

    return run_connector_construction


def test_clean_vllm_agrees_and_every_kind_is_drawn(run):
    stats = run(0, 60)
    assert stats["configs"] == 60
    assert stats["refused"] > 0
    assert stats["sized_from_bytes"] > 0
    assert stats["disk"] > 0
    assert stats["in_multi"] > 0  # a worker's MultiConnector searched for its SimpleCPU child


def _derive_ignoring_agreed(original):
    def derive(gpu_config, cpu_capacity_bytes, num_cpu_blocks=None, aligned_num_cpu_blocks=None):
        return original(gpu_config, cpu_capacity_bytes, num_cpu_blocks, None)
    return staticmethod(derive)


def _lazy_target_without_watermark(kv_cache_config, max_num_batched_tokens, cp_world_size=1):
    return sum(-(-max_num_batched_tokens // g.kv_cache_spec.block_size)
               for g in kv_cache_config.prefix_cacheable_groups)


@pytest.mark.parametrize("fault", ["agreed", "lazy_target", "find_in_multi"])
def test_planted_sizing_faults_are_caught(run, monkeypatch, fault):
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler as S

    from kvref.models.offload.world_common import OffloadInvariantError

    if fault == "find_in_multi":  # planted: only a top-level SimpleCPU connector is found
        from vllm.distributed.kv_transfer.kv_connector.v1 import simple_cpu_offload_connector as mod

        monkeypatch.setattr(mod, "_find_simple_cpu_offload_connector",
                            lambda c: c if isinstance(c, mod.SimpleCPUOffloadConnector) else None)
    elif fault == "agreed":
        monkeypatch.setattr(S, "_derive_cpu_config", _derive_ignoring_agreed(S._derive_cpu_config))
    else:
        monkeypatch.setattr(S, "_estimate_lazy_target_blocks", staticmethod(_lazy_target_without_watermark))
    with pytest.raises(OffloadInvariantError):
        run(0, 60)


def test_a_worker_role_answering_for_the_scheduler_is_caught(run, monkeypatch):
    """Planted: the worker role reports pending push work (the engine would hold finished requests
    for a scheduler side that does not exist in that process)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import SimpleCPUOffloadConnector

    from kvref.models.offload.world_common import OffloadInvariantError

    monkeypatch.setattr(SimpleCPUOffloadConnector, "has_pending_push_work",
                        lambda self: self.scheduler_manager is None or self.scheduler_manager.has_pending_stores())
    with pytest.raises(OffloadInvariantError, match="other role"):
        run(0, 60)


def test_role_answers_refuse_an_unknown_role():
    from kvref.impl.reference.offload.simple_cpu_connector_config import simple_cpu_role_answers
    from kvref.spec.errors import InvalidFieldError

    assert simple_cpu_role_answers("scheduler") == {"aligned_num_cpu_blocks": None, "worker_finished": (None, None),
                                                    "worker_meta": None}
    assert simple_cpu_role_answers("worker")["match"] == (0, False)
    with pytest.raises(InvalidFieldError, match="role"):
        simple_cpu_role_answers("both")


def test_ranks_agree_on_the_smallest_pool_and_a_max_is_caught(run, monkeypatch):
    """vLLM's forked gloo ranks all-reduce their pool sizes (MIN); planted: MAX (a rank would
    allocate block ids its peers lack)."""
    import torch.distributed as dist

    from kvref.models.machines.simple_offload_connector import run_sizing_agreement
    from kvref.models.offload.world_common import OffloadInvariantError

    stats = run_sizing_agreement(0, 4)
    assert stats["ranks"] > stats["rank_sets"], "some rank set has several ranks"
    real = dist.all_reduce
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None, op=None: real(t, group=group, op=dist.ReduceOp.MAX))
    with pytest.raises(OffloadInvariantError, match="agreed"):
        run_sizing_agreement(0, 4)


def test_a_lone_worker_keeps_its_pool_and_a_change_is_caught(run):
    """A worker process without torch.distributed keeps its own pool size (vLLM's sizing returns
    it unchanged); planted: one block more."""
    import inspect
    import sys
    import textwrap

    from vllm.v1.simple_kv_offload import sizing

    from kvref.models.machines.simple_offload_connector import run_sizing_agreement
    from kvref.models.offload.world_common import OffloadInvariantError

    assert run_sizing_agreement(0, 4)["lone"] > 0  # fixed draws: rank set 3 is a lone worker
    real = sizing.sync_num_offload_blocks_across_workers
    src = inspect.getsource(real)
    old = "if not dist.is_initialized():\n        return num_offload_blocks"
    assert src.count(old) == 1
    ns: dict = {}
    exec(compile(textwrap.dedent(src.replace(old, old + " + 1")), "<fault sizing>", "exec"),  # noqa: S102
         vars(sys.modules[sizing.__name__]), ns)
    sizing.sync_num_offload_blocks_across_workers = ns["sync_num_offload_blocks_across_workers"]
    try:
        with pytest.raises(OffloadInvariantError, match="lone"):
            run_sizing_agreement(0, 4)
    finally:
        sizing.sync_num_offload_blocks_across_workers = real


def test_a_scheduler_role_answering_for_the_workers_is_caught(run, monkeypatch):
    """Planted: the scheduler role reports finished transfers (empty sets, not "nothing tracked"):
    the engine would count them as this process's worker reporting."""
    from vllm.distributed.kv_transfer.kv_connector.v1.simple_cpu_offload_connector import SimpleCPUOffloadConnector

    from kvref.models.offload.world_common import OffloadInvariantError

    real = SimpleCPUOffloadConnector.get_finished
    monkeypatch.setattr(SimpleCPUOffloadConnector, "get_finished",
                        lambda self, ids: (set(), set()) if self.worker_handler is None else real(self, ids))
    with pytest.raises(OffloadInvariantError, match="other role"):
        run(0, 60)
