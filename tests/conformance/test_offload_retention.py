"""conform-offload under vLLM's ``prefix_cache_retention_interval`` (issue #22): the OffloadingConnector
stores only the sliding-window tails sparse retention keeps (the replay boundary, the shared-prefix
junction, one per interval segment), and ``SchedulerOffloadConfig.from_spec`` refuses intervals
that are negative or not a multiple of a windowed group's chunk. The cases are the ones
``kvref verify`` draws at the ``fast`` profile (seed 0); each fault planted in vLLM's own source must
be flagged while the clean vLLM passes."""

from __future__ import annotations

import random

import pytest

from tests.conformance.offloading_faults import offloading_scheduler_class, planted_edit
from tests.vllm_env import require_vllm


@pytest.fixture(scope="module")
def cases():
    require_vllm()
    from kvref.models.offload.offloading_retention import retention_cases

    return retention_cases(0, 4)  # kvref verify's fast draw


@pytest.fixture(scope="module")
def refusal_cases():
    from kvref.models.offload.offloading_retention import retention_refusal_cases

    return retention_refusal_cases(random.Random("offload-retention-refusals-0"), 12)  # the fast draw


def _finding(run, *args):
    from kvref.models.offload.world_common import OffloadInvariantError

    try:
        run(*args)
    except OffloadInvariantError as exc:
        return str(exc)
    return None


@pytest.mark.vllm
def test_retention_traces_agree_on_clean_vllm(cases):
    from kvref.models.offload.offloading_retention import COVERAGE, run_retention_traces

    COVERAGE.clear()
    stats = run_retention_traces(cases)
    assert stats["traces"] == 4 and stats["ops"] > 100, stats
    # the traces reach what the part is for: junctions reported, sliding-window chunks stored
    assert COVERAGE["junctions"] > 0 and COVERAGE["swa_stores"] > 0, COVERAGE


@pytest.mark.vllm
def test_a_store_mask_without_the_shared_prefix_junction_is_flagged(cases):
    from kvref.models.offload.offloading_retention import run_retention_traces

    with planted_edit(offloading_scheduler_class(), "_build_store_jobs",
                      "reachable_boundaries += (req.shared_prefix_boundary,)", "pass"):
        finding = _finding(run_retention_traces, cases)
    assert finding is not None and "differ" in finding, finding


@pytest.mark.vllm
def test_a_final_segment_stored_under_retention_is_flagged(cases):
    """vLLM keeps no store horizon under an interval; a connector that keeps the dense one stores a
    finished request's last partial segment (or a prompt's) that sparse retention drops."""
    from kvref.models.offload.offloading_retention import run_retention_traces

    with planted_edit(offloading_scheduler_class(), "_build_store_jobs",
                      "self.config.retention_interval is not None\n", "False\n"):
        finding = _finding(run_retention_traces, cases)
    assert finding is not None and "differ" in finding, finding


@pytest.mark.vllm
def test_refusals_agree_on_clean_vllm(refusal_cases):
    from kvref.models.offload.offloading_retention import compare_refusals

    out = compare_refusals(refusal_cases)
    assert out["configs"] == 12 and 0 < out["refused"] < 12, out


@pytest.mark.vllm
def test_a_from_spec_that_accepts_any_interval_is_flagged(refusal_cases):
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import SchedulerOffloadConfig

    from kvref.models.offload.offloading_retention import compare_refusals

    with planted_edit(SchedulerOffloadConfig, "from_spec", "if retention_interval is not None:", "if False:"):
        finding = _finding(compare_refusals, refusal_cases)
    assert finding is not None and "vLLM accepts" in finding, finding


def test_the_reference_refuses_what_from_spec_refuses():
    from kvref.models.offload.offloading_connector_world import OffloadingConfig
    from kvref.models.offload.offloading_retention import reference_refusal, refusal_kind

    swa = dict(block_size=4, blocks_per_chunk=2, sliding_window=8)
    assert refusal_kind(reference_refusal(OffloadingConfig(**swa, prefix_cache_retention_interval=-8))) == ("negative",)
    assert refusal_kind(reference_refusal(OffloadingConfig(**swa, prefix_cache_retention_interval=4))) == ("chunk", 8)
    assert reference_refusal(OffloadingConfig(**swa, prefix_cache_retention_interval=16)) is None
    assert reference_refusal(OffloadingConfig(**swa, prefix_cache_retention_interval=0)) is None
    # full attention caches densely: any non-negative interval is the GPU cache's business
    assert reference_refusal(OffloadingConfig(block_size=4, blocks_per_chunk=2, prefix_cache_retention_interval=4)) is None
    assert "retention_interval" in reference_refusal(OffloadingConfig(**swa, prefix_cache_retention_interval=4))


def test_sparse_store_mask_keeps_only_the_boundary_tails():
    """Window 8 on 4-token blocks needs 2 blocks before a hit's end; alignment 4. Under interval 0
    only the tails at the reachable boundaries stay (39 -> blocks 7, 8; 17 -> blocks 2, 3); under
    16 one tail per 4-block segment joins them; dense keeps every block (None)."""
    from kvref.impl.reference.offload.offloading_scheduler import swa_store_mask
    from kvref.spec.kv_cache_interface import SlidingWindowSpec

    spec = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float32", sliding_window=8)
    kept = lambda m: [i for i, x in enumerate(m) if x]  # noqa: E731
    assert swa_store_mask(spec, 0, 12, 4, None) is None
    assert kept(swa_store_mask(spec, 0, 12, 4, None, 0, (39, 17))) == [2, 3, 7, 8]
    assert kept(swa_store_mask(spec, 0, 12, 4, None, 16, (39,))) == [2, 3, 6, 7, 8, 10, 11]
    # MTP's extra retained tokens widen the stored tail (window 8 + 3: 3 blocks)
    wide = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float32", sliding_window=8,
                             extra_retained_tokens=3)
    assert kept(swa_store_mask(wide, 0, 12, 4, None, 0, (17,))) == [1, 2, 3]
