"""Layouts derived from the packaged ``config.json`` fixtures, against figures derived by hand here.

Each expected figure is worked out in the comment beside it from the model card's values (the
same values the fixture holds), so a wrong rule in :mod:`kvref.spec.hf_config` fails on a number a
reader can check. ``tests/conformance/test_hf_config_conformance.py`` compares the same layouts
with vLLM's own derivation.
"""

from __future__ import annotations

import json
from importlib import resources

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvref.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    InvalidFieldError,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    plan_kv_cache,
)
from kvref.spec.hf_config import (
    SUPPORTED_ARCHITECTURES,
    derived_max_model_len,
    hybrid_attention_block_size,
    layout_from_hf_config,
)

from tests.conftest import profile_examples


def fixture(name: str) -> dict:
    return json.loads((resources.files("kvref") / "examples" / "hf_configs" / f"{name}.json").read_text())


def fixture_names() -> list[str]:
    root = resources.files("kvref") / "examples" / "hf_configs"
    return sorted(p.name.removesuffix(".json") for p in root.iterdir() if p.name.endswith(".json"))


# name -> (counts per kind, block size, derived max_model_len, num_kv_heads, head_size, page bytes of layer 0's kind)
EXPECTED = {
    # 32 layers, GQA 8 x 128, bf16: page = 16 tokens x 8 heads x (128 K + 128 V) x 2 B = 65,536;
    # 131072 positions, llama3 RoPE is pre-scaled (no factor)
    "llama-3.1-8b": ({"full": 32}, 16, 131072, 8, 128, 65536),
    # Mistral-7B-v0.1: sliding_window 4096 and no layer_types: every layer slides
    "mistral-7b-v0.1": ({"sliding_window": 32}, 16, 32768, 8, 128, 65536),
    # use_sliding_window false clears sliding_window 131072: full attention; 4 KV heads x 128
    "qwen2.5-7b-instruct": ({"full": 28}, 16, 32768, 4, 128, 32768),
    "qwen3-8b": ({"full": 36}, 16, 40960, 8, 128, 65536),
    # MoE changes the MLP only: 48 full-attention layers, 4 KV heads x 128 -> 16 x 4 x 256 x 2 = 32,768
    "qwen3-30b-a3b": ({"full": 48}, 16, 40960, 4, 128, 32768),
    # Mixtral: no sliding window ("sliding_window": null; MixtralConfig defaults to None as well)
    "mixtral-8x7b-instruct-v0.1": ({"full": 32}, 16, 32768, 8, 128, 65536),
    # 42 layers alternate, even ones sliding (4096); head_dim 256 -> 16 x 8 x 512 x 2 = 131,072;
    # float32 checkpoint served in bf16
    "gemma-2-9b-it": ({"sliding_window": 21, "full": 21}, 16, 8192, 8, 256, 131072),
    # 62 layers, pattern 6: full at 5, 11, ..., 59 -> 10 full, 52 sliding (1024); 16 x 128 heads;
    # linear RoPE factor 8 NOT applied (Gemma-3's length is already scaled)
    "gemma-3-27b-it": ({"sliding_window": 52, "full": 10}, 16, 131072, 16, 128, 131072),
    # 24 layers, even ones sliding (128); 8 x 64 heads: 16 x 8 x 128 x 2 = 32,768; YaRN: no factor
    "gpt-oss-20b": ({"sliding_window": 12, "full": 12}, 16, 131072, 8, 64, 32768),
    # 48 layers, every 4th NoPE (full), 36 chunked (8192); llama3 RoPE pre-scaled: 10,485,760
    "llama-4-scout-17b-16e-instruct": ({"chunked_local": 36, "full": 12}, 16, 10485760, 8, 128, 65536),
    # MLA: 1 head of 512 + 64 = 576, bf16, block 64: 64 x 576 x 2 = 73,728; YaRN: no factor
    "deepseek-v3": ({"mla": 61}, 64, 163840, 1, 576, 73728),
    "deepseek-v2-lite": ({"mla": 27}, 64, 163840, 1, 576, 73728),
    # 48 layers, every 4th full: 12 full, 36 gated delta net. Attention 2 x 256 x 2 x 2 = 2,048 B/token.
    # GDN state: conv (3, 128*16*2 + 128*32 = 8192) bf16 = 49,152 + (32, 128, 128) bf16 = 1,048,576
    # -> 1,097,728 B; block = 16 * cdiv(1,097,728, 16 * 2,048) = 16 * 34 = 544 (vLLM logs 544);
    # page = 544 x 2,048 = 1,114,112
    "qwen3-next-80b-a3b-instruct": ({"mamba": 36, "full": 12}, 544, 262144, 2, 256, 1114112),
    # pattern: 24 M, 4 *, 24 -. Attention 8 x 128 x 2 x 2 = 4,096 B/token. Mamba2: conv
    # (3, 128*64 + 2*8*128 = 10240) bf16 = 61,440 + SSM (128, 64, 128) float32 = 4,194,304 -> 4,255,744;
    # block = 16 * cdiv(4,255,744, 65,536) = 16 * 65 = 1,040; page 4,259,840
    "nemotron-h-8b-base-8k": ({"mamba": 24, "full": 4}, 1040, 8192, 8, 128, 4259840),
    # attention at i % 8 == 4: 4 of 32. Mamba1: conv (3, 2*4096) bf16 = 49,152 + SSM (8192, 16) bf16
    # = 262,144 -> 311,296; block = 16 * cdiv(311,296, 65,536) = 80; page 80 x 4,096 = 327,680
    "jamba-v0.1": ({"mamba": 28, "full": 4}, 80, 262144, 8, 128, 327680),
    # 26 layers, pattern 6: full at 5, 11, 17, 23; 1 KV head x 256: 16 x 1 x 512 x 2 = 16,384; no RoPE scaling
    "gemma-3-1b-it": ({"sliding_window": 22, "full": 4}, 16, 32768, 1, 256, 16384),
    # 46 layers alternate; 16 x 128: 16 x 16 x 256 x 2 = 131,072
    "gemma-2-27b-it": ({"sliding_window": 23, "full": 23}, 16, 8192, 16, 128, 131072),
    # 36 layers, even ones sliding; YaRN: no factor
    "gpt-oss-120b": ({"sliding_window": 18, "full": 18}, 16, 131072, 8, 64, 32768),
    # as Scout, 1,048,576 positions and no RoPE scaling
    "llama-4-maverick-17b-128e-instruct": ({"chunked_local": 36, "full": 12}, 16, 1048576, 8, 128, 65536),
    "deepseek-v2": ({"mla": 60}, 64, 163840, 1, 576, 73728),
    # use_sliding_window false: full; 8192 / 64 = 128 per head
    "qwen2.5-72b-instruct": ({"full": 80}, 16, 32768, 8, 128, 65536),
    # "sliding_window": null: full attention
    "mistral-7b-v0.3": ({"full": 32}, 16, 32768, 8, 128, 65536),
    # Qwen2-MoE, use_sliding_window false; 16 KV heads x 2048 / 16 = 128: 16 x 16 x 256 x 2 = 131,072
    "qwen1.5-moe-a2.7b": ({"full": 24}, 16, 8192, 16, 128, 131072),
    # 4 attention of 40; 4 KV x 1536 / 12 = 128: 2,048 B/token. Mamba2: conv (3, 3072 + 2*1*128 = 3328)
    # bf16 = 19,968 + SSM (48, 64, 128) bf16 = 786,432 -> 806,400; block 16 * cdiv(806,400, 32,768) = 400
    "granite-4.0-h-tiny": ({"mamba": 36, "full": 4}, 400, 131072, 4, 128, 819200),
    # every layer attention + Mamba2; 2 KV x 128: 1,024 B/token. conv (3, 3072 + 2*1*256 = 3584) bf16
    # = 21,504 + SSM (24, 128, 256) bf16 = 1,572,864 -> 1,594,368; block 16 * cdiv(., 16,384) = 1,568
    "falcon-h1-7b-instruct": ({"mamba": 44, "full": 44}, 1568, 262144, 2, 128, 1605632),
    # attention-free: no alignment, block 16, no padding; no length key: 2048. float32 served in bf16.
    # Mamba1: conv (3, 5120) bf16 = 30,720 + SSM (5120, 16) bf16 = 163,840
    "mamba-2.8b-hf": ({"mamba": 64}, 16, 2048, None, None, 194560),
    # Mamba2: conv (3, 5120 + 2*1*128 = 5376) bf16 = 32,256 + SSM (80, 64, 128) bf16 = 1,310,720
    "mamba2-2.7b": ({"mamba": 64}, 16, 2048, None, None, 1342976),
    # 54 Mamba2 layers, 9 of them hybrid (+ attention): 32 KV heads x 160 (2 * 2560 / 32): 20,480 B/token.
    # Mamba2: conv (3, 5120 + 2*1*64 = 5248) bf16 = 31,488 + SSM (80, 64, 64) bf16 = 655,360 -> 686,848;
    # block 16 * cdiv(686,848, 327,680) = 48; page 48 x 20,480 = 983,040
    "zamba2-2.7b": ({"mamba": 54, "full": 9}, 48, 4096, 32, 160, 983040),
}


