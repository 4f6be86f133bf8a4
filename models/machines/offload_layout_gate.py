"""Generated layer sets and parallel shapes through vLLM's ``build_offloading_config`` and the
reference's gate (:mod:`kvref.impl.reference.offload.parallel_layout`): the offloaded groups, a
worker's bytes per block, ``is_parallelism_agnostic`` and ``replicated_layout`` agree, or both
refuse (#22).

A case draws 1-3 cache groups (a shared spec over 1-3 layers, or a ``UniformTypeKVCacheSpecs``;
now and then one out of KV transfer) of full, sliding-window, chunked-local, MLA (one or two
tokens per state), sliding-window MLA, hidden-state, Mamba or circular-buffer layers with head
counts right or wrong for the TP size and per-token-head quantization now and then; the TP size,
the model's KV heads, DCP/PCP/PP, a world that is or is not the TP group, the MLA switch, KV
replication, the executor backend and node count, the V2 model runner, the canonical layout, and
whether the config lists KV cache tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvref.impl.reference.offload.parallel_layout import (
    OffloadGroup,
    OffloadLayer,
    OffloadParallel,
    offloaded_groups,
    parallelism_agnostic,
    replicated_layout,
    required_kv_cache_layout,
    worker_kv_bytes_per_block,
)
from kvref.spec.errors import InvalidFieldError

_MLA_KINDS = ("mla", "swa_mla", "hidden_state")


@dataclass(frozen=True)
class GateCase:
    groups: tuple[OffloadGroup, ...]
    par: OffloadParallel
    canonical: bool
    num_blocks: int
    tensor_bytes: int | None
    hisparse_host: bool = False

    def reference(self) -> dict | str:
        groups, hs = list(self.groups), self.hisparse_host
        try:
            ids = offloaded_groups(groups, hs)
        except InvalidFieldError:
            return "refused"
        wb = worker_kv_bytes_per_block(groups, self.num_blocks, self.tensor_bytes, hs)
        return {"group_ids": ids, "worker_kv_bytes_per_block": wb,
                "parallelism_agnostic": parallelism_agnostic(groups, self.par, self.canonical),
                "replicated_layout": replicated_layout(groups, self.par, self.canonical, wb, hs)}


def _layer(rng, kind: str, bs: int, heads: int) -> OffloadLayer:
    tps = 2 if kind in ("mla", "hidden_state") and bs > 1 and rng.random() < 0.2 else 1
    if kind in _MLA_KINDS:
        return OffloadLayer(kind, 1, bs // tps * rng.choice([2, 4, 8]), bs, rng.random() < 0.08, tps)
    if kind == "mamba":
        return OffloadLayer(kind, 1, rng.choice([16, 48, 64]), bs)
    page = 2 * bs * heads * rng.choice([1, 2, 4])
    return OffloadLayer(kind, heads, page, bs, rng.random() < 0.08)


#: sides of the gate a case can be made to reach (``random_gate_case``'s ``force``): a layer set the
#: canonical layout certifies only if every layer of a ``UniformTypeKVCacheSpecs`` group is looked at
#: (its first certifies, a later one does not), an MLA model replicated on every TP rank, and a set
#: refused for its per-token-head quantization alone
FORCES = ("uniform_mixed", "mla_replicated", "per_token_head")


def gate_cases(rng, n: int) -> list[GateCase]:
    """``n`` random cases, the first two of each :data:`FORCES` side."""
    return [random_gate_case(rng, FORCES[i % len(FORCES)] if i < 2 * len(FORCES) else None) for i in range(n)]


def random_gate_case(rng, force: str | None = None) -> GateCase:
    """A random case; ``force`` (one of :data:`FORCES`) gives it that side."""
    if force == "uniform_mixed":
        tp = rng.choice([1, 2, 4])
        total = tp * rng.choice([1, 2])
        bs = rng.choice([2, 4])
        good = _layer(rng, "full", bs, total // tp)
        bad = _layer(rng, rng.choice(["chunked", "hidden_state", "swa_mla"]), bs, total // tp)
        return GateCase((OffloadGroup((replace(good, per_token_head=False), bad), uniform=True),),
                        OffloadParallel(tp, total), True, 8, None)
    if force == "per_token_head":  # a layer set the canonical gate refuses for its quantization alone
        tp = rng.choice([1, 2, 4])
        total, bs = tp * rng.choice([1, 2]), rng.choice([2, 4])
        layer = replace(_layer(rng, rng.choice(["full", "swa"]), bs, total // tp), per_token_head=True)
        return GateCase((OffloadGroup((layer,) * rng.choice([1, 2])),), OffloadParallel(tp, total), True, 8, None)
    if force == "mla_replicated":
        tp, bs = rng.choice([2, 4]), rng.choice([2, 4])
        layer = replace(_layer(rng, "mla", bs, 1), per_token_head=False, tokens_per_state=1)
        layer = replace(layer, page_size_bytes=bs * rng.choice([2, 4]))
        return GateCase((OffloadGroup((layer,) * rng.choice([1, 2])),), OffloadParallel(
            tp, 1, use_mla=True, kv_tp_replicas=tp), rng.random() < 0.5, 8, rng.choice([None, 8 * 64]))
    tp = rng.choice([1, 2, 4, 8])
    total = rng.choice([1, 2, 3, 4, 8, 16])
    dcp = rng.choice([1, 1, 1, 2])
    pcp = rng.choice([1, 1, 1, 2])
    pp = rng.choice([1, 1, 1, 2])
    mla_model = rng.random() < 0.35
    bs = rng.choice([2, 4, 16])
    kinds = (["mla", "mla", "swa_mla", "hidden_state"] if mla_model else ["full", "full", "swa", "chunked"]) \
        + ["mamba", "circular"] * (dcp == 1 and rng.random() < 0.3)
    groups = []
    hisparse_host = rng.random() < 0.12  # a HiSparse host pool: the indexer groups are offloaded
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        heads = max(1, total // tp) if rng.random() < 0.8 else rng.choice([1, 2, 3])
        uniform = rng.random() < 0.3
        n = rng.choice([1, 2, 3])
        first = rng.choice(kinds)
        layers = tuple(_layer(rng, rng.choice(kinds) if uniform and i else first, bs, heads) for i in range(n))
        groups.append(OffloadGroup(layers, uniform, transfer=rng.random() > 0.08,
                                   # (an indexer is an attention cache, never the compressor's ring)
                                   hisparse_indexer=hisparse_host and rng.random() < 0.6
                                   and all(x.kind != "circular" for x in layers)))
    par = OffloadParallel(tp, total, dcp, pcp, pp, world_size=0 if rng.random() < 0.85 else tp * pp * pcp + 1,
                          use_mla=mla_model, v2_runner=rng.random() < 0.1,
                          backend="mp" if rng.random() < 0.85 else "ray", nnodes=1 if rng.random() < 0.9 else 2,
                          kv_tp_replicas=tp if mla_model and rng.random() < 0.8 else 1)
    num_blocks = rng.choice([0, 8, 8, 8, 30])
    tensor_bytes = rng.choice([None, None, num_blocks * 96 + rng.choice([0, 5])])
    return GateCase(tuple(groups), par, rng.random() < 0.5, num_blocks, tensor_bytes, hisparse_host)


def compare_gate(case: GateCase) -> str | None:
    """None when vLLM's ``build_offloading_config`` agrees with the reference, else what differs."""
    from kvref.impl.vllm.offload_layout_gate import vllm_offloading_gate, vllm_required_layout

    want = case.reference()
    hisparse = case.num_blocks % 3 == 0  # the layout the connector asks the engine for, either way
    layout = vllm_required_layout(hisparse)
    if layout != required_kv_cache_layout(hisparse):
        return f"HiSparse {hisparse}: vLLM's engine takes the layout {layout!r} from the OffloadingConnector, " \
               f"the reference {required_kv_cache_layout(hisparse)!r}"
    try:
        got = vllm_offloading_gate(list(case.groups), case.par, case.canonical, case.num_blocks, case.tensor_bytes,
                                   case.hisparse_host)
    except AssertionError as exc:
        return f"{case}: vLLM's build_offloading_config failed its assertion ({exc}); reference {want}"
    if isinstance(got, str):
        return None if want == "refused" else f"{case}: vLLM refused ({got}); reference {want}"
    if got != want:
        return f"{case}: vLLM {got}, reference {want}"
    return None
