"""Ahead-of-time compilation of the kernels for a GPU target, on a machine without a GPU.

Triton's compiler needs no device: ``triton.compile`` lowers a kernel through TTIR, TTGIR, LLVM
IR and PTX to a cubin with the ``ptxas`` shipped in the triton wheel, for any ``GPUTarget``
(here ``cuda`` sm_80 / sm_90). That turns "the kernels are written to compile" into a checked
fact where no GPU is lent, and ``cuobjdump --dump-resource-usage`` (also in the wheel) reports
what the compiled kernel costs per thread: registers, and the stack that register spills use.
That report chose the CUDA defaults in :func:`.attention.kernel_config` (the first draft's
64-position tile spilled 1.4 KB of stack per thread on sm_90).

What it cannot tell: whether the cubin runs correctly (the interpreter tests check the same
source on CPU, and ``bench_triton_attention.py --check-only`` checks the cubin on a device) and
how fast it is.

The variants are built from the wrappers' own configuration (:func:`.attention.kernel_config`),
with the argument types the wrappers pass, so what is compiled here is what a launch compiles.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass

import torch

from kvref.spec.errors import InvalidFieldError

#: GPU architectures checked (compute capability x 10): A100, H100/H200
ARCHS = (80, 90)
_TYPE = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
         torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.int8: "i8"}


@dataclass(frozen=True)
class CompiledKernel:
    """One compiled variant: ``registers`` and ``stack_bytes`` per thread (spills live on the
    stack), ``shared_bytes`` of shared memory per program; ``None`` where cuobjdump is missing."""

    label: str
    arch: int
    num_warps: int
    cubin_bytes: int
    registers: int | None
    stack_bytes: int | None
    shared_bytes: int
    #: widest global load in the PTX, bits (128: ``ld.global.v4.b32``, 16-byte vectors)
    load_bits: int = 0
    #: for pass 1 of attention: :func:`.attention.shared_memory_bound` of the configuration
    shared_bound: int | None = None

    @property
    def spills(self) -> bool:
        return bool(self.stack_bytes)


def _cuobjdump() -> str | None:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else None


def _resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    tool = _cuobjdump()
    if tool is None:
        return None, None
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else (None, None)


def compile_kernel(kernel, label: str, pointer_types: dict[str, torch.dtype], constexprs: dict,
                   num_warps: int, arch: int = 90, num_stages: int | None = None,
                   ints: dict[str, int] | None = None) -> CompiledKernel:
    """Compile ``kernel`` (a ``triton.jit`` function, interpreted or not) for ``cuda`` sm_``arch``.

    ``pointer_types``: element type of each pointer argument; other non-constexpr arguments are
    ints (``i32``: the wrappers' strides and sizes fit; Triton picks ``i64`` at launch only for
    values beyond 2**31). Specialised as a launch specialises them: pointers 16-byte aligned
    (torch's allocations are), and the ints of ``ints`` (representative values) that are
    multiples of 16 marked so — what lets the compiler vectorize loads along a contiguous row.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile
    from triton.runtime.jit import JITFunction

    from .availability import _interpret_requested

    if _interpret_requested():
        # Triton's frontend reads the variable while compiling, and a process that has run
        # interpreted kernels keeps part of the interpreter's patching: compile in a clean process.
        raise InvalidFieldError("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET"),
                                "unset in the compiling process: use compile_in_subprocess() or "
                                "`python -m kvref.impl.torch.triton_kernels.aot`")
    if arch not in ARCHS:
        raise InvalidFieldError("arch", arch, "one of " + ", ".join(map(str, ARCHS)))
    fn = JITFunction(getattr(kernel, "fn", kernel))  # the interpreter wraps the same function
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointer_types:
            sig[name] = "*" + _TYPE[pointer_types[name]]
        else:
            sig[name] = "i32"
    ints = ints or {}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if name in pointer_types or (name in ints and ints[name] % 16 == 0)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Triton 3.9's FP-fusion default notice
        out = compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", arch, 32),
                      options={"num_warps": num_warps, **({"num_stages": num_stages} if num_stages else {})})
    cubin = out.asm["cubin"]
    regs, stack = _resource_usage(cubin)
    widths = [int(w or 1) * int(b) for w, b in re.findall(r"ld\.global(?:\.[a-z]+)*?(?:\.v(\d))?\.b(\d+)",
                                                           out.asm["ptx"])]
    return CompiledKernel(label, arch, num_warps, len(cubin), regs, stack, int(out.metadata.shared),
                          max(widths, default=0))


