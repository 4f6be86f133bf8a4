"""What the OffloadingConnector's configuration says about parallelism (vLLM 0.33.0
``offloading/config.py``, ``build_offloading_config``; #22): which cache groups it offloads, how
many bytes one GPU block is on a worker, whether the offloaded KV is *parallelism-agnostic* (a
worker of any TP size may read it: host folders and keys drop the rank), and whether the host
pages are one replicated layout for all TP ranks (MLA's latent is the same on every rank).

Written from the facts:

* offloaded groups: those that take part in KV transfer and whose every layer is prefix-cacheable
  (a circular-buffer ring is not) — with a HiSparse host pool, the HiSparse indexer groups instead;
  none is refused;
* bytes per block: the first KV cache tensor's size over the block count when the config lists
  tensors and there is no HiSparse host pool, else the offloaded groups' pages (a group with one spec: its page times its layers; a
  ``UniformTypeKVCacheSpecs`` group: the sum of its layers' pages); 0 without blocks;
* agnostic without the canonical layout: the V1 model runner, one cache group whose spec is plain
  (not MLA) full attention with head-sharded pages (heads x TP = the model's KV heads), no
  per-token-head quantization, no DCP/PCP;
* with the canonical layout (RFC #42082) also every configuration whose every layer certifies:
  attention, not per-token-head quantized; an exact MLA layer with one token per state and rows
  splitting its page; full or sliding-window attention (not an MLA subclass, not chunked-local)
  whose heads shard evenly (the model's KV heads a multiple or divisor of TP) to exactly
  ``max(1, total // tp)`` per rank — and no DCP/PCP, and the world exactly the TP group;
* the KV cache layout the connector asks the engine for: layer-outermost ``LBHNC`` (a layer's
  blocks contiguous, heads before tokens), block-outermost ``BLHNC`` under HiSparse;
* replicated layout without the canonical layout: an MLA model under TP > 1 whose cache is
  replicated on all TP ranks, with bytes to offload, no PP/PCP/DCP, world = TP, the ``mp``
  executor on one node; with it: agnostic, every offloaded layer exact MLA, one node, and one
  worker or the ``mp`` executor.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvref.spec.errors import InvalidFieldError

#: layer kinds (vLLM spec classes): FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec,
#: MLAAttentionSpec, SlidingWindowMLASpec, HiddenStateCacheSpec (an MLA subclass), MambaSpec,
#: CircularBufferSpec (not prefix-cacheable)
LAYER_KINDS = ("full", "swa", "chunked", "mla", "swa_mla", "hidden_state", "mamba", "circular")
_ATTENTION = ("full", "swa", "chunked", "mla", "swa_mla", "hidden_state", "circular")


def _int(name: str, value: object, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise InvalidFieldError(name, value, f"an int >= {minimum}")
    return value


@dataclass(frozen=True)
class OffloadLayer:
    """One layer's cache spec as the gate sees it."""

    kind: str
    num_kv_heads: int
    page_size_bytes: int
    block_size: int
    per_token_head: bool = False
    tokens_per_state: int = 1

    def __post_init__(self) -> None:
        if self.kind not in LAYER_KINDS:
            raise InvalidFieldError("kind", self.kind, "one of " + ", ".join(LAYER_KINDS))
        for name in ("num_kv_heads", "page_size_bytes", "block_size", "tokens_per_state"):
            _int(name, getattr(self, name), 1)
        if not isinstance(self.per_token_head, bool):
            raise InvalidFieldError("per_token_head", self.per_token_head, "a bool")

    @property
    def prefix_cacheable(self) -> bool:
        return self.kind != "circular"


@dataclass(frozen=True)
class OffloadGroup:
    """A cache group: ``uniform`` True, one ``UniformTypeKVCacheSpecs`` over ``layers``; False, the
    first layer's spec shared by ``len(layers)`` layer names. ``transfer``: takes part in KV transfer."""

    layers: tuple[OffloadLayer, ...]
    uniform: bool = False
    transfer: bool = True
    hisparse_indexer: bool = False  # the group's role is HiSparse's indexer

    def __post_init__(self) -> None:
        if not isinstance(self.layers, tuple) or not self.layers or not all(
                isinstance(x, OffloadLayer) for x in self.layers):
            raise InvalidFieldError("layers", self.layers, "a non-empty tuple of OffloadLayer")
        for name in ("uniform", "transfer", "hisparse_indexer"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidFieldError(name, getattr(self, name), "a bool")

    @property
    def specs(self) -> tuple[OffloadLayer, ...]:
        """The group's per-layer specs (one for a shared spec)."""
        return self.layers if self.uniform else self.layers[:1]

    @property
    def offloaded(self) -> bool:
        return self.transfer and all(x.prefix_cacheable for x in self.specs)

    @property
    def bytes_per_block(self) -> int:
        if self.uniform:
            return sum(x.page_size_bytes for x in self.layers)
        return self.layers[0].page_size_bytes * len(self.layers)


@dataclass(frozen=True)
class OffloadParallel:
    """The engine's parallel shape and the switches the gate reads."""

    tp: int
    total_kv_heads: int
    dcp: int = 1
    pcp: int = 1
    pp: int = 1
    world_size: int = 0  # 0: tp * pp * pcp
    use_mla: bool = False
    v2_runner: bool = False
    backend: str = "mp"
    nnodes: int = 1
    kv_tp_replicas: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "total_kv_heads", "dcp", "pcp", "pp", "nnodes", "kv_tp_replicas"):
            _int(name, getattr(self, name), 1)
        _int("world_size", self.world_size, 0)
        for name in ("use_mla", "v2_runner"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidFieldError(name, getattr(self, name), "a bool")
        if not isinstance(self.backend, str):
            raise InvalidFieldError("backend", self.backend, "an executor backend name")

    @property
    def world(self) -> int:
        return self.world_size or self.tp * self.pp * self.pcp


def _groups(groups: object) -> tuple[OffloadGroup, ...]:
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, OffloadGroup) for g in groups):
        raise InvalidFieldError("groups", groups, "a list of OffloadGroup")
    return tuple(groups)


