"""vLLM's ``MultiConnector`` on both sides of an engine step vs the reference
(:mod:`kvref.impl.reference.multi_connector_worker`), on generated traces (issue #22).

A trace: 1-3 scripted children, 1-2 tensor-parallel ranks (one WORKER ``MultiConnector`` each, one
SCHEDULER one), KV caches registered, then steps. In each step requests finish (each child
answers whether it saves asynchronously and its ``kv_transfer_params``), the scheduler builds the
metadata, every rank binds it and runs the forward-pass hooks (loads, per-layer waits and saves,
preemptions), then reports: each child finishes some of the saves it owes on that rank and some
loads, names failed blocks and may hand worker metadata up; vLLM's ``KVOutputAggregator`` merges
the ranks and the scheduler's ``update_connector_output`` hands each child its part. Setup and
teardown add the memory-pool context, the handshake metadata, the finished count and a shutdown
in which children fail.

Oracles, after every call: the answer and every child's call log equal the reference's, and the
extra-async-save counts on every instance agree; independently of the reference, a rank reports a
request as finished sending exactly when the last child that saves it has reported it there, and
the aggregate exactly when the last rank has. The merged stats then take the engine's way to the
logger and the metrics endpoint (:class:`_LoggingSide`), compared with the reference's after
every step.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from kvref.impl.reference.connector_worker_child import ChildShutdownError, ScriptedWorkerChild
from kvref.impl.reference.multi_connector_worker import MultiConnectorModel, RankOutputAggregator, aggregate_multi_stats


class MultiWorkerDivergence(AssertionError):
    """vLLM's MultiConnector and the reference (or the independent send oracle) disagree."""


@dataclass(frozen=True)
class MultiWorkerCase:
    num_children: int
    world_size: int
    num_layers: int
    steps: int
    seed: int

    @classmethod
    def random(cls, rng: random.Random) -> MultiWorkerCase:
        return cls(num_children=rng.randint(1, 3), world_size=rng.randint(1, 2), num_layers=rng.randint(1, 2),
                   steps=rng.randint(3, 9), seed=rng.randrange(2**31))


def _outcome(fn) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except (ValueError, RuntimeError, AssertionError) as exc:  # compared by type: the messages are vLLM's
        return "raised", type(exc).__name__


class _Pair:
    """The reference and vLLM instances side by side, with their children's scripts."""

    def __init__(self, case: MultiWorkerCase) -> None:
        from kvref.impl.vllm import multi_connector_worker as vmw

        self.vmw = vmw
        n, w = case.num_children, case.world_size
        rng = random.Random(f"class-{case.seed}")  # each child's class-level answers
        traits = [dict(kv_cache_layout=rng.choice([None, None, "HND", "NHD"]), sleep_mode=rng.random() < 0.7,
                       piecewise_cudagraph=rng.random() < 0.3) for _ in range(n)]
        self.kids_ref = [[ScriptedWorkerChild(i, **traits[i]) for i in range(n)] for _ in range(w + 1)]  # [0]: scheduler
        self.kids_vllm = [[ScriptedWorkerChild(i, **traits[i]) for i in range(n)] for _ in range(w + 1)]
        self.ref = [MultiConnectorModel(k) for k in self.kids_ref]
        self.vllm = [vmw.build_multi_connector(self.kids_vllm[0], "scheduler", w)]
        self.vllm += [vmw.build_multi_connector(k, "worker", w) for k in self.kids_vllm[1:]]
        self.where = ""

    def answer(self, inst: int, name: str, answers: list) -> None:
        for side in (self.kids_ref, self.kids_vllm):
            for child, a in zip(side[inst], answers):
                child.answers[name] = a

    def both(self, what: str, ref_fn, vllm_fn, norm=lambda x: x) -> Any:
        self.where = what
        r = _outcome(ref_fn)
        v = _outcome(vllm_fn)
        if r[0] == "ok" and v[0] == "ok":
            v = ("ok", norm(v[1]))
        if r != v:
            raise MultiWorkerDivergence(f"{what}: reference {r!r}, vLLM {v!r}")
        self.compare(what)
        return r

    def compare(self, what: str) -> None:
        for inst, (kr, kv) in enumerate(zip(self.kids_ref, self.kids_vllm)):
            for i, (a, b) in enumerate(zip(kr, kv)):
                if a.calls != b.calls:
                    k = next(j for j in range(max(len(a.calls), len(b.calls)))
                             if a.calls[j:j + 1] != b.calls[j:j + 1])
                    raise MultiWorkerDivergence(
                        f"after {what}: child {i} of {'the scheduler' if inst == 0 else f'rank {inst - 1}'} was "
                        f"called differently at call {k}: reference {a.calls[k:k + 3]}, vLLM {b.calls[k:k + 3]}")
            if self.ref[inst].extra_async_saves != self.vllm[inst]._extra_async_saves:
                raise MultiWorkerDivergence(
                    f"after {what}: extra async saves of instance {inst}: reference "
                    f"{self.ref[inst].extra_async_saves}, vLLM {self.vllm[inst]._extra_async_saves}")
            self.ref[inst].check_invariants()


