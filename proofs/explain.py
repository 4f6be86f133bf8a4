"""Turning a model (variable -> value) into a configuration a vLLM developer can read.

``LEGEND`` names every variable the theorems use after the vLLM field it stands for; ``explain``
adds the quantities that make the failure visible (blocks held vs. cap, need vs. pool, ...),
computed with the formula set in question.
"""

from __future__ import annotations

from typing import Any, Mapping

from .formulas import Formulas
from .ops import PyOps as o

LEGEND: dict[str, str] = {
    "sw": "SlidingWindowSpec.sliding_window", "extra": "SlidingWindowSpec.extra_retained_tokens",
    "chunk": "ChunkedLocalAttentionSpec.attention_chunk_size", "bs": "block_size",
    "page": "page_size_bytes", "k": "max_concurrent_batches (2 = async scheduling)",
    "B": "max_num_batched_tokens", "M": "max_model_len", "L": "request tokens (<= max_model_len)",
    "c": "request.num_computed_tokens at this step", "f": "request.num_in_flight_tokens",
    "n": "tokens scheduled this step",
    "nf": "# full-attention groups", "bsf": "full-attention block_size", "dcp": "decode_context_parallel_size",
    "ns": "# sliding-window groups", "bss": "sliding-window block_size", "nc": "# chunked-local groups",
    "bsc": "chunked-local block_size", "nm": "# Mamba groups", "bsm": "Mamba block_size",
    "align": "mamba_cache_mode == 'align'", "spec": "MambaSpec.num_speculative_blocks",
    "ckpt": "MambaSpec.num_prefill_checkpoint_blocks", "ckpt_flag": "a prefill checkpoint is due",
    "bpb": "pool bytes per block (_pool_bytes_per_block)", "profiled": "profiled available KV memory (bytes)",
    "override": "num_gpu_blocks_override", "override_set": "num_gpu_blocks_override is set",
    "M0": "the model's own max_model_len (auto-fit start)", "Lstar": "auto-fitted max_model_len",
    "Lp": "a larger max_model_len", "bs1": "group 1 block_size", "bs2": "group 2 block_size",
    "bs3": "group 3 block_size", "s1": "group 1 DCP-sharded", "s2": "group 2 DCP-sharded",
    "s3": "group 3 DCP-sharded", "c2": "group 2 prefix-cacheable", "c3": "group 3 prefix-cacheable",
    "unit_set": "prefix_match_unit is set", "unit": "prefix_match_unit", "m": "a common multiple",
    "cache_bs": "cache_config.block_size", "bpc": "offloading blocks_per_chunk",
    "free": "free blocks", "R": "blocks in-flight prefills still need", "spec_step": "spec-decode step blocks",
    "full_need": "full-sequence gate need of the new request", "n_new": "blocks the admission allocates now",
    "reserved": "reserved_blocks", "watermark": "watermark blocks",
    "A": "HiSparse device blocks one max_model_len request takes at admission",
    "S": "... at steady state (resident groups pinned to ACTIVE_TAIL_PAGES)",
    "H": "hisparse_host_num_blocks", "h": "host blocks one max_model_len request takes",
}