def attention(dtype: torch.dtype, mask_kind: str = "sliding_window", num_q_heads: int = 32, num_kv_heads: int = 8,
              head_size: int = 128, block_size: int = 16, split: bool = False, tile: int | None = None,
              num_warps: int | None = None, arch: int = 90, group_block: int | None = None,
              num_stages: int | None = None) -> CompiledKernel:
    """Pass 1 of the paged-attention kernels as ``paged_attention_triton`` launches it on a CUDA
    device of ``arch`` (the configuration chosen to fit that architecture's shared memory)."""
    from .attention import SHARED_LIMIT, kernel_config

    cfg = kernel_config(dtype, mask_kind, num_q_heads, num_kv_heads, head_size, block_size, True, split, tile,
                        num_warps, group_block, num_stages, shared_limit=SHARED_LIMIT.get(arch))
    return attention_config(cfg, dtype, arch, num_q_heads, num_kv_heads)


def attention_ints(consts: dict, num_q_heads: int, num_kv_heads: int, splits: int = 8) -> dict[str, int]:
    """The integer arguments ``paged_attention_triton`` passes for a contiguous cache of these
    heads (strides; the table width and sizes are unknown here and left unspecialised)."""
    d, bs = consts["HEAD"], consts["BLOCK_SIZE"]
    out = dict(stride_qt=num_q_heads * d, stride_qh=d, stride_cb=2 * bs * num_kv_heads * d,
               stride_ckv=bs * num_kv_heads * d, stride_cs=num_kv_heads * d, stride_ch=d)
    if consts["SPLIT"]:
        out.update(stride_ot=num_q_heads * splits * d, stride_oh=splits * d, stride_os=d,
                   stride_mt=num_q_heads * splits, stride_mh=splits)
    else:
        out.update(stride_ot=num_q_heads * d, stride_oh=d)
    return out


def attention_config(cfg, dtype: torch.dtype, arch: int = 90, num_q_heads: int = 32,
                     num_kv_heads: int = 8) -> CompiledKernel:
    """Compile one :class:`.attention.KernelConfig` of pass 1 for sm_``arch``; the label names
    the configuration and ends with its shared-memory bound."""
    from .attention import _MASK_CODE, _paged_attention_kernel

    consts = cfg.consts
    split = consts["SPLIT"]
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    ptrs = dict(q_ptr=dtype, cache_ptr=dtype, out_ptr=acc if split else dtype, table_ptr=torch.int32,
                ctx_ptr=torch.int64, rows_ptr=torch.int64, qpos_ptr=torch.int64, scale_ptr=acc, m_ptr=acc,
                l_ptr=acc)
    mask = {v: k for k, v in _MASK_CODE.items()}[consts["MASK_KIND"]]
    label = (f"attention {str(dtype)[6:]} {mask} gqa{consts['GROUP']} d{consts['HEAD']} "
             f"bs{consts['BLOCK_SIZE']} tile{consts['TILE']} stages{cfg.num_stages}{' split' if split else ''}"
             + (f" {consts['HEAD_BLOCKS']} head blocks" if consts["HEAD_BLOCKS"] > 1 else "")
             + f" bound{cfg.shared_bytes}")
    out = compile_kernel(_paged_attention_kernel, label, ptrs, consts, cfg.num_warps, arch, cfg.num_stages,
                         attention_ints(consts, num_q_heads, num_kv_heads))
    return dataclasses.replace(out, shared_bound=cfg.shared_bytes)


