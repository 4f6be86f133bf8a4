"""The sink-attention manager: vLLM 0.33.0's ``SinkFullAttentionManager`` vs the reference's (#22).

vLLM's coordinator cannot build it (docs/differences.md), so engine traces never run its
``__init__``; here both are built directly over their own pool from generated specs (sink lengths
that fill whole blocks or not, none, DCP-wide blocks) and must agree on accepting the spec, on the
block size and, once built, on the block ids each chunk of one request's growth is handed.
Run inside ``conform-kv-manager``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from kvref.impl.reference.block_pool import BlockPool
from kvref.impl.reference.sink_full_attention_manager import SinkFullAttentionManager
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import SinkFullAttentionSpec


@dataclass(frozen=True)
class SinkCase:
    spec: SinkFullAttentionSpec
    num_blocks: int
    dcp_world_size: int
    chunks: tuple[int, ...]


@st.composite
def sink_cases(draw) -> SinkCase:
    block_size = draw(st.sampled_from((1, 2, 4, 16)))
    dcp = draw(st.sampled_from((1, 1, 2)))
    sink = draw(st.one_of(st.none(), st.integers(1, 4).map(lambda k: k * block_size * dcp),
                          st.integers(1, 4 * block_size * dcp)))
    spec = SinkFullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype="float16", sink_len=sink)
    return SinkCase(spec, draw(st.integers(2, 12)), dcp, tuple(draw(st.lists(st.integers(1, 20), max_size=4))))


def reference_sink_run(case: SinkCase) -> tuple[str, int | None, list[list[int]]]:
    """What :func:`kvref.impl.vllm.sink_manager.vllm_sink_manager_run` returns, from the reference."""
    pool = BlockPool(case.num_blocks, False, case.spec.block_size)
    try:
        manager = SinkFullAttentionManager(case.spec, block_pool=pool, enable_caching=False, kv_cache_group_id=0,
                                           scheduler_block_size=case.spec.block_size,
                                           dcp_world_size=case.dcp_world_size)
    except InvalidFieldError:
        return "rejected", None, []
    grown, total = [], 0
    for chunk in case.chunks:
        done, total = total, total + chunk
        if manager.get_num_blocks_to_allocate("r", total, [], done, 0, total) > pool.get_num_free_blocks():
            break
        grown.append([b.block_id for b in manager.allocate_new_blocks("r", total, total)])
    manager.check_invariants()
    return "accepted", manager.block_size, grown


def agree_sink(case: SinkCase, vllm_run) -> None:
    theirs = vllm_run(case.spec, case.num_blocks, case.dcp_world_size, list(case.chunks))
    ours = reference_sink_run(case)
    assert ours == theirs, f"SinkFullAttentionManager: kvref {ours} != vLLM {theirs}\n{case}"
