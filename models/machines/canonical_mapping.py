"""Generated layers whose canonical page mappings vLLM derives and the reference
(:mod:`kvref.impl.reference.offload.canonical_mapping`) states, compared byte for byte on every
rank (#22).

A case draws the model's KV heads, the tensor-parallel size, the rank's head count (the one vLLM
uses, or a wrong one: the fallback), the page kind and memory order (or a layout vLLM does not
recognize: a flat tensor, a permuted or padded one, another element size, several tensors or none),
block size, head size, element size, context parallelism (decode and prefill CP sizes, token
interleave), per-token-head quantization, padded pages, the group's spec form (one spec or
``UniformTypeKVCacheSpecs``), and now and then an MLA layer (one or two tokens per state), a Mamba
layer, a layer kind with no canonical page, or a worker group that is not the TP x PCP grid (vLLM
then derives nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvref.impl.reference.offload.canonical_mapping import (
    AttentionPage,
    ContextParallel,
    attention_mapping,
    mla_mapping,
    opaque_mapping,
    recognized_order,
)

#: the memory order (outermost first) of a page's dims for each dense layout
DENSE_ORDERS = {("split", "NHD"): (0, 1, 2, 3), ("split", "HND"): (0, 2, 1, 3),
                ("packed", "NHD"): (1, 0, 2), ("packed", "HND"): (0, 1, 2)}


@dataclass(frozen=True)
class LayerCase:
    total_kv_heads: int
    tp_size: int
    heads: int
    kind: str | None  # None: a layout vLLM does not recognize (a flat tensor)
    order: str
    block_size: int
    head_size: int
    elem_size: int
    mla: bool = False
    world_size: int | None = None  # != tp_size * pcp: not the TP x PCP grid
    dcp: int = 1
    pcp: int = 1
    interleave: int = 1
    layer_kind: str = "attention"  # or "mla" (also when mla), "mamba", "other"
    perm: tuple[int, ...] | None = None  # the tensor's memory order of the page dims (None: order's)
    pad: int = 0  # elements of padding after the innermost dim in memory
    aliased: tuple[int, ...] | None = None  # explicit (token, head) strides of an aliasing view, dims else dense
    tensor_elem: int | None = None  # the tensor's element size when not the spec's
    per_token_head: bool = False
    tensor_form: str = "tensor"  # "list", "absent"
    mla_tokens_per_state: int = 1
    uniform: bool = False
    page_size_padded: int | None = None

    @property
    def kind_of_layer(self) -> str:
        return "mla" if self.mla else self.layer_kind

    @property
    def ranks(self) -> int:
        return self.tp_size * self.pcp

    @property
    def dims(self) -> tuple[int, ...]:
        if self.kind == "split":
            return (2, self.block_size, self.heads, self.head_size)
        return (self.heads, self.block_size, 2 * self.head_size)

    @property
    def strides(self) -> tuple[int, ...] | None:
        """The tensor's element strides of the page dims (None for a flat tensor)."""
        if self.kind is None:
            return None
        if self.aliased is not None:
            token, head = self.aliased
            if self.kind == "split":
                return (self.block_size * self.heads * self.head_size, token, head, 1)
            return (head, token, 1)
        perm = self.perm or DENSE_ORDERS[(self.kind, self.order)]
        strides, step = [0] * len(perm), 1
        for i, d in enumerate(reversed(perm)):
            strides[d] = step
            step *= self.dims[d] + (self.pad if i == 0 else 0)
        return tuple(strides)

    @property
    def page(self) -> AttentionPage | None:
        """The attention page the reference certifies, or None (opaque fallback)."""
        if (self.kind is None or self.per_token_head or self.tensor_form != "tensor"
                or (self.tensor_elem or self.elem_size) != self.elem_size):
            return None
        order = recognized_order(self.kind, self.block_size, self.heads, self.head_size, self.strides)
        if order is None:
            return None
        return AttentionPage(self.kind, order, self.block_size, self.heads, self.head_size, self.elem_size)

    def reference(self):
        """Every rank's reference mapping (None for all when the group is not the TP x PCP grid or
        the layer has no canonical page)."""
        n = self.ranks
        if self.world_size not in (None, n) or self.kind_of_layer == "other":
            return [None] * n
        cp = ContextParallel(self.dcp, self.pcp, self.interleave)
        if self.kind_of_layer == "mamba":
            page = (self.heads * self.head_size + self.block_size) * self.elem_size  # unpadded
            return [opaque_mapping(page, n, r) for r in range(n)]
        if self.kind_of_layer == "mla":
            page = self.block_size // self.mla_tokens_per_state * self.head_size * self.elem_size
            ok = self.mla_tokens_per_state == 1 and not self.per_token_head
            return [mla_mapping(page, self.tp_size, r, cp, self.block_size, ok) for r in range(n)]
        page_bytes = 2 * self.block_size * self.heads * self.head_size * self.elem_size
        return [attention_mapping(self.page, self.total_kv_heads, self.tp_size, r, page_bytes, cp)
                for r in range(n)]


