"""A scheduler-like driver that runs the torch bookkeeping *and* its data path, step by step.

Each step: running requests get their next prefill chunk or one decode token (a failed
allocation preempts that request), then waiting requests are admitted FCFS with their prefix
hit and the full-sequence gate; the step's chunks are written and attended through the block
tables (``DataPathRunner.run_step``) and compared with dense attention over the contiguous
sequences (``dense_step``). ``max_error`` is the largest absolute difference seen.

``attention_backend`` (``"torch"`` or ``"triton"``) picks who writes K/V and runs paged
attention; dense attention stays torch. Used by the data-path tests and by the mutant tests,
which show that a bookkeeping fault alone (no invariant check, no comparison with vLLM)
produces wrong numbers here.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from kvref.impl.request import Request, RequestStatus
from kvref.impl.torch.model_runner import Chunk, DataPathRunner
from kvref.impl.torch.manager import TorchKVCacheManager


@dataclass
class StepLog:
    chunks: list[tuple[str, int, int]]
    error: float
    hits: dict[str, int] = field(default_factory=dict)


class DataPathScheduler:
    def __init__(self, manager: TorchKVCacheManager, runner: DataPathRunner | None = None,
                 budget: int = 8, seed: int = 0, dtype: torch.dtype = torch.float64,
                 attention_backend: str = "torch") -> None:
        self.m = manager
        self.runner = runner or DataPathRunner(manager, dtype=dtype, seed=seed, attention_backend=attention_backend)
        self.budget = budget
        self.seed = seed
        self.reqs: dict[str, Request] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.max_error = 0.0
        self.log: list[StepLog] = []
        self.outputs: dict[tuple[str, int], dict[tuple[int, int], torch.Tensor]] = {}

    def add(self, request: Request) -> None:
        self.reqs[request.request_id] = request
        self.waiting.append(request.request_id)

    def finish(self, rid: str) -> None:
        req = self.reqs[rid]
        self.m.free(req)
        (self.running if rid in self.running else self.waiting).remove(rid)
        req.status = RequestStatus.FINISHED

    def _preempt(self, rid: str) -> None:
        req = self.reqs[rid]
        self.m.free(req)
        self.running.remove(rid)
        self.waiting.insert(0, rid)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1

    def step(self) -> StepLog:
        chunks: list[Chunk] = []
        hits: dict[str, int] = {}
        max_len = self.m.config.max_model_len
        for rid in list(self.running):
            req = self.reqs[rid]
            if req.num_computed_tokens >= req.num_tokens:
                if len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= max_len:
                    self.finish(rid)
                    continue
                # "Sampling" is a function of (seed, request, position) so reruns agree.
                req.output_token_ids.append(random.Random(f"{self.seed}:{rid}:{req.num_tokens}").randrange(4))
            n = min(req.num_tokens - req.num_computed_tokens, self.budget)
            if self.m.allocate_slots(req, n) is None:
                self._preempt(rid)
                continue
            chunks.append(Chunk(req, req.num_computed_tokens, n))
        while self.waiting:
            req = self.reqs[self.waiting[0]]
            ids, hit = self.m.get_computed_blocks(req)
            n = min(req.num_tokens - hit, self.budget)
            out = self.m.allocate_slots(req, n, hit, ids, full_sequence_must_fit=True,
                                        has_scheduled_reqs=bool(self.running))
            if out is None:
                break
            self.waiting.pop(0)
            self.running.append(req.request_id)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = hit
            hits[req.request_id] = hit
            chunks.append(Chunk(req, hit, n))
        err = 0.0
        if chunks:
            paged = self.runner.run_step(chunks)
            dense = self.runner.dense_step(chunks)
            for key in paged:
                err = max(err, float((paged[key] - dense[key]).abs().max()))
            at = 0
            for c in chunks:
                self.outputs[(c.request.request_id, c.start)] = {
                    k: v[at:at + c.num_tokens] for k, v in paged.items()}
                at += c.num_tokens
        for c in chunks:
            c.request.num_computed_tokens = c.start + c.num_tokens
        self.max_error = max(self.max_error, err)
        log = StepLog([(c.request.request_id, c.start, c.num_tokens) for c in chunks], err, hits)
        self.log.append(log)
        return log

    def run(self, max_steps: int = 200) -> float:
        for _ in range(max_steps):
            if not self.running and not self.waiting:
                break
            self.step()
        return self.max_error
