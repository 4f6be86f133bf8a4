"""``kvref size``: size a KV cache pool the way vLLM 0.33.0 does at startup, without a GPU.

Reads a model's layer layout and engine settings from a JSON or TOML file (or one of the packaged
examples), lets flags override the settings, runs :func:`kvref.spec.plan_kv_cache` and prints the
plan: KV cache groups, page sizes, bytes per block, blocks (usable = all but the null block),
per-group blocks and admission cap of one ``max_model_len`` request, max concurrency and the
largest length the pool can serve. ``--json`` prints the same for machines.

File format (JSON shown; TOML is the same keys)::

    {"name": "llama-3-8b-like",
     "defaults": {"block_size": 16, "dtype": "bfloat16", "num_kv_heads": 8, "head_size": 128},
     "pattern": [{"kind": "full", "count": 1}],      # layer kinds in model order ...
     "repeat": 32,                                    # ... repeated this many times
     "tail": [],                                      # optional layers after the repeats
     "engine": {"derived_max_model_len": 131072, "max_model_len": 8192},
     "available_memory": "16GiB"}

Kinds: ``full``, ``mla``, ``sliding_window``, ``chunked_local``, ``cross``, ``mamba``; any other key
of a pattern entry is a field of that spec (``sliding_window``, ``attention_chunk_size``,
``shapes``/``dtypes`` for Mamba, ``state_content_bytes``, ``page_size_padded``, ...). ``engine`` keys
are :class:`kvref.spec.EngineConfig` fields.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import replace
from importlib import resources
from typing import Any

from kvref.spec import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EngineConfig,
    FullAttentionSpec,
    InsufficientKVCacheError,
    InvalidFieldError,
    KVCachePlan,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    plan_kv_cache,
)

KINDS: dict[str, type[KVCacheSpec]] = {
    "full": FullAttentionSpec,
    "mla": MLAAttentionSpec,
    "sliding_window": SlidingWindowSpec,
    "chunked_local": ChunkedLocalAttentionSpec,
    "cross": CrossAttentionSpec,
    "mamba": MambaSpec,
}
_ATTENTION_DEFAULTS = ("num_kv_heads", "head_size", "dtype")
#: layers a layout may expand to (pattern counts x repeat + tail): real models have a few hundred;
#: the limit keeps a typo such as ``"repeat": 10**12`` from building layers until memory runs out
MAX_LAYERS = 100_000
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(text: Any, field: str = "available_memory") -> int:
    """``"16GiB"``, ``"512 MiB"``, ``"1.5e9"``, ``12345`` → bytes (GiB = 2**30, GB = 10**9)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise InvalidFieldError(field, text, "a byte count >= 0 such as 17179869184 or '16GiB'")
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidFieldError(field, text, "a byte count such as 17179869184, '16GiB', '512MiB' or '20GB'")
    value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if not math.isfinite(value):
        raise InvalidFieldError(field, text, "a finite byte count")
    return int(value)


def example_names() -> list[str]:
    root = resources.files("kvref") / "examples"
    return sorted(p.name for p in root.iterdir() if p.name.endswith((".json", ".toml")))


