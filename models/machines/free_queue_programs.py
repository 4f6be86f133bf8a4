"""Generated op sequences on the free block queue, vLLM's against the reference's (issue #22).

The block pool reaches only part of ``FreeKVCacheBlockQueue``: it pops from the front in batches,
removes hit blocks and appends/prepends freed lists. ``append`` of one block, ``popleft`` (and on an
empty queue), ``popleft_n(0)`` and ``iter_blocks_after`` (the CPU-offload store scan's walk from a
cursor) never ran under ``conform-kv-manager``. These programs drive every method on a queue of a
few blocks, drawing only calls vLLM's callers make (a block is removed only while free, appended
only while taken, at most the free count popped), and compare after every op: the returned ids,
the whole order front to back and the count; ``popleft`` on an empty queue must be refused by both.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import strategies as st

from kvref.impl.free_block_queue_view import FreeBlockQueueView
from kvref.impl.reference.free_block_queue import FreeKVCacheBlockQueue
from kvref.impl.reference.kv_cache_block import KVCacheBlock
from kvref.models.hypothesis_runs.programs import first_unaccepted_difference
from kvref.spec.errors import check_int

OPS = ("popleft", "popleft_n", "remove", "append", "append_n", "prepend_n", "ids_after")


class ReferenceFreeBlockQueue(FreeBlockQueueView):
    """The reference's queue behind block ids (the twin of ``kvref.impl.vllm.free_block_queue``)."""

    def __init__(self, num_blocks: int) -> None:
        check_int("num_blocks", num_blocks, minimum=0)
        blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        super().__init__(blocks, FreeKVCacheBlockQueue(list(blocks)))


@st.composite
def free_queue_programs(draw) -> tuple[int, list[tuple[str, int]]]:
    """(number of blocks, ops): each op a name and a draw the runner maps onto a valid argument."""
    num_blocks = draw(st.integers(0, 8))
    ops = draw(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 2**16)), min_size=1, max_size=30))
    return num_blocks, ops


def _call(queue, name: str, pick: int, free: list[int], taken: list[int]) -> tuple[str, object]:
    """Apply one op with an argument valid for the free/taken split both queues share."""
    try:
        if name == "popleft":
            return name, queue.popleft()
        if name == "popleft_n":
            return name, queue.popleft_n(pick % (len(free) + 1))
        if name == "remove" and free:
            block = free[pick % len(free)]
            queue.remove(block)
            return name, block
        if name in ("append", "append_n", "prepend_n") and taken:
            k = 1 if name == "append" else 1 + pick % len(taken)
            start = (pick // 7) % len(taken)
            chosen = (taken[start:] + taken[:start])[:k]
            if name == "append":
                queue.append(chosen[0])
            else:
                getattr(queue, name)(chosen)
            return name, chosen
        if name == "ids_after":
            cursor = None if not free or pick % 3 == 0 else free[pick % len(free)]
            return name, (cursor, queue.ids_after(cursor))
        return "skip", None
    except (ValueError, IndexError) as exc:  # an empty queue: vLLM ValueError, the reference IndexError
        return name, f"refused: {type(exc).__name__ in ('ValueError', 'IndexError')}"


def run_program(num_blocks: int, ops: list[tuple[str, int]], vllm_queue, seen: Counter | None = None) -> str | None:
    """``ops`` on the reference's queue and ``vllm_queue`` (built over the same ``num_blocks``);
    the first difference, described, or None."""
    ref = ReferenceFreeBlockQueue(num_blocks)
    seen = Counter() if seen is None else seen
    for i, (name, pick) in enumerate(ops):
        free = ref.free_block_ids()
        taken = sorted(set(range(num_blocks)) - set(free))
        ours = _call(ref, name, pick, free, taken)
        theirs = _call(vllm_queue, name, pick, free, taken)
        after = (ref.free_block_ids(), ref.num_free_blocks), (vllm_queue.free_block_ids(), vllm_queue.num_free_blocks)
        if ours != theirs or after[0] != after[1]:
            return (f"free block queue differs after op {i} {name} (of {num_blocks} blocks): reference {ours} "
                    f"-> {after[0]}, vLLM {theirs} -> {after[1]}")
        seen[ours[0] if not isinstance(ours[1], str) else ours[0] + " refused"] += 1
    return None


def run_free_queue_programs(make_vllm_queue, examples: int, *, seed: int = 0) -> tuple[str | None, Counter]:
    """``examples`` generated programs, each on a fresh ``make_vllm_queue(num_blocks)`` beside the
    reference's queue. Returns the first difference (None when all agreed) and the ops seen."""
    check_int("examples", examples, minimum=1)
    check_int("seed", seed, minimum=0)
    seen: Counter = Counter()
    return first_unaccepted_difference(
        free_queue_programs(), lambda p: run_program(p[0], p[1], make_vllm_queue(p[0]), seen), examples, seed), seen
