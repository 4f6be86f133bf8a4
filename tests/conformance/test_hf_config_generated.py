"""Generated ``config.json`` files, derived by kvref and by vLLM 0.33.0's own code, field by field.

The packaged fixtures are hand-picked; a user's file is another size or release of the same family.
Per supported family this test starts from a fixture and redraws the fields the layout depends on
(layer counts, heads, KV heads and head size present or absent, windows and layer patterns, chunked
attention, MLA ranks, Mamba mixer sizes, lengths and RoPE scaling, the dtype key), plus the engine
arguments (tensor parallelism, block size, KV cache and SSM dtypes, prefix caching). vLLM loads
the file with its own loader (:func:`kvref.impl.vllm.model_config.vllm_hf_facts`); kvref's
:func:`~kvref.spec.hf_config.layout_from_hf_config` must give the same facts, and where vLLM (or
transformers' config class under it) rejects the file or the arguments, kvref must reject them
with :class:`~kvref.spec.errors.InvalidFieldError` — and vice versa.
"""

from __future__ import annotations

import json
from importlib import resources

import pytest
from hypothesis import given, note, settings
from hypothesis import strategies as st
from kvref.spec.errors import InvalidFieldError
from kvref.spec.hf_config import layout_from_hf_config

from tests.conformance.test_hf_config_conformance import assert_layout_matches
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

ROOT = resources.files("kvref") / "examples" / "hf_configs"
ABSENT = object()


def _fixture(name: str) -> dict:
    return json.loads((ROOT / f"{name}.json").read_text())


def _put(d: dict, key: str, value) -> None:
    """Set ``key`` (``ABSENT``: remove it)."""
    if value is ABSENT:
        d.pop(key, None)
    else:
        d[key] = value


@st.composite
def _attention(draw, t: dict, *, head_dim: bool = True, kv_absent: bool = True) -> None:
    """Heads, KV heads (absent: = heads), head_dim (absent: hidden_size / heads), hidden size."""
    heads = draw(st.sampled_from([1, 2, 4, 8, 12, 16, 32, 40, 64]))
    t["num_attention_heads"] = heads
    kv = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0] + ([ABSENT, None] if kv_absent else [])))
    _put(t, "num_key_value_heads", kv)
    per_head = draw(st.sampled_from([64, 80, 96, 128, 256]))
    t["hidden_size"] = heads * per_head
    if head_dim:
        _put(t, "head_dim", draw(st.sampled_from([ABSENT, None, 64, 128, 256, per_head])))


@st.composite
def _length(draw, t: dict, *, rope: bool = True) -> None:
    """max_position_embeddings and RoPE scaling of each type (old ``rope_scaling`` key or
    transformers 5's ``rope_parameters``)."""
    # absent: the class default (transformers), which a file omits when it equals it
    _put(t, "max_position_embeddings", draw(st.sampled_from([ABSENT, 2048, 4096, 8192, 32768, 131072, 163840])))
    if not rope:
        return
    other = draw(st.sampled_from([None, "max_seq_len", "seq_length", "model_max_length"]))
    if other is not None:  # vLLM's other length keys: the smallest wins, model_max_length wins outright
        t[other] = draw(st.sampled_from([1024, 4096, 65536]))
    kind = draw(st.sampled_from(["keep", "none", "linear", "dynamic", "yarn", "llama3"]))
    if kind == "keep":
        return
    t.pop("rope_scaling", None)
    t.pop("rope_parameters", None)
    if kind == "none":
        return
    factor = draw(st.sampled_from([2.0, 4.0, 8.0, 32.0]))
    rp: dict = {"rope_type": kind, "factor": factor}
    if kind == "yarn":
        rp["original_max_position_embeddings"] = t.get("max_position_embeddings", 4096)
    if kind == "llama3":
        rp.update(low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=min(8192, t.get("max_position_embeddings", 8192)))
    key = draw(st.sampled_from(["rope_scaling", "rope_parameters"]))
    if key == "rope_parameters":  # transformers 5's form carries rope_theta (its validation requires it)
        rp["rope_theta"] = t.get("rope_theta", 10000.0)
    t[key] = rp