def candidate_variants(full: bool = False):
    """``(label, thunk)`` compiling the configurations the wrapper can choose, to hold
    :func:`.attention.shared_memory_bound` against the compiler's shared memory: with ``full``
    every candidate (:func:`.attention.candidate_configs`) of every fixture shape
    (:func:`real_shapes`) in its dtype, split and not, for sm_80 and sm_90; else a sample — the
    configuration chosen for the widest fixture shape (the 128-head MLA latent) on each arch,
    every candidate of the decode default (bfloat16, GQA 4, head 128, block 16, split), and the
    float32 / float64 defaults at head 256."""
    from .attention import SHARED_LIMIT, candidate_configs, kernel_config

    names = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    out = []

    def add(cfg, dt, arch, hq, hkv):
        out.append((f"{cfg.consts} warps{cfg.num_warps} stages{cfg.num_stages} sm{arch}",
                    lambda: attention_config(cfg, dt, arch, hq, hkv)))
    if full:
        seen = set()
        for mk, _, dt, hq, hkv, d, bs in real_shapes():
            for split in (False, True):
                for cfg in candidate_configs(names[dt], mk, hq, hkv, d, bs, True, split):
                    key = (repr(sorted(cfg.consts.items())), cfg.num_warps, cfg.num_stages, dt)
                    if key in seen:
                        continue
                    seen.add(key)
                    for arch in ARCHS:
                        add(cfg, names[dt], arch, hq, hkv)
        return out
    for arch in ARCHS:
        add(kernel_config(torch.bfloat16, "causal", 128, 1, 576, 64, True, False,
                          shared_limit=SHARED_LIMIT[arch]), torch.bfloat16, arch, 128, 1)
    for cfg in candidate_configs(torch.bfloat16, "causal", 32, 8, 128, 16, True, True):
        add(cfg, torch.bfloat16, 90, 32, 8)
    for dt in (torch.float32, torch.float64):
        add(kernel_config(dt, "sliding_window", 16, 2, 256, 16, True, False, shared_limit=SHARED_LIMIT[80]),
            dt, 80, 16, 2)
    return out


def combine(dtype: torch.dtype, head_size: int = 128, splits: int = 8, arch: int = 90) -> CompiledKernel:
    """Pass 2 (the split reduce) as the wrapper launches it."""
    from .attention import _combine_kernel, _pow2

    acc = torch.float64 if dtype == torch.float64 else torch.float32
    ptrs = dict(part_ptr=acc, m_ptr=acc, l_ptr=acc, out_ptr=dtype)
    consts = dict(HEAD=head_size, HEAD_P=_pow2(head_size), SPLITS_P=_pow2(splits), ACC_F64=acc == torch.float64)
    return compile_kernel(_combine_kernel, f"combine {str(dtype)[6:]} d{head_size} splits{splits}", ptrs, consts,
                          4, arch)


def write_kv(dtype: torch.dtype, num_kv_heads: int = 8, head_size: int = 128, block_size: int = 16,
             arch: int = 90) -> CompiledKernel:
    """The K/V write kernel as ``write_kv_triton`` launches it."""
    from .write_kv import _write_kv_kernel

    row = num_kv_heads * head_size
    consts = dict(BLOCK_SIZE=block_size, ROW=row, ROW_P=1 << max(0, (row - 1).bit_length()))
    ptrs = dict(k_ptr=dtype, v_ptr=dtype, cache_ptr=dtype, slots_ptr=torch.int64)
    return compile_kernel(_write_kv_kernel, f"write_kv {str(dtype)[6:]} {num_kv_heads}x{head_size}", ptrs, consts,
                          4, arch)


