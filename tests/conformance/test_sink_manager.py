"""vLLM 0.33.0's ``SinkFullAttentionManager``, built directly (its coordinator cannot build it), vs
the reference's on generated specs and growth (#22; models/conformance/sink_manager.py, also run
by ``kvref verify --against vllm`` in conform-kv-manager)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings

from kvref.models.conformance.sink_manager import SinkCase, agree_sink, reference_sink_run, sink_cases
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import FullAttentionSpec, SinkFullAttentionSpec
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def test_generated_sink_managers_match_vllm():
    """Derandomized: both verdicts and growth past the first chunk are reached under every profile."""
    require_vllm()
    from kvref.impl.vllm.sink_manager import vllm_sink_manager_run

    seen: Counter = Counter()

    @given(sink_cases())
    @settings(max_examples=profile_examples(60, 150), derandomize=True, database=None, deadline=None)
    def run(case):
        verdict, _bs, grown = reference_sink_run(case)
        seen[verdict] += 1
        seen["grown"] += len(grown) > 1
        agree_sink(case, vllm_sink_manager_run)

    run()
    assert seen["accepted"] and seen["rejected"] and seen["grown"], seen


def test_a_sink_that_does_not_fill_whole_blocks_is_refused():
    spec = SinkFullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16", sink_len=6)
    assert reference_sink_run(SinkCase(spec, 8, 1, (5,))) == ("rejected", None, [])
    # with DCP 2 a block spans 8 tokens: a sink of 4 no longer fills one
    spec = SinkFullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16", sink_len=4)
    assert reference_sink_run(SinkCase(spec, 8, 2, ()))[0] == "rejected"
    assert reference_sink_run(SinkCase(spec, 8, 1, (5, 4)))[1:] == (4, [[1, 2], [3]])


def test_the_adapter_refuses_another_spec():
    require_vllm()
    from kvref.impl.vllm.sink_manager import vllm_sink_manager_run

    with pytest.raises(InvalidFieldError, match="spec"):
        vllm_sink_manager_run(FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float16"), 8, 1, [])
