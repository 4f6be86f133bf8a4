"""The SimpleCPU offload world on full-attention + Mamba "align" pools with fine-grained hashes (#22).

vLLM's SimpleCPU connector has two store paths its positional cursors never take on the pools of
:mod:`.simple_cpu_world`: the Mamba "align" **boundary-state hand-offs** (a Mamba table is not
positionally stable, so the KV cache manager hands the connector each committed state by block
id, every step) and, at a request's finish, the **full-attention partial tail** (the block that
holds the prompt's last hash boundary when that boundary falls inside a block). Both need a pool
whose blocks are wider than the hash unit and a Mamba group in "align" mode: this world draws
exactly those (FA + Mamba "align", 8-token blocks hashed every 4 or 2 tokens).

The engine schedules as vLLM's ``Scheduler`` does on such a pool (synchronous scheduling):
``new_step_starts``, each chunk clipped to Mamba state boundaries (``_mamba_block_aligned_split``,
kvref's :func:`~kvref.impl.reference.scheduler_mamba_split.mamba_block_aligned_split`, from the
backend's own look-up and junction), then the hand-offs drained into the step's
``KVConnectorBlockState`` and the copy-on-write pairs of sub-block hits released, then
``build_connector_meta``. The traces are :func:`~kvref.models.offload.traces.random_ops`'.

The oracle is the reference backend (:class:`kvref.impl.simple_cpu_mamba_backends.SimpleCPUMambaReferenceBackend`)
run beside vLLM's (:class:`kvref.impl.vllm.simple_offload_mamba.SimpleCPUMambaVllmBackend`): every
step's transfers, hand-offs and copies, and after every operation both pools (free queues, cached
keys, ref counts), the in-flight set, the connector's per-request state, its cumulative hand-off
counters and drained ``SAVE_OUTCOMES``, its stats, must agree. The content model of
:mod:`.simple_cpu_world` keys contents by hash-sized blocks; here blocks are wider than the hash
unit and Mamba states are not token blocks, so it only checks that no GPU block is the source of
two in-flight stores and that loads write blocks of a loading request.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from kvref.impl.reference.offload.simple_cpu_offload_scheduler import SimpleOffloadStep
from kvref.impl.reference.scheduler_mamba_split import MambaSplitConfig, mamba_block_aligned_split
from kvref.spec.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec

from kvref.models.offload.simple_cpu_world import BACKENDS, SimpleOffloadWorld, _Transfer
from kvref.models.offload.world_common import OffloadInvariantError, ScheduledBatch

#: what the generated traces reached (a test asserts the rare paths under a derandomized run)
MAMBA_COVERAGE: Counter = Counter()


@dataclass(frozen=True)
class SimpleOffloadMambaConfig:
    """FA + Mamba "align" groups of ``block_size`` tokens hashed every ``hash_block_size``."""

    block_size: int = 8
    hash_block_size: int = 4
    num_gpu_blocks: int = 24
    num_cpu_blocks: int = 24
    world_size: int = 1
    max_model_len: int = 256
    max_num_batched_tokens: int = 64
    # feed the connector hand-offs vLLM's manager does not make today (a repeated entry, the null
    # block, an unhashed block of the request): the connector's declining branches, counted
    odd_handoffs: bool = False
    # vLLM's ``kv_events_config.enable_kv_cache_events``: the CPU cache's BlockStored events, with
    # the payloads of each block and of the hash units inside it, and none for hand-offs and tails
    kv_events: bool = False
    # what SimpleOffloadWorld reads: eager stores, synchronous scheduling, no window
    lazy: bool = False
    async_scheduling: bool = False
    sliding_window: None = None

    def kvref_groups(self) -> tuple[KVCacheGroupSpec, ...]:
        kw = dict(block_size=self.block_size, num_kv_heads=1, head_size=1, dtype="float32")
        return (KVCacheGroupSpec(("full",), FullAttentionSpec(**kw)),
                KVCacheGroupSpec(("mamba",), MambaSpec(block_size=self.block_size, shapes=((2, 8),),
                                                       dtypes=("float16",), mamba_cache_mode="align")))

    @classmethod
    def random(cls, rng: Any) -> SimpleOffloadMambaConfig:
        """KV events are drawn from a generator seeded by ``rng``'s state without advancing it, so
        the traces drawn after the configuration stay what they were."""
        import random

        side = random.Random(hash(rng.getstate()[1]))  # the int tuple alone: see SimpleOffloadConfig.random
        return cls(hash_block_size=rng.choice([4, 4, 2]), num_gpu_blocks=rng.randint(12, 24),
                   num_cpu_blocks=rng.choice([40, 24, 16, 8, 3, 1]), world_size=rng.randint(1, 2),
                   odd_handoffs=rng.random() < 0.3, kv_events=side.random() < 0.5)


def _reference(cfg, variant="reference"):
    from kvref.impl.simple_cpu_mamba_backends import SimpleCPUMambaReferenceBackend

    return SimpleCPUMambaReferenceBackend(cfg, variant)


def _vllm(cfg, variant="reference"):
    from kvref.impl.vllm.simple_offload_mamba import SimpleCPUMambaVllmBackend

    return SimpleCPUMambaVllmBackend(cfg, variant)


BACKENDS.setdefault("mamba-reference", _reference)
BACKENDS.setdefault("mamba-vllm", _vllm)


class SimpleOffloadMambaWorld(SimpleOffloadWorld):
    """:class:`SimpleOffloadWorld` on a Mamba "align" pool; ``backend`` is ``"reference"`` or ``"vllm"``."""

    def __init__(self, cfg: SimpleOffloadMambaConfig, backend: str = "reference") -> None:
        super().__init__(cfg, f"mamba-{backend}", allow_duplicates_within_event=True)
        specs = [g.kv_cache_spec for g in cfg.kvref_groups()]
        self.split_config = MambaSplitConfig.from_specs(specs, cfg.hash_block_size, cfg.block_size, True,
                                                        max_prefill_tokens=cfg.max_num_batched_tokens)
        self.junction: dict[str, int] = {}
        self._tally = backend == "reference"  # count each path once per trace pair
        self._step_extras: tuple[dict, list] = ({}, [])  # the last step's hand-offs and copy pairs
        self._events_counted = 0  # KV events already tallied by observe()

    def _count(self, key: str, n: int = 1) -> None:
        if self._tally:
            MAMBA_COVERAGE[key] += n

    def step(self, chunk: int) -> tuple:
        """:meth:`SimpleOffloadWorld.step` after ``new_step_starts``; returns the metadata with the
        step's hand-offs and copy-on-write pairs."""
        self.b.new_step_starts()
        self._step_extras = ({}, [])
        meta = super().step(chunk)
        return (meta, *self._step_extras)

    # -- the schedule loop's hooks -------------------------------------------------------------

    def _lookup(self, r) -> tuple[Any, int]:
        """The look-up also gives the shared-prefix junction, where chunks stop."""
        hits, n_hit, self.junction[r.rid] = self.b.lookup(r.req)
        self._count("sub_block_local_hit", bool(n_hit % self.cfg.block_size))
        return hits, n_hit

    def _clip(self, r, n: int, n_hit: int) -> int:
        """Chunks end at Mamba state boundaries (vLLM's ``_mamba_block_aligned_split``)."""
        if n <= 0:
            return n
        return mamba_block_aligned_split(self.split_config, r.computed, r.req.num_prompt_tokens, r.req.num_tokens, n,
                                         num_new_local_computed_tokens=n_hit,
                                         shared_prefix_boundary=self.junction.get(r.rid, 0))

    def _wait_for_remote_kvs(self, r, n_hit: int, n_ext: int) -> None:
        self._count("cpu_load")
        super()._wait_for_remote_kvs(r, n_hit, n_ext)

    def _connector_step(self, batch: ScheduledBatch) -> SimpleOffloadStep:
        """The step's hand-offs drained into its ``KVConnectorBlockState``, after which the
        copy-on-write pairs of sub-block hits are released (as ``schedule()`` does)."""
        handoffs = self.b.take_boundary_state_offloads()
        if self.cfg.odd_handoffs and handoffs:
            self._add_odd_handoffs(handoffs)
        copies = self.b.release_kv_cache_block_copies()
        step = super()._connector_step(batch)
        step.boundary_state_offloads = handoffs
        self._count("handoffs", sum(map(len, handoffs.values())))
        self._count("copies", len(copies))
        self._step_extras = (handoffs, copies)
        return step

    def _add_odd_handoffs(self, handoffs: dict) -> None:
        """After the first request's own entries: its first entry again (in flight or on the CPU by
        then), the null block, and its lowest unhashed block if it has one."""
        rid = next(iter(handoffs))
        first = handoffs[rid][0]
        extra = [first, (first[0], 0, first[2])]
        table = self.b.table(rid) if rid in self.reqs and self.reqs[rid].phase != "done" else ()
        unhashed = [b for ids in table for b in ids if b and self.b.gpu_pool.blocks[b].block_hash is None]
        if unhashed:
            extra.append((0, min(unhashed), first[2]))
        handoffs[rid] = list(handoffs[rid]) + extra
        self._count("odd_handoffs", len(extra))
        # and one for a request preempted since the last step: its blocks are being given back
        for gone in sorted(self.preempted_pending - set(handoffs)):
            handoffs[gone] = [first]
            self._count("odd_handoffs")
            break

    def observe(self) -> dict:
        seen = super().observe()
        for (outcome,), n in seen["stats"][2].items():
            self._count(f"outcome:{outcome}", n)
        for e in seen["kv_events"][self._events_counted:]:  # the BlockStored kinds published
            if e["type"] == "BlockStored":
                kind = ("hash_unit_payload" if e["block_size"] == self.cfg.hash_block_size and e["token_ids"]
                        else "block_payload" if e["token_ids"] else f"no_payload_size_{e['block_size']}")
                self._count(f"stored_event:{kind}")
        self._events_counted = len(seen["kv_events"])
        return seen

    def finish(self, rid: str) -> None:
        before = len(self.b.conn._pending_finished_stores)
        super().finish(rid)
        self._count("finish_flush", len(self.b.conn._pending_finished_stores) > before)

    def forget_gpu_prefix_cache(self) -> tuple:
        """Finish every request, flush and deliver every transfer, then reset the GPU prefix cache
        (vLLM's ``reset_prefix_cache`` without the connector): later arrivals of earlier prompts
        can only hit what the CPU pool kept, so they load it back (states included)."""
        for rid in self.live():
            self.finish(rid)
        meta = self.step(1)  # the finish-time flushes go out with the next step's metadata
        while self.stores or self.loads:
            self.complete_store(0, self.cfg.world_size)
            self.complete_load(0)
        ok = self.b.mgr.reset_prefix_cache()
        self._count("gpu_forgotten", ok)
        self._check()
        return meta, ok

    # -- the content model: transfers only (see the module docstring) -------------------------

    def _write_computed(self, r, start: int, end: int) -> None:
        return None

    def _on_stores(self, meta: tuple) -> None:
        _, _, _, store_event, sg, sc, _ = meta
        if store_event < 0:
            return
        busy = {g for t in self.stores.values() if not t.abandoned for g, _ in t.pairs}
        for g in sg:
            if g in busy:
                self._fail(f"GPU block {g} is the source of two in-flight stores (event {store_event})")
        self.stores[store_event] = _Transfer(list(zip(sg, sc)), dict.fromkeys(sg))

    def _on_loads(self, meta: tuple) -> None:
        load_event, lg, lc = meta[:3]
        if load_event < 0:
            return
        owner: dict[int, str] = {}
        for rid in self.live("loading"):
            if rid not in self.load_event_of:
                owner.update((bid, rid) for ids in self.b.table(rid) for bid in ids if bid != 0)
        per_req: dict[str, list[tuple[int, int]]] = {}
        for gid, cid in zip(lg, lc):
            if gid not in owner:
                self._fail(f"load event {load_event} writes GPU block {gid}, no loading request owns it")
            per_req.setdefault(owner[gid], []).append((gid, cid))
        for rid, pairs in per_req.items():
            self.load_event_of[rid] = load_event
            self.loads[rid] = _Transfer(pairs, {g: None for g, _ in pairs})


