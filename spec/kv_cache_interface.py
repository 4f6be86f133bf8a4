"""KV cache specs: what one layer's cache looks like, and how much a request may hold of it.

Mirrors ``vllm/v1/kv_cache_interface.py`` of vLLM 0.33.0 for the spec types kvref models. All
specs are frozen dataclasses that validate their fields on construction (bad values raise
:class:`~kvref.spec.errors.InvalidFieldError`, a ``ValueError``), so a spec that exists is sane.

The rule that matters most (vLLM #40946, fixing #39734): for sliding-window and
chunked-local layers, ``max_admission_blocks_per_request`` is the *single* formula both startup
sizing (``max_memory_usage_bytes``) and the runtime admission gate use. When the two disagreed,
startup accepted a ``max_model_len`` that the gate could never admit and the scheduler waited
forever.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from math import prod
from typing import TYPE_CHECKING, ClassVar

from .dtypes import canonical_dtype, get_dtype_size
from .errors import InvalidFieldError, SpecMergeError, WindowSizeMismatchError, check_choice, check_int
from .mathutil import cdiv, round_up

if TYPE_CHECKING:  # pragma: no cover
    from .config import EngineConfig


#: filled at the end of the module (the classes must exist first)
_UNIFORM_TYPE_BASE: "dict[type, type]" = {}


def _checked_sizing(fn):
    """Check a sizing method's ``config`` (an :class:`EngineConfig`) and length (an int >= 0; None
    allowed where the method defaults it) before any arithmetic: a wrong value there used to escape
    as ``AttributeError``/``TypeError`` from deep inside the formula."""
    import functools
    import inspect

    params = list(inspect.signature(fn).parameters)
    length_name = params[2]
    optional = inspect.signature(fn).parameters[length_name].default is None

    @functools.wraps(fn)
    def checked(self, config, *args, **kwargs):
        from .config import EngineConfig

        if not isinstance(config, EngineConfig):
            raise InvalidFieldError("config", config, "an EngineConfig")
        length = args[0] if args else kwargs.get(length_name)
        check_int(length_name, length, minimum=0, allow_none=optional)
        return fn(self, config, *args, **kwargs)

    return checked


def _check_specs(field: str, specs: object, *, mapping: bool) -> None:
    """A non-empty dict of layer name -> spec (``mapping``) or a non-empty list of specs."""
    if mapping:
        ok = isinstance(specs, dict) and specs and all(isinstance(s, KVCacheSpec) for s in specs.values())
        what = "a non-empty dict of layer name -> KVCacheSpec"
    else:
        ok = isinstance(specs, (list, tuple)) and specs and all(isinstance(s, KVCacheSpec) for s in specs)
        what = "a non-empty list of KVCacheSpec"
    if not ok:
        raise InvalidFieldError(field, specs, what)


def _check_bool(owner: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidFieldError(f"{owner}.{name}", value, "True or False")


@dataclass(frozen=True)
class KVCacheSpec:
    """Base of all specs: ``block_size`` tokens share one block (page) of the pool."""

    block_size: int
    #: whether decode context parallelism shards this cache's token positions
    dcp_sharded: bool = field(default=False, kw_only=True)

    #: name of the vLLM single-type manager that runs this spec
    manager_name: ClassVar[str] = ""
    #: whether blocks of this spec can be shared through the prefix cache
    prefix_cacheable: ClassVar[bool] = True

    def __post_init__(self) -> None:
        check_int(f"{type(self).__name__}.block_size", self.block_size, minimum=1)
        _check_bool(type(self).__name__, "dcp_sharded", self.dcp_sharded)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer."""
        raise NotImplementedError(f"{type(self).__name__} is abstract: use a concrete spec")

    @_checked_sizing
    def max_memory_usage_bytes(self, config: "EngineConfig", max_model_len: int | None = None) -> int:
        """Bytes one request of ``max_model_len`` tokens may hold at once (startup sizing)."""
        raise NotImplementedError(f"{type(self).__name__} is abstract: use a concrete spec")

    @_checked_sizing
    def max_memory_usage_blocks(self, config: "EngineConfig", max_model_len: int | None = None) -> int:
        """``cdiv(max_memory_usage_bytes, page_size_bytes)``: block ids one request may hold.

        This is what vLLM's ``_max_memory_usage_bytes_from_groups`` and the max-concurrency report
        count per group.
        """
        return cdiv(self.max_memory_usage_bytes(config, max_model_len), self.page_size_bytes)

    @_checked_sizing
    def max_num_blocks_per_req(self, config: "EngineConfig", max_len: int) -> int:
        """Width of the worker-side block table row (not memory accounting)."""
        return cdiv(max_len, self.block_size)

    @property
    def prefix_replay_tokens(self) -> int:
        """Trailing hit tokens a prefix hit recomputes to rebuild this group's KV (vLLM 0.33.0
        ``KVCacheSpec.prefix_replay_tokens``): 0 except for a bounded-replay sliding window
        (:class:`SlidingWindowMLASpec`), whose window is recomputed after every hit."""
        return 0

    def admission_cap(self, max_in_flight_tokens: int, max_model_len: int) -> int | None:
        """The per-request block cap vLLM's manager for this spec admits against, or None (no cap).

        The one answer to "is this spec capped?": startup sizing (``plan_kv_cache``), the runtime
        gate (the coordinator), the torch implementation and the explorer all ask it, so they
        cannot disagree — the disagreement behind vLLM #39734 / #35541. Windowed specs override it
        with ``max_admission_blocks_per_request`` (vLLM #40946).
        """
        return None

    def effective_block_size(self, dcp_world_size: int = 1) -> int:
        """Tokens per block as managers see them (block_size × DCP when sharded)."""
        check_int("dcp_world_size", dcp_world_size, minimum=1)
        return self.block_size * (dcp_world_size if self.dcp_sharded else 1)

    def copy_with_new_block_size(self, block_size: int) -> "KVCacheSpec":
        from dataclasses import replace

        return replace(self, block_size=block_size)

    # -- grouping (vLLM's ``merge`` / ``is_uniform_with_collection``) ---------------------------

    @classmethod
    def uniform_type_base(cls) -> "type[KVCacheSpec] | None":
        """The class vLLM's spec registry groups this spec with (``uniform_type_base_spec``).

        None for specs vLLM 0.33.0 does not register (planning rejects them).
        """
        for klass in cls.__mro__:
            if klass in _UNIFORM_TYPE_BASE:
                return _UNIFORM_TYPE_BASE[klass]
        return None

    @classmethod
    def merge(cls, specs: "list[KVCacheSpec]") -> "KVCacheSpec":
        """One spec for layers that share a group: they must all be equal.

        Raises :class:`SpecMergeError` (vLLM: ``AssertionError``) when they are not.
        """
        _check_specs("specs", specs, mapping=False)
        first = specs[0]
        if not all(s == first for s in specs[1:]):
            raise SpecMergeError("All layers in the same KV cache group must be the same.")
        return first

    def is_uniform_with_collection(self, specs: "dict[str, KVCacheSpec]") -> bool:
        """Whether all ``specs`` need the same number of token slots as this one (so they can form
        one :class:`UniformTypeKVCacheSpecs` group although their page sizes differ)."""
        _check_specs("specs", specs, mapping=True)
        base = self.uniform_type_base()
        return base is not None and all(isinstance(s, base) for s in specs.values())


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    """Paged K/V: one block holds ``block_size`` tokens × ``num_kv_heads`` × (K + V)."""

    dcp_sharded: bool = True
    num_kv_heads: int
    head_size: int
    dtype: str
    head_size_v: int | None = None
    page_size_padded: int | None = None
    #: bytes of one (head, token) cell when the backend packs it (vLLM ``state_content_bytes``,
    #: e.g. 656 for DeepSeek's ``fp8_ds_mla``); None: dense K+V, ``(head_size + head_size_v) * dtype``
    state_content_bytes: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        check_int(f"{owner}.state_content_bytes", self.state_content_bytes, minimum=1, allow_none=True)
        check_int(f"{owner}.num_kv_heads", self.num_kv_heads, minimum=1)
        check_int(f"{owner}.head_size", self.head_size, minimum=1)
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype, f"{owner}.dtype"))
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        check_int(f"{owner}.head_size_v", self.head_size_v, minimum=0)
        check_int(f"{owner}.page_size_padded", self.page_size_padded, minimum=1, allow_none=True)
        if self.page_size_padded is not None and self.page_size_padded < self.unpadded_page_size_bytes:
            raise InvalidFieldError(
                f"{owner}.page_size_padded", self.page_size_padded,
                f"None or an int >= the unpadded page size {self.unpadded_page_size_bytes}")

    @property
    def state_content_size_bytes(self) -> int:
        """Bytes per (head, token) cell of the page."""
        if self.state_content_bytes is not None:
            return self.state_content_bytes
        assert self.head_size_v is not None
        return (self.head_size + self.head_size_v) * get_dtype_size(self.dtype)

    @property
    def unpadded_page_size_bytes(self) -> int:
        return self.num_kv_heads * self.block_size * self.state_content_size_bytes

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.unpadded_page_size_bytes

    @_checked_sizing
    def max_num_blocks_per_req(self, config: "EngineConfig", max_len: int) -> int:
        return cdiv(max_len, self.effective_block_size(config.dcp_world_size))


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    """Full causal attention: a request keeps every block until it finishes (no admission cap).

    ``sliding_window``/``attention_chunk_size`` are only set when the hybrid manager is disabled
    and a windowed layer was promoted to full attention (compute stays windowed).
    """

    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    manager_name: ClassVar[str] = "FullAttentionManager"

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        check_int(f"{owner}.sliding_window", self.sliding_window, minimum=1, allow_none=True)
        check_int(f"{owner}.attention_chunk_size", self.attention_chunk_size, minimum=1, allow_none=True)
        if self.sliding_window is not None and self.attention_chunk_size is not None:
            raise InvalidFieldError(f"{owner}.attention_chunk_size", self.attention_chunk_size,
                                    "None when sliding_window is set (not both)")

    @_checked_sizing
    def max_memory_usage_bytes(self, config: "EngineConfig", max_model_len: int | None = None) -> int:
        m = config.resolved_max_model_len if max_model_len is None else max_model_len
        if self.dcp_sharded and config.dcp_world_size > 1:
            m = cdiv(m, config.dcp_world_size)
        return cdiv(m, self.block_size) * self.page_size_bytes

    @classmethod
    def merge(cls, specs: "list[KVCacheSpec]") -> "KVCacheSpec":
        """Merge full-attention layers: the window/chunk sizes set on promoted layers must agree.

        Mirrors vLLM's ``FullAttentionSpec.merge``: the merged spec takes the first layer's fields
        and the (single) window and chunk size found; every layer must match it on the
        :class:`AttentionSpec` fields. Different window sizes raise
        :class:`WindowSizeMismatchError` (vLLM: ``ValueError``), any other mismatch
        :class:`SpecMergeError` (vLLM: ``AssertionError``).
        """
        _check_specs("specs", specs, mapping=False)
        if not all(isinstance(s, FullAttentionSpec) for s in specs):
            raise SpecMergeError("All attention layers in the same KV cache group must be FullAttentionSpec.")
        windows = {s.sliding_window for s in specs if s.sliding_window is not None}  # type: ignore[attr-defined]
        chunks = {s.attention_chunk_size for s in specs if s.attention_chunk_size is not None}  # type: ignore[attr-defined]
        if any(isinstance(s, MLAAttentionSpec) for s in specs):
            raise SpecMergeError("MLAAttentionSpec layers merge only with MLAAttentionSpec layers.")
        if len(windows) > 1 or len(chunks) > 1:
            raise WindowSizeMismatchError(
                "All attention layers in the same KV cache group must have the same window size "
                f"(sliding_window values {sorted(windows)}, attention_chunk_size values {sorted(chunks)}).")
        first = specs[0]
        assert isinstance(first, AttentionSpec)
        if windows and chunks:
            raise SpecMergeError("Model with both sliding window layers and chunked local attention layers "
                                 "is not supported.")
        merged = cls(**_attention_fields(first),  # type: ignore[call-arg]
                     sliding_window=next(iter(windows), None), attention_chunk_size=next(iter(chunks), None))
        _check_same_attention_fields(specs, merged)
        return merged


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: one latent vector per token (``head_size_v = 0``).

    ``alignment`` pads the page up to a multiple (DeepSeek-V4 style), as vLLM does in
    ``__post_init__``.
    """

    head_size_v: int | None = 0
    cache_dtype_str: str | None = None
    alignment: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(f"{type(self).__name__}.alignment", self.alignment, minimum=1, allow_none=True)
        if self.alignment is not None:
            padded = round_up(self.unpadded_page_size_bytes, self.alignment)
            if padded != self.unpadded_page_size_bytes:
                object.__setattr__(self, "page_size_padded", padded)

    @classmethod
    def merge(cls, specs: "list[KVCacheSpec]") -> "KVCacheSpec":
        """Merge MLA layers (vLLM's ``MLAAttentionSpec.merge``): same ``cache_dtype_str`` and
        :class:`AttentionSpec` fields. The merged spec keeps the first layer's page (padding
        included) but, as in vLLM, not its ``alignment`` or window fields."""
        _check_specs("specs", specs, mapping=False)
        if not all(isinstance(s, MLAAttentionSpec) for s in specs):
            raise SpecMergeError("All attention layers in the same KV cache group must be MLAAttentionSpec.")
        if len({s.cache_dtype_str for s in specs}) != 1:  # type: ignore[attr-defined]
            raise SpecMergeError("All MLA layers in the same KV cache group must use the same cache dtype.")
        first = specs[0]
        assert isinstance(first, MLAAttentionSpec)
        fields_ = _attention_fields(first)
        fields_.pop("head_size_v")
        merged = cls(**fields_, cache_dtype_str=first.cache_dtype_str)  # type: ignore[call-arg]
        _check_same_attention_fields(specs, merged)
        return merged


@dataclass(frozen=True, kw_only=True)
class HiddenStateCacheSpec(MLAAttentionSpec):
    """A layer that stores hidden states in the KV cache (vLLM's ``extract_hidden_states``: one
    "head" per captured layer, ``head_size`` = the hidden size), laid out like MLA.

    Grouping keeps it out of the attention buckets: it becomes a group of its own whose block size
    divides the other groups' and whose page is padded to their common page (see
    :mod:`kvref.spec.planning_hidden_state`). Merges like MLA layers.
    """


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention: blocks wholly before the window are freed as the request advances.

    ``extra_retained_tokens`` keeps that many extra trailing tokens' blocks alive below the window
    (multi-module MTP re-prefills them); vLLM sets it globally in ``get_global_kv_cache_groups``.
    """

    sliding_window: int
    extra_retained_tokens: int = 0
    manager_name: ClassVar[str] = "SlidingWindowManager"

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        check_int(f"{owner}.sliding_window", self.sliding_window, minimum=1)
        check_int(f"{owner}.extra_retained_tokens", self.extra_retained_tokens, minimum=0)

    @property
    def num_retained_tokens(self) -> int:
        """Tokens below the next position that must stay readable."""
        return self.sliding_window - 1 + self.extra_retained_tokens

    def admission_cap(self, max_in_flight_tokens: int, max_model_len: int) -> int | None:
        return self.max_admission_blocks_per_request(max_in_flight_tokens, max_model_len)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """Blocks one request may hold at once; startup sizing and the runtime gate both use it.

        A request holds the last ``sliding_window - 1`` processed tokens, the extra retained ones and
        the tokens in flight (frees happen on the processed-token basis), never more than
        ``max_model_len``; ``+1`` because the window may start mid-block (block size 4, a 6-token
        window ``[CDEF]`` spans ``[XXCD][EF]``). See vLLM #40946 / #39734.
        """
        check_int("max_in_flight_tokens", max_in_flight_tokens, minimum=0)
        check_int("max_model_len", max_model_len, minimum=1)
        num_tokens = min(self.sliding_window - 1 + self.extra_retained_tokens + max_in_flight_tokens,
                         max_model_len)
        return cdiv(num_tokens, self.block_size) + 1

    @_checked_sizing
    def max_memory_usage_bytes(self, config: "EngineConfig", max_model_len: int | None = None) -> int:
        if self.dcp_sharded and config.dcp_world_size != 1:
            raise InvalidFieldError("dcp_world_size", config.dcp_world_size,
                                    "1 (decode context parallelism does not support sliding window)")
        m = config.resolved_max_model_len if max_model_len is None else max_model_len
        return self.max_admission_blocks_per_request(config.max_in_flight_tokens, m) * self.page_size_bytes

    def is_uniform_with_collection(self, specs: "dict[str, KVCacheSpec]") -> bool:
        """Sliding-window layers need the same token slots only with the same window."""
        _check_specs("specs", specs, mapping=True)
        return all(isinstance(s, SlidingWindowSpec) and s.sliding_window == self.sliding_window
                   for s in specs.values())


