"""Publication masks: vLLM 0.33.0's ``<Manager>.reachable_block_mask`` vs the reference's (#22/#23).

A manager publishes only the full blocks some later hit could use (``reachable_block_mask``), and
vLLM's offloading connector reuses the same classmethod to choose which blocks it stores. An
engine run always passes the scheduler block size as the alignment, so generated traces never
reach the mask's other inputs: no alignment, a sub-block alignment (hybrid offloading, which
aligns to the full-attention chunk), decode context parallelism (a block holds
``dcp_world_size`` ranks' tokens) and the connector's ``final_segment_end_block`` (the tail of a
finished request's last, partial segment). Here each input is drawn over its whole range,
including those, and the two masks must be equal element for element (None = every block).
Run inside ``conform-kv-manager``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from kvref.impl.reference.full_attention_manager import FullAttentionManager
from kvref.impl.reference.mamba_manager import MambaManager
from kvref.impl.reference.sliding_window_manager import SlidingWindowManager
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec

#: kvref manager kind -> the reference manager class (vLLM's is named alike)
REFERENCE_CLASSES = {"full": FullAttentionManager, "sliding_window": SlidingWindowManager, "mamba": MambaManager}


@dataclass(frozen=True)
class MaskCase:
    kind: str
    spec: KVCacheSpec
    start_block: int
    end_block: int
    alignment_tokens: int | None
    use_eagle: bool
    retention_interval: int | None
    reachable_boundaries: tuple[int, ...]
    dcp_world_size: int
    final_segment_end_block: int | None

    def arguments(self) -> tuple:
        return (self.start_block, self.end_block, self.alignment_tokens, self.spec, self.use_eagle,
                self.retention_interval, self.reachable_boundaries)


def _spec(kind: str, block_size: int, window: int) -> KVCacheSpec:
    if kind == "mamba":
        return MambaSpec(block_size=block_size, shapes=((2,),), dtypes=("float16",), mamba_cache_mode="align")
    if kind == "sliding_window":
        return SlidingWindowSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float16",
                                 sliding_window=window)
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float16")


@st.composite
def mask_cases(draw) -> MaskCase:
    kind = draw(st.sampled_from(("sliding_window", "sliding_window", "sliding_window", "mamba", "full")))
    block_size = draw(st.sampled_from((1, 2, 4)))
    dcp = draw(st.sampled_from((1, 1, 2)))
    wide = block_size * dcp  # the block a DCP-scaled sliding-window group counts in
    # short windows too: a run shorter than a segment is what makes a mask sparse
    spec = _spec(kind, block_size, draw(st.one_of(st.integers(1, 2 * wide), st.integers(1, 6 * wide))))
    # whole multiples of the (wide) block, sub-block alignments, and none (a connector's "no constraint")
    alignment = draw(st.one_of(st.integers(1, 8).map(lambda k: k * wide), st.sampled_from((1, 2, 3)), st.none()))
    unit = alignment or wide
    retention = draw(st.one_of(st.none(), st.just(0), st.integers(1, 6).map(lambda k: k * unit)))
    start = draw(st.integers(0, 20))
    end = draw(st.integers(start, 30))
    # the connector's final segment ends at or a little past the range it stores
    final = draw(st.one_of(st.none(), st.integers(0, 34), st.integers(start, end + 4)))
    return MaskCase(kind, spec, start, end, alignment, draw(st.booleans()), retention,
                    tuple(draw(st.lists(st.integers(0, 130), max_size=4))), dcp, final)


@st.composite
def sparse_window_cases(draw) -> MaskCase:
    """A sliding-window group whose hit run (``need`` blocks) is shorter than a segment, so the mask
    is sparse and each tail (segment ends, replay boundaries, the final partial segment) shows."""
    block_size = draw(st.sampled_from((1, 2, 4)))
    dcp = draw(st.sampled_from((1, 2)))
    wide = block_size * dcp
    per_segment = draw(st.integers(2, 8))
    need = draw(st.integers(1, per_segment - 1))
    window = (need - 1) * wide + draw(st.integers(2, wide + 1))  # cdiv(window - 1, wide) == need
    spec = _spec("sliding_window", block_size, window)
    alignment = per_segment * wide
    retention = draw(st.sampled_from((None, None, alignment, 0)))
    # a final segment that ends part-way into a segment, mostly no shorter than the run
    final = draw(st.integers(0, 3)) * per_segment + draw(st.one_of(st.integers(need, per_segment - 1),
                                                                   st.integers(0, per_segment - 1)))
    start = draw(st.integers(0, final))
    end = draw(st.integers(max(start, final - 2), final + 3))
    final = draw(st.sampled_from((final, final, final, None)))
    return MaskCase("sliding_window", spec, start, end, alignment, draw(st.sampled_from((False, False, True))),
                    retention,
                    tuple(draw(st.lists(st.integers(0, 130), max_size=2))), dcp, final)


def any_mask_cases() -> st.SearchStrategy[MaskCase]:
    """Every input class (:func:`mask_cases`) and, as often, sparse sliding-window masks."""
    return st.one_of(mask_cases(), sparse_window_cases())


def reference_mask(case: MaskCase) -> list[bool] | None:
    return REFERENCE_CLASSES[case.kind].reachable_block_mask(
        *case.arguments(), dcp_world_size=case.dcp_world_size, final_segment_end_block=case.final_segment_end_block)


def agree_mask(case: MaskCase, vllm_mask) -> None:
    """Assert the reference's mask is vLLM's (``vllm_mask``: the adapter's function)."""
    theirs = vllm_mask(case.kind, *case.arguments(), case.dcp_world_size, case.final_segment_end_block)
    ours = reference_mask(case)
    assert ours == theirs, f"reachable_block_mask: kvref {ours} != vLLM {theirs}\n{case}"
