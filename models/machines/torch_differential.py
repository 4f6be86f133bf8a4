"""Differential state machine: the torch implementation against another implementation.

Both get the same generated pool config and the same scheduler-like operations (admit a waiting
request with its prefix hit, run the next prefill chunk or a decode step, settle in-flight
tokens, preempt, finish). After every step the machine asserts that both answered identically:
admission decision, hit tokens and hit block ids, newly allocated block ids, every live block
table, free count, free-queue order, cached hashes (and, where the other side exposes them, the
whole hash map and ref counts). Block ids must match exactly, not up to renaming.

``make_differential_machine(other_factory)`` returns a ``RuleBasedStateMachine`` class; the
other implementation is vLLM's ``KVCacheManager`` (behind
:class:`kvref.impl.vllm.kv_cache_manager.VllmKVCacheManager`) or the reference
(``kvref.impl.reference.adapter``).
"""

from __future__ import annotations

from typing import Callable

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvref.impl.interface import PoolConfig
from kvref.impl.request import Request, RequestStatus
from kvref.spec.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)

SPEC_KW = dict(num_kv_heads=1, head_size=2, dtype="float32")
#: group layouts drawn: uniform and hybrid
LAYOUTS = ("fa", "swa", "chunked", "fa+swa", "fa+chunked", "fa+swa+swa", "swa+chunked", "fa+fa",
           "mamba", "fa+mamba", "fa+swa+mamba")
#: layouts the attention data path can run (no Mamba groups)
ATTENTION_LAYOUTS = tuple(lay for lay in LAYOUTS if "mamba" not in lay)


@st.composite
def pool_configs(draw, layouts=LAYOUTS, aligned_chunks: bool = False) -> PoolConfig:
    """Small pools over the modelled group types, uniform or hybrid.

    ``aligned_chunks`` draws chunk sizes that are multiples of the block size, as vLLM's workers
    require (``make_local_attention_virtual_batches`` asserts it); the bookkeeping alone accepts any.
    """
    layout = draw(st.sampled_from(layouts))
    kinds = layout.split("+")
    hybrid = len(kinds) > 1
    if hybrid:
        hbs = 2
        sbs = draw(st.sampled_from([2, 4]))
    else:
        hbs = sbs = draw(st.sampled_from([2, 4]))
    groups = []
    for i, k in enumerate(kinds):
        bs = sbs if (not hybrid or k == "chunked") else draw(st.sampled_from(sorted({hbs, sbs})))
        if k == "fa":
            spec = FullAttentionSpec(block_size=bs, **SPEC_KW)
        elif k == "swa":
            spec = SlidingWindowSpec(block_size=bs, sliding_window=draw(st.integers(1, 12)), **SPEC_KW)
        elif k == "mamba":
            spec = MambaSpec(block_size=bs, shapes=((2, 2),), dtypes=("float32",), mamba_cache_mode="none",
                             num_speculative_blocks=draw(st.integers(0, 2)))
        else:
            chunk = draw(st.sampled_from([bs, 2 * bs, 3 * bs] if aligned_chunks else [4, 6, 8]))
            spec = ChunkedLocalAttentionSpec(block_size=bs, attention_chunk_size=chunk, **SPEC_KW)
        groups.append(KVCacheGroupSpec((f"g{i}",), spec, is_eagle_group=hybrid and draw(st.booleans())
                                       and not draw(st.booleans())))
    return PoolConfig.off_plan(
        "generated pools aim at admission edges (a block short, a block spare) startup never sizes",
        num_blocks=draw(st.integers(4, 28)),
        groups=tuple(groups),
        max_model_len=draw(st.integers(12, 40)),
        scheduler_block_size=sbs,
        hash_block_size=hbs,
        max_in_flight_tokens=draw(st.one_of(st.none(), st.integers(1, 12))),
        # Mamba prefix caching needs "align" mode, which is not modelled: Mamba pools run uncached.
        enable_caching=("mamba" not in kinds) and (draw(st.booleans()) or draw(st.booleans())),
        watermark=draw(st.sampled_from([0.0, 0.0, 0.1, 0.25])),
        use_eagle="chunked" not in kinds and draw(st.sampled_from([False, False, True])),
    )


def data_path_ok(cfg: PoolConfig) -> bool:
    """Whether the attention data path can run this pool (attention groups, chunk sizes that are
    multiples of the block size, as vLLM's workers require)."""
    for g in cfg.groups:
        s = g.kv_cache_spec
        if isinstance(s, MambaSpec):
            return False
        if isinstance(s, ChunkedLocalAttentionSpec) and s.attention_chunk_size % s.block_size:
            return False
    return True