#: a child class of vLLM's that is not ``SupportsHMA`` (for ``all_children_support_hma``)
NOT_HMA_CHILD = {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}


class _LoggingSide:
    """The stats' way from the scheduler to the logger process and the metrics endpoint, vLLM's
    classes against the reference's stats (#22): ``MultiKVConnectorStats.to_dict`` (the payload
    of ``SchedulerStats``), ``KVConnectorLogging`` rebuilding it by connector class name
    (``MultiConnector.build_kv_connector_stats``; the scripted child rebuilds nothing from an
    interval without jobs), accumulating intervals (``MultiKVConnectorStats.aggregate``) and
    logging them, and ``KVConnectorProm`` (``MultiConnector.build_prom_metrics``: one metrics
    object per child class) handing each class its part of the payload. Once per trace also what
    the engine asks the class or the connector about its children: ``all_children_support_hma``
    and the cache-hit sources of a request no child offered tokens for."""

    def __init__(self, p: _Pair, rng: random.Random) -> None:
        self.p, self.rng, self.vmw = p, rng, p.vmw
        multi = p.vllm[0]
        self.logging = self.vmw.connector_logging(multi)
        self.engines = rng.randint(1, 3)
        self.prom, built = self.vmw.connector_prom(multi, self.engines)
        if len(built) != 1:
            raise MultiWorkerDivergence(f"build_prom_metrics built {len(built)} metrics objects for "
                                        f"{len(multi._connectors)} children of one class; expected one")
        self.child_prom = built[0]
        self.observed: list[tuple[dict, int]] = []
        self.acc: dict | None = None  # the reference's accumulated interval
        self.observes = 0
        self.logged = 0
        # no child offered tokens for a request (the scripted children offer none): the external
        # tokens are reported as from an unspecified source, none for no tokens (base connector's rule)
        for n in (0, rng.randint(1, 64)):
            got_src = {getattr(k, "value", k): v for k, v in
                       multi.get_external_cache_hit_sources(self.vmw.request(f"hits-{n}"), n).items()}
            if got_src != ({"external_unspecified": n} if n else {}):
                raise MultiWorkerDivergence(f"get_external_cache_hit_sources with no chosen child, {n} tokens: "
                                            f"{got_src}")
        kids = [dict(c) for c in multi._vllm_config.kv_transfer_config.kv_connector_extra_config["connectors"]]
        at = rng.randrange(len(kids) + 1)
        mixed = kids[:at] + [NOT_HMA_CHILD] + kids[at:]
        for extra, want in ((None, True), ([], False), (mixed, False)):
            got = self.vmw.children_support_hma(multi, extra)
            if got != want:
                raise MultiWorkerDivergence(f"all_children_support_hma with children "
                                            f"{'as configured' if extra is None else extra}: {got}, expected {want}")
        # beside a child class without Prometheus metrics (vLLM's ExampleConnector): only the
        # scripted class gets metrics, and a payload hands it its own part only
        prom, built = self.vmw.connector_prom(multi, 1, mixed)
        payload = {self.vmw.CLASS_NAME: {"jobs": at + 1}, NOT_HMA_CHILD["kv_connector"]: {"jobs": 7}}
        prom.observe(payload, 0)
        if len(built) != 1 or built[0].observed != [({"jobs": at + 1}, 0)]:
            raise MultiWorkerDivergence(f"build_prom_metrics beside a class without metrics built {len(built)} "
                                        f"metrics objects; observed {[b.observed for b in built]}")

    def step(self, step: int, payload: dict | None, ref_stats: dict | None, last: bool) -> None:
        """``payload``: vLLM's ``MultiKVConnectorStats.to_dict()`` of the ranks' merged stats."""
        vmw = self.vmw
        want = None if ref_stats is None else {vmw.CLASS_NAME: dict(v) for v in ref_stats.values()}
        if payload != want:
            raise MultiWorkerDivergence(f"step {step}: SchedulerStats payload {payload}, the reference's {want}")
        if payload is not None:  # the metrics endpoint gets every payload, with the engine's index
            engine = self.rng.randrange(self.engines)
            foreign = {"OffloadingConnector": {"jobs": step}}  # a class with no metrics here: skipped
            self.prom.observe({**payload, **foreign} if self.rng.random() < 0.5 else payload, engine)
            self.observed += [(dict(v), engine) for k, v in payload.items() if k == vmw.CLASS_NAME]
            if self.child_prom.observed != self.observed:
                raise MultiWorkerDivergence(f"step {step}: the child's Prometheus metrics observed "
                                            f"{self.child_prom.observed[-3:]}, expected {self.observed[-3:]}")
        if payload:  # the logger's interval accumulator
            self.logging.observe(payload)
            self.observes += 1
            rebuilt = {k: v for k, v in payload.items() if not vmw.nothing_to_log(v)}
            self.acc = rebuilt if self.acc is None else aggregate_multi_stats(self.acc, rebuilt)
        if last or self.rng.random() < 0.3:
            self._log(step)

    def _log(self, step: int) -> None:
        acc = self.logging.transfer_stats_accumulator
        got = None if acc is None else {k: dict(v) for k, v in acc.reduce().items()}
        if got != self.acc:
            raise MultiWorkerDivergence(f"step {step}: the logger accumulated {got}, the reference {self.acc}")
        lines: list[tuple] = []
        self.logging.log(log_fn=lambda *args: lines.append(args))
        expect = self.acc is not None and any(any(v.values()) for v in self.acc.values())
        if len(lines) != int(expect) or (lines and any(f"{k}=" not in lines[0][1] for k in self.acc)):
            raise MultiWorkerDivergence(f"step {step}: the logger logged {lines} for the interval {self.acc}")
        self.logged += len(lines)
        if expect:  # a logged interval starts afresh; an empty one goes on accumulating
            self.acc = None
        if (self.logging.transfer_stats_accumulator is None) != (self.acc is None):
            raise MultiWorkerDivergence(f"step {step}: the logger's interval {'not ' if expect else ''}reset after "
                                        f"{'logging' if expect else 'an empty interval'}")


