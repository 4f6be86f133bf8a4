"""Where each byte of a worker's KV page sits in the *canonical* page of an offloaded block — the
page a single, unsharded worker with the same layout would hold (vLLM's
``offloading/canonical_mapping.py``, RFC #42082: canonical pages make offloaded KV independent of
the tensor-parallel size that stored it).

Written from the facts, not from vLLM's run arithmetic: a rank's page holds ``H`` of the model's
``T`` KV heads, laid out in one of vLLM's two attention page shapes (K and V in separate halves,
``(2, block_size, H, head_size)``; or adjacent per token and head, ``(H, block_size, 2*head_size)``)
in NHD (token-major) or HND (head-major) memory order. A local byte with coordinates (K/V half or
packed element, token, local head ``h``, byte) goes to the byte with the same coordinates and
global head ``head_shard * H + h`` in the page of a worker holding all ``T`` heads. With fewer KV
heads than ranks (``T < tp``) ``tp // T`` ranks hold the same heads: each block is written by one
of them, rotating (``num_writers``, ``writer_index``). MLA's latent is replicated on every rank:
the identity map, written by one rank per block. A layer that cannot be certified (a head count
that does not shard evenly, a layout not among these) gets the opaque fallback: the whole local
page at a rank-private offset of a ``tp``-times page (never parallelism-agnostic).

Scope: decode/prefill context parallelism off (``dcp = pcp = 1``), no per-token-head quantization
(docs/differences.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvref.spec.errors import InvalidFieldError

KINDS = ("split", "packed")
ORDERS = ("NHD", "HND")


#: the largest page these byte maps are built for (a map holds one int per byte)
MAX_PAGE_BYTES = 1 << 22


def _positive(name: str, value: object, most: int = MAX_PAGE_BYTES) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
        raise InvalidFieldError(name, value, f"an int in [1, {most}]")
    return value


def _rank(rank: object, tp_size: int) -> int:
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < tp_size:
        raise InvalidFieldError("rank", rank, f"an int in [0, {tp_size})")
    return rank


@dataclass(frozen=True)
class AttentionPage:
    """One rank's attention page: ``kind`` ``"split"`` (K, V halves) or ``"packed"`` (K|V per token
    and head), ``order`` ``"NHD"`` or ``"HND"``, ``num_kv_heads`` heads on this rank."""

    kind: str
    order: str
    block_size: int
    num_kv_heads: int
    head_size: int
    elem_size: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidFieldError("kind", self.kind, "one of " + ", ".join(KINDS))
        if self.order not in ORDERS:
            raise InvalidFieldError("order", self.order, "one of " + ", ".join(ORDERS))
        for name in ("block_size", "num_kv_heads", "head_size", "elem_size"):
            _positive(name, getattr(self, name))
        if self.page_size_bytes > MAX_PAGE_BYTES:
            raise InvalidFieldError("page_size_bytes", self.page_size_bytes, f"at most {MAX_PAGE_BYTES}")

    @property
    def page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.elem_size

    def with_heads(self, heads: int) -> AttentionPage:
        _positive("heads", heads)
        return AttentionPage(self.kind, self.order, self.block_size, heads, self.head_size, self.elem_size)

    def element_offset(self, part: int, token: int, head: int, x: int) -> int:
        """The element offset of coordinate (``part``, token, head, ``x``) in the page.

        split: ``part`` is K (0) or V (1), ``x`` < head_size; packed: ``part`` is 0 and ``x`` <
        2 * head_size (K then V of one token and head, adjacent)."""
        bs, heads, hs = self.block_size, self.num_kv_heads, self.head_size
        parts, width = (2, hs) if self.kind == "split" else (1, 2 * hs)
        for name, v, n in (("part", part, parts), ("token", token, bs), ("head", head, heads), ("x", x, width)):
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < n:
                raise InvalidFieldError(name, v, f"an int in [0, {n})")
        if self.kind == "split":
            if self.order == "NHD":
                return ((part * bs + token) * heads + head) * hs + x
            return ((part * heads + head) * bs + token) * hs + x
        if self.order == "NHD":
            return (token * heads + head) * 2 * hs + x
        return (head * bs + token) * 2 * hs + x

    def coordinates(self):
        """Every (part, token, head, x) of the page."""
        parts, width = (2, self.head_size) if self.kind == "split" else (1, 2 * self.head_size)
        for part in range(parts):
            for token in range(self.block_size):
                for head in range(self.num_kv_heads):
                    for x in range(width):
                        yield part, token, head, x


@dataclass(frozen=True)
class ReferenceMapping:
    """``byte_map[i]``: the canonical byte that local byte ``i`` is stored at."""

    canonical_page_size_bytes: int
    local_page_size_bytes: int
    byte_map: tuple[int, ...]
    num_writers: int
    writer_index: int
    parallelism_agnostic: bool


def opaque_mapping(page_size_bytes: int, num_ranks: int, rank: int) -> ReferenceMapping:
    """The fallback: the whole page at ``rank * page`` of a ``num_ranks``-page canonical page."""
    _positive("page_size_bytes", page_size_bytes)
    _rank(rank, _positive("num_ranks", num_ranks))
    return ReferenceMapping(num_ranks * page_size_bytes, page_size_bytes,
                            tuple(rank * page_size_bytes + i for i in range(page_size_bytes)), 1, 0, False)


def shard_plan(total_kv_heads: int, tp_size: int, num_kv_heads: int) -> tuple[int, int] | None:
    """``(num_head_shards, replication)`` for a rank holding ``num_kv_heads`` of ``total_kv_heads``
    heads under ``tp_size`` ranks, or None when the heads do not shard evenly (uncertifiable)."""
    for name, v in (("total_kv_heads", total_kv_heads), ("tp_size", tp_size), ("num_kv_heads", num_kv_heads)):
        _positive(name, v)
    if num_kv_heads != max(1, total_kv_heads // tp_size):
        return None
    if total_kv_heads >= tp_size:
        return (tp_size, 1) if total_kv_heads % tp_size == 0 else None
    return (total_kv_heads, tp_size // total_kv_heads) if tp_size % total_kv_heads == 0 else None


def attention_mapping(page: AttentionPage | None, total_kv_heads: int, tp_size: int, rank: int,
                      page_size_bytes: int | None = None) -> ReferenceMapping:
    """Rank ``rank``'s mapping for an attention layer (``page`` None: a layout vLLM does not
    recognize, of ``page_size_bytes``)."""
    if page is not None and not isinstance(page, AttentionPage):
        raise InvalidFieldError("page", page, "an AttentionPage or None")
    _positive("total_kv_heads", total_kv_heads)
    _rank(rank, _positive("tp_size", tp_size))
    plan = shard_plan(total_kv_heads, tp_size, page.num_kv_heads) if page is not None else None
    if plan is None:
        return opaque_mapping(page.page_size_bytes if page is not None else page_size_bytes, tp_size, rank)
    shards, replication = plan
    canonical = page.with_heads(shards * page.num_kv_heads)
    head_shard = rank // replication
    e = page.elem_size
    byte_map = [0] * page.page_size_bytes
    for part, token, head, x in page.coordinates():
        local = page.element_offset(part, token, head, x) * e
        glob = canonical.element_offset(part, token, head_shard * page.num_kv_heads + head, x) * e
        for b in range(e):
            byte_map[local + b] = glob + b
    return ReferenceMapping(canonical.page_size_bytes, page.page_size_bytes, tuple(byte_map), replication,
                            rank % replication, True)


def mla_mapping(page_size_bytes: int, tp_size: int, rank: int) -> ReferenceMapping:
    """MLA's latent is the same on every rank: the identity, written by one rank per block."""
    _positive("page_size_bytes", page_size_bytes)
    _rank(rank, _positive("tp_size", tp_size))
    return ReferenceMapping(page_size_bytes, page_size_bytes, tuple(range(page_size_bytes)), tp_size, rank, True)
