"""Issue #22: paths of vLLM's KV cache manager that ``conform-kv-manager``'s generated traces must
execute under the oracle, with a planted fault in each that the same run must catch.

* ``kv_cache_report_mode="full"``: a multi-turn follow-up hits the local prefix cache and vLLM's
  ``BlockPool.emit_cached_block_events`` announces the hit; the event streams are compared after
  every op.

Each run is seeded (``run_machine(seed=...)``), so what it reaches does not depend on the profile.
"""

from __future__ import annotations

import pytest

from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

_SEED = 0
_EXAMPLES = 12


def _counting(monkeypatch, cls, name: str) -> list[int]:
    calls = [0]
    orig = getattr(cls, name)

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return orig(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, counted)
    return calls


def _run(out_dir, **kwargs):
    """The seeded run; a failing trace goes to ``out_dir`` (the test's tmp_path: run_machine takes
    the folder, no environment variable is swapped, #26)."""
    from kvref.models.machines.kv_cache_manager import run_machine

    return run_machine(("reference", "vllm"), _EXAMPLES, seed=_SEED, shrink=False, group_sets=("fa", "fa+swa"),
                       out_dir=str(out_dir), **kwargs)


def test_generated_follow_ups_announce_full_mode_hits(monkeypatch, tmp_path):
    """The generated traces reach vLLM's announcement of a reused prefix and agree on it."""
    require_vllm()
    from vllm.v1.core.block_pool import BlockPool

    calls = _counting(monkeypatch, BlockPool, "emit_cached_block_events")
    run = _run(tmp_path)
    assert run.ok, run.failure
    assert calls[0] > 0


def test_a_dropped_hit_announcement_is_caught(monkeypatch, tmp_path):
    """vLLM announcing a full-mode hit without its last block (a planted fault) diverges."""
    require_vllm()
    from vllm.v1.core.block_pool import BlockPool

    orig = BlockPool.emit_cached_block_events

    def short(self, request, num_cached_blocks, block_size, kv_cache_group_id):
        return orig(self, request, num_cached_blocks - 1, block_size, kv_cache_group_id)

    monkeypatch.setattr(BlockPool, "emit_cached_block_events", short)
    run = _run(tmp_path)
    assert not run.ok
    assert "event" in run.failure.lower()
    assert run.trace_path is not None and run.trace_path.startswith(str(tmp_path))  # kept where asked
