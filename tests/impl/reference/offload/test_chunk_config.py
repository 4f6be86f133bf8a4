"""The OffloadingConnector's chunk-size options (:mod:`kvref.impl.reference.offload.chunk_config`)."""

from __future__ import annotations

import pytest

from kvref.impl.reference.offload.chunk_config import blocks_per_chunk
from kvref.spec.errors import InvalidFieldError


@pytest.mark.parametrize("options, sizes, expected", [
    ({}, [4], 1),
    ({"blocks_per_chunk": 3}, [4, 8], 3),  # in blocks: the groups' block sizes may differ
    ({"blocks_per_chunk": "2"}, [4], 2),
    ({"blocks_per_chunk": 2.9}, [4], 2),  # int() truncates, as vLLM applies it
    ({"block_size": 12}, [4, 4], 3),
    ({"block_size": "8"}, [4], 2),
    ({"blocks_per_chunk": None, "block_size": 8}, [4], 2),  # None is unset
])
def test_chunk_sizes(options, sizes, expected):
    assert blocks_per_chunk(options, sizes) == expected


@pytest.mark.parametrize("options, sizes, field", [
    ({"blocks_per_chunk": 2, "block_size": 8}, [4], "kv_connector_extra_config"),
    ({"blocks_per_chunk": 0}, [4], "blocks_per_chunk"),
    ({"blocks_per_chunk": -1}, [4], "blocks_per_chunk"),
    ({"blocks_per_chunk": "x"}, [4], "blocks_per_chunk"),
    ({"blocks_per_chunk": []}, [4], "blocks_per_chunk"),
    ({"block_size": 6}, [4], "block_size"),
    ({"block_size": 8}, [4, 8], "block_size"),
    ({"block_size": 0}, [4], "block_size"),  # vLLM 0.33.0 accepts it (docs/differences.md)
    ({"block_size": -8}, [4], "block_size"),
    ([("block_size", 8)], [4], "kv_connector_extra_config"),
    ({}, [], "group_tokens_per_block"),
    ({}, [0], "group_tokens_per_block"),
])
def test_refused_options_are_named(options, sizes, field):
    with pytest.raises(InvalidFieldError, match=field):
        blocks_per_chunk(options, sizes)