def _maybe(rng: random.Random, p: float, value: Any) -> Any:
    return value if rng.random() < p else None


def run_multi_worker_trace(case: MultiWorkerCase) -> dict:
    """Run one trace; raises :class:`MultiWorkerDivergence` at the first difference."""
    import torch

    rng = random.Random(case.seed)
    p = _Pair(case)
    vmw = p.vmw
    n, w = case.num_children, case.world_size
    ranks = range(1, w + 1)
    stats = {"calls": 0, "sends_finished": 0, "extra_saves": 0, "raised": 0, "logged": 0, "prom_observed": 0}
    layers = [f"model.layers.{i}.attn" for i in range(case.num_layers)]
    caches = {name: torch.zeros(2, 4, 8) for name in layers}

    def copy_blocks(*args):  # the host-buffer copy op a platform hands the connectors
        return None

    # ---- what the engine asks the class before building anything -----------------------------------
    ref0 = p.ref[0]
    want = (_outcome(ref0.required_kvcache_layout), ref0.supports_sleep_mode(), ref0.requires_piecewise_for_cudagraph())
    want = (want[0][1] if want[0][0] == "ok" else ValueError, want[1], want[2])
    got = vmw.class_answers(p.vllm[0])
    if got != want:
        raise MultiWorkerDivergence(f"class-level answers (layout, sleep mode, piecewise): reference {want}, "
                                    f"vLLM {got}")
    # ---- setup: what a worker does once -----------------------------------------------------------
    for r in ranks:
        p.both("register_kv_caches", lambda r=r: p.ref[r].forward("register_kv_caches", tuple(sorted(caches))),
               lambda r=r: p.vllm[r].register_kv_caches(caches))
        p.both("set_host_xfer_buffer_ops", lambda r=r: p.ref[r].forward("set_host_xfer_buffer_ops", "copy_blocks"),
               lambda r=r: p.vllm[r].set_host_xfer_buffer_ops(copy_blocks))
        p.answer(r, "get_mem_pool_context", [_maybe(rng, 0.3, f"pool-{i}") for i in range(n)])
        stats["raised"] += p.both("get_mem_pool_context", p.ref[r].get_mem_pool_context,
                                  p.vllm[r].get_mem_pool_context)[0] == "raised"
        p.answer(r, "get_handshake_metadata", [_maybe(rng, 0.4, f"hs-{r}-{i}") for i in range(n)])
        p.both("get_handshake_metadata", p.ref[r].get_handshake_metadata, p.vllm[r].get_handshake_metadata)
        hs = {rank - 1: f"hs-{rank}" for rank in ranks}
        p.both("set_xfer_handshake_metadata",
               lambda r=r: p.ref[r].forward("set_xfer_handshake_metadata", tuple(sorted(hs.items()))),
               lambda r=r: p.vllm[r].set_xfer_handshake_metadata(hs))
    hs_pp = {(rank - 1, 0): f"hs-pp-{rank}" for rank in ranks}
    for r in ranks:
        p.both("set_xfer_handshake_metadata_pp_aware",
               lambda r=r: p.ref[r].forward("set_xfer_handshake_metadata_pp_aware", tuple(sorted(hs_pp.items()))),
               lambda r=r: p.vllm[r].set_xfer_handshake_metadata_pp_aware(hs_pp))
    pool = vmw.block_pool(rng.randint(4, 16))  # the scheduler binds its GPU block pool to the connector
    p.both("bind_gpu_block_pool", lambda: p.ref[0].forward("bind_gpu_block_pool", pool.num_gpu_blocks),
           lambda: p.vllm[0].bind_gpu_block_pool(pool))
    # the engine sizes its output aggregator from the connector's finished count (None: world size)
    counts = [rng.choice([None, w, w, w + 1]) for _ in range(n)]
    p.answer(1, "get_finished_count", counts)
    stats["raised"] += p.both("get_finished_count", p.ref[1].get_finished_count,
                              p.vllm[1].get_finished_count)[0] == "raised"
    p.answer(1, "get_finished_count", [w] * n)  # as the engine is built: every rank reports
    aggs: list = []
    p.both("KVOutputAggregator.from_connector",
           lambda: aggs.append(RankOutputAggregator.from_connector(p.ref[1], w)) or aggs[-1].expected,
           lambda: aggs.append(vmw.kv_output_aggregator(p.vllm[1], w)) or aggs[-1]._expected_finished_count)
    agg_ref, agg_vllm = aggs
    side = random.Random(f"logging-{case.seed}")  # draws of the logging side, apart from the trace's
    logging_side = _LoggingSide(p, side)

    # ---- steps ------------------------------------------------------------------------------------
    saving: dict[str, set[int]] = {}  # request -> children that save it asynchronously
    owed = [[set() for _ in range(n)] for _ in range(w + 1)]  # [rank][child]: saves still to report
    reported = [dict() for _ in range(w + 1)]  # [rank]: request -> children that reported it
    rank_done: dict[str, int] = {}  # request -> ranks that reported it finished
    next_req = 0
    for step in range(case.steps):
        finished = []
        for _ in range(rng.choice([0, 1, 1, 2])):
            rid = f"req-{next_req}"
            next_req += 1
            clash = rng.random() < 0.05
            answers = [(rng.random() < 0.6, {"k": i} if clash else _maybe(rng, 0.5, {f"k{i}": rid}))
                       for i in range(n)]
            p.answer(0, "request_finished", answers)
            # one KV cache group: the engine calls either form; both ask every child (#22)
            one_group = side.random() < 0.3
            out = p.both(f"request_finished({rid})", lambda rid=rid: p.ref[0].request_finished(rid),
                         lambda rid=rid: p.vllm[0].request_finished(vmw.request(rid), []) if one_group
                         else p.vllm[0].request_finished_all_groups(vmw.request(rid), ([],)))
            stats["calls"] += 1
            if out[0] == "raised":
                stats["raised"] += 1
                return stats  # the engine stops at a key clash
            saving[rid] = {i for i, (s, _) in enumerate(answers) if s}
            stats["extra_saves"] += max(0, len(saving[rid]) - 1)
            finished.append(rid)
        if rng.random() < 0.2:
            p.answer(0, "register_finished_partial_tail", [rng.random() < 0.3 for _ in range(n)])
            p.both("register_finished_partial_tail", lambda: p.ref[0].register_finished_partial_tail("tail"),
                   lambda: p.vllm[0].register_finished_partial_tail(vmw.request("tail"), ([],), []))
        meta_ref_v: list = []
        p.both("build_connector_meta", lambda: meta_ref_v.append(p.ref[0].build_connector_meta(tuple(sorted(finished))))
               or meta_ref_v[-1],
               lambda: meta_ref_v.append(p.vllm[0].build_connector_meta(vmw.scheduler_output(finished)))
               or vmw.multi_metadata(meta_ref_v[-1]))
        meta_ref, meta_vllm = meta_ref_v
        for rid in finished:
            for r in ranks:
                for i in saving[rid]:
                    owed[r][i].add(rid)
        outputs_ref, outputs_vllm = [], []
        preempted = rng.random() < 0.25
        for r in ranks:
            ref, vm = p.ref[r], p.vllm[r]
            p.both("bind_connector_metadata", lambda: ref.bind_connector_metadata(meta_ref),
                   lambda: vm.bind_connector_metadata(meta_vllm))
            if preempted:
                p.both("handle_preemptions", lambda: ref.handle_preemptions(meta_ref),
                       lambda: vm.handle_preemptions(meta_vllm))
            fc = f"forward-{step}"
            p.both("start_load_kv", lambda: ref.forward("start_load_kv", fc), lambda: vm.start_load_kv(fc))
            for name in layers:
                p.both("wait_for_layer_load", lambda: ref.forward("wait_for_layer_load", name),
                       lambda: vm.wait_for_layer_load(name))
                p.both("save_kv_layer", lambda: ref.forward("save_kv_layer", (name, tuple(caches[name].shape))),
                       lambda: vm.save_kv_layer(name, caches[name], None))
            p.both("wait_for_save", lambda: ref.forward("wait_for_save"), vm.wait_for_save)
            p.both("finish_forward", lambda: ref.forward("finish_forward"), vm.finish_forward)
            if rng.random() < 0.2:
                p.both("reset_capture_state", lambda: ref.forward("reset_capture_state"), vm.reset_capture_state)
            # each child finishes some of the saves it owes here, and some loads
            answers = []
            for i in range(n):
                done = [rid for rid in sorted(owed[r][i]) if rng.random() < 0.5]  # sorted: str hashes vary
                owed[r][i] -= set(done)
                loads = [f"load-{step}-{k}" for k in range(rng.randint(0, 2))]
                answers.append((set(done) if done else rng.choice([None, set()]), set(loads) if loads else None))
            p.answer(r, "get_finished", answers)
            fin_ids = frozenset(finished)
            if rng.random() < 0.5:
                got = p.both("get_finished", lambda: ref.get_finished(fin_ids), lambda: vm.get_finished(set(fin_ids)),
                             lambda x: tuple(None if s is None else frozenset(s) for s in x))[1]
                sending, recving = got
            else:
                got = p.both("get_transfer_results", lambda: ref.get_transfer_results(fin_ids),
                             lambda: vm.get_transfer_results(set(fin_ids)),
                             lambda x: (frozenset(x.finished_sending), frozenset(x.finished_recving),
                                        frozenset(x.failed_recving)))[1]
                sending, recving = got[0], got[1]
            # the independent oracle: finished sending here = every saving child has reported it here
            expect = set()
            for i, (done, _) in enumerate(answers):
                for rid in done or ():
                    reported[r].setdefault(rid, set()).add(i)
                    if reported[r][rid] == saving[rid]:
                        expect.add(rid)
            if set(sending or ()) != expect:
                raise MultiWorkerDivergence(f"rank {r - 1} step {step}: vLLM's MultiConnector reported "
                                            f"{sorted(sending or ())} finished sending; the children that save them "
                                            f"have finished {sorted(expect)}")
            stats["sends_finished"] += len(expect)
            p.answer(r, "get_block_ids_with_load_errors",
                     [frozenset(rng.sample(range(1, 9), rng.randint(0, 2))) for _ in range(n)])
            invalid = p.both("get_block_ids_with_load_errors", ref.get_block_ids_with_load_errors,
                             vm.get_block_ids_with_load_errors, frozenset)[1]
            p.answer(r, "get_kv_connector_stats",
                     [_maybe(rng, 0.5, {"jobs": rng.randint(0, 3), "bytes": rng.randint(0, 64)}) for _ in range(n)])
            st_ref_v: list = []
            p.both("get_kv_connector_stats", lambda: st_ref_v.append(ref.get_kv_connector_stats()) or st_ref_v[-1],
                   lambda: st_ref_v.append(vm.get_kv_connector_stats()) or vmw.multi_stats(st_ref_v[-1]))
            p.answer(r, "build_connector_worker_meta",
                     [_maybe(rng, 0.5, ((r - 1, i, step),)) for i in range(n)])
            wm_ref_v: list = []
            p.both("build_connector_worker_meta", lambda: wm_ref_v.append(ref.build_connector_worker_meta())
                   or wm_ref_v[-1], lambda: wm_ref_v.append(vm.build_connector_worker_meta())
                   or vmw.worker_meta_items(wm_ref_v[-1]))
            p.both("clear_connector_metadata", ref.clear_connector_metadata, vm.clear_connector_metadata)
            outputs_ref.append((sending, recving, invalid, wm_ref_v[0], st_ref_v[0]))
            outputs_vllm.append(vmw.model_runner_output(sending, recving, invalid, wm_ref_v[1], st_ref_v[1]))
            stats["calls"] += 1
        merged = [None, None]
        p.both("KVOutputAggregator.aggregate", lambda: merged.__setitem__(0, agg_ref.aggregate(outputs_ref)),
               lambda: merged.__setitem__(1, agg_vllm.aggregate(outputs_vllm).kv_connector_output))
        out = merged[1]
        got = (frozenset(out.finished_sending or ()), frozenset(out.finished_recving or ()),
               frozenset(out.invalid_block_ids), vmw.worker_meta_items(out.kv_connector_worker_meta),
               vmw.multi_stats(out.kv_connector_stats))
        if got != merged[0]:
            raise MultiWorkerDivergence(f"step {step}: the ranks' outputs merged: reference {merged[0]}, vLLM {got}")
        payload = vmw.stats_payload(out.kv_connector_stats)  # serialized before the logging side resets them
        # the logging side: stats rebuilt from the merged ones, reduced, reset
        rebuilt = vmw.rebuilt_stats(out.kv_connector_stats)
        want = merged[0][4] or {}
        if (vmw.multi_stats(rebuilt) or {}) != want or rebuilt.reduce() != {
                vmw.CLASS_NAME: v for v in want.values()} or rebuilt.is_empty() != (not any(
                any(v.values()) for v in want.values())):
            raise MultiWorkerDivergence(f"step {step}: stats rebuilt {rebuilt.to_dict()} / reduced "
                                        f"{rebuilt.reduce()}, the ranks reported {want}")
        rebuilt.reset()
        if not rebuilt.is_empty():
            raise MultiWorkerDivergence(f"step {step}: stats {rebuilt.to_dict()} not empty after reset")
        logging_side.step(step, payload, merged[0][4], last=step == case.steps - 1)
        stats["logged"], stats["prom_observed"] = logging_side.logged, len(logging_side.observed)
        for r in ranks:
            for rid in set(outputs_ref[r - 1][0] or ()):
                rank_done[rid] = rank_done.get(rid, 0) + 1
        whole = {rid for rid, k in rank_done.items() if k == w}
        if set(got[0]) != whole:
            raise MultiWorkerDivergence(f"step {step}: the aggregate says {sorted(got[0])} finished sending, every "
                                        f"rank has finished {sorted(whole)}")
        for rid in whole:
            del rank_done[rid]
        p.both("update_connector_output",
               lambda: p.ref[0].update_connector_output(merged[0][0], merged[0][3]),
               lambda: p.vllm[0].update_connector_output(out))
        if rng.random() < 0.3:
            p.answer(0, "has_pending_push_work", [rng.random() < 0.3 for _ in range(n)])
            p.both("has_pending_push_work", p.ref[0].has_pending_push_work, p.vllm[0].has_pending_push_work)

    # ---- teardown: sleep mode, then shutdown with failing children ---------------------------------
    for r in ranks:
        p.both("unregister_kv_caches", lambda r=r: p.ref[r].forward("unregister_kv_caches"),
               p.vllm[r].unregister_kv_caches)
        p.both("restore_kv_caches", lambda r=r: p.ref[r].forward("restore_kv_caches"), p.vllm[r].restore_kv_caches)
        p.answer(r, "shutdown", [ChildShutdownError(f"child {i}") if rng.random() < 0.3 else None for i in range(n)])
        stats["raised"] += p.both("shutdown", p.ref[r].shutdown, lambda r=r: vmw.shutdown(p.vllm[r]))[0] == "raised"
    return stats


def random_multi_worker_cases(seed: int, n: int) -> list[MultiWorkerCase]:
    rng = random.Random(f"multi-connector-worker-{seed}")
    return [MultiWorkerCase.random(rng) for _ in range(n)]


def run_multi_worker_traces(cases) -> dict:
    """Run every case; raises :class:`MultiWorkerDivergence` (naming the case) at the first
    difference."""
    total = {"traces": 0, "calls": 0, "sends_finished": 0, "extra_saves": 0, "raised": 0, "logged": 0,
             "prom_observed": 0}
    for case in cases:
        try:
            stats = run_multi_worker_trace(case)
        except MultiWorkerDivergence as exc:
            raise MultiWorkerDivergence(f"{case}: {exc}") from exc
        total["traces"] += 1
        for k, v in stats.items():
            total[k] += v
    return total
