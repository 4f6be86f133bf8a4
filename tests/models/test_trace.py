"""Traces: JSON round trip of every pool config the strategies generate, and bad input."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings

from kvref.impl.interface import PoolConfig
from kvref.models.strategies.pools import pool_configs
from kvref.models.conformance.trace import OP_FIELDS, Op, Trace, pool_config_from_json, pool_config_to_json
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import KVCacheGroupSpec, MambaSpec, SlidingWindowSpec
from tests.conftest import profile_examples


@settings(max_examples=profile_examples(50, 200))
@given(pool_configs())
def test_pool_config_round_trips_through_json(pool):
    text = json.dumps(pool_config_to_json(pool))
    assert pool_config_from_json(json.loads(text)) == pool


def test_trace_round_trip_and_digest(tmp_path):
    swa = SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=4, dtype="bfloat16", sliding_window=6)
    mamba = MambaSpec(block_size=4, shapes=((2, 3), (4,)), dtypes=("float16", "float32"))
    pool = PoolConfig(num_blocks=9, groups=(KVCacheGroupSpec(("s",), swa), KVCacheGroupSpec(("m",), mamba)),
                      max_model_len=32, scheduler_block_size=4, hash_block_size=4, enable_caching=False)
    ops = [Op("add", dict(rid="r0", prompt=[1, 2, 3], max_tokens=2, cache_salt="s")),
           Op("admit", dict(rid="r0", chunk=8, full_sequence_must_fit=True, reserved_blocks=0, in_flight=True,
                            token=4)),
           Op("process", dict(rid="r0")), Op("new_step", {}), Op("finish", dict(rid="r0"))]
    t = Trace(pool, ops, note="hand-made")
    loaded = Trace.load(t.save(tmp_path / "sub" / "t.json"))
    assert loaded.pool_config == pool and loaded.ops == ops and loaded.note == "hand-made"
    assert loaded.digest() == t.digest()
    assert Trace(pool, ops[:-1]).digest() != t.digest()
    assert str(ops[0]) == "add(rid='r0', max_tokens=2, cache_salt='s', prompt=<3 tokens>)"
    assert ops[1].chunk == 8


@pytest.mark.parametrize("bad, field", [
    (lambda: Op("explode", {}), "op"),
    (lambda: Op("finish", {}), "finish.args"),
    (lambda: Op("finish", {"rid": "a", "extra": 1}), "finish.args"),
    (lambda: Trace.loads("{not json"), "trace"),
    (lambda: Trace.loads('{"format": "other"}'), "format"),
    (lambda: Trace.loads('{"format": "kvref-trace", "version": 99}'), "version"),
    (lambda: Trace.loads('{"format": "kvref-trace", "version": 1, "ops": 3}'), "ops"),
    (lambda: Trace.loads('{"format": "kvref-trace", "version": 1, "ops": [], "pool_config": 1}'), "pool_config"),
    (lambda: Op.from_json([1]), "ops"),
])
def test_bad_traces_are_rejected_with_the_field_named(bad, field):
    with pytest.raises(InvalidFieldError) as info:
        bad()
    assert info.value.field.startswith(field)


def test_every_op_kind_has_fields_listed():
    assert set(OP_FIELDS) == {"add", "admit", "step", "process", "preempt", "finish", "new_step",
                               "reset_prefix_cache", "evict_blocks", "load_done", "connector_lookup",
                               "make_prefix_cache_stats"}
