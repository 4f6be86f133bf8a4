"""The reference's KV-connector waiting loop applies vLLM's Mamba "align" split (issues #22, #28).

vLLM 0.33.0's ``Scheduler._mamba_block_aligned_split`` runs on the connector path too, the chunk
starting after the local and the external hit (``start = num_computed + local + external``), and
every admission look-up stores the request's ``shared_prefix_boundary``. A sync external hit that
ends mid-block must therefore stop the first chunk at the next block boundary.
"""

from __future__ import annotations

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.scheduler import Scheduler
from kvref.impl.reference.scheduler_connector import ConnectorConfig, ExternalHit, ScriptedConnector
from kvref.impl.request import Request
from kvref.impl.scheduler_types import SchedulerConfig
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec

BS = 4


def _align_sched(num_blocks: int = 32) -> tuple[Scheduler, ScriptedConnector]:
    groups = (KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8,
                                                            dtype="float16")),
              KVCacheGroupSpec(("mamba",), MambaSpec(block_size=BS, shapes=((2, 8),), dtypes=("float16",),
                                                     mamba_cache_mode="align")))
    pool = PoolConfig(num_blocks=num_blocks, groups=groups, max_model_len=64, scheduler_block_size=BS,
                      hash_block_size=BS, max_in_flight_tokens=64, enable_caching=True)
    conn = ScriptedConnector(ConnectorConfig())
    return Scheduler(pool, SchedulerConfig(max_num_batched_tokens=64), connector=conn), conn


def test_a_sync_external_hit_mid_block_stops_the_chunk_at_the_next_block_boundary():
    s, conn = _align_sched()
    conn.set_hit("a", ExternalHit(num_tokens=5))
    s.add_request(Request("a", list(range(100, 113)), max_tokens=2))
    (a,) = s.schedule().scheduled
    # start = 0 local + 5 external; the next Mamba state boundary is 8: 3 tokens, not 13 - 5 = 8
    assert (a.num_computed_tokens, a.num_scheduled_tokens) == (5, 3)


def test_without_an_external_hit_the_chunk_stops_at_the_last_cacheable_boundary():
    s, conn = _align_sched()
    conn.set_hit("a", ExternalHit(num_tokens=0))
    s.add_request(Request("a", list(range(100, 113)), max_tokens=2))
    (a,) = s.schedule().scheduled
    # 13 prompt tokens: the last state the cache can hold is after 12 tokens
    assert (a.num_computed_tokens, a.num_scheduled_tokens) == (0, 12)