def block_copy(element_size: int = 2, arch: int = 90) -> CompiledKernel:
    """The block-copy kernel as ``copy_pages_triton`` launches it for pages of ``element_size``
    bytes (16-byte aligned tensors: 8-byte words unless the element is narrower and the page odd)."""
    import triton.language as tl

    from .block_copy import CHUNK, _copy_pages_kernel

    ptrs = dict(src_addr_ptr=torch.int64, dst_addr_ptr=torch.int64, src_stride_ptr=torch.int64,
                dst_stride_ptr=torch.int64, src_ids_ptr=torch.int64, dst_ids_ptr=torch.int64)
    return compile_kernel(_copy_pages_kernel, f"block_copy {element_size}-byte elements (8-byte words)", ptrs,
                          dict(CHUNK=CHUNK, WORD=tl.int64, VEC=2), 4, arch, ints=dict(page=4096))


def standard_variants(full: bool = False):
    """``(label, thunk)`` for the variants the data path launches: the decode defaults (bfloat16,
    GQA 4, head 128, block 16) with and without splits, the K/V write and the block copy; with
    ``full`` every dtype x mask x split x arch."""
    dtypes = (torch.bfloat16, torch.float16, torch.float32, torch.float64) if full else (torch.bfloat16,)
    masks = ("causal", "sliding_window", "chunked_local") if full else ("sliding_window",)
    archs = ARCHS if full else (90,)
    out = []
    for arch in archs:
        for dt in dtypes:
            for mk in masks:
                for split in (False, True):
                    out.append((f"attention {dt} {mk} split={split} sm{arch}",
                                lambda dt=dt, mk=mk, split=split, arch=arch: attention(dt, mk, split=split, arch=arch)))
            out.append((f"combine {dt} sm{arch}", lambda dt=dt, arch=arch: combine(dt, arch=arch)))
            out.append((f"write_kv {dt} sm{arch}", lambda dt=dt, arch=arch: write_kv(dt, arch=arch)))
        for size in ((2, 4, 8) if full else (2,)):
            out.append((f"block_copy {size} sm{arch}", lambda size=size, arch=arch: block_copy(size, arch=arch)))
    return out


def real_shapes(tensor_parallel_size: int = 8) -> list[tuple[str, int, str, int, int, int, int]]:
    """Distinct ``(mask_kind, window or chunk (0: causal), dtype name, query heads, KV heads, head
    size, block size)`` of the
    attention layers of the packaged ``config.json`` fixtures (``kvref/examples/hf_configs``, read
    at call time so new fixtures count), as :func:`kvref.spec.hf_config.layout_from_hf_config`
    derives them, for one rank of TP 1 and of the largest TP up to ``tensor_parallel_size`` that
    divides the query heads (and whose KV-head split vLLM accepts): what the kernel sees per rank.
    MLA layers are one 576-wide latent head here, as the torch data path stores them (docs/torch.md).
    The KV head count only sizes the grid; what changes the compiled code is the GQA ratio, head
    size, block size, mask and dtype."""
    from importlib import resources

    from kvref.spec.hf_config import _text_config, layout_from_hf_config
    from kvref.spec.kv_cache_interface import AttentionSpec, MLAAttentionSpec

    from ..paged_attention import AttentionMask

    root = resources.files("kvref") / "examples" / "hf_configs"
    out: dict[tuple, None] = {}
    for path in sorted((p for p in root.iterdir() if p.name.endswith(".json")), key=lambda p: p.name):
        data = json.loads(path.read_text())
        heads = _text_config(data).get("num_attention_heads")
        if not heads:
            continue  # attention-free (Mamba)
        for tp in sorted({1, max(t for t in range(1, tensor_parallel_size + 1) if heads % t == 0)}):
            try:
                layout = layout_from_hf_config(data, tensor_parallel_size=tp)
            except InvalidFieldError:  # a KV-head count this TP cannot split
                continue
            for spec in layout.layers.values():
                if not isinstance(spec, AttentionSpec):
                    continue
                hkv = spec.num_kv_heads
                hq = heads // tp if isinstance(spec, MLAAttentionSpec) else max(hkv, heads // tp)
                mask = AttentionMask.for_spec(spec)
                out[(mask.kind, mask.size, spec.dtype, hq, hkv, spec.head_size, spec.block_size)] = None
    return list(out)