#: the rarer sides of a layer a case can be made to have (``random_layer_case``'s ``force``), so a
#: short run still meets each of them
FEATURES = ("cp", "mla", "mamba", "other", "aliased:split", "aliased:packed", "perm:split", "perm:packed",
            "per_token_head", "elem:split", "elem:packed", "list", "absent", "mla_dense", "split:NHD", "split:HND",
            "packed:NHD", "packed:HND", "flat", "uneven:heads", "uneven:total", "uneven:tp", "grid", "partial_chunk", "dcp_replicas")


def layer_cases(rng, n: int) -> list[LayerCase]:
    """``n`` random layers, the first three times through :data:`FEATURES` one forced side each."""
    return [random_layer_case(rng, FEATURES[i % len(FEATURES)] if i < 3 * len(FEATURES) else None)
            for i in range(n)]


def random_layer_case(rng, force: str | None = None) -> LayerCase:
    """A random layer; ``force`` (one of :data:`FEATURES`) makes it have that side."""
    force, _, forced_kind = (force or "").partition(":")
    force = force or None
    forced_order = uneven = None
    if force in ("split", "packed"):
        forced_kind, forced_order = force, forced_kind
    elif force == "uneven":
        forced_kind, uneven = "split", forced_kind
    total = rng.choice([1, 2, 3, 4, 6, 8])
    tp = rng.choice([1, 2, 4, 8])
    heads = max(1, total // tp) if force or rng.random() < 0.85 else rng.choice([1, 2, 3])
    kind = forced_kind or rng.choice(["split", "packed", "split", "packed", None])
    order, bs = forced_order or rng.choice(["NHD", "HND"]), rng.choice([2, 4, 16] if forced_order else [1, 2, 4, 16])
    dcp = pcp = interleave = 1
    head_size = rng.choice([1, 2, 8])
    # sides that reach the layout or the mapping need a layer that certifies up to them: even heads,
    # DCP within the replicas, whole interleave chunks
    certifying = force in ("split", "packed", "mla_dense", "aliased", "perm", "elem", "flat", "partial_chunk",
                           "dcp_replicas")
    if force in ("cp", "split", "packed", "mla_dense") or (force != "uneven" and rng.random() < 0.4):
        dcp, pcp, interleave = rng.choice([1, 2, 4]), rng.choice([1, 1, 2]), rng.choice([1, 1, 2, 3, 4, 8])
        tp = min(tp, 4)
        if force == "cp":  # DCP over heads that may not be replicated enough for it
            dcp, interleave = rng.choice([2, 4]), 1
    if certifying or force == "cp":
        total = rng.choice([tp, 2 * tp] + [d for d in (1, 2) if d < tp])
        heads = max(1, total // tp)
        if certifying and (dcp > 1 or interleave > 1):
            replication = tp if force == "mla_dense" else tp // total if total < tp else 1
            dcp = rng.choice([d for d in (1, 2, 4) if replication % d == 0])
            interleave = rng.choice([i for i in (1, 2, 4, 8) if i <= bs and bs % i == 0])
        if force == "dcp_replicas":  # replicated heads whose ranks split the tokens under DCP
            tp, total, heads, dcp, interleave = 4, rng.choice([1, 2]), 1, 2, 1
        if force == "partial_chunk":  # CP whose interleave does not divide the block: not certified
            bs, pcp, interleave = rng.choice([4, 16]), 2, 3
    r = rng.random()
    layer_kind = "attention" if r < 0.8 else "mamba" if r < 0.88 else "other" if r < 0.93 else "mla"
    if force in ("mla", "mamba", "other", "mla_dense"):
        layer_kind = "mla" if force == "mla_dense" else force
    if force in ("aliased", "perm", "per_token_head", "elem", "list", "absent", "split", "packed", "flat", "uneven",
                 "partial_chunk", "dcp_replicas"):
        layer_kind, kind = "attention", None if force == "flat" else kind or "split"
    perm = pad = None
    plain = force in ("split", "packed", "mla_dense", "partial_chunk", "dcp_replicas")
    if kind is not None and not plain and (force == "perm" or rng.random() < 0.2):  # permuted/padded
        perm = tuple(rng.sample(range(4 if kind == "split" else 3), 4 if kind == "split" else 3))
        pad = rng.choice([0, 0, 1, 2])
    aliased = None
    if kind is not None and not plain and (force == "aliased" or rng.random() < 0.1):  # any token/head strides
        aliased = tuple(rng.choice([1, 2, 4]) * rng.choice([1, 2, 8, 16]) for _ in range(2))
        if kind == "split" and rng.random() < 0.5:  # HND's head stride, a token stride of neither layout
            aliased = (head_size * rng.choice([2, 3]), bs * head_size)
    mla = force in (None, "cp") and rng.random() < 0.1
    if force == "uneven":  # a rank head count vLLM does not shard to, or heads that do not shard evenly
        if uneven != "heads":  # more heads than ranks not a multiple of them, or the other way round
            total, tp = rng.choice([(3, 2), (6, 4)] if uneven == "total" else [(3, 4), (3, 8)])
        heads = max(1, total // tp) + (1 if uneven == "heads" else 0)
    elem = rng.choice([1, 2, 4])
    return LayerCase(total, tp, heads, kind, order, bs, head_size, elem, mla=mla,
                     world_size=tp * pcp + 1 if force == "grid" or (force is None and rng.random() < 0.05) else None,
                     dcp=dcp, pcp=pcp,
                     interleave=interleave, layer_kind=layer_kind, perm=perm, pad=pad or 0, aliased=aliased,
                     tensor_elem=rng.choice([e for e in (1, 2, 4) if e != elem]) if force == "elem"
                     else rng.choice([1, 2, 4]) if not plain and rng.random() < 0.08 else None,
                     per_token_head=force == "per_token_head" or (force == "mla" and bs == 1)
                     or (not plain and rng.random() < 0.06),
                     tensor_form=force if force in ("list", "absent")
                     else "list" if not plain and rng.random() < 0.04 else "tensor",
                     mla_tokens_per_state=2 if (mla or layer_kind == "mla") and bs > 1 and force != "mla_dense"
                     and (force == "mla" or rng.random() < 0.3) else 1,
                     uniform=rng.random() < 0.3,
                     page_size_padded=(1 << 16) if rng.random() < (0.67 if force == "mamba" else 0.15) else None)


def compare_layer(case: LayerCase) -> str | None:
    """None when vLLM's mappings equal the reference's on every rank, else what differs."""
    from kvref.impl.vllm.canonical_mapping import vllm_mappings

    try:
        got = vllm_mappings(None, case.total_kv_heads, case.tp_size, block_size=case.block_size,
                            heads=case.heads, head_size=case.head_size, elem_size=case.elem_size,
                            world_size=case.world_size, dcp=case.dcp, pcp=case.pcp, interleave=case.interleave,
                            layer_kind=case.kind_of_layer, kind=case.kind, strides=case.strides,
                            tensor_elem=case.tensor_elem, per_token_head=case.per_token_head,
                            tensor_form=case.tensor_form, mla_tokens_per_state=case.mla_tokens_per_state,
                            uniform=case.uniform, page_size_padded=case.page_size_padded)
    except AssertionError as exc:  # vLLM's own tiling check
        return f"{case}: vLLM's derivation failed its assertion: {exc}"
    ref = case.reference()
    if len(got) != len(ref):
        return f"{case}: vLLM maps {len(got)} ranks, the reference {len(ref)}"
    for rank, (g, w) in enumerate(zip(got, ref)):
        if g != w:
            fields = ("canonical_page_size_bytes", "local_page_size_bytes", "num_writers", "writer_index",
                      "parallelism_agnostic")
            if g is None or w is None:
                return (f"{case}: rank {rank}: vLLM {'derives no' if g is None else 'derives a'} mapping, "
                        f"the reference {'none' if w is None else 'one'}")
            diff = [f"{f}: vLLM {getattr(g, f)} reference {getattr(w, f)}" for f in fields
                    if getattr(g, f) != getattr(w, f)]
            bad = [i for i, (a, b) in enumerate(zip(g.byte_map, w.byte_map)) if a != b]
            if bad:
                i = bad[0]
                diff.append(f"{len(bad)} local bytes placed elsewhere, first byte {i}: vLLM -> {g.byte_map[i]}, "
                            f"reference -> {w.byte_map[i]}")
            return f"{case}: rank {rank}: " + "; ".join(diff)
    return None
