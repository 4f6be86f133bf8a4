"""vLLM 0.33.0's SimpleCPU offload scheduler vs the reference on group layouts beyond full attention
(+ sliding window) first (#22): a chunked-local attention group (an external hit must start on a
chunk boundary: a local prefix ending mid-chunk loads nothing from the CPU) and the full-attention
group listed last (a model whose first layers are local; the connector finds it by kind).

The traces are conform-offload's (``SimpleOffloadConfig.random`` draws both layouts, from a
generator of their own) with the layouts forced on; the counts come from a seeded
``random.Random``, so they are the same under every profile. Cost: ~3 s at CI=true."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from kvref.models.offload.simple_cpu_world import SimpleOffloadConfig, SimpleOffloadWorld
from kvref.models.offload.traces import apply_op, random_ops
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def VSched():
    require_vllm()
    from vllm.v1.simple_kv_offload.manager import SimpleCPUOffloadScheduler

    return SimpleCPUOffloadScheduler


def _cases(n: int, seed: int = 3) -> list:
    """``n`` conform-offload configurations with a chunked-local group (8 or 12 tokens) and, in
    about half, the full-attention group last; no non-HMA sibling (that needs one group)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        cfg = replace(SimpleOffloadConfig.random(rng), non_hma_sibling=False, local_chunk=rng.choice([8, 12]),
                      full_attention_last=i % 2 == 1)
        out.append((cfg, random_ops(rng, rng.randint(30, 60))))
    return out


def _run(cases) -> int:
    """Both backends op by op; AssertionError at the first difference. Returns the ops run."""
    ops_run = 0
    for i, (cfg, ops) in enumerate(cases):
        worlds = [SimpleOffloadWorld(cfg, b, allow_duplicates_within_event=True) for b in ("reference", "vllm")]
        for j, op in enumerate(ops):
            outs = [apply_op(w, op) for w in worlds]
            assert outs[0] == outs[1], f"trace {i} op {j} {op} on {cfg}: step outputs differ"
            assert worlds[0].observe() == worlds[1].observe(), f"trace {i} op {j} {op} on {cfg}: state differs"
            ops_run += 1
    return ops_run


def test_the_layouts_are_drawn_by_conform_offload():
    rng = random.Random(0)
    drawn = [SimpleOffloadConfig.random(rng) for _ in range(200)]
    assert any(c.local_chunk for c in drawn) and any(c.full_attention_last for c in drawn)
    for c in drawn:
        groups = c.kvref_groups()
        assert len(groups) == 1 + (c.sliding_window is not None) + (c.local_chunk is not None)
        assert not (c.non_hma_sibling and len(groups) > 1), c
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        assert (kinds[-1] if c.full_attention_last else kinds[0]) == "FullAttentionSpec", (c, kinds)


def test_vllm_agrees_and_mid_chunk_lookups_are_declined(VSched, monkeypatch):
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    seen: Counter = Counter()
    original = VSched.get_num_new_matched_tokens

    def counting(self, request, num_computed_tokens):
        out = original(self, request, num_computed_tokens)
        chunk = next(g.kv_cache_spec.attention_chunk_size for g in self.cpu_kv_cache_config.kv_cache_groups
                     if isinstance(g.kv_cache_spec, ChunkedLocalAttentionSpec))
        if num_computed_tokens % self.block_size == 0 and num_computed_tokens % chunk:
            seen["mid_chunk"] += 1
            assert out == (0, False), "vLLM offered a CPU hit after a local prefix ending mid-chunk"
        seen["hit"] += bool(out[0])
        seen[f"fa_gidx={self.fa_gidx}"] += 1
        return out

    monkeypatch.setattr(VSched, "get_num_new_matched_tokens", counting)
    assert _run(_cases(12)) > 400
    assert seen["mid_chunk"] > 0 and seen["hit"] > 0, seen
    assert seen["fa_gidx=0"] > 0 and seen["fa_gidx=1"] + seen["fa_gidx=2"] > 0, seen


def _probed(cases) -> dict:
    """conform-offload's look-up edge probes (which, on a chunked-local pool, also look a request
    up after one block of local prefix, inside a chunk) over ``cases``; raises at a difference."""
    from kvref.models.offload.simple_cpu_lookup_edges import run_lookup_edges

    total: Counter = Counter()
    for i, (cfg, ops) in enumerate(cases):
        total.update(run_lookup_edges(cfg, ops, i))
    return total


def test_probes_agree_on_chunked_local_pools(VSched):
    got = _probed(_cases(12))
    assert got["probes"] > 20 and got["hits_declined"] > 0, got


def test_a_mid_chunk_cpu_hit_in_vllm_is_found(VSched, monkeypatch):
    """vLLM's chunk-boundary rule removed (its look-up no longer recognises the chunked-local
    group): it offers a CPU hit after a local prefix ending inside a chunk, and the probes differ."""
    import vllm.v1.simple_kv_offload.manager as manager

    from kvref.models.offload.world_common import OffloadInvariantError

    monkeypatch.setattr(manager, "ChunkedLocalAttentionSpec", type("NoChunkedLocal", (), {}))
    with pytest.raises(OffloadInvariantError, match="probe of"):
        _probed(_cases(12))


def test_the_reference_without_the_chunk_rule_is_found(VSched, monkeypatch):
    """The reference's own rule matters: without it the reference offers those hits and differs."""
    import kvref.impl.reference.offload.simple_cpu_offload_scheduler as sched

    from kvref.models.offload.world_common import OffloadInvariantError

    monkeypatch.setattr(sched, "ChunkedLocalAttentionSpec", type("NoChunkedLocal", (), {}))
    with pytest.raises(OffloadInvariantError, match="probe of"):
        _probed(_cases(12))
