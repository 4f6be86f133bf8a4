"""vLLM's ``SinkFullAttentionManager`` built directly (issue #22).

vLLM 0.33.0's coordinator cannot build this manager (``get_manager_for_kv_cache_spec`` passes
``needs_kv_cache_zeroing``, which its ``__init__`` does not take: docs/differences.md), so no
engine-level trace reaches it. This adapter builds it over its own ``BlockPool`` with the
arguments the coordinator would pass otherwise, and grows one request's table: the conformance
check compares which sink lengths it accepts and the blocks it hands out with the reference's.
"""

from __future__ import annotations

from kvref.spec.errors import InvalidFieldError, check_int
from kvref.spec.kv_cache_interface import SinkFullAttentionSpec

from kvref.impl.vllm.loader import load_vllm
from kvref.impl.vllm.specs import to_vllm_spec


def vllm_sink_manager_run(spec: SinkFullAttentionSpec, num_blocks: int, dcp_world_size: int,
                          chunks: list[int]) -> tuple[str, int | None, list[list[int]]]:
    """Build vLLM's manager for ``spec`` and grow request ``r`` by ``chunks`` tokens: ``("rejected",
    None, [])`` when vLLM refuses the spec, else ``("accepted", block_size, new block ids per chunk)``
    (a chunk the pool cannot serve ends the run)."""
    if not isinstance(spec, SinkFullAttentionSpec):
        raise InvalidFieldError("spec", spec, "a kvref SinkFullAttentionSpec")
    check_int("num_blocks", num_blocks, minimum=2)
    check_int("dcp_world_size", dcp_world_size, minimum=1)
    load_vllm()
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import SinkFullAttentionManager

    pool = BlockPool(num_gpu_blocks=num_blocks, enable_caching=False, hash_block_size=spec.block_size)
    try:
        manager = SinkFullAttentionManager(kv_cache_spec=to_vllm_spec(spec), block_pool=pool, enable_caching=False,
                                           kv_cache_group_id=0, scheduler_block_size=spec.block_size,
                                           dcp_world_size=dcp_world_size)
    except AssertionError:  # vLLM asserts a positive sink that fills whole blocks
        return "rejected", None, []
    grown, total = [], 0
    for chunk in chunks:
        done, total = total, total + chunk
        if manager.get_num_blocks_to_allocate("r", total, [], done, 0, total) > pool.get_num_free_blocks():
            break
        grown.append([b.block_id for b in manager.allocate_new_blocks("r", total, total)])
    return "accepted", manager.block_size, grown