def test_every_fixture_has_expected_figures():
    assert sorted(EXPECTED) == fixture_names()


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_layout(name):
    counts, block, derived, kv_heads, head, page = EXPECTED[name]
    layout = layout_from_hf_config(fixture(name))
    assert layout.counts() == counts
    assert layout.block_size == block
    assert layout.derived_max_model_len == derived
    attn = [s for s in layout.layers.values() if not isinstance(s, MambaSpec)]
    assert {(s.num_kv_heads, s.head_size, s.block_size) for s in attn} == \
        ({(kv_heads, head, block)} if kv_heads is not None else set())
    assert {s.page_size_bytes for s in layout.layers.values()} == {page}
    # the layout plans: every fixture fits one request of 32k tokens (or its own length) in 80 GiB
    config = layout.engine_config(max_model_len=min(derived, 32768), max_num_batched_tokens=8192)
    plan = plan_kv_cache(layout.layers, config, 80 << 30)
    plan.check_invariants()
    assert plan.max_model_len == min(derived, 32768)


def test_windows_and_chunks():
    gemma2 = layout_from_hf_config(fixture("gemma-2-9b-it"))
    kinds = [type(s) for s in gemma2.layers.values()]
    assert kinds[:4] == [SlidingWindowSpec, FullAttentionSpec, SlidingWindowSpec, FullAttentionSpec]
    assert {s.sliding_window for s in gemma2.layers.values() if isinstance(s, SlidingWindowSpec)} == {4096}
    gemma3 = list(layout_from_hf_config(fixture("gemma-3-27b-it")).layers.values())
    assert [i for i, s in enumerate(gemma3) if type(s) is FullAttentionSpec] == list(range(5, 62, 6))
    llama4 = list(layout_from_hf_config(fixture("llama-4-scout-17b-16e-instruct")).layers.values())
    assert [i for i, s in enumerate(llama4) if type(s) is FullAttentionSpec] == list(range(3, 48, 4))
    assert {s.attention_chunk_size for s in llama4 if isinstance(s, ChunkedLocalAttentionSpec)} == {8192}


