"""kvref's config.json -> layout derivation against vLLM 0.33.0's own code, for every packaged fixture.

vLLM loads each fixture with its own config loader (transformers' classes and their defaults), and
its functions give the KV heads, head size, MLA, derived length, Mamba state shapes and dtypes, and
the hybrid attention block size (``Platform._align_hybrid_block_size``); see
:mod:`kvref.impl.vllm.model_config` for what runs and why not a whole ``ModelConfig``. Every field
must agree, layer by layer, under the default engine arguments and under changed ones (tensor
parallelism, prefix caching off, SSM dtype, block size).
"""

from __future__ import annotations

import json
from importlib import resources

import pytest
from kvref.spec import MambaSpec
from kvref.spec.hf_config import ModelLayout, layout_from_hf_config

from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

ROOT = resources.files("kvref") / "examples" / "hf_configs"
NAMES = sorted(p.name.removesuffix(".json") for p in ROOT.iterdir() if p.name.endswith(".json"))

#: (fixture, engine arguments) beyond the defaults
VARIANTS = [
    ("qwen3-next-80b-a3b-instruct", {"tensor_parallel_size": 2}),
    ("qwen3-next-80b-a3b-instruct", {"block_size": 64}),
    ("nemotron-h-8b-base-8k", {"enable_prefix_caching": False, "tensor_parallel_size": 2}),
    ("nemotron-h-8b-base-8k", {"mamba_ssm_cache_dtype": "bfloat16"}),
    ("jamba-v0.1", {"mamba_ssm_cache_dtype": "float32"}),
    ("jamba-v0.1", {"kv_cache_dtype": "fp8"}),
    ("llama-3.1-8b", {"tensor_parallel_size": 16}),
    ("gemma-3-27b-it", {"tensor_parallel_size": 4}),
]


def kinds_by_index(layout: ModelLayout, n: int) -> list[str]:
    """Each layer's kind as :func:`vllm_hf_facts` names it (``full+mamba``: both in one layer)."""
    kinds: list[list[str]] = [[] for _ in range(n)]
    for name, spec in layout.layers.items():
        kinds[int(name.split(".")[2])].append({"FullAttentionSpec": "full", "SlidingWindowSpec": "sliding_window",
                                               "ChunkedLocalAttentionSpec": "chunked_local",
                                               "MLAAttentionSpec": "mla", "MambaSpec": "mamba"}[type(spec).__name__])
    return ["+".join(sorted(k, key=lambda x: x == "mamba")) or "none" for k in kinds]


def assert_layout_matches(layout: ModelLayout, facts: dict) -> None:
    """Every field of kvref's layout equals vLLM's facts, layer by layer."""
    n = len(facts["layer_kinds"])
    assert kinds_by_index(layout, n) == facts["layer_kinds"]
    assert layout.derived_max_model_len == facts["derived_max_model_len"]
    assert layout.model_dtype == facts["model_dtype"]
    attn = [s for s in layout.layers.values() if not isinstance(s, MambaSpec)]
    if attn:
        assert {s.num_kv_heads for s in attn} == {facts["num_kv_heads"]}
        assert {s.head_size for s in attn} == {facts["head_size"]}
    assert {getattr(s, "sliding_window", None) for s in attn if type(s).__name__ == "SlidingWindowSpec"} <= \
        {facts["sliding_window"]}
    assert {getattr(s, "attention_chunk_size", None) for s in attn
            if type(s).__name__ == "ChunkedLocalAttentionSpec"} <= {facts["attention_chunk_size"]}
    if not any("mamba" in k for k in facts["layer_kinds"]):
        return
    mamba = [s for s in layout.layers.values() if isinstance(s, MambaSpec)]
    assert {s.shapes for s in mamba} == {facts["mamba_shapes"]}
    assert {s.dtypes for s in mamba} == {facts["mamba_dtypes"]}
    assert layout.block_size == facts["block_size"]
    assert {s.block_size for s in attn} <= {facts["block_size"]}
    assert {s.page_size_padded for s in mamba} == {facts["mamba_page_size_padded"]}
    assert layout.mamba_cache_mode == facts["mamba_cache_mode"]
    assert {s.block_size for s in mamba} == {facts["mamba_block_size"]}


@pytest.mark.parametrize("name, kwargs", [(n, {}) for n in NAMES] + VARIANTS,
                         ids=[n for n in NAMES] + [f"{n}-{'-'.join(f'{k}={v}' for k, v in kw.items())}"
                                                   for n, kw in VARIANTS])
def test_layout_matches_vllms_derivation(name, kwargs, tmp_path):
    require_vllm()
    from kvref.impl.vllm.model_config import vllm_hf_facts

    text = (ROOT / f"{name}.json").read_text()
    (tmp_path / "config.json").write_text(text)
    vkw = {k: v for k, v in kwargs.items() if k != "block_size"}
    facts = vllm_hf_facts(str(tmp_path), block_size=kwargs.get("block_size", 16), **vkw)
    layout = layout_from_hf_config(json.loads(text), **kwargs)
    assert_layout_matches(layout, facts)


#: (fixture, derivation arguments, engine changes): every packaged layout planned end to end
PLANS = [(n, {}, {}) for n in NAMES] + [
    ("llama-4-scout-17b-16e-instruct", {"allow_chunked_local_with_hybrid": True}, {}),
    ("deepseek-v3", {"kv_cache_dtype": "fp8_ds_mla"}, {"max_model_len": "auto"}),
    ("jamba-v0.1", {"enable_prefix_caching": False, "max_model_len": 16384}, {"enable_prefix_caching": False}),
    ("gemma-3-27b-it", {}, {"max_concurrent_batches": 2, "max_num_batched_tokens": 8192}),
]


@pytest.fixture(scope="module")
def planner():
    require_vllm()
    from kvref.impl.vllm.planning import VllmPlanner

    return VllmPlanner()


@pytest.mark.parametrize("name, derive, engine", PLANS,
                         ids=[f"{n}{'-' + '-'.join(map(str, d.values())) if d else ''}" for n, d, _ in PLANS])
def test_derived_layout_plans_like_vllms_startup(planner, name, derive, engine):
    """The derived layout, planned by kvref and by vLLM's startup planner (what ``kvref size
    --hf-config … --against vllm`` prints): the same groups, blocks, caps, concurrency."""
    from kvref.impl.vllm.planning import kvref_outcome

    layout = layout_from_hf_config(json.loads((ROOT / f"{name}.json").read_text()), **derive)
    changes = {"max_model_len": min(layout.derived_max_model_len, 16384), "max_num_batched_tokens": 2048, **engine}
    config = layout.engine_config(**changes)
    ours = kvref_outcome(planner, layout.layers, config, 24 << 30)
    theirs = planner.plan(layout.layers, config, 24 << 30, extra_retained_tokens=0)
    assert ours.key() == theirs.key()
    assert ours.status == "ok"
    for field in ours.fields:
        assert ours.fields[field] == theirs.fields[field], field
