"""Run vLLM 0.33.0's own startup planning in-process, cheaply, and normalise its outcome.

Cheapest faithful path (measured: ~5 ms per plan, ~12 ms with auto-fit, against ~4 s for a
``VllmConfig`` with a ``ModelConfig``): build one ``VllmConfig`` per test module, resolve the
layout once (``LBNHC``, vLLM's default), and per case set only the fields vLLM's planning
functions read, then call exactly what ``EngineCore._initialize_kv_caches`` calls:
``get_global_kv_cache_groups`` → ``get_kv_cache_configs`` → ``generate_scheduler_kv_cache_config``
→ (``cache_config.block_size`` = smallest prefix-cacheable group block size) →
``update_kv_cache_capacity`` (``get_kv_cache_capacity`` → ``get_max_concurrency_for_kv_cache_config``)
→ ``resolve_kv_cache_block_sizes``.

``extra_retained_tokens`` reaches vLLM the way it does in production: ``get_global_kv_cache_groups``
tags every sliding-window layer with ``num_prefill_lookahead_tokens - 1``; the driver sets that
property for the call (it is normally derived from a multi-module MTP speculative config).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from kvref.spec import (
    EngineConfig,
    InsufficientKVCacheError,
    InvalidFieldError,
    KVCacheGroupingError,
    KVCacheSpec,
)
from kvref.impl.vllm.scratch import tiny_llama_dir


@dataclass
class Outcome:
    """What one planner said: ``ok`` with comparable fields, or a classified rejection."""

    status: str  # "ok" | "insufficient" | "invalid" | "grouping"
    detail: Any = None  # reason / field
    estimated_max_model_len: int | None = None
    fields: dict[str, Any] = field(default_factory=dict)

    def key(self):
        return (self.status, self.detail, self.estimated_max_model_len)


class VllmPlanner:
    def __init__(self):
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        import torch
        from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
        from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE
        from vllm.v1 import kv_cache_interface as kci
        from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
        from vllm.v1.core import kv_cache_planning as planning
        from vllm.v1.core import kv_cache_utils as utils

        logging.getLogger("vllm").setLevel(logging.ERROR)
        self.torch, self.kci, self.planning, self.utils = torch, kci, planning, utils
        self.dtypes = STR_DTYPE_TO_TORCH_DTYPE
        self.KVTransferConfig = KVTransferConfig
        self.VllmConfig = VllmConfig
        d = tiny_llama_dir(num_hidden_layers=4, max_position_embeddings=4096)
        mc = ModelConfig(model=d, tokenizer=d, skip_tokenizer_init=True, max_model_len=1024, dtype="float16")
        self.vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=16))
        resolve_kv_cache_layout(self.vc, [["LBNHC", "LBHNC"]], [])
        assert self.vc.cache_config.kv_cache_layout == "LBNHC"
        logging.getLogger("vllm").setLevel(logging.ERROR)

    # -- kvref spec -> vLLM spec ------------------------------------------------------------

    def to_vllm(self, spec: KVCacheSpec):
        """vLLM's twin of a kvref spec (the shared converter of :mod:`kvref.impl.vllm`)."""
        from kvref.impl.vllm import to_vllm_spec

        return to_vllm_spec(spec)

    # -- settings ---------------------------------------------------------------------------

    def configure(self, config: EngineConfig, max_model_len: int | None = None) -> None:
        vc = self.vc
        mml = config.resolved_max_model_len if max_model_len is None else max_model_len
        vc.model_config.max_model_len = mml
        vc.model_config.original_max_model_len = -1 if config.auto_fit and max_model_len is None else mml
        cc = vc.cache_config
        cc.num_gpu_blocks_override = config.num_gpu_blocks_override
        cc.enable_prefix_caching = config.enable_prefix_caching
        cc.mamba_cache_mode = config.mamba_cache_mode
        cc.prefix_match_unit = config.prefix_match_unit
        cc.block_size = config.block_size
        sc = vc.scheduler_config
        sc.max_num_batched_tokens = config.max_num_batched_tokens
        assert config.max_concurrent_batches in (1, 2)
        sc.async_scheduling = config.max_concurrent_batches == 2
        sc.max_num_encoder_input_tokens = config.max_num_encoder_input_tokens
        sc.disable_hybrid_kv_cache_manager = config.disable_hybrid_kv_cache_manager
        vc.parallel_config.decode_context_parallel_size = config.dcp_world_size
        vc.kv_transfer_config = (self.KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both")
                                 if config.has_kv_connector else None)
        assert vc.max_in_flight_tokens == config.max_in_flight_tokens

    # -- one plan ---------------------------------------------------------------------------

    def plan(self, layers: dict[str, KVCacheSpec], config: EngineConfig, available_memory: int,
             extra_retained_tokens: int, kv_cache_layout: str = "LBNHC") -> Outcome:
        self.configure(config)
        self.vc.cache_config.kv_cache_layout = kv_cache_layout  # VLLM_KV_CACHE_LAYOUT
        specs = {n: self.to_vllm(s) for n, s in layers.items()}
        vc, planning, utils = self.vc, self.planning, self.utils
        cls = type(vc)
        saved = cls.__dict__["num_prefill_lookahead_tokens"]
        cls.num_prefill_lookahead_tokens = property(
            lambda self: extra_retained_tokens + 1 if extra_retained_tokens else 0)
        try:
            groups = planning.get_global_kv_cache_groups(vc, [dict(specs)])
            cfgs = planning.get_kv_cache_configs(vc, [dict(specs)], [available_memory], groups)
            sched = utils.generate_scheduler_kv_cache_config(cfgs)
            participating = [g.kv_cache_spec.block_size for g in sched.kv_cache_groups
                             if g.kv_cache_spec.prefix_cacheable]
            vc.cache_config.block_size = min(participating or [g.kv_cache_spec.block_size
                                                               for g in sched.kv_cache_groups])
            # as EngineCore does: update_kv_cache_capacity stores both capacity figures in the cache config
            utils.update_kv_cache_capacity(vc, sched)
            concurrency = vc.cache_config.kv_cache_max_concurrency
            sbs, hbs = utils.resolve_kv_cache_block_sizes(sched, vc)
            alignment = utils.resolve_cache_hit_alignment_tokens(sched, vc, sbs, hbs)
        except ValueError as exc:
            return self._classify(exc)
        except (NotImplementedError, StopIteration):  # StopIteration: an empty packed group (planning_packed)
            return Outcome("grouping")
        except AssertionError as exc:
            if "KV cache groups miss layers" in str(exc):  # a packed split that drops layers
                return Outcome("grouping")
            if "DCP not support sliding window" in str(exc):
                return Outcome("invalid", "dcp_world_size")
            if "Page padding requires dimensions" in str(exc):
                return Outcome("invalid", "kv_cache_layout")
            raise
        finally:
            cls.num_prefill_lookahead_tokens = saved
        worker = cfgs[0]
        mml = vc.model_config.max_model_len
        dcp = vc.parallel_config.decode_context_parallel_size
        per_group, caps, bounds = [], [], []
        for g, sg in zip(worker.kv_cache_groups, sched.kv_cache_groups):
            spec = g.kv_cache_spec
            per_group.append(spec.max_memory_usage_pages(vc) if isinstance(spec, self.kci.UniformTypeKVCacheSpecs)
                             else -(-spec.max_memory_usage_bytes(vc) // spec.page_size_bytes))
            s = sg.kv_cache_spec
            caps.append(s.max_admission_blocks_per_request(vc.max_in_flight_tokens, mml)
                        if hasattr(s, "max_admission_blocks_per_request") else None)
            bounds.append(s.max_memory_usage_bytes(vc))
        return Outcome("ok", fields=dict(
            groups=[(tuple(g.layer_names), g.kv_cache_spec) for g in worker.kv_cache_groups],
            scheduler_groups=[(tuple(g.layer_names), g.kv_cache_spec) for g in sched.kv_cache_groups],
            page_sizes=[g.kv_cache_spec.page_size_bytes for g in worker.kv_cache_groups],
            bytes_per_block=planning._pool_bytes_per_block(vc, worker.kv_cache_groups),
            num_blocks=worker.num_blocks, max_model_len=mml, blocks_per_request=per_group,
            admission_caps=caps, memory_bounds=bounds, scheduler_block_size=sbs, hash_block_size=hbs,
            cache_hit_alignment_tokens=alignment, max_concurrency=concurrency,
            kv_cache_size_tokens=vc.cache_config.kv_cache_size_tokens,
            # the token span of each group's block under DCP (what a token-keyed connector stores)
            dcp_specs=[None if _padded(g.kv_cache_spec) else utils.resolve_dcp_kv_cache_spec(g.kv_cache_spec, dcp)
                       for g in worker.kv_cache_groups],
            # where each layer's bytes live in the worker's allocation (#22: gen.kv_cache_planning.706.inc)
            kv_cache_tensors=vllm_kv_cache_tensors(worker)))

    def check_per_layer(self, layers: dict[str, KVCacheSpec], config: EngineConfig, available_memory: int,
                        kv_cache_layout: str = "LBNHC") -> Outcome:
        """vLLM's public per-layer ``check_enough_kv_cache_memory(vllm_config, specs, memory)``."""
        self.configure(config)
        self.vc.cache_config.kv_cache_layout = kv_cache_layout
        try:
            self.planning.check_enough_kv_cache_memory(self.vc, {n: self.to_vllm(s) for n, s in layers.items()},
                                                       available_memory)
        except ValueError as exc:
            return self._classify(exc)
        except (NotImplementedError, StopIteration):
            return Outcome("grouping")
        except AssertionError as exc:
            if "DCP not support sliding window" in str(exc):
                return Outcome("invalid", "dcp_world_size")
            raise
        return Outcome("ok")

    @staticmethod
    def _classify(exc: ValueError) -> Outcome:
        msg = str(exc)
        if msg.startswith("No available memory"):
            return Outcome("insufficient", InsufficientKVCacheError.NO_MEMORY, 0)
        if msg.startswith("To serve at least one request"):
            m = re.search(r"estimated maximum model length is (\d+)", msg)
            return Outcome("insufficient", InsufficientKVCacheError.TOO_LONG, int(m.group(1)) if m else 0)
        if msg.startswith("Cannot auto-fit"):
            return Outcome("insufficient", InsufficientKVCacheError.AUTO_FIT_FAILED, 0)
        if msg.startswith("Invalid prefix_match_unit"):
            return Outcome("invalid", "prefix_match_unit")
        if msg.startswith("KV cache layout") and "cannot express" in msg:
            return Outcome("invalid", "kv_cache_layout")
        if "same window size" in msg or "Failed to promote" in msg:
            return Outcome("grouping")
        raise exc


def _padded(spec: Any) -> bool:
    """Whether a (kvref or vLLM) group spec has a padded page: vLLM's ``resolve_dcp_kv_cache_spec``
    keeps the unscaled ``page_size_padded``, below the scaled page, which kvref's specs refuse to
    hold (docs/differences.md), so the DCP view of such a group is not compared."""
    layers = getattr(spec, "kv_cache_specs", None) or {"": spec}
    return any(getattr(s, "page_size_padded", None) is not None for s in layers.values())


def _kvref_attempt(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, Outcome | None]:
    """``fn``'s result, or the normalised outcome of kvref's refusal (one mapping of kvref's errors
    to :class:`Outcome` for every kvref-side verdict, as the planner has for vLLM's)."""
    try:
        return fn(*args, **kwargs), None
    except InsufficientKVCacheError as exc:
        return None, Outcome("insufficient", exc.reason, exc.estimated_max_model_len)
    except KVCacheGroupingError:
        return None, Outcome("grouping")
    except InvalidFieldError as exc:
        return None, Outcome("invalid", exc.field)


def kvref_per_layer_outcome(layers, config, available_memory, kv_cache_layout: str = "LBNHC") -> Outcome:
    """kvref's :func:`~kvref.spec.planning_per_layer_check.check_enough_kv_cache_memory_per_layer` verdict."""
    from kvref.spec.planning_per_layer_check import check_enough_kv_cache_memory_per_layer

    _, refused = _kvref_attempt(check_enough_kv_cache_memory_per_layer, layers, config, available_memory,
                                kv_cache_layout=kv_cache_layout)
    return refused or Outcome("ok")


def kvref_outcome(planner: VllmPlanner, layers, config, available_memory, kv_cache_layout: str = "LBNHC") -> Outcome:
    """kvref's plan in the same normalised form (specs converted to vLLM's for comparison)."""
    from kvref.spec import plan_kv_cache
    from kvref.spec.block_sizes import resolve_dcp_kv_cache_spec

    plan, refused = _kvref_attempt(plan_kv_cache, layers, config, available_memory, kv_cache_layout=kv_cache_layout)
    if refused:
        return refused
    plan.check_invariants()
    m = plan.max_model_len
    return Outcome("ok", fields=dict(
        groups=[(g.layer_names, planner.to_vllm(g.kv_cache_spec)) for g in plan.groups],
        scheduler_groups=[(g.layer_names, planner.to_vllm(g.kv_cache_spec)) for g in plan.scheduler_groups],
        page_sizes=[g.kv_cache_spec.page_size_bytes for g in plan.groups],
        bytes_per_block=plan.bytes_per_block, num_blocks=plan.num_blocks, max_model_len=m,
        blocks_per_request=list(plan.blocks_per_request), admission_caps=list(plan.admission_caps),
        memory_bounds=[g.kv_cache_spec.max_memory_usage_bytes(config, m) for g in plan.scheduler_groups],
        scheduler_block_size=plan.scheduler_block_size, hash_block_size=plan.hash_block_size,
        cache_hit_alignment_tokens=plan.cache_hit_alignment_tokens, max_concurrency=plan.max_concurrency,
        kv_cache_size_tokens=plan.kv_cache_size_tokens,
        dcp_specs=[None if _padded(g.kv_cache_spec) else
                   planner.to_vllm(resolve_dcp_kv_cache_spec(g.kv_cache_spec, config.dcp_world_size))
                   for g in plan.groups],
        kv_cache_tensors=plan.kv_cache_tensors))


def vllm_kv_cache_tensors(kv_cache_config: Any) -> tuple[Any, ...]:
    """vLLM's planned ``KVCacheConfig.kv_cache_tensors`` as kvref's
    :class:`~kvref.spec.kv_cache_tensors.KVCacheTensor` (same fields, layer names as a tuple)."""
    from kvref.spec.kv_cache_tensors import KVCacheTensor

    return tuple(KVCacheTensor(t.size, tuple(t.layers), t.layer_stride, t.block_stride, t.offset, t.host_resident)
                 for t in kv_cache_config.kv_cache_tensors)


def tensor_divergence(ours: Any, theirs: Any) -> str | None:
    """None when both plans place the KV bytes alike, else the first difference, naming the tensor's
    index, field and layers (``kv_cache_tensors[2].offset: kvref 0 != vLLM 1 (layers ...)``): a
    misplaced view reads another layer's KV, which no block count shows."""
    from dataclasses import fields

    from kvref.spec.kv_cache_tensors import KVCacheTensor

    ours, theirs = tuple(ours), tuple(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        for f in fields(KVCacheTensor):
            got, want = getattr(a, f.name), getattr(b, f.name)
            if got != want:
                return f"kv_cache_tensors[{i}].{f.name}: kvref {got!r} != vLLM {want!r} (layers {list(b.layers)})"
    if len(ours) != len(theirs):
        return (f"kv_cache_tensors: kvref plans {len(ours)} tensors, vLLM {len(theirs)} "
                f"(layers: kvref {[list(t.layers) for t in ours]}, vLLM {[list(t.layers) for t in theirs]})")
    return None


def outcome_divergence(ours: Outcome, theirs: Outcome) -> str | None:
    """None when kvref's and vLLM's outcomes agree (verdict, reason, estimated length, then every
    field vLLM's side reports), else the first difference in one line; tensors by index and field."""
    if ours.key() != theirs.key():
        return f"accept/reject: kvref {ours.key()} vs vLLM {theirs.key()}"
    for name, want in theirs.fields.items():
        got = ours.fields.get(name)
        if name == "kv_cache_tensors":
            diff = tensor_divergence(got, want)
            if diff:
                return diff
        elif got != want:
            return f"{name}: kvref {got!r} != vLLM {want!r}"
    return None


def vllm_approximate_gcd(values: list[int], **kwargs: Any) -> int:
    """vLLM's ``_approximate_gcd`` (the packed layouts' chunk size), called as is."""
    from vllm.v1.core.kv_cache_planning import _approximate_gcd

    return _approximate_gcd(values, **kwargs)


def vllm_largest_divisor_at_most(value: int, limit: int) -> int:
    """vLLM's ``_largest_divisor_at_most`` (the hidden-state block size), called as is."""
    from vllm.v1.core.kv_cache_planning import _largest_divisor_at_most

    return _largest_divisor_at_most(value, limit)
