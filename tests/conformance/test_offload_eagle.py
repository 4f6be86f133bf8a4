"""conform-offload on pools with an EAGLE/MTP drafter group (issue #22): vLLM's OffloadingConnector
pops the drafter group's volatile trailing chunk from a hit (querying one chunk further, #52735),
holds its last offloadable chunk back while the request decodes and stores it once finished
(#52735), and masks a sliding-window drafter group's stores with the EAGLE run. The cases are the
first 12 of the ``ci`` draw (seed 0; ``fast`` runs the first 6); each fault planted in vLLM's own
source must be flagged while the clean vLLM agrees (the widened query under a load cap, which the
draw meets rarely, on a directed trace)."""

from __future__ import annotations

import pytest

from tests.conformance.offloading_faults import offloading_scheduler_class, planted_edit
from tests.vllm_env import require_vllm


@pytest.fixture(scope="module")
def cases():
    from kvref.models.offload.offloading_eagle import eagle_cases

    return eagle_cases(0, 12)


def _finding(cases):
    from kvref.models.offload.offloading_eagle import run_eagle_traces
    from kvref.models.offload.world_common import OffloadInvariantError

    try:
        run_eagle_traces(cases)
    except OffloadInvariantError as exc:
        return str(exc)
    return None


@pytest.mark.vllm
def test_eagle_traces_agree_on_clean_vllm(cases):
    require_vllm()
    from kvref.models.offload.offloading_eagle import COVERAGE

    COVERAGE.clear()
    assert _finding(cases) is None
    # the drafter group's chunks are both loaded and stored, on FA and sliding-window drafters
    assert COVERAGE["eagle_loads"] > 0 and COVERAGE["eagle_stores"] > 0, COVERAGE
    assert {c.eagle_group for c, _ in cases} == {0, 1, None}  # None: speculative decoding, none flagged


def _request_state_class():
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import RequestOffloadState

    return RequestOffloadState


@pytest.mark.vllm
@pytest.mark.parametrize("owner, name, old, new", [
    # the volatile chunk stored while decoding
    ("state", "storable_chunks", "num_chunks = max(0, num_chunks - 1)", "pass"),
    # the hit keeps the volatile chunk
    ("sched", "_lookup_complete_chunks", "num_hit_chunks -= 1", "pass"),
    # a sliding-window drafter group stored with the plain (non-EAGLE) mask
    ("sched", "_reachable_store_block_mask", "use_eagle=group_config.is_eagle_group", "use_eagle=False"),
], ids=["stored-while-decoding", "no-pop", "plain-mask"])
def test_planted_eagle_faults_are_flagged(cases, owner, name, old, new):
    require_vllm()
    cls = _request_state_class() if owner == "state" else offloading_scheduler_class()
    with planted_edit(cls, name, old, new):
        finding = _finding(cases)
    assert finding is not None and "differ" in finding, finding


def _capped_reload(backend: str):
    """A 21-token prompt stored whole, the GPU prefix cache reset, the prompt again with a load cap
    of 8 tokens (two chunks): the step's lookup and load jobs."""
    from kvref.models.offload.offloading_connector_world import OffloadingConfig, OffloadingWorld

    cfg = OffloadingConfig(block_size=4, num_gpu_blocks=40, num_cpu_chunks=32, eagle_group=0,
                           kv_transfer_params=({"max_load_tokens": 8},))
    w = OffloadingWorld(cfg, backend, strict=False)
    prompt = list(range(100, 121))
    w.add_request(prompt)
    for _ in range(4):
        w.step(32)
    while w.jobs:
        w.complete(0, 2)
    w.step(32)
    assert w.reset_gpu_prefix_cache()
    w.add_request(prompt)  # the second arrival carries the params
    loads, _, _, lookups = w.step(32)
    return lookups, [(j, r, len(k)) for j, r, k, _, _ in loads]


@pytest.mark.vllm
def test_a_capped_drafter_lookup_keeps_the_widened_query():
    """vLLM #52735: the drafter group is queried a chunk past the cap, so the pop leaves the capped
    hit whole (8 tokens, two chunks); the fault planted in vLLM (no widening) loads one chunk."""
    require_vllm()
    ref = _capped_reload("reference")
    assert ref == _capped_reload("vllm") and ref[0] == (("r1", 0, 8),), ref
    with planted_edit(offloading_scheduler_class(), "_lookup_complete_chunks",
                      "max_hit_size_tokens + tokens_per_chunk,", "max_hit_size_tokens,"):
        assert _capped_reload("vllm")[0] == (("r1", 0, 4),)


def test_the_lookup_pops_a_drafter_groups_last_chunk():
    """One FA drafter group, 4-token chunks, every key a hit: a 12-token prefix capped at 8 loadable
    tokens queries 3 chunks and pops the third, so 8 load; a plain group gets 8 as well but looks
    up only 2 keys, and with only 2 keys stored the drafter group gets 4."""
    from kvref.impl.reference.offload.keys import LookupResult
    from kvref.impl.reference.offload.lookup import LookupGroup, lookup_complete_chunks

    keys = [b"a", b"b", b"c"]

    def run(eagle, stored):
        seen = []

        def lookup(k):
            seen.append(k)
            return LookupResult.HIT if k in stored else LookupResult.MISS
        hit = lookup_complete_chunks([LookupGroup(4, eagle=eagle)], [keys], 13, 0, lookup, max_load_tokens=8)
        return hit, seen

    assert run(True, set(keys)) == (8, keys)
    assert run(False, set(keys)) == (8, keys[:2])
    assert run(True, {b"a", b"b"}) == (4, keys)