def real_shape_variants(arch: int = 90):
    """``(label, thunk)`` compiling :func:`real_shapes` as the wrapper launches them on CUDA (each
    distinct GQA ratio x head size x block size x mask once; model dtype, no splits)."""
    names = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    seen, out = set(), []
    for mk, _, dt, hq, hkv, d, bs in real_shapes():
        key = (mk, dt, hq // hkv, d, bs)
        if key in seen or dt not in names:
            continue
        seen.add(key)
        out.append((f"attention {dt} {mk} gqa{hq // hkv} d{d} bs{bs} sm{arch}",
                    lambda mk=mk, dt=names[dt], hq=hq, hkv=hkv, d=d, bs=bs: attention(dt, mk, hq, hkv, d, bs,
                                                                                      arch=arch)))
    return out


def compile_in_subprocess(full: bool = False, timeout: float = 1200, real: bool = False,
                          only: str | None = None, candidates: bool = False) -> list[CompiledKernel]:
    """Compile :func:`standard_variants` (``real``: :func:`real_shape_variants` instead; ``only``:
    the variants whose label contains it) in a fresh Python process without ``TRITON_INTERPRET``
    (the kernel tests run interpreted in their own process). Raises ``RuntimeError`` with the
    child's output when a variant fails to compile."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "kvref.impl.torch.triton_kernels.aot", "--json"] + (["--full"] if full else []) \
        + (["--real"] if real else []) + (["--only", only] if only else []) \
        + (["--candidates"] if candidates else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"ahead-of-time compile failed (exit {out.returncode}):\n{out.stdout}\n{out.stderr}")
    return [CompiledKernel(**row) for row in json.loads(out.stdout)]


def main(argv=None) -> int:
    """``python -m kvref.impl.torch.triton_kernels.aot [--full] [--json]``: compile the variants
    for the GPU targets and print their per-thread resource use (a Markdown table, or JSON)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvref.impl.torch.triton_kernels.aot", description=main.__doc__)
    ap.add_argument("--full", action="store_true", help="every dtype x mask x split x arch (slow: ~1 min per 10)")
    ap.add_argument("--real", action="store_true",
                    help="instead: the attention shapes of the packaged config.json fixtures (real_shapes)")
    ap.add_argument("--candidates", action="store_true",
                    help="instead: the configurations the attention wrapper can choose (a sample; with --full "
                         "every candidate of every fixture shape, sm_80 and sm_90), to check the shared-memory bound")
    ap.add_argument("--only", metavar="TEXT", help="only the variants whose label contains TEXT")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("triton is not installed (pip install triton==3.9.0)", file=sys.stderr)
        return 2
    rows = []
    variants = (candidate_variants(args.full) if args.candidates else real_shape_variants() if args.real
                else standard_variants(args.full))
    variants = [(label, thunk) for label, thunk in variants if not args.only or args.only in label]
    if not variants:
        print(f"no variant label contains {args.only!r}", file=sys.stderr)
        return 2
    for label, thunk in variants:
        try:
            rows.append(thunk())
        except InvalidFieldError as exc:
            print(f"{label}: {exc}", file=sys.stderr)
            return 2
        except Exception as exc:  # noqa: BLE001 - a compile error is the finding; say which variant
            print(f"{label}: does not compile: {exc}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in rows]))
        return 0
    print("| kernel variant | arch | warps | registers / thread | spill stack bytes / thread | shared bytes "
          "| shared bound | widest load bits | cubin bytes |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.label} | sm_{r.arch} | {r.num_warps} | {r.registers} | {r.stack_bytes} | {r.shared_bytes} | "
              f"{r.shared_bound if r.shared_bound is not None else ''} | {r.load_bits} | {r.cubin_bytes} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