def make_differential_machine(other_factory: Callable[[PoolConfig], object],
                              torch_factory: Callable[[PoolConfig], object] | None = None,
                              deep: bool = True, datapath: bool = False,
                              attention_backend: str = "torch") -> type[RuleBasedStateMachine]:
    """A machine comparing ``torch_factory(cfg)`` (default: the torch implementation on CPU) with
    ``other_factory(cfg)``. ``deep`` also compares ``hash_index()`` and ``ref_counts()``.
    ``datapath`` also runs every scheduled chunk through the torch data path (float64) and asserts
    paged attention equals dense attention; connector tokens are written as a load.
    ``attention_backend`` (``"torch"`` or ``"triton"``) runs that data path's K/V writes and paged
    attention through the torch ops or the Triton kernels (``kvref.impl.torch.triton_kernels``)."""
    if datapath:
        from kvref.impl.torch.triton_kernels import check_backend

        check_backend("attention_backend", attention_backend)

    if torch_factory is None:
        from kvref.impl.torch import make_manager

        def torch_factory(cfg):  # noqa: E306
            return make_manager(cfg, device="cpu")

    class TorchDifferential(RuleBasedStateMachine):
        @initialize(cfg=pool_configs(), bases=st.lists(st.lists(st.integers(0, 3), min_size=12, max_size=40),
                                                       min_size=1, max_size=3))
        def setup(self, cfg, bases):
            self.cfg = cfg
            self.bases = bases
            self.t = torch_factory(cfg)
            self.o = other_factory(cfg)
            self.reqs: dict[str, Request] = {}
            self.waiting: list[str] = []
            self.running: list[str] = []
            self.n = 0
            self.runner = None
            if datapath and data_path_ok(cfg):
                import torch

                from kvref.impl.torch.model_runner import DataPathRunner
                self.runner = DataPathRunner(self.t, dtype=torch.float64, attention_backend=attention_backend)

        # ------------------------------------------------------------ helpers
        def both(self, name, *args, **kw):
            a = getattr(self.t, name)(*args, **kw)
            b = getattr(self.o, name)(*args, **kw)
            assert a == b, f"{name}{args}: torch {a!r} != other {b!r}"
            return a

        def _compute(self, req: Request, start: int, n: int, loaded: int = 0) -> None:
            """Run the data path for a successful allocation (connector tokens first)."""
            if self.runner is None:
                return
            from kvref.impl.torch.model_runner import Chunk

            if loaded:
                self.runner.write_only([Chunk(req, start - loaded, loaded)])
            if n:
                err = self.runner.max_error([Chunk(req, start, n)])
                assert err <= 1e-10, f"paged attention differs from dense by {err} ({req.request_id} @ {start})"

        def _step_tokens(self, req: Request, budget: int) -> int:
            return min(req.num_tokens - req.num_computed_tokens, budget)

        # ------------------------------------------------------------ rules
        @rule(data=st.data())
        def add_request(self, data):
            base = data.draw(st.sampled_from(self.bases))
            cut = data.draw(st.integers(0, len(base)))
            tail = data.draw(st.lists(st.integers(0, 3), max_size=10))
            prompt = (base[:cut] + tail)[: self.cfg.max_model_len - 1] or [0]
            max_tokens = data.draw(st.integers(1, max(1, self.cfg.max_model_len - len(prompt))))
            salt = data.draw(st.sampled_from([None, None, None, "s"]))
            rid = f"r{self.n}"
            self.n += 1
            self.reqs[rid] = Request(rid, prompt, max_tokens=max_tokens, cache_salt=salt)
            self.waiting.append(rid)

        @precondition(lambda self: self.waiting)
        @rule(data=st.data())
        def admit(self, data):
            rid = self.waiting[0]
            req = self.reqs[rid]
            ids, hit = self.both("get_computed_blocks", req)
            budget = data.draw(st.integers(1, 16))
            # Sometimes a connector supplies more tokens (external, possibly loaded asynchronously).
            ext = data.draw(st.sampled_from([0, 0, 0, 0, 1, 2, 4, 8]))
            ext = max(0, min(ext, req.num_tokens - hit - 1))
            delay = ext > 0 and data.draw(st.booleans())
            new = 0 if delay else max(0, min(req.num_tokens - hit - ext, budget))
            if new == 0 and hit == 0 and ext == 0:
                new = 1
            kw = dict(num_new_computed_tokens=hit, new_computed_block_ids=ids,
                      num_external_computed_tokens=ext, delay_cache_blocks=delay,
                      num_lookahead_tokens=data.draw(st.sampled_from([0, 0, 0, 1, 2])),
                      full_sequence_must_fit=data.draw(st.booleans()),
                      reserved_blocks=data.draw(st.sampled_from([0, 0, 1, 3])),
                      has_scheduled_reqs=bool(self.running))
            out = self.both("allocate_slots", req, new, **kw)
            if out is None:
                return
            self.waiting.pop(0)
            self.running.append(rid)
            req.status = RequestStatus.RUNNING
            self._compute(req, hit + ext, new, loaded=ext)
            req.num_computed_tokens = hit + ext + new
            req.num_in_flight_tokens = new if data.draw(st.booleans()) else 0

        @precondition(lambda self: self.running)
        @rule(data=st.data())
        def step(self, data):
            self._advance(data.draw(st.sampled_from(self.running)), data)

        def _advance(self, rid, data):
            req = self.reqs[rid]
            if req.num_computed_tokens >= req.num_tokens:
                if req.num_tokens >= self.cfg.max_model_len or len(req.output_token_ids) >= req.max_tokens:
                    return self._finish(rid)
                req.output_token_ids.append(data.draw(st.integers(0, 3)))
            new = self._step_tokens(req, data.draw(st.integers(1, 16)))
            out = self.both("allocate_slots", req, new,
                            num_lookahead_tokens=data.draw(st.sampled_from([0, 0, 1])))
            if out is None:
                # vLLM preempts the newest running request; here the stepped one is preempted.
                return self._preempt(rid)
            self._compute(req, req.num_computed_tokens, new)
            req.num_computed_tokens += new
            req.num_in_flight_tokens = min(req.num_in_flight_tokens + new, req.num_computed_tokens) \
                if data.draw(st.booleans()) else 0

        @rule(data=st.data())
        def schedule(self, data):
            """One scheduler-like step: every running request advances, then waiting ones are admitted
            (FCFS, stop at the first that does not fit), then in-flight tokens may settle."""
            for rid in list(self.running):
                if rid in self.running:
                    self._advance(rid, data)
            for _ in range(len(self.waiting)):
                before = len(self.waiting)
                self.admit(data)
                if len(self.waiting) == before:
                    break
            if data.draw(st.booleans()):
                for rid in self.running:
                    self.reqs[rid].num_in_flight_tokens = 0

        @precondition(lambda self: self.running)
        @rule(data=st.data())
        def settle(self, data):
            self.reqs[data.draw(st.sampled_from(self.running))].num_in_flight_tokens = 0

        @precondition(lambda self: self.running)
        @rule(data=st.data())
        def preempt(self, data):
            self._preempt(data.draw(st.sampled_from(self.running)))

        @precondition(lambda self: self.running or self.waiting)
        @rule(data=st.data())
        def finish(self, data):
            self._finish(data.draw(st.sampled_from(self.running + self.waiting)))

        def _preempt(self, rid):
            req = self.reqs[rid]
            self.both("free", req)
            self.running.remove(rid)
            self.waiting.insert(0, rid)
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            req.num_in_flight_tokens = 0
            req.num_preemptions += 1

        def _finish(self, rid):
            req = self.reqs[rid]
            self.both("free", req)
            (self.running if rid in self.running else self.waiting).remove(rid)
            req.status = RequestStatus.FINISHED

        # ------------------------------------------------------------ invariants
        @invariant()
        def same_state(self):
            if not hasattr(self, "t"):
                return
            assert self.t.get_num_free_blocks() == self.o.get_num_free_blocks()
            assert self.t.free_block_queue() == self.o.free_block_queue(), "free-queue order differs"
            assert self.t.cached_blocks() == self.o.cached_blocks(), "cached hashes differ"
            for rid in self.running + self.waiting:
                assert self.t.get_block_ids(rid) == self.o.get_block_ids(rid), f"block table of {rid}"
            if deep and hasattr(self.o, "hash_index"):
                assert self.t.hash_index() == self.o.hash_index(), "hash map differs"
            if deep and hasattr(self.o, "ref_counts"):
                assert self.t.ref_counts() == self.o.ref_counts(), "ref counts differ"
            self.t.check_invariants()
            self.o.check_invariants()

    return TorchDifferential
