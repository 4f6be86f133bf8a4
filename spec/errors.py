"""Errors raised on bad input.

Every public entry point of kvref rejects a wrong value with a subclass of ``ValueError`` whose
message names the field, the value and what would be valid — never an ``AssertionError`` or a
deep traceback. ``assert`` is reserved for internal invariants.
"""

from __future__ import annotations

from typing import Any


class KVRefError(ValueError):
    """Base class of every bad-input error kvref raises."""


class InvalidFieldError(KVRefError):
    """A field holds a value that is not allowed.

    Args:
        field: the parameter or attribute name (``"block_size"``, ``"SlidingWindowSpec.sliding_window"``).
        value: the offending value.
        allowed: what would be valid, in words (``"a positive int"``).
    """

    def __init__(self, field: str, value: Any, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"{field}={value!r} is invalid: expected {allowed}")


class InsufficientKVCacheError(KVRefError):
    """The KV cache pool cannot hold one request of ``max_model_len`` tokens.

    Mirrors vLLM's ``_check_enough_kv_cache_memory`` / auto-fit failures. ``estimated_max_model_len``
    is the largest length the pool can serve (0 when not even one token fits).
    """

    #: why: vLLM's three startup failures
    NO_MEMORY = "no_memory"          # "No available memory for the cache blocks"
    TOO_LONG = "too_long"            # "To serve at least one request with the model's max seq len"
    AUTO_FIT_FAILED = "auto_fit"     # "Cannot auto-fit max_model_len"

    def __init__(self, message: str, *, estimated_max_model_len: int,
                 needed_bytes: int = 0, available_bytes: int = 0, reason: str = "too_long") -> None:
        self.estimated_max_model_len = estimated_max_model_len
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        self.reason = reason
        super().__init__(message)


def check_int(field: str, value: Any, *, minimum: int | None = None, allow_none: bool = False) -> None:
    """Raise :class:`InvalidFieldError` unless ``value`` is an int (not bool) >= ``minimum``."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        what = "an int" if minimum is None else f"an int >= {minimum}"
        raise InvalidFieldError(field, value, what + (" or None" if allow_none else ""))
    if minimum is not None and value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise InvalidFieldError(field, value, what + (" or None" if allow_none else ""))


def check_sequence(field: str, value: Any, what: str = "a tuple or list") -> None:
    """Raise :class:`InvalidFieldError` unless ``value`` is a tuple or list (not a str, a set, an
    int, None: ``tuple(value)`` on those raised ``TypeError`` or silently split a string)."""
    if not isinstance(value, (tuple, list)):
        raise InvalidFieldError(field, value, what)


def check_choice(field: str, value: Any, choices: "tuple[Any, ...] | list[Any]") -> None:
    """Raise :class:`InvalidFieldError` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise InvalidFieldError(field, value, "one of " + ", ".join(repr(c) for c in choices))


class SpecMergeError(KVRefError):
    """Layer specs cannot share one KV cache group (vLLM's ``merge`` raises ``AssertionError``).

    Grouping catches it and tries the next strategy, as vLLM does.
    """


class KVCacheGroupingError(KVRefError):
    """The layers cannot be grouped at all; vLLM's planner fails on the same input.

    Raised where vLLM raises ``ValueError``/``NotImplementedError`` out of ``get_kv_cache_groups``
    (full-attention layers with different window sizes, a hybrid model that cannot be promoted to
    one type with the hybrid manager disabled, page sizes that can be neither scaled nor padded).
    """


class WindowSizeMismatchError(KVCacheGroupingError):
    """Full-attention layers of one group carry different ``sliding_window``/``attention_chunk_size``.

    vLLM's ``FullAttentionSpec.merge_window_sizes`` raises ``ValueError`` here; unlike other merge
    failures it is *not* caught by ``is_kv_cache_spec_uniform``, so it aborts planning.
    """