def simple_mamba_cases(seed: int, n: int) -> list:
    """``n`` random Mamba-align configurations with engine traces (``random_ops``)."""
    import random

    from kvref.models.offload.traces import random_ops

    rng = random.Random(f"simple-cpu-mamba-{seed}")
    cases = []
    for _ in range(n):
        cfg = SimpleOffloadMambaConfig.random(rng)
        ops = random_ops(rng, rng.randint(30, 60))
        ops.insert(rng.randint(10, len(ops)), _FORGET)
        cases.append((cfg, ops + _reload_tail(rng)))
    return cases


_FORGET = ("forget", 0, 0, 0, 0, 0, 0, 0, False)


def _reload_tail(rng) -> list:
    """Forget the GPU prefix cache, then ask for earlier prompts again (cut to a block boundary, or a
    shared prefix with a new tail) and run them: their hits come from the CPU pool."""
    pick = rng.randint(0, 99)
    return [_FORGET, ("add", 0, 13, 0, 8, rng.choice([1, 4]), pick, 2, True),
            ("add", rng.choice([0, 1]), rng.choice([13, 30, 20]), rng.randint(0, 3), 8, 2, pick // 3, 1, False),
            ("step", 0, 13, 0, rng.choice([8, 64]), 3, pick, 1, False), ("drain", 0, 13, 0, 8, 1, pick, 2, True),
            ("step", 0, 13, 0, 8, 3, pick, 1, False)]


def apply_mamba_op(w: SimpleOffloadMambaWorld, op):
    """:func:`~kvref.models.offload.traces.apply_op`, plus ``"forget"`` (:meth:`SimpleOffloadMambaWorld.forget_gpu_prefix_cache`)."""
    from kvref.models.offload.traces import apply_op

    return w.forget_gpu_prefix_cache() if op[0] == "forget" else apply_op(w, op)


def run_simple_mamba_traces(cases) -> dict:
    """Run ``cases`` on the reference and on vLLM; raises :class:`OffloadInvariantError` (or the
    world's ``AssertionError``) at the first difference, with the trace position."""
    stats = {"traces": 0, "ops": 0}
    for i, (cfg, ops) in enumerate(cases):
        worlds = [SimpleOffloadMambaWorld(cfg, b) for b in ("reference", "vllm")]
        stats["traces"] += 1
        for j, op in enumerate(ops):
            try:
                outs = [apply_mamba_op(w, op) for w in worlds]
            except AssertionError as exc:
                raise type(exc)(f"SimpleCPU Mamba trace {i} op {j} {op} on {cfg}: {exc}") from exc
            stats["ops"] += 1
            if outs[0] != outs[1]:
                raise OffloadInvariantError(f"SimpleCPU Mamba trace {i} op {j} {op} on {cfg}: the step outputs differ: "
                                            f"reference {outs[0]!r}"[:700] + f" / vLLM {outs[1]!r}"[:700])
            seen = [w.observe() for w in worlds]
            if seen[0] != seen[1]:
                diff = sorted(k for k in seen[0] if seen[0][k] != seen[1].get(k))
                raise OffloadInvariantError(
                    f"SimpleCPU Mamba trace {i} op {j} {op} on {cfg}: the observed state differs in {diff}: "
                    + "; ".join(f"{k}: reference {seen[0][k]!r} / vLLM {seen[1][k]!r}"[:500] for k in diff))
    return stats