@dataclass(frozen=True, kw_only=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    """A sliding window stored in MLA format (one latent vector per token, ``head_size_v = 0``;
    vLLM 0.33.0 ``SlidingWindowMLASpec``, run by the ``SlidingWindowManager``).

    ``bounded_replay`` (DeepSeek-V4.1 "SWA bounded replay"): the group's blocks are per-request
    scratch, never shared through the prefix cache (``prefix_cacheable`` is False: no hit lookup,
    no caching, no hashes); after a prefix hit the scheduler recomputes the hit's last
    ``sliding_window`` tokens (``prefix_replay_tokens``) to rebuild the window's KV, and drops hits
    no longer than the window (see :mod:`kvref.impl.reference.scheduler_prefix_replay`).
    ``alignment`` pads the page up to a multiple, as for :class:`MLAAttentionSpec`.
    """

    head_size_v: int | None = 0
    cache_dtype_str: str | None = None
    alignment: int | None = None
    bounded_replay: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        _check_bool(owner, "bounded_replay", self.bounded_replay)
        check_int(f"{owner}.alignment", self.alignment, minimum=1, allow_none=True)
        if self.alignment is not None:
            padded = round_up(self.unpadded_page_size_bytes, self.alignment)
            if padded != self.unpadded_page_size_bytes:
                object.__setattr__(self, "page_size_padded", padded)

    @property
    def prefix_cacheable(self) -> bool:  # type: ignore[override]
        return not self.bounded_replay

    @property
    def prefix_replay_tokens(self) -> int:
        return self.sliding_window if self.bounded_replay else 0

    @classmethod
    def merge(cls, specs: "list[KVCacheSpec]") -> "KVCacheSpec":
        """Merge sliding-window MLA layers (vLLM's ``SlidingWindowMLASpec.merge``): one cache dtype,
        window, retained-token count and replay policy, and the same :class:`AttentionSpec`
        fields; the merged spec keeps the first layer's page (padding included)."""
        _check_specs("specs", specs, mapping=False)
        if not all(isinstance(s, SlidingWindowMLASpec) for s in specs):
            raise SpecMergeError("All attention layers in the same KV cache group must be SlidingWindowMLASpec.")
        for name in ("cache_dtype_str", "sliding_window", "extra_retained_tokens", "bounded_replay"):
            if len({getattr(s, name) for s in specs}) != 1:
                raise SpecMergeError("All attention layers in the same KV cache group must use the same "
                                     f"quantization method, sliding window size, retained token count and "
                                     f"replay policy ({name} differs).")
        first = specs[0]
        assert isinstance(first, SlidingWindowMLASpec)
        merged = cls(**_attention_fields(first), sliding_window=first.sliding_window,  # type: ignore[call-arg]
                     extra_retained_tokens=first.extra_retained_tokens, cache_dtype_str=first.cache_dtype_str,
                     bounded_replay=first.bounded_replay)
        _check_same_attention_fields(specs, merged)
        return merged

    def is_uniform_with_collection(self, specs: "dict[str, KVCacheSpec]") -> bool:
        """Same token slots only with the same window and replay policy (a replay group's blocks
        are not prefix-cached, a plain window's are)."""
        _check_specs("specs", specs, mapping=True)
        return all(isinstance(s, SlidingWindowMLASpec) and s.sliding_window == self.sliding_window
                   and s.bounded_replay == self.bounded_replay for s in specs.values())


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Chunked local attention: a token sees only its own ``attention_chunk_size`` chunk."""

    attention_chunk_size: int
    manager_name: ClassVar[str] = "ChunkedLocalAttentionManager"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(f"{type(self).__name__}.attention_chunk_size", self.attention_chunk_size, minimum=1)

    def admission_cap(self, max_in_flight_tokens: int, max_model_len: int) -> int | None:
        return self.max_admission_blocks_per_request(max_in_flight_tokens, max_model_len)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """One chunk plus the in-flight tokens, at most ``max_model_len``; no ``+1`` (chunks start
        on their own boundaries). Single source of truth with startup sizing (vLLM #40946)."""
        check_int("max_in_flight_tokens", max_in_flight_tokens, minimum=0)
        check_int("max_model_len", max_model_len, minimum=1)
        num_tokens = min(self.attention_chunk_size + max_in_flight_tokens, max_model_len)
        return cdiv(num_tokens, self.block_size)

    @_checked_sizing
    def max_memory_usage_bytes(self, config: "EngineConfig", max_model_len: int | None = None) -> int:
        m = config.resolved_max_model_len if max_model_len is None else max_model_len
        return self.max_admission_blocks_per_request(config.max_in_flight_tokens, m) * self.page_size_bytes

    def is_uniform_with_collection(self, specs: "dict[str, KVCacheSpec]") -> bool:
        _check_specs("specs", specs, mapping=True)
        return all(isinstance(s, ChunkedLocalAttentionSpec) and s.attention_chunk_size == self.attention_chunk_size
                   for s in specs.values())


@dataclass(frozen=True, kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    """Cross-attention of encoder-decoder models: sized by the encoder budget.

    NOTE: ``prefix_cacheable`` stays True as in vLLM 0.33.0 (``CrossAttentionSpec`` does not
    override it), which matters for block-size resolution; its manager never records hits.
    """

    manager_name: ClassVar[str] = "CrossAttentionManager"

    @_checked_sizing
    def max_memory_usage_bytes(self, config: "EngineConfig", max_model_len: int | None = None) -> int:
        return cdiv(config.max_num_encoder_input_tokens, self.block_size) * self.page_size_bytes


@dataclass(frozen=True, kw_only=True)
class EncoderOnlyAttentionSpec(AttentionSpec):
    """Encoder-only attention needs no KV cache."""

    manager_name: ClassVar[str] = ""

    @_checked_sizing
    def max_memory_usage_bytes(self, config: "EngineConfig", max_model_len: int | None = None) -> int:
        return 0


@dataclass(frozen=True, kw_only=True)
class RSWASpec(FullAttentionSpec):
    """Reference sliding-window attention (R-SWA): the prompt stays visible to every token, but
    only the last ``rswa_window`` generated tokens; the *gap* between the prompt's last block and
    the decode window is freed as decoding goes on (vLLM ``RSWAManager``). Sized like full
    attention (prompt + window never exceed ``max_model_len``), so no admission cap."""

    rswa_window: int
    manager_name: ClassVar[str] = "RSWAManager"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(f"{type(self).__name__}.rswa_window", self.rswa_window, minimum=0)

    @classmethod
    def merge(cls, specs: "list[KVCacheSpec]") -> "KVCacheSpec":
        """R-SWA layers merge only with R-SWA layers of the same window (vLLM asserts both)."""
        _check_specs("specs", specs, mapping=False)
        if not all(isinstance(s, RSWASpec) for s in specs):
            raise SpecMergeError("All attention layers in the same KV cache group must be RSWASpec.")
        windows = {s.rswa_window for s in specs}  # type: ignore[attr-defined]
        if len(windows) != 1:
            raise SpecMergeError(f"All R-SWA layers must share the same rswa_window, got {sorted(windows)}")
        base = FullAttentionSpec.merge(specs)
        assert isinstance(base, FullAttentionSpec)
        return cls(**_attention_fields(base), sliding_window=base.sliding_window,
                   attention_chunk_size=base.attention_chunk_size, rswa_window=windows.pop())


@dataclass(frozen=True, kw_only=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with ``sink_len`` attention-sink tokens (vLLM ``SinkFullAttentionManager``:
    full attention that requires ``sink_len`` to be a positive multiple of the block size)."""

    sink_len: int | None = None
    manager_name: ClassVar[str] = "SinkFullAttentionManager"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(f"{type(self).__name__}.sink_len", self.sink_len, minimum=1, allow_none=True)


@dataclass(frozen=True, kw_only=True)
class CircularBufferSpec(AttentionSpec):
    """One ring block per request for its whole life (the raw keys of the token group still being
    compressed; ``block_size`` is the ring capacity). Never prefix-cached (vLLM
    ``CircularBufferManager``): it holds one block whatever the request's length."""

    manager_name: ClassVar[str] = "CircularBufferManager"
    prefix_cacheable: ClassVar[bool] = False

    @_checked_sizing
    def max_memory_usage_bytes(self, config: "EngineConfig", max_model_len: int | None = None) -> int:
        return self.page_size_bytes

    @_checked_sizing
    def max_num_blocks_per_req(self, config: "EngineConfig", max_len: int) -> int:
        return 1

    def is_uniform_with_collection(self, specs: "dict[str, KVCacheSpec]") -> bool:
        _check_specs("specs", specs, mapping=True)
        return all(isinstance(s, CircularBufferSpec) for s in specs.values())


MAMBA_CACHE_MODES = ("none", "all", "align")


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    """Recurrent (Mamba/SSM) state: a fixed-size state per request, not per token.

    ``shapes``/``dtypes`` are the state tensors; the page holds all of them. In ``"align"`` cache
    mode the state is checkpointed at block boundaries so it can be prefix-cached.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    page_size_padded: int | None = None
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    #: the grid (tokens past the chunk start) on which the backend can export a prefill
    #: checkpoint inside a chunk; None = it cannot (vLLM sets it with the checkpoint blocks)
    prefill_checkpoint_alignment: int | None = None
    manager_name: ClassVar[str] = "MambaManager"

    def __post_init__(self) -> None:
        super().__post_init__()
        owner = type(self).__name__
        if not isinstance(self.shapes, (tuple, list)) or not self.shapes:
            raise InvalidFieldError(f"{owner}.shapes", self.shapes, "a non-empty tuple of shape tuples")
        shapes = []
        for i, shape in enumerate(self.shapes):
            if not isinstance(shape, (tuple, list)) or not shape:
                raise InvalidFieldError(f"{owner}.shapes[{i}]", shape, "a non-empty tuple of positive ints")
            for d in shape:
                check_int(f"{owner}.shapes[{i}]", d, minimum=1)
            shapes.append(tuple(shape))
        object.__setattr__(self, "shapes", tuple(shapes))
        if not isinstance(self.dtypes, (tuple, list)) or len(self.dtypes) != len(self.shapes):
            raise InvalidFieldError(f"{owner}.dtypes", self.dtypes,
                                    f"a tuple of {len(self.shapes)} dtype names (one per shape)")
        object.__setattr__(self, "dtypes",
                           tuple(canonical_dtype(d, f"{owner}.dtypes[{i}]") for i, d in enumerate(self.dtypes)))
        check_int(f"{owner}.page_size_padded", self.page_size_padded, minimum=1, allow_none=True)
        check_choice(f"{owner}.mamba_cache_mode", self.mamba_cache_mode, MAMBA_CACHE_MODES)
        check_int(f"{owner}.num_speculative_blocks", self.num_speculative_blocks, minimum=0)
        check_int(f"{owner}.num_prefill_checkpoint_blocks", self.num_prefill_checkpoint_blocks, minimum=0)
        check_int(f"{owner}.prefill_checkpoint_alignment", self.prefill_checkpoint_alignment, minimum=1,
                  allow_none=True)
        if self.page_size_padded is not None and self.page_size_padded < self.unpadded_page_size_bytes:
            raise InvalidFieldError(f"{owner}.page_size_padded", self.page_size_padded,
                                    f"None or an int >= the state size {self.unpadded_page_size_bytes}")

    @property
    def unpadded_page_size_bytes(self) -> int:
        return sum(prod(s) * get_dtype_size(d) for s, d in zip(self.shapes, self.dtypes))

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.unpadded_page_size_bytes

    @_checked_sizing
    def max_memory_usage_bytes(self, config: "EngineConfig", max_model_len: int | None = None) -> int:
        """``align`` mode: 2 states (+ speculative + checkpoint blocks); else 1 (+ speculative).

        NOTE: vLLM reads the mode from ``cache_config`` here, not from the spec.
        """
        if config.mamba_cache_mode == "align":
            return self.page_size_bytes * (2 + self.num_speculative_blocks + self.num_prefill_checkpoint_blocks)
        return self.page_size_bytes * (1 + self.num_speculative_blocks)

    @_checked_sizing
    def max_num_blocks_per_req(self, config: "EngineConfig", max_len: int) -> int:
        if config.mamba_cache_mode == "align":
            return cdiv(max_len, self.block_size) + self.num_speculative_blocks
        return cdiv(self.max_memory_usage_bytes(config), self.page_size_bytes)

    def is_uniform_with_collection(self, specs: "dict[str, KVCacheSpec]") -> bool:
        """Mamba layers form one group only with equal state pages and extra-block counts."""
        _check_specs("specs", specs, mapping=True)
        return all(isinstance(s, MambaSpec)
                   and s.num_speculative_blocks == self.num_speculative_blocks
                   and s.num_prefill_checkpoint_blocks == self.num_prefill_checkpoint_blocks
                   and s.prefill_checkpoint_alignment == self.prefill_checkpoint_alignment
                   and s.page_size_bytes == self.page_size_bytes
                   for s in specs.values())


def get_mamba_prefill_checkpoint_position(num_tokens: int, hash_block_size: int, drop_eagle_block: bool,
                                          num_hash_lookahead_tokens: int = 0) -> int:
    """The reusable Mamba state boundary of a prefill of ``num_tokens`` (vLLM's function of the
    same name): leave the last token for logits (or ``num_hash_lookahead_tokens``, the tokens a
    lookahead hash needs) unless EAGLE's block drop already leaves tokens to recompute; round down
    to ``hash_block_size``; EAGLE then backs off one more unit (its replay boundary)."""
    check_int("num_tokens", num_tokens, minimum=0)
    check_int("hash_block_size", hash_block_size, minimum=1)
    check_int("num_hash_lookahead_tokens", num_hash_lookahead_tokens, minimum=0)
    if not isinstance(drop_eagle_block, bool):
        raise InvalidFieldError("drop_eagle_block", drop_eagle_block, "True or False")
    limit = num_tokens if drop_eagle_block else num_tokens - max(1, num_hash_lookahead_tokens)
    position = limit // hash_block_size * hash_block_size
    if drop_eagle_block:
        position -= hash_block_size
    return max(position, 0)


def is_mamba_prefill_checkpoint_valid(query_start: int, query_end: int, checkpoint_position: int,
                                      hash_block_size: int, mamba_block_size: int,
                                      checkpoint_alignment: int | None) -> bool:
    """Whether the backend can export the prefill checkpoint at ``checkpoint_position`` from inside
    the chunk ``[query_start, query_end)`` (vLLM's function of the same name): the chunk starts on
    a hash boundary, the checkpoint lies strictly inside it at least one hash unit past the start,
    on the backend's alignment grid, and in a state column after the chunk's initial state."""
    for name, value in (("query_start", query_start), ("query_end", query_end),
                        ("checkpoint_position", checkpoint_position)):
        check_int(name, value, minimum=0)
    check_int("hash_block_size", hash_block_size, minimum=1)
    check_int("mamba_block_size", mamba_block_size, minimum=1)
    check_int("checkpoint_alignment", checkpoint_alignment, minimum=1, allow_none=True)
    if checkpoint_alignment is None:
        return False
    initial_state_col = (query_start - 1) // mamba_block_size
    checkpoint_col = cdiv(query_end, mamba_block_size) - 2
    return (query_start % hash_block_size == 0
            and checkpoint_col > initial_state_col
            and query_start + hash_block_size <= checkpoint_position
            and query_start < checkpoint_position < query_end
            and (checkpoint_position - query_start) % checkpoint_alignment == 0)


def has_admission_cap(spec: KVCacheSpec) -> bool:
    """Whether vLLM's manager for this spec gets ``max_admission_blocks_per_request`` (§2.9):
    the spec overrides :meth:`KVCacheSpec.admission_cap`."""
    if not isinstance(spec, KVCacheSpec):
        raise InvalidFieldError("spec", spec, "a KVCacheSpec")
    return type(spec).admission_cap is not KVCacheSpec.admission_cap


def attention_compare_fields(spec: AttentionSpec) -> tuple:
    """The :class:`AttentionSpec` fields two attention specs must share to be merged into one group
    (vLLM compares ``fields(AttentionSpec)``, not the subclass's extra fields)."""
    if not isinstance(spec, AttentionSpec):
        raise InvalidFieldError("spec", spec, "an AttentionSpec")
    return tuple(getattr(spec, f.name) for f in fields(AttentionSpec) if f.compare)


def _attention_fields(spec: AttentionSpec) -> dict:
    return {f.name: getattr(spec, f.name) for f in fields(AttentionSpec) if f.init}


def _check_same_attention_fields(specs: "list[KVCacheSpec]", merged: AttentionSpec) -> None:
    want = attention_compare_fields(merged)
    for s in specs:
        if attention_compare_fields(s) != want:  # type: ignore[arg-type]
            raise SpecMergeError("All attention layers in the same KV cache group must have the same attention spec.")


@dataclass(frozen=True, kw_only=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    """One group of layers of the same kind that need different page sizes (e.g. head sizes).

    ``page_size_bytes`` is the sum of the layers' pages; memory is the largest per-layer block count
    times that sum.
    """

    kv_cache_specs: dict[str, KVCacheSpec]

    def __post_init__(self) -> None:
        super().__post_init__()
        specs = self.kv_cache_specs
        if (not isinstance(specs, dict) or not specs
                or not all(isinstance(k, str) and isinstance(v, KVCacheSpec)
                           and not isinstance(v, UniformTypeKVCacheSpecs) for k, v in specs.items())):
            raise InvalidFieldError("UniformTypeKVCacheSpecs.kv_cache_specs", specs,
                                    "a non-empty dict of layer name (str) -> per-layer KVCacheSpec")
        object.__setattr__(self, "dcp_sharded", next(iter(self.kv_cache_specs.values())).dcp_sharded)

    def __hash__(self) -> int:  # dict field: hash by layer names and specs
        return hash((self.block_size, tuple(self.kv_cache_specs.items())))

    @property
    def first_spec(self) -> KVCacheSpec:
        return next(iter(self.kv_cache_specs.values()))

    @property
    def manager_name(self) -> str:  # type: ignore[override]
        return self.first_spec.manager_name

    @property
    def page_size_bytes(self) -> int:
        return sum(s.page_size_bytes for s in self.kv_cache_specs.values())

    @_checked_sizing
    def max_memory_usage_pages(self, config: "EngineConfig", max_model_len: int | None = None) -> int:
        return max(cdiv(s.max_memory_usage_bytes(config, max_model_len), s.page_size_bytes)
                   for s in self.kv_cache_specs.values())

    @_checked_sizing
    def max_memory_usage_bytes(self, config: "EngineConfig", max_model_len: int | None = None) -> int:
        return self.max_memory_usage_pages(config, max_model_len) * self.page_size_bytes

    @property
    def prefix_cacheable(self) -> bool:  # type: ignore[override]
        return all(s.prefix_cacheable for s in self.kv_cache_specs.values())

    @property
    def prefix_replay_tokens(self) -> int:
        return max(s.prefix_replay_tokens for s in self.kv_cache_specs.values())

    @staticmethod
    def is_uniform_type(specs: "dict[str, KVCacheSpec]") -> bool:
        """vLLM's ``is_uniform_type``: one block size, one ``dcp_sharded`` value, and the first
        layer's :meth:`~KVCacheSpec.is_uniform_with_collection` holds for all."""
        _check_specs("specs", specs, mapping=True)
        if len({s.block_size for s in specs.values()}) > 1:
            return False
        if len({s.dcp_sharded for s in specs.values()}) > 1:
            return False
        return next(iter(specs.values())).is_uniform_with_collection(specs)

    @classmethod
    def from_specs(cls, specs: "dict[str, KVCacheSpec]") -> "UniformTypeKVCacheSpecs | None":
        """The one group of these layers, or None when they are not of one uniform type."""
        if isinstance(specs, dict) and not specs:
            return None
        _check_specs("specs", specs, mapping=True)
        if not cls.is_uniform_type(specs):
            return None
        return cls(block_size=next(iter(specs.values())).block_size, kv_cache_specs=dict(specs))

    def layer_spec(self, layer_name: str) -> KVCacheSpec:
        if not isinstance(layer_name, str) or layer_name not in self.kv_cache_specs:
            raise InvalidFieldError("layer_name", layer_name, f"one of the layers {sorted(self.kv_cache_specs)}")
        return self.kv_cache_specs[layer_name]

    @_checked_sizing
    def max_num_blocks_per_req(self, config: "EngineConfig", max_len: int) -> int:
        """Block-table width: every layer must need the same (DCP sharding included)."""
        widths = {s.max_num_blocks_per_req(config, max_len) for s in self.kv_cache_specs.values()}
        if len(widths) != 1:
            raise InvalidFieldError("UniformTypeKVCacheSpecs.kv_cache_specs", sorted(widths),
                                    "layers that need the same number of block-table entries")
        return widths.pop()


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table: ``layer_names`` and their common ``kv_cache_spec``."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec
    is_eagle_group: bool = False

    def __post_init__(self) -> None:
        names = self.layer_names
        if isinstance(names, (str, bytes)) or not isinstance(names, (tuple, list)) \
                or not all(isinstance(n, str) for n in names):
            raise InvalidFieldError("KVCacheGroupSpec.layer_names", names, "a tuple of layer names (str)")
        object.__setattr__(self, "layer_names", tuple(names))
        if not isinstance(self.is_eagle_group, bool):
            raise InvalidFieldError("KVCacheGroupSpec.is_eagle_group", self.is_eagle_group, "True or False")
        if not isinstance(self.kv_cache_spec, KVCacheSpec):
            raise InvalidFieldError("KVCacheGroupSpec.kv_cache_spec", self.kv_cache_spec, "a KVCacheSpec")


#: vLLM 0.33.0's ``register_all_kvcache_specs``: which class each spec type groups with.
#: EncoderOnlyAttentionSpec is not registered there (planning rejects it).
_UNIFORM_TYPE_BASE.update({
    FullAttentionSpec: FullAttentionSpec,
    MLAAttentionSpec: FullAttentionSpec,
    HiddenStateCacheSpec: FullAttentionSpec,  # vLLM registers it so; grouping sets it apart after step 3
    RSWASpec: FullAttentionSpec,
    SinkFullAttentionSpec: FullAttentionSpec,
    CircularBufferSpec: CircularBufferSpec,
    SlidingWindowSpec: SlidingWindowSpec,
    SlidingWindowMLASpec: SlidingWindowMLASpec,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionSpec,
    MambaSpec: MambaSpec,
    CrossAttentionSpec: CrossAttentionSpec,
})