def test_llama4_disables_the_hybrid_manager_unless_allowed():
    data = fixture("llama-4-scout-17b-16e-instruct")
    default = layout_from_hf_config(data)
    assert default.disable_hybrid_kv_cache_manager and default.engine_config().disable_hybrid_kv_cache_manager
    assert any("VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE" in n for n in default.notes)
    allowed = layout_from_hf_config(data, allow_chunked_local_with_hybrid=True)
    assert not allowed.disable_hybrid_kv_cache_manager
    # promoted to full attention, one group; kept local, two groups
    assert len(plan_kv_cache(default.layers, default.engine_config(max_model_len=65536), 40 << 30).groups) == 1
    assert len(plan_kv_cache(allowed.layers, allowed.engine_config(max_model_len=65536), 40 << 30).groups) > 1


def test_mla_fp8_ds_mla_packs_656_bytes_per_token():
    layout = layout_from_hf_config(fixture("deepseek-v3"), kv_cache_dtype="fp8_ds_mla")
    spec = next(iter(layout.layers.values()))
    assert isinstance(spec, MLAAttentionSpec) and spec.page_size_bytes == 64 * 656
    with pytest.raises(InvalidFieldError, match="kv_cache_dtype"):
        layout_from_hf_config(fixture("llama-3.1-8b"), kv_cache_dtype="fp8_ds_mla")


