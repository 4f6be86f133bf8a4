"""HiSparse startup layout: vLLM 0.33.0's ``v1/hisparse/layout.py`` vs :mod:`kvref.spec.hisparse_layout` (#22/#23).

Generated sparse-MLA layer sets (source layers with index-group leaders, indexer layers, one
block size), hot-buffer settings and host budgets; vLLM lays them out with its own
``_lay_out_hisparse_groups`` and ``create_hisparse_layout`` and the spec predicts every group
(kind, layer names in order, page size, hot blocks per request, host residency, KV transfer),
the host pool's blocks and stride, or which rule rejects the setting. Run inside
``conform-planning``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from kvref.spec.errors import InvalidFieldError, check_int
from kvref.spec.hisparse_layout import (check_hisparse_first_group, hisparse_device_buffer_size, hisparse_hot_blocks_per_request,
                                        hisparse_host_num_blocks, lay_out_hisparse_groups)

_UNIFORM = "UniformTypeKVCacheSpecs"


@dataclass(frozen=True)
class LayoutCase:
    source: tuple[tuple[str, int, bool], ...]  # (name, head_size, is_index_group_leader)
    indexer: tuple[tuple[str, int], ...]  # (name, head_size)
    block_size: int
    top_k: int
    device_buffer_size: int | None
    host_budget: int
    max_model_len: int
    flaw: str | None = None  # a spoiled first group (kvref.impl.vllm.hisparse_layout.FLAWS)


@st.composite
def layout_cases(draw) -> LayoutCase:
    block_size = draw(st.sampled_from([16, 64]))
    heads = draw(st.sampled_from([(64,), (96,), (64,), (32, 64), (32, 64, 96)]))
    n = draw(st.integers(1, 6))
    source = tuple((f"model.layers.{i}.attn", draw(st.sampled_from(heads)), draw(st.booleans()))
                   for i in range(n))
    indexer = tuple((f"model.layers.{i}.indexer", draw(st.sampled_from([32, 64, 128, 192])))
                    for i in range(draw(st.sampled_from([0, 1, 1, 2, 2, 2]))))
    top_k = draw(st.sampled_from([8, 64, 512, 2048]))
    buffer = draw(st.one_of(st.none(), st.none(), st.integers(1, 40000), st.sampled_from([top_k, 2 * top_k, 32768, 32769])))
    max_model_len = draw(st.integers(1, 4096))
    source_page = block_size * sum(h for _, h, _ in source)
    need = source_page * (-(-max_model_len // block_size) + 2)
    host_budget = draw(st.one_of(st.integers(need, 3 * need), st.integers(need, 3 * need), st.integers(0, need),
                                  st.sampled_from([need, need - 1, max(0, need - source_page)])))
    return LayoutCase(source, indexer, block_size, top_k, buffer, host_budget, max_model_len)


@st.composite
def flawed_layout_cases(draw) -> LayoutCase:
    """A layout case whose first group breaks one of vLLM's partition checks (two layers at least,
    so one can carry another block size)."""
    from dataclasses import replace

    from kvref.impl.vllm.hisparse_layout import FLAWS

    case = draw(layout_cases().filter(lambda c: len(c.source) + len(c.indexer) >= 2))
    return replace(case, flaw=draw(st.sampled_from(FLAWS)))


def _first_group_rule(case: LayoutCase) -> None:
    """kvref's view of the first group ``case.flaw`` spoils (the same layers the driver builds)."""
    names = [n for n, _, _ in case.source] + [n for n, _ in case.indexer]
    sizes = [case.block_size] * len(names)
    versions: list[str | None] = [None] * len(names)
    extra: list[str] = []
    if case.flaw == "block_size":
        sizes[-1] = 2 * case.block_size
    elif case.flaw == "deepseek_v4":
        versions[0] = "deepseek_v4"
    elif case.flaw == "full_attention":
        extra = ["model.layers.extra.attn"]
    check_hisparse_first_group(sizes, versions, extra)


def kvref_layout(case: LayoutCase) -> dict[str, Any]:
    """The spec's layout of ``case``, in the driver's normalised form; ``{"error": field}`` on a rejection."""
    bs = case.block_size
    source = [(name, bs * head, leader) for name, head, leader in case.source]
    source_page = sum(page for _, page, _ in source)
    indexer_page = sum(bs * head for _, head in case.indexer)
    try:
        _first_group_rule(case)
        check_int("indexer_page", indexer_page, minimum=1)  # vLLM partitions the layers first
        size = hisparse_device_buffer_size(1, case.top_k, case.device_buffer_size)
        device = lay_out_hisparse_groups(source, indexer_page, bs, hisparse_hot_blocks_per_request(size, bs))
        host = hisparse_host_num_blocks(case.host_budget, source_page, False, case.max_model_len, bs)
    except InvalidFieldError as exc:
        return {"error": exc.field}
    groups = [(f"HISPARSE_SOURCE:{_UNIFORM}", tuple(n for n, _, _ in source), source_page, None, True, True),
              (f"HISPARSE_INDEXER:{_UNIFORM}", tuple(n for n, _ in case.indexer), indexer_page, None, False, True)]
    for kind, names, page, blocks in device:
        spec = "HiSparseResidentSpec" if kind == "resident" else "HiSparseHotSpec"
        groups.append((f"DEFAULT:{spec}", names, page, blocks, False, False))
    return {"groups": groups, "host": host, "device_groups": len(groups) - 1}


def rejection_field(message: str) -> str:
    """The spec field matching a vLLM layout rejection message (the rule that fired)."""
    if "requires sparse-MLA and indexer" in message:
        return "indexer_page"
    if "requires uniform sparse-MLA" in message or "one resolved GPU block size" in message:
        return "block_size"
    if "DeepSeek V4" in message:
        return "model_version"
    if "MLA only" in message:
        return "layers"
    if "device_buffer_size" in message:
        return "device_buffer_size"
    if "hot-cache groups require one page size" in message:
        return "source_layers"
    if "host" in message:
        return "host_budget"
    return f"unrecognised: {message}"


def agree_layout(case: LayoutCase) -> dict[str, Any]:
    """Assert vLLM and the spec lay ``case`` out identically; return vLLM's outcome."""
    from kvref.impl.vllm.hisparse_layout import vllm_hisparse_layout

    theirs = vllm_hisparse_layout(case.source, case.indexer, case.block_size, case.top_k, case.device_buffer_size,
                                  case.host_budget, case.max_model_len, case.flaw)
    ours = kvref_layout(case)
    if "error" in theirs:
        assert ours.get("error") == rejection_field(theirs["error"]), \
            f"HiSparse layout: vLLM rejects ({theirs['error']}), kvref {ours}\n{case}"
        return theirs
    assert "error" not in ours, f"HiSparse layout: kvref rejects {ours['error']}, vLLM lays out {theirs}\n{case}"
    for key in ("host", "device_groups", "groups"):
        assert ours[key] == theirs[key], f"HiSparse layout {key}: kvref {ours[key]!r} != vLLM {theirs[key]!r}\n{case}"
    return theirs