def explain(theorem_id: str, F: Formulas, v: Mapping[str, Any]) -> dict[str, Any]:
    """Derived quantities of a concrete model under formula set ``F`` (best effort)."""
    out: dict[str, Any] = {}
    try:
        if theorem_id == "T1":
            out["startup SWA blocks"] = F.startup_swa_blocks(o, v["sw"], v["extra"], v["bs"], v["k"], v["B"], v["M"])
            out["runtime SWA cap"] = F.runtime_swa_cap(o, v["sw"], v["extra"], v["bs"], v["k"], v["B"], v["M"])
            out["startup chunked-local blocks"] = F.startup_cl_blocks(o, v["chunk"], v["bs"], v["k"], v["B"], v["M"])
            out["runtime chunked-local cap"] = F.runtime_cl_cap(o, v["chunk"], v["bs"], v["k"], v["B"], v["M"])
        elif theorem_id == "T2":
            p = F.removal_basis(o, v["c"], v["f"], v["M"])
            out["processed tokens (removal basis)"] = p
            out["SWA blocks held"] = F.held_after_step(o, v["c"], v["f"], v["n"], v["M"], v["bs"],
                                                       F.swa_skipped(o, p, v["sw"], v["extra"]))
            out["SWA cap"] = F.runtime_swa_cap(o, v["sw"], v["extra"], v["bs"], v["k"], v["B"], v["M"])
            out["chunked-local blocks held"] = F.held_after_step(o, v["c"], v["f"], v["n"], v["M"], v["bs"],
                                                                 F.cl_skipped(o, p, v["chunk"]))
            out["chunked-local cap"] = F.runtime_cl_cap(o, v["chunk"], v["bs"], v["k"], v["B"], v["M"])
        elif theorem_id == "T3":
            from .theorems import _mix_gate, _mix_pages, _mix_total, _startup

            pages = _mix_pages(F, o, v, v["M"])
            _, accepted, nb = _startup(F, o, v, _mix_total(v, pages))
            out["startup blocks per request (full, swa, cl, mamba)"] = pages
            out["startup check accepts"] = accepted
            out["num_gpu_blocks (incl. null block)"] = nb
            out["gate need (full, swa, cl, mamba)"] = _mix_gate(F, o, v, v["L"])
            out["gate total vs free"] = (_mix_total(v, _mix_gate(F, o, v, v["L"])), nb - 1)
        elif theorem_id == "T4":
            from .theorems import _mix_pages, _mix_total

            out["need(L*) blocks"] = _mix_total(v, _mix_pages(F, o, v, v["Lstar"]))
            out["pool blocks"] = F.num_blocks(o, v["profiled"], True, v["override"], v["bpb"])
            out["check memory"] = F.check_memory(o, F.available_memory(o, v["profiled"], True, v["override"],
                                                                       v["bpb"]), v["bpb"])
        elif theorem_id == "T5":
            from .theorems import _t5_sizes

            raw, eff = _t5_sizes(o, v)
            out["effective block sizes"] = eff
            out["hash_block_size"] = F.hash_block_size(o, eff, (True, v["c2"], v["c3"]), v["unit_set"], v["unit"],
                                                       v["cache_bs"])
            out["scheduler_block_size"] = F.scheduler_block_size(o, eff)
        elif theorem_id == "T6":
            tpc = v["bs"] * v["bpc"]
            out["tokens per chunk"] = tpc
            out["SWA window in chunks"] = F.offload_window_swa(o, v["sw"], v["extra"], tpc)
            out["tokens the window must cover"] = max(v["sw"], v["sw"] - 1 + v["extra"])
            out["chunked-local supported"] = F.offload_supports_chunked_local
        elif theorem_id == "T7":
            table = o.cdiv(v["c"], v["bs"])
            need = min(v["c"] + v["n"], v["M"])
            cap = F.runtime_swa_cap(o, v["sw"], v["extra"], v["bs"], v["k"], v["B"], v["M"])
            out["predicted blocks"] = F.step_predicted_blocks(o, need, v["bs"], table, cap)
            out["blocks allocate_new_blocks takes"] = F.step_pulled_blocks(o, need, v["bs"], table)
        elif theorem_id == "T8":
            out["reserved_blocks"] = F.async_load_reserved(o, v["R"], v["spec_step"])
            out["free after admission"] = v["free"] - v["n_new"]
        elif theorem_id == "T9":
            out["source admission count"] = F.hisparse_source_admission(o, v["required"], v["host_free"], v["nb"])
            out["GPU blocks available"] = v["free"] - v["reserved"]
        elif theorem_id == "T10":
            num, den = F.hisparse_steady_gpu(o, v["nb"], v["A"], v["S"])
            out["steady-state GPU concurrency"] = f"{num}/{den}"
            out["admission concurrency (GPU, host)"] = f"{v['nb']}/{v['A']}, {v['H']}/{v['h']}"
    except (KeyError, ZeroDivisionError):  # pragma: no cover - partial models
        pass
    return out


_UNUSED_WHEN = (("nf", 0, ("bsf", "dcp")), ("ns", 0, ("sw", "extra", "bss")), ("nc", 0, ("chunk", "bsc")),
                ("nm", 0, ("bsm", "spec", "ckpt", "ckpt_flag", "align")), ("override_set", False, ("override",)),
                ("unit_set", False, ("unit",)))


def render_config(theorem_id: str, F: Formulas, values: Mapping[str, Any]) -> list[str]:
    """Lines ``name = value   # meaning`` plus the derived quantities; variables of group kinds
    the configuration does not use (count 0, no override...) are left out of the listing."""
    hidden = {name for key, off, names in _UNUSED_WHEN if key in values and values[key] == off for name in names}
    lines = [f"{k} = {values[k]!r}" + (f"   # {LEGEND[k]}" if k in LEGEND else "")
             for k in values if k not in hidden]
    for k, val in explain(theorem_id, F, values).items():
        lines.append(f"-> {k}: {val}")
    return lines
