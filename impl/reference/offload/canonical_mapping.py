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

Context parallelism (#22): with ``dcp`` decode and ``pcp`` prefill context-parallel ranks
(``cp = dcp * pcp``) the offloaded block spans ``block_size * cp`` tokens. The group is the
``tp x pcp`` grid (rank ``r``: TP rank ``r % tp``, CP rank ``(r // tp) * dcp + (r % tp) % dcp``);
a rank's local tokens come in chunks of ``interleave`` and chunk ``c`` of CP rank ``k`` is canonical
chunk ``c * cp + k``. DCP splits tokens among ranks that replicate heads, so the heads' replication
must be a multiple of ``dcp`` and only ``replication // dcp`` writers rotate. A layer whose block
is not a whole number of interleave chunks, a per-token-head quantized page, a layer with no single
KV tensor, or a tensor whose shape and strides are not exactly one of the four dense layouts is not
certified (opaque fallback). A Mamba layer always gets the fallback of its unpadded page; any
other kind of layer has no canonical page at all.
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


def _rank(rank: object, tp_size: int, name: str = "rank") -> int:
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < tp_size:
        raise InvalidFieldError(name, rank, f"an int in [0, {tp_size})")
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


@dataclass(frozen=True)
class ContextParallel:
    """Decode (``dcp``) and prefill (``pcp``) context-parallel sizes and the token interleave."""

    dcp: int = 1
    pcp: int = 1
    interleave: int = 1

    def __post_init__(self) -> None:
        for name in ("dcp", "pcp", "interleave"):
            _positive(name, getattr(self, name), 64)

    @property
    def size(self) -> int:
        return self.dcp * self.pcp

    def cp_rank(self, rank: int, tp_size: int) -> int:
        """The rank's place among the ``cp`` token shards of a block."""
        _rank(rank, _positive("tp_size", tp_size, 1 << 16) * self.pcp)
        return (rank // tp_size) * self.dcp + (rank % tp_size) % self.dcp

    def canonical_token(self, token: int, cp_rank: int) -> int:
        """Where the rank's local token ``token`` sits among the block's ``block_size * cp`` tokens."""
        _rank(cp_rank, self.size, "cp_rank")
        if not isinstance(token, int) or isinstance(token, bool) or token < 0:
            raise InvalidFieldError("token", token, "an int >= 0")
        chunk, pos = divmod(token, self.interleave)
        return (chunk * self.size + cp_rank) * self.interleave + pos

    def tiles(self, block_size: int) -> bool:
        """Whether a block of ``block_size`` local tokens is whole interleave chunks (always, without CP)."""
        _positive("block_size", block_size)
        return self.size == 1 or (self.interleave <= block_size and block_size % self.interleave == 0)


_NO_CP = ContextParallel()


def _cp(cp: object) -> ContextParallel:
    if not isinstance(cp, ContextParallel):
        raise InvalidFieldError("cp", cp, "a ContextParallel")
    return cp


def recognized_order(kind: str, block_size: int, heads: int, head_size: int,
                     strides: tuple[int, ...]) -> str | None:
    """The memory order (``"NHD"``/``"HND"``) whose dense element strides a page's dims have exactly
    (split: (K/V half, token, head, x); packed: (head, token, x)), NHD first; None for any other
    strides: vLLM certifies a layout from its strides alone, so a padded or permuted one fails closed."""
    if kind not in KINDS:
        raise InvalidFieldError("kind", kind, "one of " + ", ".join(KINDS))
    for name in ("block_size", "heads", "head_size"):
        _positive(name, locals()[name])
    if not isinstance(strides, tuple) or not all(isinstance(v, int) for v in strides):
        raise InvalidFieldError("strides", strides, "a tuple of ints")
    bs, h, hs = block_size, heads, head_size
    if kind == "split":
        layouts = (("NHD", (bs * h * hs, h * hs, hs, 1)), ("HND", (bs * h * hs, hs, bs * hs, 1)))
    else:
        layouts = (("NHD", (2 * hs, h * 2 * hs, 1)), ("HND", (bs * 2 * hs, 2 * hs, 1)))
    for order, want in layouts:
        if strides == want:
            return order
    return None


def attention_mapping(page: AttentionPage | None, total_kv_heads: int, tp_size: int, rank: int,
                      page_size_bytes: int | None = None, cp: ContextParallel = _NO_CP) -> ReferenceMapping:
    """Rank ``rank`` (of the ``tp_size * cp.pcp`` grid)'s mapping for an attention layer (``page``
    None: a layer that cannot be certified, of ``page_size_bytes``)."""
    if page is not None and not isinstance(page, AttentionPage):
        raise InvalidFieldError("page", page, "an AttentionPage or None")
    cp = _cp(cp)
    _positive("total_kv_heads", total_kv_heads)
    _positive("tp_size", tp_size)
    ranks = tp_size * cp.pcp
    _rank(rank, ranks)
    plan = shard_plan(total_kv_heads, tp_size, page.num_kv_heads) if page is not None else None
    if plan is not None and (plan[1] % cp.dcp or not cp.tiles(page.block_size)):
        plan = None  # DCP needs the replicated ranks to split tokens; CP needs whole chunks per block
    if plan is None:
        if page is None and page_size_bytes is None:
            raise InvalidFieldError("page_size_bytes", None, "an int when page is None")
        return opaque_mapping(page.page_size_bytes if page is not None else page_size_bytes, ranks, rank)
    shards, replication = plan
    tp_rank, cp_rank = rank % tp_size, cp.cp_rank(rank, tp_size)
    canonical = AttentionPage(page.kind, page.order, page.block_size * cp.size, shards * page.num_kv_heads,
                              page.head_size, page.elem_size)
    head_shard = tp_rank // replication
    e = page.elem_size
    byte_map = [0] * page.page_size_bytes
    for part, token, head, x in page.coordinates():
        local = page.element_offset(part, token, head, x) * e
        glob = canonical.element_offset(part, cp.canonical_token(token, cp_rank),
                                        head_shard * page.num_kv_heads + head, x) * e
        for b in range(e):
            byte_map[local + b] = glob + b
    return ReferenceMapping(canonical.page_size_bytes, page.page_size_bytes, tuple(byte_map),
                            replication // cp.dcp, (tp_rank % replication) // cp.dcp, cp.size == 1)


def mla_mapping(page_size_bytes: int, tp_size: int, rank: int, cp: ContextParallel = _NO_CP,
                block_size: int = 1, certifiable: bool = True) -> ReferenceMapping:
    """MLA's latent is the same on every TP rank: each local token row goes to its canonical token's
    row, written by one of the ``tp / dcp`` ranks holding those tokens per block. Not certified
    (opaque fallback): ``certifiable`` False (several tokens per state, per-token-head
    quantization), rows that do not split the page, ``dcp`` not dividing ``tp``, partial chunks."""
    _positive("page_size_bytes", page_size_bytes)
    cp = _cp(cp)
    _positive("tp_size", tp_size)
    _positive("block_size", block_size)
    if not isinstance(certifiable, bool):
        raise InvalidFieldError("certifiable", certifiable, "a bool")
    ranks = tp_size * cp.pcp
    _rank(rank, ranks)
    if not certifiable or page_size_bytes % block_size or tp_size % cp.dcp or not cp.tiles(block_size):
        return opaque_mapping(page_size_bytes, ranks, rank)
    row = page_size_bytes // block_size
    cp_rank = cp.cp_rank(rank, tp_size)
    byte_map = tuple(cp.canonical_token(i // row, cp_rank) * row + i % row for i in range(page_size_bytes))
    return ReferenceMapping(cp.size * page_size_bytes, page_size_bytes, byte_map, tp_size // cp.dcp,
                            (rank % tp_size) // cp.dcp, cp.size == 1)