@st.composite
def _dtype(draw, top: dict, t: dict) -> None:
    for d in (top, t):
        d.pop("torch_dtype", None)
        d.pop("dtype", None)
    key = draw(st.sampled_from(["torch_dtype", "dtype", None]))
    if key is not None:
        where = draw(st.sampled_from([top, t])) if t is not top else top
        where[key] = draw(st.sampled_from(["bfloat16", "float16", "float32"]))


def _layers(draw, lo: int = 1, hi: int = 48) -> int:
    return draw(st.integers(lo, hi))


@st.composite
def llama_like(draw):
    top = _fixture(draw(st.sampled_from(["llama-3.1-8b", "mistral-7b-v0.1", "mistral-7b-v0.3",
                                         "mixtral-8x7b-instruct-v0.1"])))
    top["num_hidden_layers"] = n = _layers(draw)
    draw(_attention(top))
    _put(top, "sliding_window", draw(st.sampled_from([ABSENT, None, 64, 4096, 131072])))
    if draw(st.booleans()):
        extra = draw(st.sampled_from([0, 0, 0, 1]))
        top["layer_types"] = [draw(st.sampled_from(["full_attention", "sliding_attention"])) for _ in range(n + extra)]
    draw(_length(top))
    draw(_dtype(top, top))
    return top


