"""Issue #23: DCP/PCP at runtime against vLLM 0.33.0's own KV cache manager.

Generated traces on pools under decode/prefill context parallelism (``models/machines/
context_parallel.py``) are compared with vLLM after every operation; the world sizes vLLM refuses
(its hybrid coordinator's and its lookups' assertions) are drawn and compared with the reference's
refusals; and the one place the reference departs from vLLM on purpose ("full"-report hit events
under DCP, docs/differences.md) is pinned.
"""

from __future__ import annotations

from collections import Counter
from math import lcm

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

from kvref.impl.interface import PoolConfig, make_manager
from kvref.impl.reference.full_attention_manager import FullAttentionManager
from kvref.impl.request import Request
from kvref.models.conformance.differential import Divergence
from kvref.models.hypothesis_runs.reproducible import same_inputs_in_every_process
from kvref.models.machines.kv_cache_manager import kv_cache_manager_machine
from kvref.spec.errors import InvalidFieldError
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec, SlidingWindowSpec
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

#: one full-attention group (hashes at the sharded block) and the hybrids where DCP turns on
#: fine-grained hits (a Mamba block equal to the hash block) or scales them
GROUP_SETS = ("fa", "fa+mamba_align", "fa+mamba_fine")


@pytest.fixture(scope="module")
def vllm_loaded():
    require_vllm()


def _run(machine, phases=tuple(Phase)):
    with same_inputs_in_every_process():
        run_state_machine_as_test(machine, settings=settings(
            max_examples=profile_examples(10, 30), stateful_step_count=40, deadline=None, derandomize=True,
            database=None, phases=phases))


def test_dcp_pools_match_vllm(vllm_loaded):
    """Generated traces on DCP 2/4 (and PCP 2) pools agree with vLLM after every operation: block
    ids at the scaled block, hits, copy-on-write pairs, events. Derandomized, so DCP-scaled pools
    with prefix hits and copy-on-write are always reached."""
    machine = kv_cache_manager_machine(("reference", "vllm"), group_sets=GROUP_SETS, context_parallel=True)
    _run(machine)
    st_ = machine.stats
    assert {k for k in st_.context_parallel_pools if not k.startswith("dcp1/")}
    assert st_.dcp_prefix_hits > 0 and st_.dcp_cow_copies > 0
    assert not st_.unsupported_reasons


def test_reference_ignoring_dcp_in_lookups_is_caught(vllm_loaded, monkeypatch):
    """A reference whose full-attention lookup reads hashes at the unscaled block diverges."""
    original = FullAttentionManager.find_longest_cache_hit.__func__

    def unscaled(cls, *args, dcp_world_size=1, pcp_world_size=1):
        return original(cls, *args)

    monkeypatch.setattr(FullAttentionManager, "find_longest_cache_hit", classmethod(unscaled))
    machine = kv_cache_manager_machine(("reference", "vllm"), group_sets=GROUP_SETS, context_parallel=True)
    with pytest.raises(Divergence):
        _run(machine, phases=(Phase.generate,))


_ATTN = dict(block_size=4, num_kv_heads=1, head_size=1, dtype="float16")


@st.composite
def _cp_pools(draw):
    kinds = draw(st.lists(st.sampled_from(("fa", "swa", "mamba")), min_size=1, max_size=3))
    caching = draw(st.booleans())
    specs = []
    for kind in kinds:
        sharded = draw(st.booleans())
        if kind == "fa":
            specs.append(FullAttentionSpec(**_ATTN, dcp_sharded=sharded))
        elif kind == "swa":
            specs.append(SlidingWindowSpec(**_ATTN, sliding_window=8, dcp_sharded=sharded))
        else:
            specs.append(MambaSpec(block_size=4, shapes=((1,),), dtypes=("float32",),
                                   mamba_cache_mode="align" if caching else "none"))
    dcp, pcp = draw(st.sampled_from((1, 2, 4))), draw(st.sampled_from((1, 1, 2)))
    sizes = [s.effective_block_size(dcp) for s in specs]
    sbs = lcm(4, *sizes)
    hbs = sizes[0] if len(specs) == 1 and caching else 4
    return dict(num_blocks=64, groups=tuple(KVCacheGroupSpec((f"l{i}",), s) for i, s in enumerate(specs)),
                max_model_len=64, scheduler_block_size=sbs, hash_block_size=hbs, enable_caching=caching,
                dcp_world_size=dcp, pcp_world_size=pcp)


