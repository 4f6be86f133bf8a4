"""conform-offload with requests that ask for prompt logprobs: vLLM's OffloadingConnector answers
such a request (``skip_reading_prefix_cache``) 0 hit tokens without a lookup, the reference too
(issue #22). The cases are the ones ``kvref verify`` draws at the ``fast`` profile (seed 0); the
fault planted in vLLM's own source (the flag ignored: the request loads offloaded chunks) must be
flagged while the clean vLLM passes."""

from __future__ import annotations

import random

import pytest

from tests.conformance.offloading_faults import conform_offloading, offloading_scheduler_class, planted_edit
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def logprob_cases():
    require_vllm()
    from kvref.models.offload.offloading_connector_world import OffloadingConfig
    from kvref.verify import _offload_cases

    return [c for c in _offload_cases(random.Random(0), 80)
            if isinstance(c[0], OffloadingConfig) and c[0].prompt_logprobs_every]


def test_prompt_logprob_cases_agree_on_clean_vllm(logprob_cases):
    assert len(logprob_cases) >= 5, len(logprob_cases)
    assert conform_offloading(logprob_cases) is None


def test_a_connector_that_reads_the_cache_for_prompt_logprobs_is_flagged(logprob_cases):
    with planted_edit(offloading_scheduler_class(), "get_num_new_matched_tokens",
                      "if request.skip_reading_prefix_cache:", "if False:"):
        finding = conform_offloading(logprob_cases)
    assert finding is not None, "a lookup for a prompt-logprobs request survived the fast cases"
    assert "differ" in finding, finding  # a lookup answer of the step differs


def test_the_reference_answers_such_a_request_without_a_lookup(logprob_cases):
    """On the reference alone: prompt-logprobs requests are drawn, ask the connector and get 0."""
    from kvref.impl.reference.offload.offloading_scheduler import OffloadingConnectorScheduler as Ref
    from kvref.models.offload.offloading_connector_world import OffloadingWorld
    from kvref.models.offload.traces import apply_offloading_op

    answers = []
    real = Ref.get_num_new_matched_tokens

    def spy(self, req, num_computed_tokens):
        out = real(self, req, num_computed_tokens)
        if req.skip_reading_prefix_cache:
            answers.append(out)
        return out

    Ref.get_num_new_matched_tokens = spy
    try:
        for cfg, ops in logprob_cases[:3]:
            w = OffloadingWorld(cfg, "reference", strict=False)
            for op in ops:
                apply_offloading_op(w, op)
    finally:
        Ref.get_num_new_matched_tokens = real
    assert answers and all(a == (0, False) for a in answers), answers
