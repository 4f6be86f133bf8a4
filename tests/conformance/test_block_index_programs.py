"""Issue #22: vLLM's ``BlockHashToBlockMap`` beside the reference's on generated op sequences.

The block pool never pops a key with another block's id, never asks ``contain``/``get_one_block``
about duplicates and never calls ``__len__``; these programs (run by conform-kv-manager's sweep)
do, comparing the answers, the whole map and its length after every op.
"""

from __future__ import annotations

import pytest

from kvref.impl.reference.block_hash_to_block_map import BlockHashToBlockMap
from kvref.models.machines.block_index_programs import run_block_index_programs, run_program
from kvref.spec.errors import InvalidFieldError
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_index():
    require_vllm()
    from kvref.impl.vllm.block_hash_map import VllmBlockHashToBlockMap  # noqa: PLC0415 - imports vLLM

    return VllmBlockHashToBlockMap


def test_programs_agree_and_drive_every_case(vllm_index):
    failure, seen = run_block_index_programs(vllm_index, profile_examples(40, 120), seed=0)
    assert failure is None, failure
    for kind in ("insert (absent)", "insert (one, another block)", "pop (absent)", "pop (one, its block)",
                 "pop (one, another block)", "pop (duplicates, its block)", "pop (duplicates, another block)",
                 "get_one_block (duplicates)", "contain (duplicates, its block)",
                 "contain (duplicates, another block)", "len"):
        assert seen[kind] > 0, (kind, seen)


def test_an_index_that_drops_a_lone_block_popped_with_another_id_is_caught(vllm_index, monkeypatch):
    """A planted reference fault: ``pop`` with another block's id removes the key's lone block
    (vLLM puts it back and answers None)."""
    real_pop = BlockHashToBlockMap.pop

    def pop(self, key, block_id):
        blocks = self._cache.get(key)
        if blocks is not None and not isinstance(blocks, dict):
            return self._cache.pop(key)
        return real_pop(self, key, block_id)

    monkeypatch.setattr(BlockHashToBlockMap, "pop", pop)
    failure = run_program(2, [("insert", 0, 0), ("pop", 0, 1)], vllm_index(2))
    assert failure and "op 1 pop" in failure


def test_an_index_that_answers_the_newest_duplicate_is_caught(vllm_index, monkeypatch):
    """A planted reference fault: ``get_one_block`` answers the newest of several blocks (vLLM the
    oldest)."""
    real_get = BlockHashToBlockMap.get_one_block

    def get_one_block(self, key):
        blocks = self._cache.get(key)
        return list(blocks.values())[-1] if isinstance(blocks, dict) else real_get(self, key)

    monkeypatch.setattr(BlockHashToBlockMap, "get_one_block", get_one_block)
    failure = run_program(2, [("insert", 0, 0), ("insert", 0, 1), ("get_one_block", 0, 0)], vllm_index(2))
    assert failure and "get_one_block" in failure


@pytest.mark.parametrize("kwargs, field", [(dict(examples=0), "examples"), (dict(examples=1, seed=-1), "seed")])
def test_bad_arguments_are_named(vllm_index, kwargs, field):
    with pytest.raises(InvalidFieldError, match=field):
        run_block_index_programs(vllm_index, **kwargs)


def test_a_map_of_no_blocks_is_refused(vllm_index):
    with pytest.raises(InvalidFieldError, match="num_blocks"):
        vllm_index(0)
