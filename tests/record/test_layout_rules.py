"""check-run's rules for R-SWA and circular-buffer groups, from a header alone (issue #28, session 20;
no vLLM needed): the spec rebuilt from its record, the R-SWA gap (``RSWAManager.remove_skipped_blocks``
with the prompt length) and the ring's single, never-hashed block."""

from __future__ import annotations

from kvref.models.run_check.generate import header_for
from kvref.models.run_check.setup import setup_from_header
from kvref.models.run_check.windows import group_rules
from kvref.spec import kv_cache_interface as ks

from tests.record.traces import full_setup


def _header(*specs: dict) -> dict:
    h = header_for(*full_setup())
    h["pool"]["groups"] = [{"layers": [f"l{i}"], "spec": s} for i, s in enumerate(specs)]
    return h


RSWA = {"type": "RSWASpec", "block_size": 4, "rswa_window": 5, "sliding_window": None, "attention_chunk_size": None}
RING = {"type": "CircularBufferSpec", "block_size": 2}
FULL = {"type": "FullAttentionSpec", "block_size": 4}


def test_the_specs_are_rebuilt_and_followable():
    s = setup_from_header(_header(FULL, RING))
    assert s.followable, s.unmodelled
    assert isinstance(s.pool.groups[1].kv_cache_spec, ks.CircularBufferSpec)
    s = setup_from_header(_header(RSWA))
    assert s.followable, s.unmodelled
    spec = s.pool.groups[0].kv_cache_spec
    assert isinstance(spec, ks.RSWASpec) and spec.rswa_window == 5


def test_the_rswa_gap_is_what_vllm_frees():
    (rule,) = group_rules(_header(RSWA))
    assert (rule.kind, rule.frees_exactly, rule.holds_tokens, rule.cacheable) == ("rswa", True, True, True)
    # prompt of 6 tokens (blocks 0-1 hold it), window 5: the gap opens at block 2
    assert rule.skipped_range(processed=10, prompt_len=6) == range(2, 1)  # window start 6: nothing yet
    assert list(rule.skipped_range(processed=17, prompt_len=6)) == [2]  # window starts at 12: block 2 wholly before
    assert list(rule.skipped_range(processed=25, prompt_len=6)) == [2, 3, 4]
    assert rule.needs(1, 25, 7, 6) and not rule.needs(3, 25, 7, 6) and rule.needs(5, 25, 7, 6)
    assert rule.skipped_range(processed=25, prompt_len=0) == range(0)  # prompt unknown: nothing assumed


def test_the_ring_holds_one_block_never_hashed():
    full, ring = group_rules(_header(FULL, RING))
    assert full.kind == "full"
    assert (ring.kind, ring.bound, ring.cacheable, ring.holds_tokens, ring.frees_exactly) == ("ring", 1, False, False, True)
    assert not ring.caches(0) and ring.skipped_range(100, 10) == range(0)