def test_eagle_groups_are_refused_where_not_modelled():
    from kvref.impl.reference.offload.cpu_offloading_manager import CPUOffloadingManager
    from kvref.impl.reference.offload.offloading_scheduler import OffloadingConnectorScheduler
    from kvref.spec.errors import InvalidFieldError
    from kvref.spec.kv_cache_interface import FullAttentionSpec, MambaSpec

    fa = FullAttentionSpec(block_size=8, num_kv_heads=1, head_size=1, dtype="float32")
    mamba = MambaSpec(block_size=8, shapes=((2, 8),), dtypes=("float16",), mamba_cache_mode="align")
    with pytest.raises(InvalidFieldError, match="eagle_groups"):
        OffloadingConnectorScheduler([fa], CPUOffloadingManager(4, "lru"), 8, eagle_groups=[1])
    with pytest.raises(InvalidFieldError, match="Mamba"):
        OffloadingConnectorScheduler([fa, mamba], CPUOffloadingManager(4, "lru"), 8, eagle_groups=[1])
    # finer hashes (partial tails): the drafter group's tails are keyed one hash past the boundary
    tails = OffloadingConnectorScheduler([fa, mamba], CPUOffloadingManager(4, "lru"), 4, eagle_groups=[0])
    assert tails.supports_partial_tail and tails.eagle_proof_margins == {0: 4}
    assert OffloadingConnectorScheduler([fa], CPUOffloadingManager(4, "lru"), 8, eagle_groups=[0]).groups[0].is_eagle_group


@pytest.fixture(scope="module")
def tail_cases():
    from kvref.models.offload.offloading_eagle import eagle_partial_tail_cases

    return eagle_partial_tail_cases(0, 8)


def _tail_finding(cases):
    from kvref.models.offload.offloading_eagle import run_eagle_partial_tail_traces
    from kvref.models.offload.world_common import OffloadInvariantError

    try:
        run_eagle_partial_tail_traces(cases)
    except OffloadInvariantError as exc:
        return str(exc)
    return None


@pytest.mark.vllm
def test_eagle_partial_tail_traces_agree_and_reach_the_margin():
    """Partial tails with a drafter group (#22): conform-offload's pinned child (seed 0, no plain
    partial-tail case, 8 EAGLE ones) agrees with vLLM, and the traces store tails at the proof
    margin, skip those of requests that did not load from the CPU tier, hit tails and load the
    bridge chunk with them (~15 s at CI=true: one spawned interpreter)."""
    require_vllm()
    from kvref.verify_offload_tails import run_pinned_partial_tails

    stats, counts, _ = run_pinned_partial_tails(0, 0, 8)
    assert stats["traces"] == 0 and stats["eagle_traces"] == 8 and stats["eagle_ops"] > 300, stats
    for what in ("eagle_tail_stores", "eagle_unloaded_skips", "eagle_tail_hits", "eagle_bridge_hits"):
        assert counts.get(what, 0) > 0, (what, counts)


@pytest.mark.vllm
@pytest.mark.parametrize("name, old, new", [
    # the drafter's tail keyed at the boundary (its proof margin ignored)
    ("_partial_tail_key_tokens", "boundary + self._eagle_proof_margins.get(group_config.group_idx, 0)", "boundary"),
    # one block searched: the tail past the drafter's popped chunk (with the bridge) is never found
    ("_lookup", "num_search_blocks = 2 if self._max_eagle_proof_margin else 1", "num_search_blocks = 1"),
    # tails stored by requests that did not load from the CPU tier
    ("_build_partial_tail_store_jobs", "if self._max_eagle_proof_margin and not req_status.loaded_from_offload:",
     "if False:"),
], ids=["no-margin-key", "one-block-search", "store-unloaded"])
def test_planted_eagle_partial_tail_faults_are_flagged(tail_cases, name, old, new):
    """Each fault planted in vLLM's own source is flagged on the 8 cases (~12 s each at CI=true)."""
    require_vllm()
    with planted_edit(offloading_scheduler_class(), name, old, new):
        finding = _tail_finding(tail_cases)
    assert finding is not None and "EAGLE partial-tail" in finding and "differ" in finding, finding


@pytest.mark.vllm
def test_a_reference_ignoring_the_proof_margin_is_caught(tail_cases, monkeypatch):
    """The fault planted in the reference instead (its drafter tails keyed at the boundary) makes the
    same comparison fail against the clean vLLM (~12 s at CI=true)."""
    require_vllm()
    from kvref.impl.reference.offload.partial_tails import PartialTails

    monkeypatch.setattr(PartialTails, "_partial_tail_key_tokens", lambda self, c, boundary: boundary)
    finding = _tail_finding(tail_cases)
    assert finding is not None and "EAGLE partial-tail" in finding and "differ" in finding, finding
