"""Which group layouts vLLM's ``HiSparseCoordinator`` accepts, against the reference's (issue #22).

Generated layouts start from the one vLLM's HiSparse layout builder makes (host source, indexer,
``n`` resident then ``n`` hot groups of one block size, sometimes a plain full-attention group
after them) and then get one of :data:`FAULTS`: a second host group, the host group after a
resident group, a resident group of another block size, a host group of another block size, no
host group (resident groups left without one), no HiSparse group at all, no host capacity. vLLM
builds its ``KVCacheManager`` over the layout and asks ``get_hisparse_coordinator``; the reference
binds its coordinator to its managers in the same order
(:func:`kvref.impl.reference.hisparse_group_layout.hisparse_coordinator_for_layout`). Both must
accept the same layouts and, when they do, agree on the host group, the resident and hot groups,
the transition watermark and the write-back bound (``max_spill_pages``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from kvref.impl.reference.hisparse_group_layout import hisparse_coordinator_for_layout

#: what each generated layout changes in the builder's layout ("none": it is the builder's)
FAULTS = ("none", "two_sources", "source_late", "resident_size", "host_size", "no_source", "no_hisparse",
          "no_capacity")


@st.composite
def group_layouts(draw, fault: str) -> tuple[list[tuple[str, int]], int | None, int, int, int]:
    """``(layout, host_num_blocks, num_gpu_blocks, max_model_len, blocks_per_request)`` with ``fault``."""
    bs = draw(st.sampled_from((2, 4)))
    other = 6 - bs  # the other block size (2 <-> 4)
    n = draw(st.integers(2 if fault == "resident_size" else 1 if fault == "source_late" else 0, 2))
    layout = [("source", bs), ("indexer", bs)] + [("resident", bs)] * n + [("hot", bs)] * n
    if draw(st.booleans()):
        layout.append(("full", bs))
    if fault == "two_sources":
        layout.insert(draw(st.integers(1, len(layout))), ("source", bs))
    elif fault == "source_late":
        source = layout.pop(0)
        layout.insert(draw(st.integers(2, len(layout))), source)  # after the first resident group
    elif fault == "resident_size":
        layout[2 + draw(st.integers(0, n - 1))] = ("resident", other)
    elif fault == "host_size":
        layout[0] = ("source", other)
    elif fault == "no_source":
        layout.pop(0)
    elif fault == "no_hisparse":
        layout = [(kind, bs) for kind in draw(st.lists(st.sampled_from(("indexer", "full")), min_size=1, max_size=3))]
    host = None if fault == "no_capacity" else draw(st.integers(2, 12))
    max_model_len = draw(st.integers(1, 40))
    return layout, host, draw(st.integers(2, 64)), max_model_len, draw(st.integers(1, 3))


def _outcome(build: Callable[..., Any], args: tuple) -> tuple:
    """``("rejected",)`` or what the accepted coordinator decided."""
    try:
        c = build(*args)
    except Exception:  # vLLM rejects with ValueError, or an assert where no host group serves residents
        return ("rejected",)
    return ("accepted", c.host_group_id, len(c.resident_managers), len(c.hot_managers), c.transition_watermark,
            c.max_spill_pages)


def run_hisparse_layouts(build_vllm: Callable[..., Any], examples: int,
                         seed: int | None = None) -> tuple[str | None, Counter]:
    """``examples`` generated layouts of each fault (derandomized unless ``seed`` is given), built by
    ``build_vllm`` (vLLM's builder, the signature of ``hisparse_coordinator_for_layout``) and by the
    reference. Returns the first disagreement (None when all agree) and the outcomes seen per fault."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed

    from kvref.models.hypothesis_runs.reproducible import same_inputs_in_every_process

    seen: Counter = Counter()

    def layouts_of(fault: str) -> Callable[[], None]:
        @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is None,
                  suppress_health_check=list(HealthCheck), print_blob=False)
        @given(group_layouts(fault))
        def run(args):
            ref, got = _outcome(hisparse_coordinator_for_layout, args), _outcome(build_vllm, args)
            if ref != got:
                raise AssertionError(f"HiSparse layout {args[0]} (host capacity {args[1]}, {args[2]} GPU blocks, "
                                     f"max_model_len {args[3]}, fault {fault}): reference {ref} != vLLM {got}")
            seen[f"{fault}:{ref[0]}"] += 1

        return run if seed is None else hypothesis_seed(seed)(run)

    try:
        for fault in FAULTS:
            with same_inputs_in_every_process():
                layouts_of(fault)()
    except AssertionError as exc:
        return str(exc).splitlines()[0], seen
    return None, seen
