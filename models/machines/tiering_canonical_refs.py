"""Generated worker layer references through vLLM's ``TieringOffloadingSpec.create_worker``, against
:func:`kvref.spec.tiering_canonical_refs.canonical_refs_verdict` (issue #22).

Each case draws ``canonical_layout``, ``is_parallelism_agnostic``, a tensor-parallel world (size,
rank, ``replicated_layout``) and one to three KV-cache groups of one to three layer references, each
with no canonical mapping or one whose ``parallelism_agnostic`` is drawn. vLLM must refuse exactly
the references the rule refuses (a ``RuntimeError`` naming the rule), build its worker for the
others, record the same ``all_layers_portable``, keep ``replicated_layout`` as configured (tiering
always allocates on the shared region), hand its worker the layout flag, chunking and the
shared-region slot of rank 0 when the layout is replicated (else of its own rank), let a worker that
fails to build fail the call, and leave no shared-region file behind either way.
"""

from __future__ import annotations

import random

from kvref.spec.tiering_canonical_refs import NOT_PORTABLE, UNCERTIFIED, canonical_refs_verdict

#: what vLLM's RuntimeError says, by the rule the reference reports
_WORDS = {UNCERTIFIED: "could not be certified", NOT_PORTABLE: "parallelism-agnostic"}


class CanonicalRefsDivergence(AssertionError):
    """vLLM's create_worker accepted, refused or recorded layer references unlike the reference."""


def random_case(rng: random.Random) -> dict:
    world = rng.choice((1, 1, 2))
    p_none = rng.choice((0.0, 0.0, 0.15, 0.5))
    p_portable = rng.choice((1.0, 0.9, 0.5))
    portable = [[None if rng.random() < p_none else rng.random() < p_portable
                 for _ in range(rng.randint(1, 3))] for _ in range(rng.randint(1, 3))]
    return {"canonical_layout": rng.random() < 0.85, "is_parallelism_agnostic": rng.random() < 0.5,
            "portable": portable, "world_size": world, "rank": rng.randrange(world),
            "replicated_layout": rng.random() < 0.3, "worker_fails": rng.random() < 0.15}


def run_case(case: dict, counts: dict) -> None:
    from kvref.impl.vllm.tiering_canonical import create_tiering_worker

    refusal, portable = canonical_refs_verdict(case["canonical_layout"], case["is_parallelism_agnostic"],
                                               case["portable"])
    got = create_tiering_worker(**case)
    want_outcome = "refused" if refusal is not None else "worker_failed" if case["worker_fails"] else "worker"
    problems = []
    if got.outcome != want_outcome:
        problems.append(f"reference {refusal or 'builds the worker'}, vLLM {got.outcome} ({got.error})")
    elif refusal is not None and not (got.error.startswith("RuntimeError") and _WORDS[refusal] in got.error):
        problems.append(f"reference refuses ({refusal}), vLLM raised {got.error}")
    if got.all_layers_portable != portable:
        problems.append(f"all_layers_portable: reference {portable}, vLLM {got.all_layers_portable}")
    if got.replicated_layout != case["replicated_layout"]:
        problems.append(f"replicated_layout: configured {case['replicated_layout']}, vLLM {got.replicated_layout}")
    # what the worker is handed: the layout, one block per chunk, the spec's 2 chunks, and the slot
    # of rank 0 when the layout is replicated (every rank holds the same bytes), else its own rank
    want_worker = None if refusal is not None else (
        case["canonical_layout"], 1, 2, 0 if case["replicated_layout"] else case["rank"])
    if got.worker != want_worker:
        problems.append(f"worker handed (canonical_layout, blocks_per_chunk, chunks, region rank): reference "
                        f"{want_worker}, vLLM {got.worker}")
    if got.leftover:
        problems.append(f"create_worker left shared-region files {list(got.leftover)}")
    if problems:
        raise CanonicalRefsDivergence(f"create_worker on {case}: " + "; ".join(problems))
    counts["worker_cases"] = counts.get("worker_cases", 0) + 1
    if refusal is not None:
        counts["worker_refused"] = counts.get("worker_refused", 0) + 1


def run_worker_cases(seed: int, n: int) -> dict:
    """``n`` generated cases (seeded by ``seed``); returns counts of cases and refusals."""
    rng = random.Random(f"conform-tiering-worker-{seed}")
    counts: dict = {"worker_cases": 0, "worker_refused": 0}
    for _ in range(n):
        run_case(random_case(rng), counts)
    return counts


__all__ = ["CanonicalRefsDivergence", "random_case", "run_case", "run_worker_cases"]