@st.composite
def qwen(draw):
    top = _fixture(draw(st.sampled_from(["qwen2.5-7b-instruct", "qwen3-8b", "qwen3-30b-a3b", "qwen1.5-moe-a2.7b"])))
    top["num_hidden_layers"] = n = _layers(draw)
    draw(_attention(top, head_dim=top["model_type"] != "qwen2"))
    _put(top, "sliding_window", draw(st.sampled_from([ABSENT, None, 128, 4096, 131072])))
    _put(top, "use_sliding_window", draw(st.sampled_from([ABSENT, False, True])))
    _put(top, "max_window_layers", draw(st.sampled_from([ABSENT, 0, n, n // 2])))
    if draw(st.booleans()):  # files saved by transformers 5 list layer_types
        pick = draw(st.sampled_from(["full", "sliding", "mixed"]))
        if pick == "sliding" and top["model_type"] == "qwen2_moe" and top.get("use_sliding_window") is not True:
            pick = "mixed"  # a 0-token window vLLM builds and kvref refuses (docs/size.md)
        top["layer_types"] = [{"full": "full_attention", "sliding": "sliding_attention"}.get(
            pick, draw(st.sampled_from(["full_attention", "sliding_attention"]))) for _ in range(n)]
    draw(_length(top))
    draw(_dtype(top, top))
    return top


@st.composite
def gemma(draw):
    name = draw(st.sampled_from(["gemma-2-9b-it", "gemma-2-27b-it", "gemma-3-27b-it", "gemma-3-1b-it"]))
    top = _fixture(name)
    t = top.get("text_config", top)
    t["num_hidden_layers"] = n = _layers(draw)
    draw(_attention(t))
    _put(t, "sliding_window", draw(st.sampled_from([ABSENT, None, 512, 1024, 4096])))
    if "gemma-3" in name:
        _put(t, "sliding_window_pattern", draw(st.sampled_from([ABSENT, 2, 6])))
    if draw(st.booleans()):  # one too many now and then: both must refuse
        extra = draw(st.sampled_from([0, 0, 0, 1]))
        t["layer_types"] = [draw(st.sampled_from(["full_attention", "sliding_attention"])) for _ in range(n + extra)]
    draw(_length(t, rope="gemma-3" not in name))
    draw(_dtype(top, t))
    return top


@st.composite
def gpt_oss(draw):
    top = _fixture(draw(st.sampled_from(["gpt-oss-20b", "gpt-oss-120b"])))
    top["num_hidden_layers"] = n = _layers(draw)
    top["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    draw(_attention(top))
    _put(top, "sliding_window", draw(st.sampled_from([ABSENT, None, 64, 128, 256])))
    draw(_length(top))
    draw(_dtype(top, top))
    return top


@st.composite
def llama4(draw):
    top = _fixture(draw(st.sampled_from(["llama-4-scout-17b-16e-instruct", "llama-4-maverick-17b-128e-instruct"])))
    t = top["text_config"]
    t["num_hidden_layers"] = n = _layers(draw)
    draw(_attention(t))
    _put(t, "attention_chunk_size", draw(st.sampled_from([ABSENT, None, 2048, 8192])))
    how = draw(st.sampled_from(["empty", "list", "interval"]))
    if how == "list":
        t["no_rope_layers"] = [draw(st.sampled_from([0, 1])) for _ in range(n)]
    elif how == "interval":
        t["no_rope_layers"] = []
        t["no_rope_layer_interval"] = draw(st.sampled_from([2, 4]))
    draw(_length(t))
    draw(_dtype(top, t))
    return top


@st.composite
def deepseek(draw):
    top = _fixture(draw(st.sampled_from(["deepseek-v2-lite", "deepseek-v2", "deepseek-v3"])))
    top["num_hidden_layers"] = _layers(draw)
    top["num_attention_heads"] = heads = draw(st.sampled_from([16, 32, 64, 128]))
    top["num_key_value_heads"] = heads
    top["kv_lora_rank"] = draw(st.sampled_from([256, 512]))
    top["qk_rope_head_dim"] = draw(st.sampled_from([32, 64]))
    draw(_length(top))
    draw(_dtype(top, top))
    return top


@st.composite
def qwen3_next(draw):
    top = _fixture("qwen3-next-80b-a3b-instruct")
    top["num_hidden_layers"] = n = _layers(draw, 2)
    draw(_attention(top))
    if draw(st.booleans()):
        top["layer_types"] = [draw(st.sampled_from(["linear_attention", "full_attention"])) for _ in range(n)]
    else:
        top["full_attention_interval"] = draw(st.sampled_from([2, 4, 8]))
    top["linear_num_key_heads"] = nk = draw(st.sampled_from([8, 16]))
    top["linear_num_value_heads"] = nk * draw(st.sampled_from([1, 2, 4]))
    top["linear_key_head_dim"] = draw(st.sampled_from([64, 128]))
    top["linear_value_head_dim"] = draw(st.sampled_from([64, 128]))
    top["linear_conv_kernel_dim"] = draw(st.sampled_from([2, 4]))
    draw(_length(top, rope=False))
    draw(_dtype(top, top))
    return top


@st.composite
def nemotron_h(draw):
    top = _fixture("nemotron-h-8b-base-8k")
    # at least one layer with a cache (kvref refuses a model without one: nothing to size)
    pattern = "".join(draw(st.lists(st.sampled_from("MM*-E"), min_size=2, max_size=60).filter(
        lambda p: "M" in p or "*" in p)))
    top["hybrid_override_pattern"] = pattern
    top["num_hidden_layers"] = len(pattern)
    draw(_attention(top))
    top["mamba_num_heads"] = draw(st.sampled_from([32, 64, 128]))
    top["mamba_head_dim"] = draw(st.sampled_from([32, 64]))
    top["n_groups"] = draw(st.sampled_from([1, 2, 3, 8]))
    top["ssm_state_size"] = draw(st.sampled_from([64, 128]))
    top["conv_kernel"] = draw(st.sampled_from([2, 4]))
    _put(top, "mamba_ssm_cache_dtype", draw(st.sampled_from([ABSENT, "float32", "bfloat16"])))
    draw(_length(top, rope=False))
    draw(_dtype(top, top))
    return top


@st.composite
def jamba(draw):
    top = _fixture("jamba-v0.1")
    top["num_hidden_layers"] = _layers(draw, 2)
    draw(_attention(top, head_dim=False))
    top["attn_layer_period"] = period = draw(st.sampled_from([2, 4, 8]))
    top["attn_layer_offset"] = draw(st.integers(0, period - 1))
    top["mamba_expand"] = draw(st.sampled_from([1, 2]))
    top["mamba_d_state"] = draw(st.sampled_from([16, 32]))
    top["mamba_d_conv"] = draw(st.sampled_from([2, 4]))
    draw(_length(top, rope=False))
    draw(_dtype(top, top))
    return top


@st.composite
def granite(draw):
    top = _fixture("granite-4.0-h-tiny")
    top["num_hidden_layers"] = n = _layers(draw, 2)
    top["layer_types"] = [draw(st.sampled_from(["mamba", "mamba", "attention"])) for _ in range(n)]
    draw(_attention(top, head_dim=False))
    top["mamba_n_heads"] = heads = draw(st.sampled_from([16, 32, 48, 64]))
    top["mamba_expand"] = 2
    _put(top, "mamba_d_head", draw(st.sampled_from([ABSENT, "auto", 2 * top["hidden_size"] // heads, 64])))
    top["mamba_n_groups"] = draw(st.sampled_from([1, 2]))
    top["mamba_d_state"] = draw(st.sampled_from([64, 128]))
    draw(_length(top, rope=False))
    draw(_dtype(top, top))
    return top


@st.composite
def falcon_h1(draw):
    top = _fixture("falcon-h1-7b-instruct")
    top["num_hidden_layers"] = _layers(draw)
    draw(_attention(top))
    top["mamba_n_heads"] = heads = draw(st.sampled_from([8, 16, 24]))
    top["mamba_d_head"] = d_head = draw(st.sampled_from([64, 128]))
    _put(top, "mamba_d_ssm", draw(st.sampled_from([ABSENT, None, heads * d_head, 1024])))
    top["mamba_expand"] = draw(st.sampled_from([1, 2]))
    top["mamba_n_groups"] = draw(st.sampled_from([1, 2]))
    top["mamba_d_state"] = draw(st.sampled_from([64, 256]))
    draw(_length(top, rope=False))
    draw(_dtype(top, top))
    return top


@st.composite
def zamba2(draw):
    top = _fixture("zamba2-2.7b")
    n = _layers(draw, 2)
    top["layers_block_type"] = [draw(st.sampled_from(["mamba", "mamba", "hybrid"])) for _ in range(n)]
    _put(top, "num_hidden_layers", draw(st.sampled_from([ABSENT, n, 54])))  # vLLM counts layers_block_type
    top["num_attention_heads"] = heads = draw(st.sampled_from([8, 16, 32]))
    top["num_key_value_heads"] = heads
    top["hidden_size"] = hidden = draw(st.sampled_from([1024, 2560]))
    _put(top, "attention_head_dim", draw(st.sampled_from([ABSENT, 2 * hidden // heads, 64])))
    top["n_mamba_heads"] = mheads = draw(st.sampled_from([16, 32, 80]))
    top["mamba_expand"] = 2
    _put(top, "mamba_headdim", draw(st.sampled_from([ABSENT, 2 * hidden // mheads])))
    top["mamba_ngroups"] = draw(st.sampled_from([1, 2]))
    top["mamba_d_state"] = draw(st.sampled_from([16, 64]))
    _put(top, "use_long_context", draw(st.sampled_from([ABSENT, True, False])))
    draw(_length(top, rope=False))
    draw(_dtype(top, top))
    return top


@st.composite
def pure_mamba(draw):
    top = _fixture(draw(st.sampled_from(["mamba-2.8b-hf", "mamba2-2.7b"])))
    if top["model_type"] == "mamba" and draw(st.booleans()):
        top.update(architectures=["FalconMambaForCausalLM"], model_type="falcon_mamba")
    top["num_hidden_layers"] = _layers(draw)
    top["hidden_size"] = hidden = draw(st.sampled_from([768, 1024, 2560]))
    top["expand"] = draw(st.sampled_from([1, 2]))
    top["state_size"] = draw(st.sampled_from([16, 64, 128]))
    top["conv_kernel"] = draw(st.sampled_from([2, 4]))
    if top["model_type"] in ("mamba", "falcon_mamba"):  # a file's intermediate_size wins over expand
        _put(top, "intermediate_size", draw(st.sampled_from([ABSENT, top["expand"] * hidden, 5120])))
    else:
        top["head_dim"] = head_dim = draw(st.sampled_from([32, 64]))
        exact = top["expand"] * hidden // head_dim
        top["num_heads"] = draw(st.sampled_from([exact, exact, exact + 1]))
        top["n_groups"] = draw(st.sampled_from([1, 2, 8]))
    draw(_dtype(top, top))
    return top


FAMILIES = {"llama": llama_like, "qwen": qwen, "gemma": gemma, "gpt_oss": gpt_oss, "llama4": llama4,
            "deepseek": deepseek, "qwen3_next": qwen3_next, "nemotron_h": nemotron_h, "jamba": jamba,
            "granite": granite, "falcon_h1": falcon_h1, "zamba2": zamba2, "pure_mamba": pure_mamba}


@st.composite
def engine_args(draw, config: dict) -> dict:
    kw: dict = {"tensor_parallel_size": draw(st.sampled_from([1, 1, 2, 3, 4, 8]))}
    if draw(st.booleans()):
        kw["block_size"] = draw(st.sampled_from([16, 32, 64]))
    kw["kv_cache_dtype"] = draw(st.sampled_from(["auto", "auto", "fp8", "fp8_e5m2", "bfloat16"]))
    kw["mamba_ssm_cache_dtype"] = draw(st.sampled_from(["auto", "auto", "float32", "bfloat16", "float16"]))
    kw["enable_prefix_caching"] = draw(st.booleans())
    return kw


def check_against_vllm(config: dict, kwargs: dict, tmp_dir, log=note) -> str:
    """kvref and vLLM agree on ``config`` and ``kwargs``: the same facts, or both reject it.
    Returns ``"ok"`` or ``"rejected"``."""
    from kvref.impl.vllm.model_config import vllm_hf_facts

    (tmp_dir / "config.json").write_text(json.dumps(config))
    vkw = {k: v for k, v in kwargs.items() if k != "block_size"}
    try:
        facts = vllm_hf_facts(str(tmp_dir), block_size=kwargs.get("block_size", 16), **vkw)
    except Exception as exc:  # noqa: BLE001 - any rejection by vLLM or transformers counts
        log(f"vLLM rejects: {type(exc).__name__}: {exc}")
        with pytest.raises(InvalidFieldError):
            layout_from_hf_config(config, **kwargs)
        return "rejected"
    log(f"vLLM facts: {facts}")
    layout = layout_from_hf_config(config, **kwargs)  # an InvalidFieldError here is a false rejection
    assert_layout_matches(layout, facts)
    return "ok"


@pytest.mark.parametrize("family", sorted(FAMILIES))
@settings(max_examples=profile_examples(15, 60, 6000))
@given(data=st.data())
def test_generated_config_matches_vllm(family, data, tmp_path_factory):
    require_vllm()
    config = data.draw(FAMILIES[family](), label="config.json")
    kwargs = data.draw(engine_args(config), label="engine arguments")
    check_against_vllm(config, kwargs, tmp_path_factory.mktemp("cfg"))


#: (fixture, text-config edits, engine arguments, outcome): each difference the generated test found,
#: and both paths, kept as fixed cases so that CI sees them whatever the random draws
CASES = [
    ("llama-3.1-8b", {}, {"tensor_parallel_size": 3}, "rejected"),  # heads % TP (verify_with_parallel_config)
    ("llama-3.1-8b", {}, {"tensor_parallel_size": 16}, "ok"),  # KV heads replicated (16 % 8 == 0)
    ("llama-3.1-8b", {"num_attention_heads": 24, "num_key_value_heads": 6}, {"tensor_parallel_size": 4},
     "rejected"),  # KV heads neither divided nor replicated whole (QKVParallelLinear)
    ("llama-4-scout-17b-16e-instruct", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, {},
     "ok"),  # a nested text_config's RoPE factor does not scale the length
    ("llama-4-scout-17b-16e-instruct", {"attention_chunk_size": None}, {}, "ok"),  # null chunk: all full
    ("gemma-2-9b-it", {"sliding_window": None}, {}, "ok"),  # null window: all full
    ("gpt-oss-20b", {"sliding_window": None}, {}, "ok"),
    ("qwen3-8b", {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 28}, {},
     "rejected"),  # layers 28.. slide (transformers): mixed layer types, qwen2.py refuses
    ("qwen2.5-7b-instruct", {"use_sliding_window": True, "num_hidden_layers": 40}, {},
     "rejected"),  # max_window_layers 28 < 40 layers: the same
    ("qwen3-8b", {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 0}, {},
     "ok"),  # every layer slides
    ("qwen3-30b-a3b", {"use_sliding_window": True, "sliding_window": 4096}, {}, "ok"),  # Qwen3-MoE: all slide
    ("mixtral-8x7b-instruct-v0.1", {"sliding_window": 4096, "layer_types": ["sliding_attention", "full_attention"] * 16},
     {}, "ok"),  # mixtral.py: no per-layer window -> all full
    ("qwen3-8b", {"head_dim": None}, {}, "rejected"),  # Qwen3Config types head_dim as int
    ("qwen1.5-moe-a2.7b", {"num_key_value_heads": None}, {}, "rejected"),
    ("granite-4.0-h-tiny", {"mamba_d_head": 32}, {}, "rejected"),  # transformers' validate_architecture
    ("mamba2-2.7b", {"num_heads": 81}, {}, "rejected"),
    ("zamba2-2.7b", {"layers_block_type": ["mamba", "mamba"], "num_hidden_layers": 2, "hidden_size": 1024,
                     "num_attention_heads": 8, "attention_head_dim": 64}, {},
     "rejected"),  # no hybrid layer, but Zamba2Model builds its shared attention blocks (and their check) eagerly
    ("falcon-h1-7b-instruct", {}, {"tensor_parallel_size": 2, "enable_prefix_caching": False}, "ok"),
    ("mamba-2.8b-hf", {}, {"mamba_ssm_cache_dtype": "float32"}, "ok"),
    ("mamba-2.8b-hf", {"architectures": ["FalconMambaForCausalLM"], "model_type": "falcon_mamba"},
     {"tensor_parallel_size": 2}, "ok"),  # registry: mamba.py's MambaForCausalLM
]


@pytest.mark.parametrize("name, edits, kwargs, outcome", CASES,
                         ids=[f"{n}-{'-'.join(map(str, {**e, **k}))}" for n, e, k, _ in CASES])
def test_found_cases(name, edits, kwargs, outcome, tmp_path):
    require_vllm()
    config = _fixture(name)
    config.get("text_config", config).update(edits)
    assert check_against_vllm(config, kwargs, tmp_path, print) == outcome


def test_deliberate_difference_qwen2_moe_zero_window(tmp_path):
    """Qwen2-MoE listing only sliding layers without ``use_sliding_window``: vLLM builds a 0-token
    window on every layer; kvref refuses the file (docs/size.md, deliberate differences)."""
    from kvref.impl.vllm.model_config import vllm_hf_facts

    require_vllm()
    config = _fixture("qwen1.5-moe-a2.7b")
    config.update(num_hidden_layers=2, layer_types=["sliding_attention"] * 2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    facts = vllm_hf_facts(str(tmp_path))
    assert (facts["layer_kinds"], facts["sliding_window"]) == (["sliding_window"] * 2, 0)
    with pytest.raises(InvalidFieldError, match="use_sliding_window"):
        layout_from_hf_config(config)