def test_fp8_and_block_size_flags():
    layout = layout_from_hf_config(fixture("llama-3.1-8b"), kv_cache_dtype="fp8", block_size=32)
    spec = next(iter(layout.layers.values()))
    assert (spec.dtype, spec.block_size, spec.page_size_bytes) == ("fp8", 32, 32 * 8 * 256)


def test_tensor_parallel_splits_heads_and_states():
    llama = layout_from_hf_config(fixture("llama-3.1-8b"), tensor_parallel_size=16)
    assert next(iter(llama.layers.values())).num_kv_heads == 1  # 8 heads over 16 ranks: replicated
    qn = layout_from_hf_config(fixture("qwen3-next-80b-a3b-instruct"), tensor_parallel_size=2)
    mamba = next(s for s in qn.layers.values() if isinstance(s, MambaSpec))
    assert mamba.shapes == ((3, 4096), (16, 128, 128))
    # attention 1 head x 256 x 2 x 2 = 1,024 B/token; state 548,864 B -> 16 * cdiv(548,864, 16,384) = 544
    assert qn.block_size == 544
    with pytest.raises(InvalidFieldError, match="tensor_parallel_size"):
        layout_from_hf_config(fixture("qwen3-next-80b-a3b-instruct"), tensor_parallel_size=3)


def test_mamba_without_prefix_caching_uses_max_model_len_blocks():
    layout = layout_from_hf_config(fixture("jamba-v0.1"), enable_prefix_caching=False, max_model_len=32768)
    mamba = next(s for s in layout.layers.values() if isinstance(s, MambaSpec))
    assert (layout.mamba_cache_mode, mamba.mamba_cache_mode, mamba.block_size) == ("none", "none", 32768)
    assert layout.block_size == 80  # the attention block still covers one state


def test_mamba_ssm_dtype_override_changes_the_block():
    # Jamba with a float32 SSM state: 49,152 + 8192 x 16 x 4 = 573,440 B -> 16 * cdiv(573,440, 65,536) = 144
    layout = layout_from_hf_config(fixture("jamba-v0.1"), mamba_ssm_cache_dtype="float32")
    assert layout.block_size == 144
    # Nemotron-H with a bf16 SSM state: 61,440 + 2,097,152 = 2,158,592 -> 16 * 33 = 528
    assert layout_from_hf_config(fixture("nemotron-h-8b-base-8k"), mamba_ssm_cache_dtype="bfloat16").block_size == 528


def test_hybrid_block_size_formula():
    assert hybrid_attention_block_size(2048, 1097728, block_size=16) == 544
    assert hybrid_attention_block_size(2048, 1097728, block_size=64) == 576  # 64 * cdiv(.., 131072) = 64 * 9
    assert hybrid_attention_block_size(4096, 100, block_size=16) == 16  # never below the block size
    assert hybrid_attention_block_size(1152, 1097728, block_size=64, use_mla=True) == 1024  # 128 * 8
    assert hybrid_attention_block_size(2048, 1097728, block_size=16, checkpoint_alignment=64,
                                       align_mode=True) == 576


def test_derived_length_rules():
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
            "num_attention_heads": 4, "hidden_size": 256}
    assert derived_max_model_len({**base, "max_position_embeddings": 4096}) == 4096
    assert derived_max_model_len({**base, "max_position_embeddings": 4096,
                                  "rope_scaling": {"rope_type": "linear", "factor": 4.0}}) == 16384
    assert derived_max_model_len({**base, "max_position_embeddings": 4096,
                                  "rope_scaling": {"type": "yarn", "factor": 4.0}}) == 4096
    assert derived_max_model_len({**base, "max_position_embeddings": 4096, "seq_length": 2048}) == 2048
    assert derived_max_model_len(base) == 2048  # llama's class default max_position_embeddings


def test_explicit_null_window_is_full_attention():
    data = fixture("mistral-7b-v0.1")
    assert layout_from_hf_config({**data, "sliding_window": None}).counts() == {"full": 32}
    data.pop("sliding_window")  # absent: MistralConfig's default 4096
    assert layout_from_hf_config(data).counts() == {"sliding_window": 32}


