"""``kvref size --hf-config``: plan a pool for a real model from its ``config.json``, and
``kvref size --against vllm``: plan the same layout through vLLM's own startup planner.

The layout comes from :func:`kvref.spec.hf_config.layout_from_hf_config` (pure); this module reads
the file, turns the vLLM engine flags a user knows into kvref's arguments, and compares plans.

Memory for the KV cache, as vLLM gets it:

* ``--kv-cache-memory BYTES`` (vLLM's ``--kv-cache-memory-bytes``): exactly that much, no profiling
  (the same as ``--available-memory``);
* ``--gpu-memory TOTAL --gpu-memory-utilization U --model-memory M``: vLLM reserves ``U x TOTAL``
  and gives the KV cache what the profiled weights, activation peak and non-torch memory leave:
  ``U x TOTAL - M``. vLLM logs ``M``'s parts at startup ("model weights take …; non_torch_memory
  takes …; PyTorch activation peak memory takes …"); kvref cannot profile a model, so without
  ``--model-memory`` it says the figure is an upper bound.
"""

from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path
from typing import Any

from kvref.spec import (
    EngineConfig,
    InsufficientKVCacheError,
    InvalidFieldError,
    KVCachePlan,
    KVRefError,
    plan_kv_cache,
)
from kvref.spec.hf_config import ModelLayout, layout_from_hf_config


def hf_example_names() -> list[str]:
    root = resources.files("kvref") / "examples" / "hf_configs"
    return sorted(p.name.removesuffix(".json") for p in root.iterdir() if p.name.endswith(".json"))


