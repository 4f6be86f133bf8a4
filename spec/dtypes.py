"""KV cache dtypes by name, and their element sizes in bytes.

vLLM keys its KV cache dtypes by string (``--kv-cache-dtype fp8``) and maps them to torch dtypes
(``STR_DTYPE_TO_TORCH_DTYPE``); every fp8 flavour is stored as one byte. The spec layer is stdlib
only, so it keeps names and sizes, and the torch side maps names to ``torch.dtype``.
"""

from __future__ import annotations

from .errors import InvalidFieldError

#: element size in bytes for each dtype name vLLM 0.33.0 accepts for KV caches and Mamba states.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "float64": 8,
    "half": 2,
    "float16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "fp8_ds_mla": 1,
    "int8": 1,
    "uint8": 1,
}

#: canonical spelling used when two names denote the same stored type
_CANONICAL = {"float": "float32", "half": "float16"}


def canonical_dtype(name: object, field: str = "dtype") -> str:
    """Return the canonical dtype name, or raise :class:`InvalidFieldError` for an unknown one."""
    if not isinstance(name, str) or name not in DTYPE_SIZES:
        raise InvalidFieldError(field, name, "one of " + ", ".join(sorted(DTYPE_SIZES)))
    return _CANONICAL.get(name, name)


def get_dtype_size(name: str) -> int:
    """Bytes per element of the named dtype (vLLM's ``get_dtype_size``)."""
    return DTYPE_SIZES[canonical_dtype(name)]
