"""Generated worker layer references through vLLM 0.33.0's ``TieringOffloadingSpec.create_worker``
(#22): the canonical-layout refusals, ``all_layers_portable``, the worker's shared-region rank and
the clean-up after a refusal or a failed worker agree with :func:`kvref.spec.tiering_canonical_refs.canonical_refs_verdict`;
faults planted in the rule are found."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conformance.tiering_planted import edited
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

_REF = st.one_of(st.none(), st.booleans())


@settings(max_examples=profile_examples(20, 60), deadline=None)
@given(canonical=st.booleans(), agnostic=st.booleans(),
       portable=st.lists(st.lists(_REF, min_size=1, max_size=3), min_size=1, max_size=3),
       world=st.sampled_from([(1, 0), (2, 0), (2, 1)]), replicated=st.booleans(), fails=st.booleans())
def test_generated_refs_agree(canonical, agnostic, portable, world, replicated, fails):
    require_vllm()
    from kvref.models.machines.tiering_canonical_refs import run_case

    counts: dict = {}
    run_case({"canonical_layout": canonical, "is_parallelism_agnostic": agnostic, "portable": portable,
              "world_size": world[0], "rank": world[1], "replicated_layout": replicated,
              "worker_fails": fails}, counts)
    assert counts["worker_cases"] == 1


def test_the_checks_cases_reach_every_outcome():
    """Seeded (no Hypothesis draw): the check's fast run (60 cases, seed 0) refuses for both rules,
    and builds workers with portable, non-portable and unvalidated references."""
    require_vllm()
    import random

    from kvref.models.machines.tiering_canonical_refs import random_case
    from kvref.spec.tiering_canonical_refs import canonical_refs_verdict

    rng = random.Random("conform-tiering-worker-0")
    seen = {canonical_refs_verdict(c["canonical_layout"], c["is_parallelism_agnostic"], c["portable"])
            for c in (random_case(rng) for _ in range(60))}
    assert {("uncertified", None), ("not_portable", False), (None, True), (None, False), (None, None)} <= seen


PLANTED = [
    # a layer without a canonical mapping is stored anyway
    ("TieringOffloadingSpec", "_validate_canonical_refs", "if any(ref.mapping is None", "if all(ref.mapping is None"),
    # portability ignores the mapping's own claim
    ("TieringOffloadingSpec", "_validate_canonical_refs",
     "ref.mapping is not None and ref.mapping.parallelism_agnostic", "ref.mapping is not None"),
    # opaque bytes land in a namespace shared across topologies
    ("TieringOffloadingSpec", "_validate_canonical_refs",
     "if self.config.parallel.is_parallelism_agnostic and not", "if False and not"),
    # a refused (or failed) worker keeps its shared-region mapping
    ("TieringOffloadingSpec", "create_worker", "worker_mmap.cleanup()\n", "pass\n"),
    # the worker is not told the layout is canonical
    ("TieringOffloadingSpec", "create_worker", "canonical_layout=self.config.canonical_layout,\n",
     "canonical_layout=False,\n"),
    # a replicated layout's worker writes its own rank's slot
    ("TieringOffloadingSpec", "create_worker", "rank = 0 if self.replicated_layout else", "rank ="),
    # canonical_layout is not validated at all
    ("TieringOffloadingSpec", "create_worker", "if self.config.canonical_layout:", "if False:"),
]


@pytest.mark.parametrize("cls_name,method,old,new", PLANTED, ids=[f"{m}-{i}" for i, (_, m, _, _) in enumerate(PLANTED)])
def test_planted_faults_are_found(cls_name, method, old, new):
    require_vllm()
    from kvref.models.machines.tiering_canonical_refs import CanonicalRefsDivergence, run_worker_cases

    with edited("vllm.v1.kv_offload.tiering.spec", cls_name, method, old, new), \
            pytest.raises(CanonicalRefsDivergence):
        run_worker_cases(0, 60)