def test_unsupported_architecture_names_itself_and_the_supported_ones():
    with pytest.raises(InvalidFieldError) as info:
        layout_from_hf_config({"architectures": ["FalconForCausalLM"], "num_hidden_layers": 2})
    msg = str(info.value)
    assert "FalconForCausalLM" in msg and "Qwen3NextForCausalLM" in msg and "GptOssForCausalLM" in msg
    assert info.value.field == "architectures"
    with pytest.raises(InvalidFieldError, match="architectures"):
        layout_from_hf_config({"model_type": "llama"})
    assert len(SUPPORTED_ARCHITECTURES) >= 15


@pytest.mark.parametrize("change, field", [
    ({"num_hidden_layers": None}, "num_hidden_layers"),
    ({"num_hidden_layers": "32"}, "num_hidden_layers"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"torch_dtype": "int4"}, "torch_dtype"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"rope_scaling": "yarn"}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "linear", "factor": "4"}}, "rope_scaling.factor"),
    ({"rope_scaling": {"rope_type": "linear", "factor": float("inf")}}, "rope_scaling.factor"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
])
def test_bad_config_values_name_the_key(change, field):
    data = {**fixture("llama-3.1-8b"), **change}
    with pytest.raises(InvalidFieldError) as info:
        layout_from_hf_config(data)
    assert info.value.field.endswith(field)


def test_qwen2_partial_sliding_window_is_rejected_like_vllm():
    data = {**fixture("qwen2.5-7b-instruct"), "use_sliding_window": True, "max_window_layers": 14}
    with pytest.raises(InvalidFieldError, match="max_window_layers"):
        layout_from_hf_config(data)
    every = layout_from_hf_config({**data, "max_window_layers": 0})
    assert every.counts() == {"sliding_window": 28}


@pytest.mark.parametrize("kwargs, field", [
    ({"kv_cache_dtype": "int3"}, "kv_cache_dtype"),
    ({"block_size": 0}, "block_size"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"mamba_ssm_cache_dtype": "fp8"}, "mamba_ssm_cache_dtype"),
    ({"mamba_cache_mode": "sometimes"}, "mamba_cache_mode"),
])
def test_bad_arguments_name_the_argument(kwargs, field):
    with pytest.raises(InvalidFieldError) as info:
        layout_from_hf_config(fixture("jamba-v0.1"), **kwargs)
    assert info.value.field == field


@settings(max_examples=profile_examples(100, 500, 20000), deadline=None)
@given(per_token=st.integers(1, 1 << 16), state=st.integers(1, 1 << 26), block=st.sampled_from([1, 16, 32, 64, 128]),
       kernel=st.sampled_from([1, 16, 32, 64]), mla=st.booleans(), ckpt=st.sampled_from([None, 64, 96]),
       align_mode=st.booleans())
def test_hybrid_block_size_is_the_smallest_aligned_block_covering_the_state(per_token, state, block, kernel, mla,
                                                                             ckpt, align_mode):
    """What _align_hybrid_block_size promises: the attention page covers the Mamba state, the block
    is aligned, never below the configured block, and one alignment step less would not cover."""
    from math import lcm

    bs = hybrid_attention_block_size(per_token, state, block_size=block, kernel_block_size=kernel, use_mla=mla,
                                     checkpoint_alignment=ckpt, align_mode=align_mode)
    align = max(kernel, block, 128 if mla else 1)
    if align_mode and ckpt:
        align = lcm(align, ckpt)
    assert bs >= block and bs % kernel == 0 and bs * per_token >= state
    if bs > block:
        assert bs % align == 0 and bs * per_token >= state
        assert (bs - align) * per_token < state or bs - align < block


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-3, 10**12) | st.floats(allow_nan=True)
                     | st.text(max_size=8), lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)


@settings(max_examples=profile_examples(150, 600, 30000), deadline=None)
@given(name=st.sampled_from(sorted(EXPECTED)), data=st.data(), value=_JSON)
def test_any_wrong_value_is_an_input_error(name, data, value):
    """Whatever value a config.json key holds, derivation returns a layout or raises a ValueError
    (kvref's InvalidFieldError naming the field) — never a TypeError/KeyError/ZeroDivisionError."""
    config = fixture(name)
    target = config["text_config"] if "text_config" in config and data.draw(st.booleans()) else config
    key = data.draw(st.sampled_from(sorted(target)))
    target[key] = value
    try:
        layout = layout_from_hf_config(config)
    except ValueError:
        return
    assert layout.layers and layout.block_size >= 1 and layout.derived_max_model_len >= 1
