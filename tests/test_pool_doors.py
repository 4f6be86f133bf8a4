"""One road from config to pool (#26): source code makes a runtime pool only through
``PoolConfig.from_plan`` (what startup planned) or ``PoolConfig.off_plan`` (a named reason)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kvref.impl.interface import PoolConfig
from kvref.spec import EngineConfig, FullAttentionSpec, SlidingWindowSpec, plan_kv_cache
from kvref.spec.errors import InvalidFieldError

ROOT = Path(__file__).resolve().parent.parent
SOURCE_DIRS = ("spec", "impl", "models", "proofs", "kvref", "benchmarks")
#: files that may call the constructor itself: the class, and readers that rebuild a pool
#: field by field from a file a previous run wrote (the fields were checked when it was made)
ALLOWED = {"impl/interface.py", "models/conformance/trace.py"}


def _direct_constructions() -> list[str]:
    found = []
    for d in SOURCE_DIRS:
        for path in sorted((ROOT / d).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in ALLOWED:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "PoolConfig":
                    found.append(f"{rel}:{node.lineno}")
    return found


def test_source_builds_pools_only_through_the_two_doors():
    found = _direct_constructions()
    assert not found, ("PoolConfig(...) built field by field outside the two doors "
                       f"(use PoolConfig.from_plan(plan) or PoolConfig.off_plan(why, ...)): {found}")


def _plan():
    kw = dict(block_size=16, num_kv_heads=2, head_size=8, dtype="float16")
    layers = {"l0": FullAttentionSpec(**kw), "l1": SlidingWindowSpec(sliding_window=64, **kw)}
    return plan_kv_cache(layers, EngineConfig(max_model_len=1024, num_gpu_blocks_override=200), 1 << 30)


def test_from_plan_takes_every_derived_value_from_the_plan():
    plan = _plan()
    pool = PoolConfig.from_plan(plan, watermark=0.1)
    assert pool.origin == "plan"
    assert (pool.num_blocks, pool.max_model_len) == (plan.num_blocks, plan.max_model_len)
    assert pool.scheduler_block_size == plan.scheduler_block_size
    assert pool.hash_block_size == plan.hash_block_size
    assert pool.max_in_flight_tokens == plan.max_in_flight_tokens
    assert pool.groups == plan.scheduler_groups
    assert pool.watermark == 0.1
    # origin is provenance, not behaviour: equal fields compare equal
    assert pool == PoolConfig.off_plan("same fields by hand", **plan.pool_config_kwargs(), watermark=0.1)


def test_off_plan_names_its_reason_and_checks_fields_like_any_pool():
    kw = dict(groups=_plan().scheduler_groups, max_model_len=64, scheduler_block_size=16, hash_block_size=16)
    pool = PoolConfig.off_plan("a tiny explorer scope", num_blocks=5, **kw)
    assert pool.origin == "off-plan: a tiny explorer scope"
    for why in ("", "   ", None, 3):
        with pytest.raises(InvalidFieldError, match="why"):
            PoolConfig.off_plan(why, num_blocks=5, **kw)
    with pytest.raises(InvalidFieldError, match="num_blocks"):
        PoolConfig.off_plan("bad", num_blocks=0, **kw)
    with pytest.raises(InvalidFieldError, match="origin"):
        PoolConfig.off_plan("bad", num_blocks=5, origin="plan", **kw)


def test_from_plan_rejects_what_is_not_a_plan():
    with pytest.raises(InvalidFieldError, match="plan"):
        PoolConfig.from_plan({"num_blocks": 3})


def _off_plan_files() -> set[str]:
    found = set()
    for d in SOURCE_DIRS:
        for path in sorted((ROOT / d).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
            if any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "off_plan"
                   and ast.unparse(n.func.value) == "PoolConfig" for n in ast.walk(tree)):
                found.add(rel)
    return found


def test_every_off_plan_door_is_listed_with_its_reason_in_docs():
    """docs/pools.md lists every file that builds a pool off-plan and why: a new off-plan pool is
    a decision a reader should see, and a listed file that now plans its pool is stale."""
    import re

    listed = set(re.findall(r"^\| `([^`]+\.py)` \|", (ROOT / "docs" / "pools.md").read_text(encoding="utf-8"),
                            flags=re.M))
    found = _off_plan_files()
    assert "models/explorer/kv.py" in found  # the scan sees the door's callers at all
    assert found - listed == set(), f"off_plan pools not listed in docs/pools.md: {sorted(found - listed)}"
    assert listed - found == set(), f"docs/pools.md lists files with no off_plan pool: {sorted(listed - found)}"


def test_through_plan_is_the_plan_s_pool_where_startup_builds_the_fields_and_says_why_elsewhere():
    from kvref.impl.scheduler_types import SchedulerConfig, engine_config_for

    plan = _plan()
    cfg = SchedulerConfig(max_num_batched_tokens=plan.max_in_flight_tokens, max_num_seqs=4)
    fields = dict(num_blocks=plan.num_blocks, groups=plan.scheduler_groups, max_model_len=plan.max_model_len,
                  scheduler_block_size=plan.scheduler_block_size, hash_block_size=plan.hash_block_size,
                  max_in_flight_tokens=plan.max_in_flight_tokens, enable_caching=True)
    engine = engine_config_for(cfg, **{k: v for k, v in fields.items() if k != "max_in_flight_tokens"})
    pool = PoolConfig.through_plan(fields, engine, "a test", settings=dict(watermark=0.1))
    assert (pool.origin, pool.watermark) == ("plan", 0.1)
    assert pool == PoolConfig.off_plan("same", **fields, watermark=0.1)
    # a block short of one max-length request: startup refuses, the same fields come off-plan
    short = dict(fields, num_blocks=3)
    refused = PoolConfig.through_plan(short, engine_config_for(cfg, **{k: v for k, v in short.items()
                                                                      if k != "max_in_flight_tokens"}), "a test")
    assert refused.origin == "off-plan: a test: startup refuses it (InsufficientKVCacheError)"
    assert refused.num_blocks == 3
    # fields startup would build otherwise (another in-flight budget) are named
    other = PoolConfig.through_plan(dict(fields, max_in_flight_tokens=1), engine, "a test")
    assert other.origin == "off-plan: a test: startup would build other max_in_flight_tokens (page sizes unified or padded)"
    # a reason given up front skips the plan
    assert PoolConfig.through_plan(fields, engine, "a test", ["hand-set"]).origin == "off-plan: a test: hand-set"
    for bad in (dict(fields=[], engine=engine), dict(fields=fields, engine=None),
                dict(fields=fields, engine=engine, reasons="x"), dict(fields=fields, engine=engine, settings=[])):
        with pytest.raises(InvalidFieldError):
            PoolConfig.through_plan(why="a test", **bad)