def load_hf_config(path: str) -> tuple[str, dict[str, Any]]:
    """``(name, parsed config.json)`` from a file, a model folder holding ``config.json``, or the
    name of a packaged fixture (``kvref size --list-examples``)."""
    p = Path(path)
    try:
        p.is_dir()
    except OSError as exc:  # a name too long, a loop of links: is_dir() lets these through
        raise InvalidFieldError("--hf-config", path, f"a readable path ({exc.strerror or exc})") from None
    if p.is_dir():
        p = p / "config.json"
        if not p.is_file():
            raise InvalidFieldError("--hf-config", path, "a config.json file or a model folder that contains one")
        name = Path(path).resolve().name
    elif p.is_file():
        name = p.parent.resolve().name if p.name == "config.json" else p.stem
    elif path in hf_example_names():
        return path, json.loads((resources.files("kvref") / "examples" / "hf_configs" / f"{path}.json").read_text())
    else:
        raise InvalidFieldError("--hf-config", path, "a config.json file, a model folder, or a packaged example: "
                                + ", ".join(hf_example_names()))
    try:
        data = json.loads(p.read_text())
    except UnicodeDecodeError as exc:
        raise InvalidFieldError("--hf-config", path, f"a UTF-8 JSON file (byte {exc.start}: {exc.reason})") from None
    except (ValueError, RecursionError) as exc:  # RecursionError: nesting deeper than the parser goes
        raise InvalidFieldError("--hf-config", path, f"valid JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise InvalidFieldError("--hf-config", path, "a JSON object at top level")
    return name, data


def _fraction(flag: str, value: Any) -> float:
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise InvalidFieldError(flag, value, "a number in (0, 1]") from None
    if not 0 < f <= 1:
        raise InvalidFieldError(flag, value, "a number in (0, 1]")
    return f


def kv_cache_memory(args: argparse.Namespace, parse_bytes) -> tuple[int | None, list[str]]:
    """Bytes for the KV cache from the memory flags, and notes on how they were found."""
    notes: list[str] = []
    kv = getattr(args, "kv_cache_memory", None)
    available = getattr(args, "available_memory", None)
    gpu = getattr(args, "gpu_memory", None)
    if kv is not None and available is not None:
        raise InvalidFieldError("--kv-cache-memory", kv, "either --kv-cache-memory or --available-memory, not both")
    if kv is not None or available is not None:
        if gpu is not None:
            raise InvalidFieldError("--gpu-memory", gpu, "absent when --kv-cache-memory gives the KV memory directly")
        if kv is not None:
            return parse_bytes(kv, "--kv-cache-memory"), notes
        return parse_bytes(available, "available_memory"), notes
    util_text = getattr(args, "gpu_memory_utilization", None)
    model_text = getattr(args, "model_memory", None)
    if gpu is None:
        if util_text is not None or model_text is not None:
            raise InvalidFieldError("--gpu-memory", None, "the GPU's total memory (e.g. 80GiB) with "
                                                          "--gpu-memory-utilization / --model-memory")
        return None, notes
    total = parse_bytes(gpu, "--gpu-memory")
    util = 0.9 if util_text is None else _fraction("--gpu-memory-utilization", util_text)
    model = 0 if model_text is None else parse_bytes(model_text, "--model-memory")
    requested = int(util * total)
    if model > requested:
        raise InvalidFieldError("--model-memory", model_text,
                                f"at most --gpu-memory-utilization x --gpu-memory = {requested:,} B")
    notes.append(f"KV cache memory = {util:g} x {total:,} B - {model:,} B (model) = {requested - model:,} B")
    if model_text is None:
        notes.append("upper bound: --model-memory not given, so weights, activations and non-torch memory are "
                     "not subtracted (vLLM logs them at startup)")
    return requested - model, notes


def build_layout(data: dict[str, Any], args: argparse.Namespace) -> ModelLayout:
    """The layout, with the engine flags that shape specs (block size, dtypes, TP, Mamba mode)."""
    mml = getattr(args, "max_model_len", None)
    return layout_from_hf_config(
        data, block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype or "auto",
        max_model_len=int(mml) if mml not in (None, "auto", "-1") and str(mml).isdigit() else None,
        enable_prefix_caching=True if args.enable_prefix_caching is None else args.enable_prefix_caching,
        mamba_cache_mode=args.mamba_cache_mode, mamba_cache_dtype=args.mamba_cache_dtype or "auto",
        mamba_ssm_cache_dtype=args.mamba_ssm_cache_dtype or "auto",
        tensor_parallel_size=1 if args.tensor_parallel_size is None else args.tensor_parallel_size,
        kernel_block_size=16 if args.kernel_block_size is None else args.kernel_block_size,
        allow_chunked_local_with_hybrid=bool(args.allow_chunked_local_hybrid))


#: ``kvref size`` flag -> EngineConfig field, for the flags both input forms (a layout TOML or an
#: HF config.json) take; ``kvref size`` adds the layout-only ones (block size, Mamba mode)
SCHEDULING_FLAGS = (("num_gpu_blocks_override", "num_gpu_blocks_override"),
                    ("max_num_batched_tokens", "max_num_batched_tokens"), ("max_num_seqs", "max_num_seqs"),
                    ("max_concurrent_batches", "max_concurrent_batches"), ("prefix_match_unit", "prefix_match_unit"),
                    ("dcp", "dcp_world_size"), ("max_num_encoder_input_tokens", "max_num_encoder_input_tokens"))


def engine_changes(args: argparse.Namespace, int_arg, extra_flags: tuple[tuple[str, str], ...] = ()) -> dict[str, Any]:
    """EngineConfig fields the scheduling flags set: the one flag table of ``kvref size`` (block
    size and dtypes of an HF config went into its layout; a layout TOML passes them as
    ``extra_flags``). ``--max-model-len auto`` or ``-1`` (vLLM's spelling) asks for auto-fit."""
    changes: dict[str, Any] = {}
    if args.max_model_len is not None:
        changes["max_model_len"] = "auto" if args.max_model_len in ("auto", "-1") else int_arg("--max-model-len",
                                                                                              args.max_model_len)
    for flag, name in SCHEDULING_FLAGS + tuple(extra_flags):
        if getattr(args, flag, None) is not None:
            changes[name] = getattr(args, flag)
    if args.async_scheduling:
        changes["max_concurrent_batches"] = 2
    if args.disable_hybrid_kv_cache_manager:
        changes["disable_hybrid_kv_cache_manager"] = True
    if args.kv_connector:
        changes["has_kv_connector"] = True
    return changes


def plan_hf(args: argparse.Namespace, parse_bytes, int_arg):
    """``(name, layout, config, memory, plan or InsufficientKVCacheError, notes)``."""
    name, data = load_hf_config(args.hf_config)
    try:
        layout = build_layout(data, args)
    except InvalidFieldError as exc:  # a field of the file: name the file too (a flag's error stays)
        if exc.field.startswith("--"):
            raise
        given = getattr(args, exc.field, None)  # kv_cache_dtype='bogus' came from --kv-cache-dtype bogus
        if given is not None and given == exc.value:
            raise
        raise InvalidFieldError(f"--hf-config {args.hf_config}: {exc.field}", exc.value, exc.allowed) from None
    except KVRefError:
        raise
    except (ValueError, TypeError, OverflowError, ArithmeticError) as exc:
        # the file is data: a field of a type the derivation does not check yet (an entry of
        # layer_types that is a list, expand: Infinity) is still the input's fault, never a traceback
        raise InvalidFieldError(f"--hf-config {args.hf_config}", "a field of the wrong type or range",
                                f"a config.json as the model's card gives it ({type(exc).__name__}: {exc})") from None
    config = layout.engine_config(**engine_changes(args, int_arg))
    mml = config.max_model_len
    if isinstance(mml, int) and mml > layout.derived_max_model_len and mml != -1:
        # vLLM's _get_and_verify_max_len refuses it (positions past the model's range give NaNs)
        raise InvalidFieldError("--max-model-len", mml,
                                f"at most the model's derived max_model_len {layout.derived_max_model_len:,} "
                                "(vLLM refuses more unless VLLM_ALLOW_LONG_MAX_MODEL_LEN=1)")
    memory, notes = kv_cache_memory(args, parse_bytes)
    if memory is None:
        if config.num_gpu_blocks_override is None:
            raise InvalidFieldError("--kv-cache-memory", None, "--kv-cache-memory BYTES, --gpu-memory TOTAL "
                                    "[--gpu-memory-utilization U --model-memory M], or --num-gpu-blocks-override N")
        memory = 0
    try:
        result: KVCachePlan | InsufficientKVCacheError = plan_kv_cache(layout.layers, config, memory)
    except InsufficientKVCacheError as exc:
        result = exc
    return name, layout, config, memory, result, notes


def layout_summary(layout: ModelLayout) -> dict[str, Any]:
    return {"architecture": layout.architecture, "family": layout.family, "model_dtype": layout.model_dtype,
            "kv_cache_dtype": layout.kv_cache_dtype, "layers": layout.counts(), "block_size": layout.block_size,
            "derived_max_model_len": layout.derived_max_model_len, "mamba_cache_mode": layout.mamba_cache_mode,
            "disable_hybrid_kv_cache_manager": layout.disable_hybrid_kv_cache_manager, "notes": list(layout.notes)}


# -- --against vllm ---------------------------------------------------------------------------

#: the fields compared, in the order printed
COMPARED = ("status", "reason", "estimated_max_model_len", "groups", "scheduler_groups", "page_sizes",
            "bytes_per_block", "num_blocks", "max_model_len", "blocks_per_request", "admission_caps",
            "memory_bounds", "scheduler_block_size", "hash_block_size", "cache_hit_alignment_tokens",
            "max_concurrency", "kv_cache_size_tokens")


def _shown(field: str, value: Any) -> str:
    if field in ("groups", "scheduler_groups") and isinstance(value, list):
        return ", ".join(f"{type(spec).__name__.removesuffix('Spec')} x{len(names)} (block {spec.block_size})"
                         for names, spec in value)
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _plan_with_vllm(layers, config: EngineConfig, memory: int):
    from kvref.impl.vllm import vllm_available

    ok, why = vllm_available()
    if not ok:
        raise InvalidFieldError("--against", "vllm", f"an importable vLLM ({why})")
    from kvref.impl.vllm.api import check_api

    problems = check_api(("specs", "planning"))  # a moved planner is named up front, not a traceback
    if problems:
        raise InvalidFieldError("--against", "vllm", "a vLLM with the planning API kvref binds to; the installed "
                                "one differs: " + "; ".join(problems))
    from kvref.impl.vllm.planning import VllmPlanner, kvref_outcome

    planner = VllmPlanner()
    return kvref_outcome(planner, layers, config, memory), planner.plan(layers, config, memory, extra_retained_tokens=0)


def compare_with_vllm(layers, config: EngineConfig, memory: int) -> list[tuple[str, Any, Any]]:
    """``(field, kvref value, vLLM value)`` for every compared field, planning through vLLM
    0.33.0's startup functions (:class:`kvref.impl.vllm.planning.VllmPlanner`)."""
    if config.max_concurrent_batches not in (1, 2):
        raise InvalidFieldError("--max-concurrent-batches", config.max_concurrent_batches,
                                "1 or 2 with --against vllm (vLLM's planner knows async scheduling, not a PP depth)")
    from kvref.progress import Progress

    # the heartbeat covers the import too: vllm_available() imports vLLM (20-30 s on a loaded
    # machine), and the run was silent for all of it (issue #25)
    with Progress("size --against vllm").heartbeat("importing vLLM and planning through its startup planner"):
        ours, theirs = _plan_with_vllm(layers, config, memory)
    rows = []
    for field in COMPARED:
        if field == "status":
            a, b = ours.status, theirs.status
        elif field == "reason":
            a, b = ours.detail, theirs.detail
        elif field == "estimated_max_model_len":
            a, b = ours.estimated_max_model_len, theirs.estimated_max_model_len
        else:
            a, b = ours.fields.get(field), theirs.fields.get(field)
        if field == "max_concurrency" and isinstance(a, float) and isinstance(b, float) and abs(a - b) <= 1e-9 * max(1, abs(b)):
            b = a
        rows.append((field, a, b))
    return rows


def render_comparison(name: str, rows: list[tuple[str, Any, Any]], as_json: bool) -> list[str]:
    """Print the side-by-side table (or JSON); return the fields that differ."""
    differ = [f for f, a, b in rows if a != b]
    if as_json:
        print(json.dumps({"name": name, "against": "vllm", "differences": differ,
                          "fields": {f: {"kvref": _shown(f, a), "vllm": _shown(f, b)} for f, a, b in rows}}, indent=2))
        return differ
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"{escape(name)}: kvref vs vLLM's startup planner", title_justify="left")
    for col in ("field", "kvref", "vLLM", ""):
        table.add_column(col, overflow="fold")
    for f, a, b in rows:
        table.add_row(f, escape(_shown(f, a)), escape(_shown(f, b)), "[green]=[/]" if a == b else "[bold red]DIFFERS[/]")
    Console().print(table)
    return differ
