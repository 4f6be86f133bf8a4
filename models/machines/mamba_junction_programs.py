"""Generated sibling programs for the Mamba shared-prefix checkpoint (issue #23).

The KV-manager machine reaches a keyed junction only now and then: a junction needs a computed
request, a later one sharing a cut of it whose attention hit outruns the Mamba hit, and a chunk
ended exactly there, and swarm testing switches the rules that build this off in many traces. A
short default run met none, so a fault that drops vLLM's junction branch survived
``conform-kv-manager``. These programs build the situation on purpose, from generated inputs: a
fine-grained FA + Mamba "align" pool with EAGLE and ``enable_mamba_shared_prefix_checkpoint``
(sometimes sparse retention, an MTP tail or a Mamba block of one hash block, which narrow the flag
away), a base prompt computed in
the scheduler's clipped chunks, then siblings sharing drawn cuts of it with fresh tails, each
admitted and prefilled in clipped chunks (the split stops at the junction the lookup returned),
mostly a new scheduler step between them (else vLLM defers a hit on a state cached in the same
step), some finished. A :class:`~kvref.models.conformance.differential.Harness`
compares every implementation after every op (block ids, hashes, KV events, free queue).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from kvref.models.conformance.accepted import is_accepted, signature
from kvref.models.conformance.differential import Divergence, Harness
from kvref.models.conformance.trace import Op
from kvref.models.hypothesis_runs.reproducible import same_inputs_in_every_process
from kvref.models.machines.mamba_chunks import aligned_chunk, mamba_split_config
from kvref.models.machines.mamba_junctions import (
    JunctionCheckpoints,
    compare_shared_prefix_checkpoint,
    with_split_junction_stop,
)
from kvref.models.strategies.pools import pool_configs, tokens_from_seed
from kvref.spec.errors import check_int
from kvref.spec.kv_cache_interface import KVCacheGroupSpec

_ADMIT = dict(full_sequence_must_fit=False, reserved_blocks=0, in_flight=False)


@st.composite
def junction_programs(draw) -> dict:
    """A pool, a base prompt and 2-4 siblings (cut, tail, chunk, finish-after) as plain data."""
    # mostly fine-grained pools (the flag stays on); an "align" pool with a Mamba block of one hash
    # block narrows it away, and its hits land on the scheduler's alignment grid
    group_set = draw(st.sampled_from(("fa+mamba_fine", "fa+mamba_fine", "fa+mamba_fine", "fa+mamba_align")))
    pool = draw(pool_configs(group_sets=(group_set,), eagle="always", retention=True))
    # the full-attention block as wide as the Mamba block one pool in two: a hit ending inside it is
    # a partial hit of both groups (both copy the shared tail on write)
    fa, mamba = pool.groups[0].kv_cache_spec, pool.groups[1].kv_cache_spec
    if fa.block_size < mamba.block_size and draw(st.booleans()):
        wide = KVCacheGroupSpec(pool.groups[0].layer_names, dataclasses.replace(fa, block_size=mamba.block_size))
        pool = dataclasses.replace(pool, groups=(wide, *pool.groups[1:]))
    # multi-module MTP one pool in three (vLLM then narrows the flag away), clamped as vLLM requires
    lookahead = min(draw(st.sampled_from((0, 0, 0, 1, 2, 3))), pool.scheduler_block_size)
    pool = dataclasses.replace(pool, enable_mamba_shared_prefix_checkpoint=True, enable_kv_cache_events=True,
                               num_prefill_lookahead=lookahead)
    limit = max(4, min(pool.max_model_len - 1, 48))
    base = tokens_from_seed(draw(st.integers(0, 2**16)), draw(st.integers(3, limit)))
    siblings = []
    for _ in range(draw(st.integers(2, 4))):
        cut = draw(st.integers(2, len(base)))
        tail = tokens_from_seed(draw(st.integers(0, 2**16)), draw(st.integers(1, max(1, limit - cut))))
        # mostly a new scheduler step first; else the sibling arrives in the step that cached the
        # states it hits, and vLLM defers it (the same-step guard)
        siblings.append(dict(cut=cut, tail=tail, chunk=draw(st.sampled_from((2, 4, 8, 16, 1024))),
                             finish=draw(st.booleans()), new_step=draw(st.booleans())))
    return dict(pool=pool, base=base, chunk=draw(st.sampled_from((4, 8, 16, 1024))), siblings=siblings)


class _Run:
    """One program on one harness."""

    def __init__(self, program: dict, kinds: tuple[str, ...]) -> None:
        self.h = Harness(program["pool"], list(kinds))
        on = compare_shared_prefix_checkpoint(self.h.managers)
        self.split = with_split_junction_stop(mamba_split_config(program["pool"]), on)
        self.junctions = JunctionCheckpoints(self.h, self.h.managers.get("reference") if on else None)
        self.on = on
        self.token = 0

    def apply(self, op: Op) -> None:
        self.h.apply(op)
        self.junctions.observe()

    def _next_token(self) -> int:
        self.token = (self.token + 1) % 8
        return self.token

    def prefill(self, rid: str, prompt: list[int], chunk: int) -> None:
        """Add ``rid``, admit it and step it through its prompt, each chunk clipped as vLLM's
        scheduler clips it (stops at the junction the admission's lookup returned)."""
        self.apply(Op("add", dict(rid=rid, prompt=prompt, max_tokens=4, cache_salt=None)))
        self.apply(Op("admit", dict(rid=rid, chunk=aligned_chunk(self.h, self.split, rid, chunk, admitting=True),
                                    token=self._next_token(), **_ADMIT)))
        for _ in range(len(prompt)):
            r = self.h.reqs[rid].request
            if r.num_computed_tokens >= r.num_prompt_tokens or r.status.name != "RUNNING":
                return
            self.apply(Op("step", dict(rid=rid, chunk=aligned_chunk(self.h, self.split, rid, chunk, admitting=False),
                                       lookahead=0, token=self._next_token(), in_flight=False)))


def run_program(program: dict, kinds: tuple[str, ...], run: _Run | None = None) -> _Run:
    """Run ``program`` on ``kinds`` (raises :class:`Divergence` where they differ)."""
    run = run or _Run(program, kinds)
    run.prefill("base", list(program["base"]), program["chunk"])
    for i, s in enumerate(program["siblings"]):
        if s["new_step"]:
            run.apply(Op("new_step", {}))
        rid = f"s{i}"
        run.prefill(rid, list(program["base"][:s["cut"]]) + list(s["tail"]), s["chunk"])
        if s["finish"]:
            run.apply(Op("finish", dict(rid=rid)))
    return run


def run_junction_programs(kinds: tuple[str, ...], examples: int, *, seed: int = 0,
                          out_dir: str | None = None) -> tuple[str | None, str | None, str | None, Counter]:
    """``examples`` generated programs on ``kinds``; stops at the first divergence (not shrunk).

    Returns ``(failure, trace_path, signature, seen)``: the failure text (None when all agreed),
    the saved trace of the failing program (replay with ``kvref replay``), the finding's
    signature, and counters (programs, ops, pools with the narrowed flag on, junction states keyed,
    prefix hits, copy-on-write pairs)."""
    check_int("examples", examples, minimum=1)
    check_int("seed", seed, minimum=0)
    seen: Counter = Counter()
    found: list[tuple[Divergence, str | None]] = []
    folder = Path(out_dir) if out_dir else Path(os.environ.get("KVREF_TRACE_DIR", Path(tempfile.gettempdir())
                                                                 / "kvref-traces"))

    @hypothesis_seed(seed)
    @settings(max_examples=examples, database=None, deadline=None, derandomize=False,
              suppress_health_check=list(HealthCheck), phases=(Phase.generate,))
    @given(program=junction_programs())
    def body(program: dict) -> None:
        if found:
            return
        run = None
        try:
            run = _Run(program, kinds)
            run_program(program, kinds, run)
        except Divergence as exc:
            if is_accepted(exc.signature):
                return
            path = None
            if run is not None:
                name = "junction-" + hashlib.sha256((exc.signature or str(exc)).encode()).hexdigest()[:12] + ".json"
                path = str(run.h.trace.save(folder / name))
            found.append((exc, path))
            return
        seen["programs"] += 1
        seen["ops"] += run.h.num_applied
        seen["on"] += run.on
        seen["junction_checkpoints"] += run.junctions.count
        seen["prefix_hits"] += run.h.num_prefix_hits
        seen["cow_copies"] += run.h.num_cow_copies

    with same_inputs_in_every_process():
        body()
    if not found:
        return None, None, None, seen
    exc, path = found[0]
    return str(exc), path, exc.signature or signature(str(exc)), seen
