"""What the HiSparse coordinator remembers per request and per write-back (vLLM 0.33.0
``v1/hisparse/coordinator.py`` ``_HiSparseRequestState`` / ``_PendingSpill`` and the worker command
types of ``v1/hisparse/types.py``; issue #23).

A resident page moves through three states: *dirty* (only its GPU copy exists), *clean*
(``valid_pages``: the host copy is complete) and *unpinned* (clean, and its GPU reference was
released so the pool may reuse the block while it is still read). ``pinned_clean`` holds clean pages
that still keep their reference: a request keeps them until it can read from host (it holds, or has
asked for, its hot region).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .kv_cache_block import KVCacheBlock

#: sealed pages this many positions behind the block-table tail stay pinned, so a page an in-flight
#: step still writes is never handed out under it (vLLM ``ACTIVE_TAIL_PAGES``)
ACTIVE_TAIL_PAGES = 2


@dataclass(frozen=True)
class KVCacheBlockCopy:
    """One block copy the worker runs (vLLM ``KVCacheBlockCopy``): the HiSparse host source's
    copy-on-write pairs reach the worker this way, never through the generic copy path."""

    src_block_id: int
    dst_block_id: int


@dataclass(frozen=True)
class SparseKVPageTransfer:
    """Copy one page between the GPU resident groups and its host block: a write-back after the
    step's forward (``after_forward``), or a ``restore`` of an imported host page to the GPU."""

    transfer_id: int
    host_block_id: int
    resident_block_ids: tuple[int, ...]
    after_forward: bool
    restore: bool = False


@dataclass(frozen=True)
class SparseKVResidencyUpdate:
    """GPU block ids of some of a request's pages, per resident group (the null block id: read it
    from host); sent only for what the worker does not hold yet."""

    pages: list[int]
    block_ids: tuple[list[int], ...]


@dataclass(frozen=True)
class SparseKVRowMirror:
    """Mirror one contiguous span of a page's rows from the GPU resident groups into its host block."""

    source_starts: tuple[int, ...]
    destination_start: int
    num_rows: int


@dataclass
class SparseKVOffloadCommand:
    """The page transfers of one model step, for the worker connector."""

    page_transfers: list[SparseKVPageTransfer]


@dataclass
class PendingPublication:
    """A request's computed prefix whose host hashes wait for durable host copies."""

    request: object
    block_hashes: object
    num_computed_tokens: int
    num_pages: int
    retention_interval: int | None
    replay_boundaries: tuple[int, ...]
    #: the host blocks kept (touched) for a finished request whose last write-backs are in flight
    detached_blocks: list[KVCacheBlock] | None = None
    num_cached_blocks: int = 0


@dataclass
class HiSparseRequestState:
    valid_pages: set[int] = field(default_factory=set)
    #: leading pages whose host copies are all durable
    ready_prefix_pages: int = 0
    #: page -> transfer id of its write-back in flight
    pending_pages: dict[int, int] = field(default_factory=dict)
    publication: PendingPublication | None = None
    copies_recorded_blocks: int = 0
    pinned_clean: set[int] = field(default_factory=set)
    unpinned_pages: set[int] = field(default_factory=set)
    #: leading host-hit pages whose GPU copies are adopted after the admitting allocation
    pages_to_adopt: int = 0
    #: the worker holds this request's residency below ``synced_pages``, except ``stale_pages``
    synced_pages: int = 0
    stale_pages: set[int] = field(default_factory=set)


@dataclass
class PendingSpill:
    """A page transfer handed to the worker: its endpoints stay referenced until every worker that
    enqueued it reports it done."""

    transfer_id: int
    page: tuple[str, int]
    request_state: HiSparseRequestState
    host_block: KVCacheBlock
    resident_blocks: tuple[KVCacheBlock, ...]
    restore: bool = False
    expected_worker_completions: int = 0
    worker_completions: int = 0
    enqueue_applied: bool = False

