"""Hypothesis state machine for the single-type managers, driven through the reference
``KVCacheManager`` (full attention, sliding window, the hybrid pair, or full attention + R-SWA).

Where the scheduler machine and the explorer decide *when* the manager is called like vLLM's
scheduler does, this machine calls it in any order a scheduler could: admit a request with its
prefix hit, grow it by a chunk, sample a token, preempt it, free it. Prompts are drawn from a
small alphabet with shared prefixes, so hits, evictable hits and duplicates are common.

Checks after every call (besides every ``check_invariants()``, including I9):

* **M3 predictor = allocator** — just before ``allocate_slots`` the machine asks the coordinator
  for the blocks the call will take (same arguments vLLM's ``allocate_slots`` passes); a
  successful call must take exactly that many from the free queue (vLLM PR #40027: a predictor
  that under-counts crashes with "Cannot get N free blocks from the pool");
* **free order** — freeing a request puts its blocks that reach ref 0 back *tail first*: the
  uncached ones at the front, the cached ones at the back (vLLM frees ``reversed(blocks)``);
* **hit completeness** (full attention only) — a request whose prompt matches computed, cached
  full blocks gets exactly the hit vLLM gives: the longest run of full blocks, never the last
  token;
* **M1** — after an allocation each group's table covers every slot asked for.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvref.spec.mathutil import cdiv


@dataclass(frozen=True)
class ManagerConfig:
    kind: str = "hybrid"  # "full" | "swa" | "hybrid" | "full2" (two full-attention groups) | "full+rswa"
    block_size: int = 2
    sliding_window: int = 3
    num_blocks: int = 10
    max_model_len: int = 12
    max_in_flight_tokens: int = 4
    scheduler_block_size: int | None = None  # None: block_size


    def pool(self):
        from kvref.impl.interface import PoolConfig
        from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, RSWASpec, SlidingWindowSpec

        common = dict(block_size=self.block_size, num_kv_heads=1, head_size=1, dtype="float32")
        groups = []
        if self.kind in ("full", "hybrid", "full2", "full+rswa"):
            groups.append(KVCacheGroupSpec(("full",), FullAttentionSpec(**common)))
        if self.kind == "full2":  # same spec: one spec group, a hit must hit in both groups
            groups.append(KVCacheGroupSpec(("full_b",), FullAttentionSpec(**common)))
        if self.kind == "full+rswa":  # R-SWA: the gap between prompt and decode window is freed
            groups.append(KVCacheGroupSpec(("rswa",), RSWASpec(rswa_window=self.sliding_window, **common)))
        if self.kind in ("swa", "hybrid"):
            groups.append(KVCacheGroupSpec(("swa",), SlidingWindowSpec(sliding_window=self.sliding_window, **common)))
        return PoolConfig.off_plan("a manager machine's hand-sized pool",
                                   num_blocks=self.num_blocks, groups=tuple(groups), max_model_len=self.max_model_len,
                          scheduler_block_size=self.scheduler_block_size or self.block_size,
                          hash_block_size=self.block_size,
                          max_in_flight_tokens=self.max_in_flight_tokens)


class ManagerMachine(RuleBasedStateMachine):
    """Set ``targets = ("reference", "vllm")`` to drive vLLM 0.33.0's ``KVCacheManager`` beside the
    reference (through :mod:`kvref.impl.vllm`) and compare every answer, the free queue in order
    and the cached blocks."""

    config = ManagerConfig()
    targets: tuple[str, ...] = ("reference",)
    steps = 0
    #: class-wide counts of what the runs reached (``hits``, ``admissions``, ``rejections``, ``frees``):
    #: tests assert on them, so a machine that stopped reaching hits or rejections fails
    coverage: dict[str, int] = {}

    def _count(self, what: str) -> None:
        type(self).coverage[what] = type(self).coverage.get(what, 0) + 1

    def __init__(self) -> None:
        super().__init__()
        from kvref.impl.reference.kv_cache_manager import KVCacheManager

        self.kv = KVCacheManager(self.config.pool())
        self.vllm = None
        if "vllm" in self.targets:
            from kvref.impl.vllm import VllmKVCacheManager

            self.vllm = VllmKVCacheManager(self.config.pool())
        self.reqs: dict[str, object] = {}
        self.n = 0

    @staticmethod
    def _ids(kv_blocks) -> tuple:
        return None if kv_blocks is None else tuple(tuple(b.block_id for b in g) for g in kv_blocks.blocks)

    def _vllm_allocate(self, r, num_new, hit_ids=None, num_hit=0, gate=False, ref_out=None):
        if self.vllm is None:
            return
        out = self.vllm.allocate_slots(r, num_new, num_hit, hit_ids, full_sequence_must_fit=gate)
        want = self._ids(ref_out)
        if want is not None and not any(want):
            want = tuple(() for _ in want)
        if out is not None and not any(out):
            out = tuple(() for _ in out)
        assert out == want, f"vllm: allocate_slots({r.request_id}, {num_new}) = {out}, reference {want}"

    # --- helpers --------------------------------------------------------------------------------

    def _allocate(self, r, num_new: int, hit_blocks=None, num_hit: int = 0, gate: bool = False):
        """allocate_slots with the M3 and M1 checks around it."""
        kv = self.kv
        coord = kv.coordinator
        local = r.num_computed_tokens + num_hit
        total = min(local, kv.max_model_len)
        main = total + num_new
        need_slot = min(main, kv.max_model_len)
        prefill_end = max(r.num_prompt_tokens, r.num_tokens - 1)
        hits = hit_blocks.blocks if hit_blocks is not None and any(hit_blocks.blocks) else kv.empty_kv_cache_blocks.blocks
        coord.remove_skipped_blocks(r.request_id, max(0, total - r.num_in_flight_tokens), r.num_prompt_tokens)
        predicted = coord.get_num_blocks_to_allocate(r.request_id, need_slot, hits, 0, local, local, main,
                                                     prefill_end=prefill_end)
        free_before = kv.get_num_free_blocks()
        out = kv.allocate_slots(r, num_new, num_hit, hit_blocks, full_sequence_must_fit=gate)
        if out is None:
            return None
        taken = free_before - kv.get_num_free_blocks()
        assert taken == predicted, f"M3: predicted {predicted} blocks, allocate_slots took {taken}"
        for g, m in enumerate(coord.single_type_managers):
            assert len(m.req_to_blocks.get(r.request_id, ())) >= cdiv(need_slot, m.block_size), \
                f"M1: group {g} table too short for {need_slot} slots"
        return out

    # --- rules ----------------------------------------------------------------------------------

    @precondition(lambda self: len(self.reqs) < 4)
    @rule(prompt=st.lists(st.integers(1, 2), min_size=1, max_size=8), max_tokens=st.integers(1, 3),
          chunk=st.integers(1, 6))
    def admit(self, prompt, max_tokens, chunk):
        from kvref.impl.request import Request, RequestStatus

        max_tokens = min(max_tokens, self.config.max_model_len - len(prompt))
        if max_tokens < 1:
            return
        rid = f"r{self.n}"
        self.n += 1
        r = Request(rid, prompt, max_tokens=max_tokens)
        blocks, num_hit, _ = self.kv.get_computed_blocks(r)
        assert num_hit < r.num_tokens, "M7: the hit covers the last token"
        for g, m in enumerate(self.kv.coordinator.single_type_managers):
            if getattr(m, "sliding_window", None) is None:
                group = blocks.blocks[g] if blocks.blocks else ()
                assert not any(b.is_null for b in group), f"full-attention hit in group {g} holds the null block"
                assert len(group) * m.block_size >= num_hit, f"group {g}: hit blocks do not cover {num_hit} tokens"
        self._check_hit_complete(r, num_hit)
        hit_ids = self._ids(blocks)
        if self.vllm is not None:
            v_ids, v_hit = self.vllm.get_computed_blocks(r)
            assert (v_ids if any(v_ids) else None, v_hit) == (hit_ids if any(hit_ids) else None, num_hit), \
                f"vllm: get_computed_blocks({rid}) = {v_ids}, {v_hit}; reference {hit_ids}, {num_hit}"
        num_new = min(chunk, r.num_tokens - num_hit)
        out = self._allocate(r, num_new, blocks, num_hit, gate=True)
        self._vllm_allocate(r, num_new, hit_ids if any(hit_ids) else None, num_hit, True, out)
        if num_hit:
            self._count("hits")
        if out is None:
            self._count("rejections")
            return
        self._count("admissions")
        r.num_computed_tokens = num_hit + num_new
        r.status = RequestStatus.RUNNING
        self.reqs[rid] = r

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), chunk=st.integers(1, 6))
    def grow(self, data, chunk):
        r = self.reqs[data.draw(st.sampled_from(sorted(self.reqs)), label="request")]
        if r.num_computed_tokens >= r.num_tokens:  # prefill done: sample a token first
            if r.num_output_tokens >= r.max_tokens or r.num_tokens >= self.config.max_model_len:
                return
            r.output_token_ids.append(1 + r.num_tokens % 2)
        num_new = min(chunk, r.num_tokens - r.num_computed_tokens)
        out = self._allocate(r, num_new)
        self._vllm_allocate(r, num_new, ref_out=out)
        if out is not None:
            r.num_computed_tokens += num_new

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data):
        """Finish (or preempt) a request: its blocks come back tail first."""
        r = self.reqs.pop(data.draw(st.sampled_from(sorted(self.reqs)), label="request"))
        pool = self.kv.block_pool
        front, back = [], []
        for m in self.kv.coordinator.single_type_managers:
            table = [b for b in m.req_to_blocks.get(r.request_id, ()) if not b.is_null]
            for b in reversed(table):
                if b.ref_cnt == 1:
                    (front if b.block_hash is None else back).append(b.block_id)
        before = list(pool.free_block_ids())
        self._count("frees")
        self.kv.free(r)
        if self.vllm is not None:
            self.vllm.free(r)
            self.vllm.forget(r.request_id)
        after = list(pool.free_block_ids())
        # managers free one after another: each group's uncached blocks are prepended in turn
        assert sorted(after[:len(front)]) == sorted(front) and after[len(after) - len(back):] == back \
            or not (front or back), f"free order: queue {before} -> {after}, expected front {front} back {back}"
        if len(self.kv.coordinator.single_type_managers) == 1:
            assert after[:len(front)] == front, f"free order: front {after[:len(front)]}, expected {front}"

    # --- oracles --------------------------------------------------------------------------------

    def _check_hit_complete(self, r, num_hit):
        if self.config.kind != "full":
            return
        bs = self.config.block_size
        pool = self.kv.block_pool
        hashes = self.kv.block_hashes(r)
        expect = 0
        for i in range(min(len(hashes), (r.num_tokens - 1) // bs)):
            if pool.get_cached_block(hashes[i], [0]) is None:
                break
            expect = (i + 1) * bs
        # every full block any live request has computed is cached (caching on)
        for o in self.reqs.values():
            if tuple(o.all_token_ids[:expect]) != tuple(r.all_token_ids[:expect]):
                continue
        assert num_hit == expect, f"hit {num_hit} tokens, cached full blocks give {expect}"
        for o in self.reqs.values():
            full = min(o.num_computed_tokens, o.num_tokens) // bs * bs
            common = 0
            for a, b in zip(o.all_token_ids[:full], r.all_token_ids[: (r.num_tokens - 1) // bs * bs]):
                if a != b:
                    break
                common += 1
            assert num_hit >= common // bs * bs, \
                f"hit completeness: {o.request_id} computed {common // bs} matching full blocks, hit is {num_hit}"

    @invariant()
    def count_step(self):
        type(self).steps += 1

    @invariant()
    def invariants_hold(self):
        self.kv.check_invariants()

    @invariant()
    def agrees_with_vllm(self):
        if self.vllm is None:
            return
        self.vllm.check_invariants()
        ref_queue = tuple(self.kv.block_pool.free_block_ids())
        assert self.vllm.free_block_queue() == ref_queue, \
            f"vllm: free queue {self.vllm.free_block_queue()}, reference {ref_queue}"
        ref_cached = self.kv.block_pool.cached_blocks()
        v_cached = self.vllm.cached_blocks()
        assert v_cached == ref_cached, \
            f"vllm: cached blocks {sorted(v_cached)}, reference {sorted(ref_cached)}"
        for rid in self.reqs:
            ref_ids = tuple(tuple(x) for x in self.kv.get_block_ids(rid))
            assert self.vllm.get_block_ids(rid) == ref_ids, \
                f"vllm: {rid} tables {self.vllm.get_block_ids(rid)}, reference {ref_ids}"


def make_manager_machine(config: ManagerConfig, *targets: str) -> type[ManagerMachine]:
    targets = targets or ("reference",)
    for t in targets:
        if t not in ("reference", "vllm"):
            from kvref.spec.errors import InvalidFieldError

            raise InvalidFieldError("targets", t, "'reference' or 'vllm'")
    return type(f"ManagerMachine_{config.kind}_{'_'.join(targets)}", (ManagerMachine,),
                {"config": config, "targets": tuple(targets), "steps": 0, "coverage": {}})


CONFIGS = (ManagerConfig("full", num_blocks=8), ManagerConfig("swa", num_blocks=6),
           ManagerConfig("hybrid", num_blocks=10), ManagerConfig("hybrid", num_blocks=6, block_size=1,
                                                                  sliding_window=2),
           ManagerConfig("full2", num_blocks=9), ManagerConfig("full+rswa", num_blocks=12, block_size=2,
                                                                 sliding_window=2))

#: configs for the pairing with vLLM (adds a hybrid whose scheduler block spans two blocks, so
#: the sliding-window reachable-block mask and hit alignment matter)
VLLM_CONFIGS = (ManagerConfig("full", num_blocks=8), ManagerConfig("hybrid", num_blocks=10),
                ManagerConfig("hybrid", num_blocks=12, block_size=2, sliding_window=3, scheduler_block_size=4),
                ManagerConfig("full+rswa", num_blocks=12, block_size=2, sliding_window=2))


def run_manager_machines(budget: int, targets: tuple[str, ...] = ("reference",)) -> str | None:
    """Every config with ``budget`` examples, no shrinking; returns the first failure or None."""
    from kvref.models.hypothesis_runs.reproducible import same_inputs_in_every_process

    cfg = settings(max_examples=budget, stateful_step_count=30, derandomize=True, database=None,
                   deadline=None, print_blob=False, phases=[Phase.explicit, Phase.generate],
                   suppress_health_check=list(HealthCheck))
    for c in (VLLM_CONFIGS if "vllm" in targets else CONFIGS):
        try:
            with same_inputs_in_every_process():
                run_state_machine_as_test(make_manager_machine(c, *targets), settings=cfg)
        except Exception as e:  # noqa: BLE001
            text = str(e).strip().splitlines()
            return f"{c.kind}/{c.num_blocks}: {type(e).__name__}: {text[0] if text else ''}"
    return None
