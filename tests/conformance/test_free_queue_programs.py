"""Issue #22: vLLM's ``FreeKVCacheBlockQueue`` beside the reference's on generated op sequences.

The block pool never calls ``append`` of one block, ``popleft`` on an empty queue or
``iter_blocks_after``; these programs (run by conform-kv-manager's sweep) do, comparing returned
ids, the whole order and the count after every op.
"""

from __future__ import annotations

import pytest

from kvref.impl.reference.free_block_queue import FreeKVCacheBlockQueue
from kvref.models.machines.free_queue_programs import run_free_queue_programs, run_program
from kvref.spec.errors import InvalidFieldError
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_queue():
    require_vllm()
    from kvref.impl.vllm.free_block_queue import VllmFreeBlockQueue  # noqa: PLC0415 - imports vLLM

    return VllmFreeBlockQueue


def test_programs_agree_and_drive_every_method(vllm_queue):
    failure, seen = run_free_queue_programs(vllm_queue, profile_examples(40, 120), seed=0)
    assert failure is None, failure
    for op in ("popleft", "popleft refused", "popleft_n", "remove", "append", "prepend_n", "ids_after"):
        assert seen[op] > 0, (op, seen)


def test_a_queue_that_appends_at_the_front_is_caught(vllm_queue, monkeypatch):
    """A planted reference fault (``append`` puts the block at the front) differs from vLLM."""
    monkeypatch.setattr(FreeKVCacheBlockQueue, "append", lambda self, block: self.prepend_n([block]))
    failure = run_program(3, [("popleft", 0), ("append", 0)], vllm_queue(3))
    assert failure and "append" in failure


def test_an_empty_queue_is_refused_by_both(vllm_queue):
    assert run_program(0, [("popleft", 0), ("popleft_n", 5), ("ids_after", 0)], vllm_queue(0)) is None


@pytest.mark.parametrize("kwargs, field", [(dict(examples=0), "examples"), (dict(examples=1, seed=-1), "seed")])
def test_bad_arguments_are_named(vllm_queue, kwargs, field):
    with pytest.raises(InvalidFieldError, match=field):
        run_free_queue_programs(vllm_queue, **kwargs)
