"""Speculative-decoding padding of admissions, compared with vLLM 0.33.0 (#22).

vLLM's waiting loop pads a request it admits with exactly one token left to compute (its prefix
hit covers all but the last token) to ``1 + num_spec_tokens`` rows, all placeholder drafts, so
the step keeps one uniform query length for its CUDA graph ("Pad new decode requests to uniform
spec decoding size"): only without a prefill chunk in the step, with room for the sampled token
below ``max_model_len``; a padded request that does not fit the budget stops the loop ("Prefer to
not schedule than schedule un-padded"); a Mamba-aligned chunk that clipped the padding drops it.
The admitted request's KV then covers the padded rows (its blocks and the lookahead slots).

``conform-spec-decode``'s main run reaches it rarely (a resumed request whose hit ends one token
short of its sequence: one resume in a block's size). Here an arrival may repeat an earlier
prompt cut to one token past a block boundary of the scheduler, so the prefix cache hands it all
but that token, and the reference is compared with vLLM after every operation as in the main run.
A separate machine and run so that the main machine's derandomized traces stay as they are.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from .scheduler import (
    COVERAGE,
    NGRAM,
    MAX_REQUESTS,
    Lockstep,
    SchedulerRun,
    SpecDecodeSchedulerMachine,
    machine_with,
    request_specs,
    run_lockstep_machine,
    scheduler_setups,
)


class SpecPaddingMachine(SpecDecodeSchedulerMachine):
    """The speculative-decoding machine with arrivals that repeat an earlier prompt's prefix."""

    @precondition(lambda self: 0 < self.num_added < MAX_REQUESTS)
    @rule(data=st.data())
    def repeat_prompt(self, data):
        """An arrival whose prompt is an earlier prompt cut to ``k`` scheduler blocks plus one
        token, ``k`` blocks the earlier request has computed (so cached, unless evicted since):
        its hit leaves one token. Without such a request, a plain arrival."""
        d = self.driver
        bs = d.pool.scheduler_block_size
        states = d.last_snapshot.requests if d.last_snapshot is not None else {}
        blocks = {rid: min(states[rid].num_computed_tokens, len(spec.prompt) - 1) // bs
                  for rid, spec in d.specs.items() if rid in states}
        candidates = sorted(rid for rid, n in blocks.items() if n >= 1)
        fresh = data.draw(request_specs(self.num_added, d.pool.max_model_len))
        if candidates:
            rid = data.draw(st.sampled_from(candidates))
            k = data.draw(st.integers(1, blocks[rid]))
            fresh = replace(fresh, prompt=d.specs[rid].prompt[:k * bs + 1])
            COVERAGE["spec_repeated_prompts"] += 1
        self.num_added += 1
        d.add(fresh)

    @precondition(lambda self: 0 < self.num_added < MAX_REQUESTS)
    @rule(data=st.data())
    def repeat_prompt_again(self, data):
        """The same rule twice in the rule set: repeats are what this machine is for."""
        self.repeat_prompt(data)


def padding_setups():
    """n-gram speculative decoding with prefix caching. EAGLE pads no arrival: with block drop its
    hit never reaches the last full block, with lookahead hashes a block hits only with the token
    after it, so a hit always leaves at least two tokens (the main run draws EAGLE)."""
    return scheduler_setups(consistent=True, spec=True).filter(
        lambda setup: setup[0].enable_caching and setup[1].speculative_method == NGRAM)


def run_spec_padding_machine(examples: int, reproducible: bool = False, shrink: bool = True,
                             seed: int | None = None) -> SchedulerRun:
    """The reference scheduler in lock step with vLLM 0.33.0's on :class:`SpecPaddingMachine`
    traces (at least 30 operations; liveness drained at teardown on startup-consistent setups)."""
    from kvref.impl.reference.scheduler import Scheduler
    from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler

    from .counted_lockstep import run_counted

    env = VllmEnv()
    factories: dict[str, Callable] = {"vllm": lambda p, c: VllmScheduler(p, c, env), "ref": lambda p, c: Scheduler(p, c)}
    base = machine_with(factories, setups=padding_setups(), name="SpecPaddingBase", spec=True)
    return SchedulerRun(**run_counted(
        lambda counting: type("SpecPaddingRun", (SpecPaddingMachine, base), {"driver_class": counting}), Lockstep,
        lambda machine: run_lockstep_machine(machine, examples, steps=45, min_steps=31, seed=seed,
                                             reproducible=reproducible, shrink=shrink), COVERAGE))
