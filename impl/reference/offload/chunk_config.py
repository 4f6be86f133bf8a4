"""How many GPU blocks make one offloaded chunk: the OffloadingConnector's chunk-size options
(vLLM ``build_offloading_config``, ``kv_connector/v1/offloading/config.py``).

``kv_connector_extra_config`` may name the chunk in blocks (``blocks_per_chunk``) or in tokens
(``block_size``, the offloaded block's token count), never both:

* neither: one GPU block per chunk;
* ``blocks_per_chunk``: an int (vLLM applies ``int()``: ``"2"`` and ``2.9`` are 2), > 0;
* ``block_size``: an int number of tokens, a multiple of the GPU block size, which every offloaded
  group must share (vLLM asserts one block size across groups); kvref also refuses 0 and negative
  sizes, which vLLM 0.33.0 turns into 0 or negative blocks per chunk;
* both: refused.

Each group's sliding-window size in chunks then follows from ``tokens_per_block * blocks_per_chunk``
(:func:`.keys.get_sliding_window_size_in_chunks`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvref.spec.errors import InvalidFieldError, check_int


def _as_int(name: str, value: object) -> int:
    """``int(value)`` as vLLM applies it, refusing what ``int()`` refuses (named)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidFieldError(name, value, "an int (or a value int() reads: a float, a numeric string)")
    try:
        return int(value)
    except (ValueError, OverflowError):
        raise InvalidFieldError(name, value, "an int (or a value int() reads: a float, a numeric string)") from None


def blocks_per_chunk(extra_config: Mapping[str, object], group_tokens_per_block: Sequence[int]) -> int:
    """The chunk size in GPU blocks, or :class:`InvalidFieldError` naming the option vLLM refuses."""
    if not isinstance(extra_config, Mapping):
        raise InvalidFieldError("kv_connector_extra_config", extra_config, "a dict of the connector's options")
    if not isinstance(group_tokens_per_block, (list, tuple)) or not group_tokens_per_block:
        raise InvalidFieldError("group_tokens_per_block", group_tokens_per_block,
                                "the offloaded groups' block sizes (a non-empty list of ints)")
    for i, tpb in enumerate(group_tokens_per_block):
        check_int(f"group_tokens_per_block[{i}]", tpb, minimum=1)
    blocks = extra_config.get("blocks_per_chunk")
    tokens = extra_config.get("block_size")
    if blocks is not None and tokens is not None:
        raise InvalidFieldError("kv_connector_extra_config", dict(extra_config),
                                "only one of 'block_size' or 'blocks_per_chunk'")
    if blocks is not None:
        n = _as_int("blocks_per_chunk", blocks)
        if n <= 0:
            raise InvalidFieldError("blocks_per_chunk", blocks, "greater than 0")
        return n
    if tokens is None:
        return 1
    n_tokens = _as_int("block_size", tokens)
    if n_tokens <= 0:  # vLLM 0.33.0 lets 0 and negative multiples through: docs/differences.md
        raise InvalidFieldError("block_size", tokens, "greater than 0 (tokens per offloaded chunk)")
    sizes = set(group_tokens_per_block)
    if len(sizes) != 1:
        raise InvalidFieldError("block_size", tokens, "unset: the offloaded groups' block sizes differ "
                                                      f"({sorted(sizes)}), so a chunk is given in blocks")
    tpb = sizes.pop()
    if n_tokens % tpb:
        raise InvalidFieldError("block_size", tokens, f"a multiple of the GPU block size ({tpb} tokens)")
    return n_tokens // tpb
