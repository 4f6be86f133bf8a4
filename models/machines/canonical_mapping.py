"""Generated attention layers whose canonical page mappings vLLM derives and the reference
(:mod:`kvref.impl.reference.offload.canonical_mapping`) states, compared byte for byte on every
rank (#22).

A case draws the model's KV heads, the tensor-parallel size, the rank's head count (the one vLLM
uses, or a wrong one: the fallback), the page kind and memory order (or a layout vLLM does not
recognize), block size, head size, element size, and now and then an MLA layer or a worker group
that is not the TP grid (vLLM then derives nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvref.impl.reference.offload.canonical_mapping import (
    AttentionPage,
    attention_mapping,
    mla_mapping,
)


@dataclass(frozen=True)
class LayerCase:
    total_kv_heads: int
    tp_size: int
    heads: int
    kind: str | None  # None: a layout vLLM does not recognize
    order: str
    block_size: int
    head_size: int
    elem_size: int
    mla: bool = False
    world_size: int | None = None  # != tp_size: not the TP grid

    @property
    def page(self) -> AttentionPage | None:
        if self.kind is None:
            return None
        return AttentionPage(self.kind, self.order, self.block_size, self.heads, self.head_size, self.elem_size)

    def reference(self):
        """Every rank's reference mapping (None for all when the group is not the TP grid)."""
        if self.world_size not in (None, self.tp_size):
            return [None] * self.tp_size
        page_bytes = 2 * self.block_size * self.heads * self.head_size * self.elem_size
        if self.mla:
            return [mla_mapping(self.block_size * self.head_size * self.elem_size, self.tp_size, r)
                    for r in range(self.tp_size)]
        return [attention_mapping(self.page, self.total_kv_heads, self.tp_size, r, page_bytes)
                for r in range(self.tp_size)]


def random_layer_case(rng) -> LayerCase:
    total = rng.choice([1, 2, 3, 4, 6, 8])
    tp = rng.choice([1, 2, 4, 8])
    heads = max(1, total // tp) if rng.random() < 0.85 else rng.choice([1, 2, 3])
    kind = rng.choice(["split", "packed", "split", "packed", None])
    return LayerCase(total, tp, heads, kind, rng.choice(["NHD", "HND"]), rng.choice([1, 2, 4, 16]),
                     rng.choice([1, 2, 8]), rng.choice([1, 2, 4]), mla=rng.random() < 0.1,
                     world_size=tp + 1 if rng.random() < 0.05 else None)


def compare_layer(case: LayerCase) -> str | None:
    """None when vLLM's mappings equal the reference's on every rank, else what differs."""
    from kvref.impl.vllm.canonical_mapping import vllm_mappings

    try:
        got = vllm_mappings(case.page, case.total_kv_heads, case.tp_size, block_size=case.block_size,
                            heads=case.heads, head_size=case.head_size, elem_size=case.elem_size, mla=case.mla,
                            world_size=case.world_size)
    except AssertionError as exc:  # vLLM's own tiling check
        return f"{case}: vLLM's derivation failed its assertion: {exc}"
    for rank, (g, w) in enumerate(zip(got, case.reference())):
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
