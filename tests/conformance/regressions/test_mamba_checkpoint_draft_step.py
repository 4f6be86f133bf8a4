"""vLLM 0.33.0 asserts in ``cache_blocks`` on a decode step carrying as many drafts as a Mamba block.

Found in session 17 (#22/#28) while generating speculative steps on FA + Mamba "align" pools with
prefill checkpoint blocks (vLLM's Mamba2 mixer always declares one, alignment 1). A running request
whose computed tokens end on a hash-block boundary schedules ``1 + drafts`` tokens with
``drafts >= mamba block_size``: ``MambaManager.get_num_blocks_to_allocate`` finds an internal
checkpoint valid inside that query (``is_mamba_prefill_checkpoint_valid`` looks at the scheduled
tokens, drafts included) and reserves it; ``allocate_slots`` then caches up to the verified tokens
only (``request.num_tokens``), and ``_cache_partial_tail_block`` asks ``BlockPool.cache_partial_block``
for the checkpoint position, past the request's block hashes: ``_get_partial_block_hash`` fails its
``assert 0 < num_hash_blocks <= len(request.block_hashes)`` after the blocks were allocated.
Reachable only where ``num_speculative_tokens >= `` the Mamba "align" block size (small blocks);
vLLM's align-mode block sizes are usually far larger than a draft length, so this pins the
behaviour rather than claiming a server crash. The reference stops at the same call
(``cache_partial_block`` refuses the position with its ValueError subclass). No kvref machine
schedules tokens past ``num_tokens`` on these pools (the KV-cache-manager machine has no drafts;
``tests/impl/vllm/test_mamba_align_counts.py`` draws none on checkpoint pools).
"""

from __future__ import annotations

import pytest

from kvref.impl.interface import PoolConfig, make_manager
from kvref.impl.request import Request, RequestStatus
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_adapter():
    require_vllm()
    import kvref.impl.vllm.kv_cache_manager as adapter  # noqa: PLC0415 - imports vLLM once per module

    return adapter


def _draft_step(kind: str, drafts: int):
    """Blocks of 4 (hashes of 2), a prefill checkpoint block; a 4-token prompt, then 1 + drafts."""
    fa = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype="float32")
    mamba = MambaSpec(block_size=4, shapes=((2, 3),), dtypes=("float16",), mamba_cache_mode="align",
                      num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)
    m = make_manager(kind, PoolConfig(num_blocks=40, groups=(KVCacheGroupSpec(("attn",), fa),
                                                             KVCacheGroupSpec(("ssm",), mamba)),
                                      max_model_len=64, scheduler_block_size=4, hash_block_size=2))
    r = Request("r", [1, 2, 3, 4], max_tokens=20)
    assert m.allocate_slots(r, 4) is not None
    r.num_computed_tokens, r.status = 4, RequestStatus.RUNNING
    r.output_token_ids.append(6)
    return m, r


@pytest.mark.parametrize("kind", ["vllm", "reference"])
def test_fewer_drafts_than_a_block_are_served(vllm_adapter, kind):
    m, r = _draft_step(kind, 3)
    assert m.allocate_slots(r, 4) is not None


def test_a_blocks_worth_of_drafts_asserts_in_vllm_and_stops_the_reference(vllm_adapter):
    m, r = _draft_step("vllm", 4)
    with pytest.raises(AssertionError) as info:
        m.allocate_slots(r, 5)
    assert info.traceback[-1].name == "_get_partial_block_hash"
    rm, rr = _draft_step("reference", 4)
    with pytest.raises(ValueError, match="covered by the 2 block hashes"):
        rm.allocate_slots(rr, 5)
    # both stopped after allocating: the tables agree
    assert rm.get_block_ids("r") == m.get_block_ids("r")
