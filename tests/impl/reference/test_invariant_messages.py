"""Every assertion of the reference's and the torch implementation's ``check_invariants()`` starts
with its rule name (#26).

docs/invariants.md promises that a failing invariant names its rule (``I3: block 7 ...``) so a
failure points to the rule's statement. Two checks hold the reference to it: a scan of every
``assert`` inside a ``check_invariants`` of any module of ``kvref.impl.reference`` (its message must
begin with an id the document defines), and broken states whose failure message is read back.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from kvref.impl.interface import PoolConfig
from kvref.impl.reference.adapter import ReferenceKVCacheManager
from kvref.impl.request import Request, RequestStatus
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec

DOC = Path(__file__).resolve().parents[3] / "docs" / "invariants.md"
RULES = frozenset(re.findall(r"^\| ([A-Z]\d+) \|", DOC.read_text(encoding="utf-8"), flags=re.M))
#: every module of the reference is scanned (a new structure's check_invariants is held to it too)
PACKAGE = Path(importlib.import_module("kvref.impl.reference").__file__).parent
#: and of the torch implementation (its tensors keep the same pool rules, plus D1)
TORCH = Path(importlib.import_module("kvref.impl.torch").__file__).parent
_RULE_PREFIX = re.compile(r"^([A-Z]\d+): ")


def _message_head(msg: ast.expr | None) -> str:
    """The literal text an assert message starts with ("" when it has none or starts with a value)."""
    if isinstance(msg, ast.Constant) and isinstance(msg.value, str):
        return msg.value
    if isinstance(msg, ast.JoinedStr) and msg.values and isinstance(msg.values[0], ast.Constant):
        return msg.values[0].value
    return ""


def _reference_asserts(package: Path = PACKAGE) -> list[tuple[str, int, str]]:
    """``(file, line, message head)`` of every assert inside any ``check_invariants`` of ``package``
    (the reference by default)."""
    out = []
    for path in sorted(package.rglob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(fn, ast.FunctionDef) and fn.name == "check_invariants":
                out += [(str(path.relative_to(package)), node.lineno, _message_head(node.msg))
                        for node in ast.walk(fn) if isinstance(node, ast.Assert)]
    return out


def test_the_document_defines_the_rule_families():
    assert {"I1", "I5", "I9", "I11", "M2", "M8", "M13", "Q1", "Q6", "Q9", "O1", "O7", "K1", "T1", "P1", "S1"} <= RULES


def test_every_reference_assertion_message_starts_with_a_defined_rule():
    asserts = _reference_asserts()
    files = {f for f, _, _ in asserts}
    # the scan reaches the structures (a wrong package path would make it vacuous)
    assert {"block_pool.py", "scheduler.py", "offload/cpu_offloading_manager.py", "offload/tiering/manager.py",
            "offload/p2p/server.py", "scheduler_connector.py"} <= files and len(asserts) >= 140
    bad = [(where, line, head) for where, line, head in asserts
           if not (_RULE_PREFIX.match(head) and _RULE_PREFIX.match(head).group(1) in RULES)]
    assert not bad, f"check_invariants assertions without a rule name of docs/invariants.md: {bad}"


def test_every_torch_assertion_message_starts_with_a_defined_rule():
    asserts = _reference_asserts(TORCH)
    assert {"block_pool.py", "block_table.py", "manager.py"} <= {f for f, _, _ in asserts} and len(asserts) >= 16
    bad = [(where, line, head) for where, line, head in asserts
           if not (_RULE_PREFIX.match(head) and _RULE_PREFIX.match(head).group(1) in RULES)]
    assert not bad, f"torch check_invariants assertions without a rule name of docs/invariants.md: {bad}"


def _pool(**kw) -> PoolConfig:
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=4, dtype="float16")
    return PoolConfig(num_blocks=8, groups=(KVCacheGroupSpec(("l0",), spec),), max_model_len=32,
                      scheduler_block_size=4, hash_block_size=4, **kw)


def _manager_with_a_request() -> tuple[ReferenceKVCacheManager, Request]:
    mgr = ReferenceKVCacheManager(_pool())
    req = Request("r", list(range(10)))
    assert mgr.allocate_slots(req, 10) is not None
    mgr.check_invariants()
    return mgr, req


def _free_block(mgr):
    return next(iter(mgr.manager.block_pool.free_block_queue.iter_blocks()))


def _held_block(mgr):
    return mgr.manager.coordinator.single_type_managers[0].req_to_blocks["r"][0]


BREAKS = {
    "I4": lambda mgr: setattr(_free_block(mgr), "ref_cnt", -1),
    "I3": lambda mgr: setattr(_free_block(mgr), "ref_cnt", 1),
    "I5": lambda mgr: setattr(mgr.manager.block_pool.free_block_queue, "num_free_blocks",
                              mgr.manager.block_pool.free_block_queue.num_free_blocks + 1),
    "I9": lambda mgr: setattr(_held_block(mgr), "ref_cnt", _held_block(mgr).ref_cnt + 1),
    "I1": lambda mgr: setattr(mgr.manager.block_pool.blocks[3], "block_id", 5),
    "M2": lambda mgr: mgr.manager.coordinator.single_type_managers[0].num_cached_block.__setitem__("r", 9),
}


@pytest.mark.parametrize("rule", sorted(BREAKS))
def test_a_broken_state_fails_naming_its_rule(rule):
    mgr, _ = _manager_with_a_request()
    BREAKS[rule](mgr)
    with pytest.raises(AssertionError) as info:
        mgr.check_invariants()
    assert str(info.value).startswith(f"{rule}: "), str(info.value)


def _scheduler_running_one():
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.scheduler_types import SchedulerConfig

    sched = Scheduler(_pool(max_in_flight_tokens=16), SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=2))
    sched.add_request(Request("a", list(range(6)), max_tokens=3))
    sched.add_request(Request("b", list(range(40, 46)), max_tokens=3))
    sched.schedule()
    sched.add_request(Request("c", list(range(80, 86)), max_tokens=3))  # waits: two run already
    sched.check_invariants()
    return sched


SCHEDULER_BREAKS = {
    "Q1": lambda s: s.running.append(s.running[0]),
    "Q2": lambda s: setattr(s.running[0], "status", RequestStatus.PREEMPTED),
    "Q3": lambda s: setattr(next(iter(s.waiting)), "num_computed_tokens", 4),
    "Q6": lambda s: setattr(s.running[0], "num_in_flight_tokens", -1),
}


@pytest.mark.parametrize("rule", sorted(SCHEDULER_BREAKS))
def test_a_broken_scheduler_fails_naming_its_rule(rule):
    sched = _scheduler_running_one()
    SCHEDULER_BREAKS[rule](sched)
    with pytest.raises(AssertionError) as info:
        sched.check_invariants()
    assert str(info.value).startswith(f"{rule}: "), str(info.value)


OFFLOAD_BREAKS = {
    "O4": lambda m: setattr(m, "num_evictable", m.num_evictable + 1),
    "O7": lambda m: m.policy.ranks.__setitem__("stray key", 0),
}


@pytest.mark.parametrize("rule", sorted(OFFLOAD_BREAKS))
def test_a_broken_cpu_offloading_manager_fails_naming_its_rule(rule):
    from kvref.impl.reference.offload.cpu_offloading_manager import CPUOffloadingManager

    mgr = CPUOffloadingManager(4, cache_policy="lru")
    mgr.check_invariants()
    OFFLOAD_BREAKS[rule](mgr)
    with pytest.raises(AssertionError) as info:
        mgr.check_invariants()
    assert str(info.value).startswith(f"{rule}: "), str(info.value)


def _torch_manager_with_a_request():
    from kvref.impl.torch import make_manager

    mgr = make_manager(_pool(), device="cpu")
    assert mgr.allocate_slots(Request("r", list(range(10))), 10) is not None
    mgr.check_invariants()
    return mgr


TORCH_BREAKS = {
    "I4": lambda m: m.pool.ref_cnt.__setitem__(7, -1),
    "I5": lambda m: setattr(m.pool, "num_free", m.pool.num_free + 1),
    "I9": lambda m: m.pool.ref_cnt.__setitem__(1, int(m.pool.ref_cnt[1]) + 1),
}


@pytest.mark.parametrize("rule", sorted(TORCH_BREAKS))
def test_a_broken_torch_pool_fails_naming_its_rule(rule):
    mgr = _torch_manager_with_a_request()
    TORCH_BREAKS[rule](mgr)
    with pytest.raises(AssertionError) as info:
        mgr.check_invariants()
    assert str(info.value).startswith(f"{rule}: "), str(info.value)