def _vllm_refuses(fields: dict) -> bool:
    """vLLM asserts while building the manager (hybrid coordinator) or at the first lookup."""
    pool = PoolConfig(**{**fields, "dcp_world_size": 1, "pcp_world_size": 1})  # the rest is valid
    from kvref.impl.vllm.specs import kv_cache_manager_kwargs, to_vllm_kv_cache_config
    from kvref.impl.vllm.loader import load_vllm

    kwargs = {**kv_cache_manager_kwargs(pool), "dcp_world_size": fields["dcp_world_size"],
              "pcp_world_size": fields["pcp_world_size"]}
    # a vLLM request hashed every hash_block_size tokens (by a plain one-group manager's hasher)
    hbs = fields["hash_block_size"]
    hasher = PoolConfig(num_blocks=8, groups=(KVCacheGroupSpec(("h",), FullAttentionSpec(**{**_ATTN, "block_size": hbs})),),
                        max_model_len=64, scheduler_block_size=hbs, hash_block_size=hbs)
    vreq = make_manager("vllm", hasher).vllm_request(Request(request_id="r", prompt_token_ids=list(range(40))))
    try:
        manager = load_vllm()["KVCacheManager"](to_vllm_kv_cache_config(pool), **kwargs)
        manager.get_computed_blocks(vreq)
    except AssertionError:
        return True
    return False


def test_refusals_match_vllm(vllm_loaded):
    """Generated groups (sharded or replicated full attention and windows, Mamba) under DCP 1/2/4 and
    PCP 1/2, with and without prefix caching: kvref refuses (``InvalidFieldError`` naming the world
    size) exactly the pools vLLM's coordinator or lookups assert on. Derandomized: both refusals and
    acceptances under DCP/PCP are reached."""
    seen: Counter = Counter()

    @settings(max_examples=profile_examples(40, 150), deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(fields=_cp_pools())
    def check(fields):
        try:
            PoolConfig(**fields)
            refused = None
        except InvalidFieldError as exc:
            refused = exc.field
        assert (refused is not None) == _vllm_refuses(fields), (fields, refused)
        assert refused in (None, "dcp_world_size", "pcp_world_size")
        seen[refused if refused or fields["dcp_world_size"] * fields["pcp_world_size"] == 1 else "accepted cp"] += 1

    check()
    assert seen["dcp_world_size"] and seen["pcp_world_size"] and seen["accepted cp"], seen


def test_full_report_hit_events_under_dcp(vllm_loaded):
    """vLLM 0.33.0 announces a "full"-report hit at the group spec's unscaled block size: under DCP
    its lookup asserts (16 is not a multiple of the 32-token hash block). kvref announces the
    blocks the hit holds; the events of the store itself agree with vLLM's."""
    group = KVCacheGroupSpec(("l",), FullAttentionSpec(**{**_ATTN, "block_size": 16}))
    pool = PoolConfig(num_blocks=16, groups=(group,), max_model_len=256, scheduler_block_size=32,
                      hash_block_size=32, enable_kv_cache_events=True, dcp_world_size=2)
    managers = {kind: make_manager(kind, pool) for kind in ("reference", "vllm")}
    for m in managers.values():
        first = Request(request_id="a", prompt_token_ids=list(range(70)))
        assert m.allocate_slots(first, 70) == ((1, 2, 3),)
        m.free(first)
    stores = {k: [(e["block_size"], e["block_hashes"]) for e in m.take_kv_events() if e["type"] == "BlockStored"]
              for k, m in managers.items()}
    assert stores["reference"] == stores["vllm"] and stores["vllm"][0][0] == 32
    resend = Request(request_id="b", prompt_token_ids=list(range(70)), kv_cache_report_mode="full")
    with pytest.raises(AssertionError):
        managers["vllm"].get_computed_blocks(resend)
    assert managers["reference"].get_computed_blocks(resend)[1] == 64
    announced = managers["reference"].take_kv_events()
    assert [(e["block_size"], e["block_hashes"]) for e in announced] == [(32, stores["vllm"][0][1][:2])]