def load_layout(path: str | None, example: str | None) -> dict[str, Any]:
    """The layout file as a dict (JSON or TOML by suffix)."""
    if example is not None:
        names = example_names()
        matches = [n for n in names if n == example or n.rsplit(".", 1)[0] == example]
        if not matches:
            raise InvalidFieldError("--example", example, "one of " + ", ".join(n.rsplit(".", 1)[0] for n in names))
        name = matches[0]
        text = (resources.files("kvref") / "examples" / name).read_text()
    elif path is not None:
        from kvref.cli.input import read_text

        name = path
        text = read_text("config", path, "JSON or TOML layout file")
    else:
        raise InvalidFieldError("config", None, "a layout file (JSON/TOML) or --example NAME")
    if not name.endswith(".toml"):
        from kvref.cli.input import parse_json

        data = parse_json("config", name, text)  # the position named; nesting and 5,000-digit ints too
    else:
        import tomllib

        try:
            data = tomllib.loads(text)
        except (ValueError, RecursionError) as exc:  # RecursionError: arrays nested thousands deep
            raise InvalidFieldError("config", name, f"valid TOML ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict):
        raise InvalidFieldError("config", name, "a JSON/TOML object at top level")
    return data


def in_file(exc: InvalidFieldError, where: str) -> InvalidFieldError:
    """``exc`` naming the file its field comes from (``l.json: pattern[0].count=0 ...``); a flag's
    error (``--block-size=...``) is left as it is."""
    if exc.field.startswith("--") or exc.field.startswith(where):
        return exc
    return InvalidFieldError(f"{where}: {exc.field}", exc.value, exc.allowed)


def _tuplify(value: Any) -> Any:
    return tuple(_tuplify(v) for v in value) if isinstance(value, list) else value


def build_layers(data: dict[str, Any], block_size: int | None = None, kv_cache_dtype: str | None = None,
                 mamba_cache_mode: str = "none") -> dict[str, KVCacheSpec]:
    """Layer name → spec from the ``defaults``/``pattern``/``repeat``/``tail`` keys."""
    defaults = data.get("defaults", {})
    pattern, tail, repeat = data.get("pattern"), data.get("tail", []), data.get("repeat", 1)
    if not isinstance(defaults, dict):
        raise InvalidFieldError("defaults", defaults, "a table of default layer fields")
    if not isinstance(pattern, list) or not pattern or not isinstance(tail, list):
        raise InvalidFieldError("pattern", pattern, "a non-empty list of layer entries ({kind, count, ...})")
    if isinstance(repeat, bool) or not isinstance(repeat, int) or not 1 <= repeat <= MAX_LAYERS:
        raise InvalidFieldError("repeat", repeat, f"an int in [1, {MAX_LAYERS}]")
    # Every entry is checked, and the layer count bounded, before any layer is built.
    total = 0
    for where, entry, times in ([(f"pattern[{i}]", e, repeat) for i, e in enumerate(pattern)]
                                + [(f"tail[{i}]", e, 1) for i, e in enumerate(tail)]):
        if not isinstance(entry, dict):
            raise InvalidFieldError(where, entry, "a table with 'kind' and layer fields")
        kind, count = entry.get("kind"), entry.get("count", 1)
        if not isinstance(kind, str) or kind not in KINDS:
            raise InvalidFieldError(f"{where}.kind", kind, "one of " + ", ".join(KINDS))
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= MAX_LAYERS:
            raise InvalidFieldError(f"{where}.count", count, f"an int in [1, {MAX_LAYERS}]")
        total += count * times
    if total > MAX_LAYERS:
        raise InvalidFieldError("layers", total, f"at most {MAX_LAYERS} layers in all (pattern counts x repeat "
                                                 "+ tail counts)")
    layers: dict[str, KVCacheSpec] = {}
    for idx, entry in enumerate(pattern * repeat + tail):
        where = f"pattern[{idx % len(pattern)}]" if idx < len(pattern) * repeat else f"tail[{idx - len(pattern) * repeat}]"
        entry = dict(entry)
        kind, count = entry.pop("kind"), entry.pop("count", 1)
        cls = KINDS[kind]
        fields = {k: v for k, v in defaults.items() if kind != "mamba" or k not in _ATTENTION_DEFAULTS}
        if kind == "mamba":
            fields.setdefault("mamba_cache_mode", mamba_cache_mode)
        fields.update({k: _tuplify(v) for k, v in entry.items()})
        if block_size is not None:
            fields["block_size"] = block_size
        if kv_cache_dtype is not None and kind != "mamba":
            fields["dtype"] = kv_cache_dtype
        try:
            spec = cls(**fields)
        except TypeError as exc:
            raise InvalidFieldError(where, entry, f"fields of {cls.__name__} ({exc})") from None
        for _ in range(count):
            layers[f"model.layers.{len(layers)}.{kind}"] = spec
    return layers


def build_config(data: dict[str, Any], args: argparse.Namespace) -> EngineConfig:
    engine = data.get("engine", {})
    if not isinstance(engine, dict):
        raise InvalidFieldError("engine", engine, "a table of EngineConfig fields")
    try:
        config = EngineConfig(**engine)
    except TypeError as exc:
        raise InvalidFieldError("engine", engine, f"EngineConfig fields ({exc})") from None
    from kvref.size_hf import engine_changes

    changes = engine_changes(args, _int_arg, extra_flags=(
        ("block_size", "block_size"), ("mamba_cache_mode", "mamba_cache_mode"),
        ("derived_max_model_len", "derived_max_model_len")))
    if args.enable_prefix_caching is not None:
        changes["enable_prefix_caching"] = args.enable_prefix_caching
    return replace(config, **changes) if changes else config


def _int_arg(flag: str, text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise InvalidFieldError(flag, text, "an int, or 'auto' (or -1)") from None


def add_parser(sub: "argparse._SubParsersAction") -> argparse.ArgumentParser:
    p = sub.add_parser("size", help="size the KV cache pool like vLLM 0.33.0 at startup (groups, blocks, "
                                    "max_model_len, concurrency)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_arguments(p)
    return p


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="layout + engine settings, JSON or TOML")
    p.add_argument("--example", metavar="NAME", help="use a packaged example (see --list-examples)")
    p.add_argument("--hf-config", metavar="PATH",
                   help="derive the layout from a Hugging Face config.json (a file, a model folder, or a packaged "
                        "example name such as qwen3-next-80b-a3b-instruct; see --list-examples)")
    p.add_argument("--list-examples", action="store_true", help="list the packaged examples and exit")
    p.add_argument("--against", choices=("vllm",),
                   help="also plan through vLLM's own startup planner and print both; a difference exits 1")
    p.add_argument("--available-memory", metavar="BYTES", help="KV cache memory, e.g. 16GiB, 512MiB, 20GB")
    p.add_argument("--kv-cache-memory", metavar="BYTES",
                   help="vLLM's --kv-cache-memory-bytes: exactly this much for the KV cache")
    p.add_argument("--gpu-memory", metavar="BYTES", help="total GPU memory (e.g. 80GiB), with --gpu-memory-utilization")
    p.add_argument("--gpu-memory-utilization", metavar="U", help="fraction vLLM may use (default 0.9)")
    p.add_argument("--model-memory", metavar="BYTES",
                   help="weights + activation peak + non-torch memory vLLM profiled (its startup log); "
                        "subtracted from U x --gpu-memory")
    p.add_argument("--tensor-parallel-size", type=int, metavar="N", help="--hf-config: size one of N TP ranks")
    p.add_argument("--mamba-cache-dtype", choices=("auto", "bfloat16", "float16", "float32"))
    p.add_argument("--mamba-ssm-cache-dtype", choices=("auto", "bfloat16", "float16", "float32"))
    p.add_argument("--kernel-block-size", type=int, metavar="N",
                   help="--hf-config: the attention backend's smallest kernel block (16: FlashAttention/Triton)")
    p.add_argument("--allow-chunked-local-hybrid", action="store_true",
                   help="--hf-config: as VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1 (Llama-4 keeps "
                        "chunked layers local)")
    p.add_argument("--max-model-len", metavar="N|auto", help="tokens per request, or auto (fit to the pool)")
    p.add_argument("--derived-max-model-len", type=int, metavar="N", help="the model's own maximum context")
    p.add_argument("--block-size", type=int, metavar="N", help="tokens per block of every layer")
    p.add_argument("--kv-cache-dtype", metavar="DTYPE", help="dtype of every attention layer's cache")
    p.add_argument("--num-gpu-blocks-override", type=int, metavar="N", help="use N blocks whatever the memory")
    p.add_argument("--max-num-batched-tokens", type=int, metavar="N")
    p.add_argument("--max-num-seqs", type=int, metavar="N")
    p.add_argument("--async-scheduling", action="store_true", help="2 batches in flight (V1 runner, no PP)")
    p.add_argument("--max-concurrent-batches", type=int, metavar="N", help="batches in flight (PP size, ...)")
    p.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=None)
    p.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--prefix-match-unit", type=int, metavar="N", help="hash block size for hybrid models")
    p.add_argument("--mamba-cache-mode", choices=("none", "all", "align"))
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true")
    p.add_argument("--dcp", type=int, metavar="N", help="decode context parallel size")
    p.add_argument("--max-num-encoder-input-tokens", type=int, metavar="N")
    p.add_argument("--kv-connector", action="store_true", help="a KV connector is configured")
    p.add_argument("--show-layers", action="store_true", help="list every layer name of each group")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", metavar="PNG", help="also draw blocks per request vs length per group (kvref.plot)")


def make_plan(args: argparse.Namespace) -> tuple[dict[str, Any], KVCachePlan | InsufficientKVCacheError]:
    data, _layers, _config, _memory, result, _notes = _make(args)
    return data, result


def _make(args: argparse.Namespace):
    """``(layout data, layers, config, memory, plan or error, notes)`` for a layout file or example."""
    from kvref.size_hf import kv_cache_memory

    data = load_layout(args.config, args.example)
    if args.kv_cache_dtype is not None:  # named as the flag, not as the first layer's dtype field
        from kvref.spec.dtypes import canonical_dtype

        canonical_dtype(args.kv_cache_dtype, "--kv-cache-dtype")
    try:
        config = build_config(data, args)
        layers = build_layers(data, args.block_size, args.kv_cache_dtype, config.mamba_cache_mode)
    except InvalidFieldError as exc:
        raise in_file(exc, args.config or f"--example {args.example}") from None
    memory, notes = kv_cache_memory(args, parse_bytes)
    if memory is None:
        memory_text = data.get("available_memory")
        if memory_text is None:
            if config.num_gpu_blocks_override is None:
                raise InvalidFieldError("available_memory", None,
                                        "--available-memory/--kv-cache-memory, --gpu-memory or --num-gpu-blocks-override")
            memory_text = 0
        memory = parse_bytes(memory_text)
    try:
        return data, layers, config, memory, plan_kv_cache(layers, config, memory), notes
    except InsufficientKVCacheError as exc:
        return data, layers, config, memory, exc, notes


def run(args: argparse.Namespace) -> int:
    if args.list_examples:
        from kvref.size_hf import hf_example_names

        layouts = [name.rsplit(".", 1)[0] for name in example_names()]
        if args.json:
            print(json.dumps({"examples": layouts, "hf_configs": hf_example_names()}, indent=2))
            return 0
        print("layout examples (--example NAME):")
        for name in layouts:
            print(f"  {name}")
        print("config.json examples (--hf-config NAME; written from the public model cards):")
        for name in hf_example_names():
            print(f"  {name}")
        return 0
    if args.plot:  # checked before the plan is made, not after
        from kvref.cli.arguments import check_writable_file

        check_writable_file("--plot", args.plot)
        from kvref.plot import plot_format

        plot_format(args.plot)
    if args.hf_config is not None:
        if args.config is not None or args.example is not None:
            raise InvalidFieldError("--hf-config", args.hf_config, "alone: not with a layout file or --example")
        from kvref.size_hf import layout_summary, plan_hf

        name, layout, config, memory, result, notes = plan_hf(args, parse_bytes, _int_arg)
        layers, extra = layout.layers, {"layout": layout_summary(layout)}
        notes = list(layout.notes) + notes
    else:
        for flag in ("tensor_parallel_size", "kernel_block_size", "mamba_cache_dtype", "mamba_ssm_cache_dtype"):
            if getattr(args, flag, None) is not None:
                raise InvalidFieldError("--" + flag.replace("_", "-"), getattr(args, flag),
                                        "only with --hf-config (a layout file sets these per layer)")
        data, layers, config, memory, result, notes = _make(args)
        name, extra = str(data.get("name", args.example or args.config)), {}
    rows: list = []
    if args.against == "vllm":
        from kvref.size_hf import compare_with_vllm

        rows = compare_with_vllm(layers, config, memory)
        if args.json:
            extra["against_vllm"] = json.loads(_comparison_json(name, rows))
    differ = [f for f, a, b in rows if a != b]
    if not args.json:
        _print_notes(name, extra.get("layout"), notes)
    try:
        return _report(args, name, result, extra, notes, rows) or (1 if differ else 0)
    finally:
        if differ:
            print(f"kvref size: kvref and vLLM's planner differ on {', '.join(differ)}", file=sys.stderr)


def _report(args: argparse.Namespace, name: str, result, extra: dict[str, Any], notes: list[str], rows) -> int:
    """Print the plan (or why there is none), then the comparison with vLLM; 1 when the pool cannot
    serve one request."""
    rc = _report_plan(args, name, result, extra, notes)
    if rows and not args.json:
        from kvref.size_hf import render_comparison

        render_comparison(name, rows, as_json=False)
    return rc


def _report_plan(args: argparse.Namespace, name: str, result, extra: dict[str, Any], notes: list[str]) -> int:
    if isinstance(result, InsufficientKVCacheError):
        if args.json:
            print(json.dumps({"name": name, "error": str(result), "reason": result.reason,
                              "estimated_max_model_len": result.estimated_max_model_len,
                              "needed_bytes": result.needed_bytes, "available_bytes": result.available_bytes,
                              **extra, "notes": notes}, indent=2))
        else:
            from rich.console import Console
            from rich.markup import escape

            console = Console()
            console.print(f"[bold red]{escape(name)}: the pool cannot serve one max_model_len request[/]")
            console.print(str(result), markup=False, highlight=False, soft_wrap=True)
            console.print(f"largest servable max_model_len: [bold]{result.estimated_max_model_len}[/]")
        return 1
    if args.json:
        print(json.dumps({"name": name, **result.to_dict(), **extra, "notes": notes}, indent=2))
    else:
        render(name, result, show_layers=args.show_layers)
    if args.plot:
        from kvref.plot import plot_plan

        path = plot_plan(result, args.plot, title=f"{name}: {result.num_blocks:,} blocks, "
                                                  f"max concurrency {result.max_concurrency:.2f}x")
        print(f"plot written to {path}", file=sys.stderr)
    return 0


def _comparison_json(name: str, rows) -> str:
    import contextlib
    import io

    from kvref.size_hf import render_comparison

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        render_comparison(name, rows, as_json=True)
    return out.getvalue()


def _print_notes(name: str, layout: dict[str, Any] | None, notes: list[str]) -> None:
    """What the derivation decided (``--hf-config``) and how the memory was found, before the tables."""
    if layout is not None:
        kinds = ", ".join(f"{n} {k}" for k, n in layout["layers"].items())
        print(f"{name}: {layout['architecture']}, {kinds}; KV cache {layout['kv_cache_dtype']}, "
              f"block size {layout['block_size']}, derived max_model_len {layout['derived_max_model_len']:,}")
    for note in notes:
        print(f"  note: {note}")


def _human(num_bytes: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= size:
            return f"{num_bytes / size:,.2f} {unit}"
    return f"{num_bytes} B"


def kind_label(spec: KVCacheSpec) -> str:
    """A short name for a group's kind: ``full``, ``SWA 1024``, ``chunked 8192``, ``MLA``, ..."""
    if isinstance(spec, SlidingWindowSpec):
        return f"SWA {spec.sliding_window}"
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return f"chunked {spec.attention_chunk_size}"
    if isinstance(spec, MLAAttentionSpec):
        return "MLA"
    if isinstance(spec, FullAttentionSpec):
        window = spec.sliding_window or spec.attention_chunk_size
        return "full" + (f" (was local {window})" if window else "")
    if isinstance(spec, MambaSpec):
        return f"mamba {spec.mamba_cache_mode}"
    if isinstance(spec, CrossAttentionSpec):
        return "cross"
    return type(spec).__name__


def render(name: str, plan: KVCachePlan, show_layers: bool = False) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    # the name comes from the user's file: escaped, so "[/]" in it is text, not rich markup
    groups = Table(title=f"{escape(name)}: {len(plan.groups)} KV cache group(s)", title_justify="left")
    for col, justify in (("#", "right"), ("kind", "left"), ("layers", "right"), ("block", "right"),
                         ("page", "right"), ("blocks/req", "right"), ("cap", "right")):
        groups.add_column(col, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for i, g in enumerate(plan.group_plans):
        pad = f" +{g.num_padding_layers} pad" if g.num_padding_layers else ""
        uniform = "*" if g.kv_cache_spec is not g.scheduler_spec else ""
        groups.add_row(str(i), kind_label(g.scheduler_spec) + uniform, f"{len(g.layer_names)}{pad}",
                       str(g.block_size), _human(g.page_size_bytes), f"{g.blocks_per_request:,}",
                       "-" if g.admission_cap is None else f"{g.admission_cap:,}")
    groups.caption = ("blocks/req: block ids one max_model_len request holds; cap: runtime admission cap "
                      "(sliding window / chunked local)" + ("; * uniform-type group (first layer shown)"
                                                           if any(g.kv_cache_spec is not g.scheduler_spec
                                                                  for g in plan.group_plans) else ""))
    console.print(groups)
    if show_layers:
        for i, g in enumerate(plan.group_plans):
            console.print(f"group {i}: " + ", ".join(g.layer_names), highlight=False)
    summary = Table(show_header=False, title="pool", title_justify="left")
    summary.add_column("what")
    summary.add_column("value", justify="right")
    if plan.auto_fitted:
        fitted = (" (auto: the full context fits)" if plan.max_model_len >= plan.original_max_model_len
                  else f" (auto-fit down from {plan.original_max_model_len:,})")
    else:
        fitted = ""
    rows = [
        ("memory for the KV cache", f"{_human(plan.memory_bytes)} ({plan.memory_bytes:,} B)"),
        ("bytes per block", f"{plan.bytes_per_block:,}"),
        ("blocks (incl. null block)", f"{plan.num_blocks:,}"),
        ("usable blocks", f"{plan.num_usable_blocks:,}"),
        ("max_model_len", f"{plan.max_model_len:,}{fitted}"),
        ("blocks per max-len request", f"{sum(plan.blocks_per_request):,} ({_human(plan.needed_bytes)})"),
        ("max in-flight tokens", f"{plan.max_in_flight_tokens:,}"),
        ("scheduler / hash block size", f"{plan.scheduler_block_size} / {plan.hash_block_size}"),
        ("max concurrency (vLLM's figure)", f"{plan.max_concurrency:.2f}x"),
        ("KV cache size (tokens)", f"{plan.kv_cache_size_tokens:,}"),
        ("largest servable length", f"{plan.max_servable_len:,}"),
    ]
    for what, value in rows:
        summary.add_row(what, value)
    console.print(summary)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m kvref.cli.size``): ``kvref size`` itself, so the same checks,
    exit statuses and Ctrl-C handling apply (it had its own parser, without them)."""
    from kvref.cli import main as kvref_main

    return kvref_main(["size", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
