"""Generated op sequences on the prefix-cache index, vLLM's against the reference's (issue #22).

The block pool inserts a block under its own hash and pops it with its own id, so under
``conform-kv-manager`` vLLM's ``BlockHashToBlockMap`` never answered ``pop`` for an absent key or
for a key holding another block (the lone block is put back; from a duplicate set nothing is
removed), never answered ``contain``/``get_one_block`` on a key holding duplicates, and ``__len__``
never ran. These programs drive every method on a few keys and blocks (a block may sit under
several keys, as partial tails do) and compare after every op: the answer (in block ids) and the
whole map, key -> the ids under it oldest first (the order ``get_one_block`` answers from), and its
length.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import strategies as st

from kvref.impl.block_hash_map_view import BlockHashMapView
from kvref.impl.reference.block_hash import make_block_hash_with_group_id
from kvref.impl.reference.block_hash_to_block_map import BlockHashToBlockMap
from kvref.impl.reference.kv_cache_block import KVCacheBlock
from kvref.models.hypothesis_runs.programs import first_unaccepted_difference
from kvref.spec.errors import check_int

OPS = ("insert", "pop", "get_one_block", "contain", "len")
#: the draw's weights: inserts first, so keys come to hold duplicates
_DRAWN_OPS = ("insert",) * 3 + ("pop",) * 2 + ("get_one_block", "contain", "len")
#: a few keys over two groups: the same hash in another group is another key
KEYS = tuple(make_block_hash_with_group_id(bytes([h]) * 8, g) for h in range(2) for g in range(2))


#: run first, so every case is compared whatever the draw: duplicates asked about and popped down to
#: nothing, a lone block popped with another id (put back), an absent key
FIRST_PROGRAM = (4, [("insert", 0, 0), ("insert", 0, 1), ("insert", 0, 2), ("get_one_block", 0, 0),
                     ("contain", 0, 1), ("contain", 0, 3), ("pop", 0, 3), ("pop", 0, 1), ("get_one_block", 0, 0),
                     ("pop", 0, 0), ("pop", 0, 2), ("insert", 1, 0), ("pop", 1, 1), ("contain", 1, 0),
                     ("pop", 2, 0), ("len", 0, 0)])


class ReferenceBlockHashToBlockMap(BlockHashMapView):
    """The reference's empty map behind block ids (the twin of ``kvref.impl.vllm.block_hash_map``)."""

    def __init__(self, num_blocks: int) -> None:
        check_int("num_blocks", num_blocks, minimum=1)
        super().__init__([KVCacheBlock(i) for i in range(num_blocks)], BlockHashToBlockMap())


@st.composite
def block_index_programs(draw) -> tuple[int, list[tuple[str, int, int]]]:
    """(number of blocks, ops): each op a name, a key index and a block id."""
    num_blocks = draw(st.integers(1, 5))
    op = st.tuples(st.sampled_from(_DRAWN_OPS), st.integers(0, len(KEYS) - 1), st.integers(0, num_blocks - 1))
    return num_blocks, draw(st.lists(op, min_size=1, max_size=30))


def _call(index: BlockHashMapView, name: str, key: bytes, block_id: int):
    if name == "insert":
        index.insert(key, block_id)
        return None
    if name == "pop":
        return index.pop(key, block_id)
    if name == "get_one_block":
        return index.get_one_block(key)
    if name == "contain":
        return index.contain(key, block_id)
    return len(index)


def _kind(name: str, before: list[int] | None, block_id: int) -> str:
    """What case of ``name`` an op was, by what its key held before (for the ops-seen counts)."""
    if name == "len":
        return name
    held = "absent" if not before else "one" if len(before) == 1 else "duplicates"
    if name in ("pop", "contain", "insert") and before:
        held += ", its block" if block_id in before else ", another block"
    return f"{name} ({held})"


def run_program(num_blocks: int, ops: list[tuple[str, int, int]], vllm_index: BlockHashMapView,
                seen: Counter | None = None) -> str | None:
    """``ops`` on the reference's map and ``vllm_index`` (over the same ``num_blocks``); the first
    difference, described, or None."""
    ref = ReferenceBlockHashToBlockMap(num_blocks)
    seen = Counter() if seen is None else seen
    for i, (name, k, block_id) in enumerate(ops):
        key = KEYS[k]
        kind = _kind(name, ref.state().get(key), block_id)
        ours, theirs = _call(ref, name, key, block_id), _call(vllm_index, name, key, block_id)
        after = (ref.state(), len(ref)), (vllm_index.state(), len(vllm_index))
        if ours != theirs or after[0] != after[1]:
            return (f"prefix-cache index differs after op {i} {name}(key {k}, block {block_id}) of {num_blocks} "
                    f"blocks: reference {ours!r} -> {after[0]}, vLLM {theirs!r} -> {after[1]}")
        seen[kind] += 1
    return None


def run_block_index_programs(make_vllm_index, examples: int, *, seed: int = 0) -> tuple[str | None, Counter]:
    """:data:`FIRST_PROGRAM`, then ``examples`` generated programs, each on a fresh
    ``make_vllm_index(num_blocks)`` beside the reference's map. Returns the first difference (None
    when all agreed) and the op kinds seen."""
    from kvref.models.conformance.accepted import is_accepted, signature

    check_int("examples", examples, minimum=1)
    check_int("seed", seed, minimum=0)
    seen: Counter = Counter()
    failure = run_program(*FIRST_PROGRAM, make_vllm_index(FIRST_PROGRAM[0]), seen)
    if failure and not is_accepted(signature(failure)):
        return failure, seen
    return first_unaccepted_difference(
        block_index_programs(), lambda p: run_program(p[0], p[1], make_vllm_index(p[0]), seen), examples, seed), seen