def offloaded_groups(groups: list[OffloadGroup], hisparse_host: bool = False) -> tuple[int, ...]:
    """The ids of the groups the connector offloads (``hisparse_host``: the config has a HiSparse
    host pool); InvalidFieldError when there are none (vLLM: "KV offloading found no eligible cache
    groups")."""
    if not isinstance(hisparse_host, bool):
        raise InvalidFieldError("hisparse_host", hisparse_host, "a bool")
    ids = tuple(i for i, g in enumerate(_groups(groups))
                if (g.hisparse_indexer if hisparse_host else g.offloaded))
    if not ids:
        raise InvalidFieldError("groups", groups, "at least one transferable, prefix-cacheable cache group")
    return ids


def worker_kv_bytes_per_block(groups: list[OffloadGroup], num_blocks: int, tensor_bytes: int | None,
                              hisparse_host: bool = False) -> int:
    """One GPU block's bytes on a worker (``tensor_bytes``: the first KV cache tensor's size, None
    when the config lists no tensors)."""
    ids = offloaded_groups(groups, hisparse_host)
    _int("num_blocks", num_blocks, 0)
    if tensor_bytes is not None:
        _int("tensor_bytes", tensor_bytes, 0)
    if num_blocks == 0:
        return 0
    if tensor_bytes is not None and not hisparse_host:
        return tensor_bytes // num_blocks
    return sum(groups[i].bytes_per_block for i in ids)


def layer_certifiable(layer: OffloadLayer, total_kv_heads: int, tp: int) -> bool:
    """Whether the canonical layout can place this layer's pages whatever the TP size."""
    if not isinstance(layer, OffloadLayer):
        raise InvalidFieldError("layer", layer, "an OffloadLayer")
    _int("total_kv_heads", total_kv_heads, 1)
    _int("tp", tp, 1)
    if layer.kind not in _ATTENTION or layer.per_token_head:
        return False
    if layer.kind == "mla":
        return layer.tokens_per_state == 1 and layer.page_size_bytes % layer.block_size == 0
    if layer.kind not in ("full", "swa"):
        return False
    even = total_kv_heads % tp == 0 or tp % total_kv_heads == 0
    return even and layer.num_kv_heads == max(1, total_kv_heads // tp)


def parallelism_agnostic(groups: list[OffloadGroup], par: OffloadParallel, canonical: bool) -> bool:
    """Whether the offloaded KV may be read by a worker of another parallel shape."""
    groups = _groups(groups)
    if not isinstance(par, OffloadParallel):
        raise InvalidFieldError("par", par, "an OffloadParallel")
    if not isinstance(canonical, bool):
        raise InvalidFieldError("canonical", canonical, "a bool")
    no_cp = par.dcp == 1 and par.pcp == 1
    single = groups[0] if len(groups) == 1 and not groups[0].uniform else None
    if (not par.v2_runner and single is not None and single.layers[0].kind == "full"
            and single.layers[0].num_kv_heads * par.tp == par.total_kv_heads
            and not single.layers[0].per_token_head and no_cp):
        return True
    if not canonical:
        return False
    specs = [x for g in groups for x in g.specs]
    return (bool(specs) and all(layer_certifiable(x, par.total_kv_heads, par.tp) for x in specs) and no_cp
            and par.world == par.tp)


def replicated_layout(groups: list[OffloadGroup], par: OffloadParallel, canonical: bool,
                      worker_bytes: int, hisparse_host: bool = False) -> bool:
    """Whether one host page layout serves every TP rank (MLA's replicated latent)."""
    groups = _groups(groups)
    _int("worker_bytes", worker_bytes, 0)
    if canonical:
        ids = offloaded_groups(groups, hisparse_host)
        return (parallelism_agnostic(groups, par, True)
                and all(x.kind == "mla" for i in ids for x in groups[i].specs)
                and par.nnodes == 1 and (par.world == 1 or par.backend == "mp"))
    if not isinstance(par, OffloadParallel):
        raise InvalidFieldError("par", par, "an OffloadParallel")
    return (par.use_mla and par.tp > 1 and par.kv_tp_replicas == par.tp and worker_bytes > 0
            and par.pp == 1 and par.pcp == 1 and par.dcp == 1 and par.world == par.tp
            and par.backend == "mp" and par.nnodes == 1)


def required_kv_cache_layout(hisparse: bool) -> str:
    """The KV cache layout the OffloadingConnector requires of the engine (``hisparse``: a HiSparse
    attention config is set)."""
    if not isinstance(hisparse, bool):
        raise InvalidFieldError("hisparse", hisparse, "a bool")
    return "BLHNC" if hisparse else "LBHNC"
