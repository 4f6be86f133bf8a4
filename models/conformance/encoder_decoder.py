"""Encoder-decoder pools: decoder self-attention + cross-attention, reference vs vLLM (#22).

vLLM 0.33.0 runs encoder-decoder models (Whisper-style) with prefix caching off: the
``KVCacheCoordinatorNoPrefixCache`` sizes the cross-attention group by the request's encoder
tokens (``allocate_slots(num_encoder_tokens=...)``, the scheduler's sum of the encoder inputs at
admission, 0 afterwards) and the decoder's full-attention group by its tokens; both groups share
one pool. The engine-trace machine never passes encoder tokens, so the coordinator's
cross-attention branch of ``get_num_blocks_to_allocate`` and ``CrossAttentionManager``'s
``add_local_computed_blocks`` / ``allocate_external_computed_blocks`` (a connector's external
tokens on such a pool) were never run under a comparison. Here generated programs of
admissions (with encoder tokens and, sometimes, external tokens), prefill chunks, decode tokens,
preemptions and finishes run on both, and every answer is compared: the allocation (or its
refusal), each running request's whole block table, the free-block count and the free-queue
order. Run inside ``conform-kv-manager``.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from kvref.impl.interface import PoolConfig
from kvref.impl.request import Request, RequestStatus
from kvref.spec.kv_cache_interface import CrossAttentionSpec, FullAttentionSpec, KVCacheGroupSpec

#: program operations: (kind, request index, amount)
OPS = ("admit", "step", "step", "step", "preempt", "finish")


@dataclass(frozen=True)
class EncDecRequest:
    prompt_len: int
    max_tokens: int
    encoder_tokens: int
    external: int  # connector tokens offered at admission (whole scheduler blocks are used)


@dataclass(frozen=True)
class EncDecCase:
    pool: PoolConfig
    requests: tuple[EncDecRequest, ...]
    ops: tuple[tuple[str, int, int], ...]


@st.composite
def encoder_decoder_cases(draw) -> EncDecCase:
    """A FA + cross-attention pool (either order, the cross block 1 or 2 decoder blocks), caching
    off as vLLM requires for encoder-decoder models, and a program on up to four requests."""
    bs = draw(st.sampled_from((1, 2, 4, 8)))
    cross_bs = bs * draw(st.sampled_from((1, 2)))
    kw = dict(num_kv_heads=draw(st.integers(1, 2)), head_size=draw(st.sampled_from((1, 4))), dtype="float16")
    groups = [KVCacheGroupSpec(("decoder_self",), FullAttentionSpec(block_size=bs, **kw)),
              KVCacheGroupSpec(("decoder_cross",), CrossAttentionSpec(block_size=cross_bs, **kw))]
    if draw(st.booleans()):
        groups.reverse()
    max_model_len = draw(st.integers(4, 64))
    encoder_budget = draw(st.integers(1, 48))
    one = -(-max_model_len // bs) + -(-encoder_budget // cross_bs)
    num_blocks = draw(st.integers(2, max(3, 2 * one + 2)))
    pool = PoolConfig.off_plan(
        "an encoder-decoder pool sized by hand around one request (near-full pools decide admissions by a "
        "block; startup sizes by memory)",
        num_blocks=num_blocks, groups=tuple(groups), max_model_len=max_model_len,
        scheduler_block_size=max(bs, cross_bs), hash_block_size=bs, enable_caching=False)
    requests = tuple(draw(st.lists(st.builds(
        EncDecRequest, prompt_len=st.integers(1, max(1, max_model_len - 1)), max_tokens=st.integers(1, 8),
        encoder_tokens=st.integers(1, encoder_budget),
        external=st.one_of(st.just(0), st.integers(1, max_model_len))), min_size=1, max_size=4)))
    ops = tuple(draw(st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, len(requests) - 1),
                                        st.integers(1, 16)), min_size=4, max_size=24)))
    return EncDecCase(pool, requests, ops)


class EncDecDivergence(AssertionError):
    """The reference and vLLM answered one operation of an encoder-decoder program differently."""


def run_encoder_decoder(case: EncDecCase, make_managers) -> dict[str, int]:
    """Run ``case`` on the managers ``make_managers(pool)`` returns (``{kind: KVCacheManagerLike}``,
    the first the reference) and compare every answer; returns what the program did (counts).

    Raises:
        EncDecDivergence: two managers answered an operation differently.
    """
    managers = make_managers(case.pool)
    kinds = list(managers)
    sbs = case.pool.scheduler_block_size
    reqs = [Request(f"r{i}", [(7 * i + t) % 50 for t in range(spec.prompt_len)], max_tokens=spec.max_tokens)
            for i, spec in enumerate(case.requests)]
    seen = {"admitted": 0, "refused": 0, "external": 0, "steps": 0, "preempted": 0, "finished": 0}

    def agree(what: str, answers: dict) -> object:
        first = answers[kinds[0]]
        for k in kinds[1:]:
            if answers[k] != first:
                raise EncDecDivergence(f"{what}: kvref {first} != {k} {answers[k]}\n{case}")
        return first

    def each(what: str, call) -> object:
        return agree(what, {k: call(m) for k, m in managers.items()})

    for n, (kind, i, amount) in enumerate(case.ops):
        r, spec = reqs[i], case.requests[i]
        where = f"op {n} {kind} r{i}"
        if kind == "admit" and r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            # the connector's external tokens: whole scheduler blocks, never the last token
            external = min(spec.external, r.num_tokens - 1)
            external -= external % sbs
            num_new = min(amount, r.num_tokens - external)
            out = each(f"{where}: allocate_slots(admission, encoder {spec.encoder_tokens}, external {external})",
                       lambda m: m.allocate_slots(r, num_new, num_external_computed_tokens=external,
                                                  num_encoder_tokens=spec.encoder_tokens, has_scheduled_reqs=False))
            if out is None:
                seen["refused"] += 1
            else:
                seen["admitted"] += 1
                seen["external"] += external > 0
                r.status = RequestStatus.RUNNING
                r.num_computed_tokens = external + num_new
        elif kind == "step" and r.status == RequestStatus.RUNNING:
            if r.num_computed_tokens >= r.num_tokens:  # the last chunk sampled a token
                if r.num_tokens >= min(case.pool.max_model_len, r.num_prompt_tokens + spec.max_tokens):
                    continue
                r.output_token_ids.append((3 * r.num_tokens + i) % 50)
            num_new = min(amount, r.num_tokens - r.num_computed_tokens)
            out = each(f"{where}: allocate_slots(running)", lambda m: m.allocate_slots(r, num_new))
            if out is None:
                seen["refused"] += 1
            else:
                seen["steps"] += 1
                r.num_computed_tokens += num_new
        elif kind in ("preempt", "finish") and r.status == RequestStatus.RUNNING:
            for m in managers.values():
                m.free(r)
            r.num_computed_tokens = 0
            r.status = RequestStatus.PREEMPTED if kind == "preempt" else RequestStatus.FINISHED
            seen["preempted" if kind == "preempt" else "finished"] += 1
        else:
            continue
        for other in reqs:
            if other.status == RequestStatus.RUNNING:
                each(f"{where}: block table of {other.request_id}", lambda m: m.get_block_ids(other.request_id))
        each(f"{where}: free blocks", lambda m: m.get_num_free_blocks())
        each(f"{where}: free queue", lambda m: m.free_block_queue())
        for m in managers.values():  # each side's own invariants (M1 exempts cross-attention tables)
            m.check_invariants()
    return seen
