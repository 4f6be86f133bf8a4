"""conform-offload flags the OffloadingConnector faults issue #13 found escaping, planted in-process.

Each catalogue fault (``kvref mutants --target vllm --list``) is applied to the one vLLM function
that holds it, for this test only (:mod:`tests.conformance.offloading_faults`), and the
OffloadingConnector half of conform-offload at the ``fast`` profile (seed 0: the cases ``kvref
verify`` draws) must report a finding, while the same cases pass on the unmodified vLLM. The
classes: a lookup across a CPU chunk evicted inside a cached run (prefix scan, window scan), the
offload window widened by MTP's extra retained tokens (PR 41228), chunked-local groups (PR 51161).
"""

from __future__ import annotations

import random

import pytest

from tests.conformance.offloading_faults import (
    conform_offloading,
    vllm_offloading_fault,
)
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

FAULTS = ("offl.prefix_lookup_skips_miss", "offl.window_lookup_miss_keeps_streak",
          "offl.pr41228_window_ignores_extra_retained", "offl.pre51161_chunked_local_asserts")


@pytest.fixture(scope="module")
def fast_cases():
    require_vllm()
    from kvref.models.offload.offloading_connector_world import OffloadingConfig

    from kvref.verify import _offload_cases

    return [c for c in _offload_cases(random.Random(0), 80) if isinstance(c[0], OffloadingConfig)]


def test_fast_cases_agree_on_clean_vllm(fast_cases):
    assert conform_offloading(fast_cases) is None


@pytest.mark.parametrize("fault_id", FAULTS)
def test_planted_fault_is_flagged(fast_cases, fault_id):
    with vllm_offloading_fault(fault_id):
        finding = conform_offloading(fast_cases)
    assert finding is not None, f"{fault_id} survived the fast OffloadingConnector cases"
