"""Generated runs of vLLM's scheduler with the features check-run once skipped, recorded as a server would.

The recorder named four features unmodelled and ``kvref check-run`` fell back to the run
properties for them from line 1 (issue #28): multimodal requests (encoder inputs), LoRA,
lookahead block hashes (``num_hash_lookahead_tokens``) and the Mamba shared-prefix checkpoint. The
reference models all four now, so the header carries their settings and the arrivals their items
and adapters, and the replay follows them. The runs are the conform-scheduler machines' draws,
with vLLM's ``Scheduler`` / ``AsyncScheduler`` built from ``kvref.record.Recording*Scheduler``
through ``scheduler_cls`` as the only target:

* ``multimodal``: :class:`~kvref.models.machines.scheduler_encoder.EncoderMachine` (image items
  shared, repeated and evicted under a per-step encoder budget and a small encoder cache, the V2
  model runner in half the setups);
* ``lora``: :class:`~kvref.models.machines.scheduler_lora.LoraMachine` (three adapters under
  ``max_loras`` 1 or 2);
* ``hash-lookahead``: the main machine's EAGLE-like speculative-decoding setups with prefix
  caching and lookahead block hashes (no trailing-block drop);
* ``mamba-checkpoint``: the main machine's full-attention + Mamba ``align`` pools (fine-grained
  hits) under an EAGLE-like drafter with ``enable_mamba_shared_prefix_checkpoint`` on (chunks stop
  at a shared-prefix junction).

:func:`record_feature_runs` returns the traces; ``kvref check-run`` must follow and agree with every
one of them (tests/record/test_record_features.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from .connector_runs import RecordedRun
from .recording import closing_targets, scheduler_recorder

#: the features :func:`record_feature_runs` draws
FEATURES = ("multimodal", "lora", "hash-lookahead", "mamba-checkpoint")
#: and the stop conditions (session 14, format 5): :class:`~kvref.models.machines.scheduler_stop.StopMachine`'s
#: arrivals (an EOS token or none, ``min_tokens``, repetition detectors) over a three-token model
GENERATED = FEATURES + ("stop-conditions",)
#: what session 16 replays (#28, format 6): ``streaming-input``, the conform-scheduler session machine's
#: draws (:class:`~kvref.models.machines.scheduler_sessions.SessionMachine`: resumable arrivals, their
#: updates and finishing updates, turns that stop and keep their KV blocks, pause states, abort-all);
#: ``prefix-cache-reset``, the cache-controls machine's
#: (:class:`~kvref.models.machines.scheduler_cache_controls.CacheControlsMachine`: ``reset_prefix_cache``
#: through the scheduler, with or without preempting the running requests, on salted and
#: cache-skipping arrivals and multi-turn follow-ups), without speculative decoding (vLLM's
#: diffusion-LM scheduler is what that machine compares there, not a recorded server's)
SESSION_FEATURES = ("streaming-input", "prefix-cache-reset")
#: and ``prompt-embeds``: the main machine's draws (startup-consistent pools with prefix caching,
#: no speculative decoding) whose arrivals mostly carry prompt embeddings, as a server gets them
#: (token ids all 0, the embeddings hashed into every block), rows derived from the drawn tokens so
#: shared prefixes share them, one arrival in four with other rows for the same tokens (format 6)
EMBEDS_FEATURES = ("prompt-embeds",)
#: and ``prefix-replay`` (session 20): the conform-scheduler bounded-replay machine's draws
#: (:mod:`~kvref.models.machines.scheduler_prefix_replay`: full attention + a DeepSeek-V4.1
#: ``SlidingWindowMLASpec`` with ``bounded_replay``, prefix caching on, shared prefixes and
#: multi-turn follow-ups hitting shorter and longer than the window), which a session-19 recorder
#: named ``prefix_replay``; the traces carry each new request's ``replay_start``
REPLAY_FEATURES = ("prefix-replay",)
#: and the full-attention layouts a session-19 recorder named ``kv_cache_spec:<Name>`` (session 20,
#: #28): ``rswa``, pools of one R-SWA group (Unlimited-OCR: the gap between prompt and decode window
#: freed), and ``circular-buffer``, full attention beside a ``CircularBufferSpec`` ring (DeepSeek-V4.1
#: / GLM-5-next compressors: one block per request, never cached); the conform-scheduler layouts
#: machine's draws (:mod:`~kvref.models.machines.scheduler_layouts`: cache controls, follow-ups,
#: resets and long-decoding arrivals), startup-consistent, without speculative decoding
LAYOUT_FEATURES = ("rswa", "circular-buffer")
#: and ``aux-output`` (session 20): the aux-output machine's draws
#: (:class:`~kvref.models.machines.scheduler_aux_output.AuxOutputMachine`: vLLM's routed-experts
#: connector on, as ``--enable-return-routed-experts`` runs it: a MoE model on the V2 runner; repeats
#: of earlier prompts), startup-consistent pools, which a session-19 recorder named
#: ``aux_output_connector``
AUX_FEATURES = ("aux-output",)
#: and ``structured-output`` (format 7, #28): the conform-scheduler structured-output machine's draws
#: (:class:`~kvref.models.machines.scheduler_structured_output.StructuredOutputMachine`: arrivals with
#: structured output, grammars compiling or failing, drafts cut, sampled tokens rejected), vLLM's
#: structured-output manager and grammars answering from the machine's scripted oracle
SO_FEATURES = ("structured-output",)
GENERATED += SESSION_FEATURES + EMBEDS_FEATURES + REPLAY_FEATURES + LAYOUT_FEATURES + AUX_FEATURES + SO_FEATURES


def _hash_lookahead_setups():
    from kvref.models.machines.scheduler import scheduler_setups

    return scheduler_setups(consistent=True, spec=True).filter(lambda s: s[0].num_hash_lookahead_tokens > 0)


def _checkpoint_setups():
    """Full attention + a Mamba "align" group hashed at half its block (fine-grained hits) under an
    EAGLE-like drafter: where vLLM's manager narrows the checkpoint on (an EAGLE group, partial hash
    hits, no MTP tail) and its scheduler stops chunks at a junction."""
    from kvref.models.machines.scheduler import scheduler_setups

    return scheduler_setups(consistent=True, kinds=("full+mamba_fine",), spec=True).filter(
        lambda s: s[0].use_eagle).map(lambda s: (replace(s[0], enable_mamba_shared_prefix_checkpoint=True), s[1]))


def _reset_setups():
    """The cache-controls machine's setups without speculative decoding (see SESSION_FEATURES), only
    startup-consistent ones (a server runs only those: on a pool too small for any request vLLM
    never schedules, a hang the starvation property rightly reports)."""
    from hypothesis import strategies as st

    from kvref.impl.scheduler_types import PRIORITY
    from kvref.models.machines.scheduler import MAMBA_ALIGN_KINDS, scheduler_setups
    from kvref.models.machines.scheduler_cache_controls import _cacheable, _roomy

    mamba = scheduler_setups(consistent=True, kinds=MAMBA_ALIGN_KINDS)
    drawn = st.one_of(mamba, mamba, mamba, scheduler_setups(consistent=True), scheduler_setups(consistent=True),
                      scheduler_setups(policy=PRIORITY, tight=True)).filter(_cacheable)
    return st.one_of(drawn, drawn.map(_roomy))


def _replay_setups():
    """The bounded-replay machine's pools (:func:`~kvref.models.machines.scheduler_prefix_replay.
    prefix_replay_setups`), startup-consistent only: a server starts on no other (on a pool too
    small for any request vLLM never schedules, a hang the starvation property rightly reports)."""
    from hypothesis import strategies as st

    from kvref.models.machines.scheduler import scheduler_setups
    from kvref.models.machines.scheduler_cache_controls import _cacheable, _roomy
    from kvref.models.machines.scheduler_prefix_replay import _replay_group

    drawn = scheduler_setups(consistent=True, kinds=("full+swa",)).filter(_cacheable).map(
        lambda setup: (replace(setup[0], groups=tuple(_replay_group(g) for g in setup[0].groups)), setup[1]))
    return st.one_of(drawn.map(_roomy), drawn)


def _layout_setups(feature: str):
    """Startup-consistent R-SWA or full + ring pools, as drawn (mostly tight) or roomy (finished
    turns stay cached for their follow-ups)."""
    from hypothesis import strategies as st

    from kvref.models.machines.scheduler import scheduler_setups
    from kvref.models.machines.scheduler_cache_controls import _roomy

    drawn = scheduler_setups(consistent=True, kinds=("rswa",) if feature == "rswa" else ("full+circular",))
    return st.one_of(drawn, drawn.map(_roomy))


def _aux_setups():
    """The aux-output machine's pools (prefix caching on, as drawn or roomy), startup-consistent
    only (a server starts on no other)."""
    from hypothesis import strategies as st

    from kvref.models.machines.scheduler import scheduler_setups
    from kvref.models.machines.scheduler_cache_controls import _cacheable, _roomy

    drawn = st.one_of(scheduler_setups(consistent=True), scheduler_setups(consistent=True, tight=True)).filter(
        _cacheable)
    return st.one_of(drawn, drawn.map(_roomy))


def _reset_while_running():
    """A rule for the recorded reset runs: ``reset_prefix_cache(reset_running_requests=True)`` while
    two requests or more run (at most twice a trace). The machine's own reset rule is one rule among
    many and mostly meets an idle or single-request scheduler; the preemption order of a reset (the
    running requests come back first to last) shows only with several."""
    from hypothesis.stateful import precondition, rule

    def running(self) -> int:
        snap = self.driver.last_snapshot
        return len(snap.running) if snap is not None else 0

    @precondition(lambda self: running(self) >= 2 and self.driver.num_resets < 2)
    @rule()
    def reset_while_running(self):
        self.driver.reset_prefix_cache(True, False)

    return reset_while_running


def _embeds_machine(factories: dict) -> type:
    """The main scheduler machine whose ``add_request`` (and ``burst``) draws prompt-embeds arrivals
    (see :data:`EMBEDS_FEATURES`)."""
    from hypothesis import strategies as st
    from hypothesis.stateful import precondition, rule

    from kvref.impl.request import Request
    from kvref.models.machines.scheduler import MAX_REQUESTS, RequestSpec, machine_with, request_specs, scheduler_setups

    @dataclass(frozen=True)
    class EmbedsRequestSpec(RequestSpec):
        embeds: tuple | None = None

        def make(self) -> Request:
            r = super().make()
            if self.embeds is None:
                return r
            return Request(r.request_id, [0] * len(self.prompt), max_tokens=r.max_tokens, priority=r.priority,
                           arrival_time=r.arrival_time, stop_token_ids=r.stop_token_ids, prompt_embeds=self.embeds)

    setups = scheduler_setups(consistent=True).filter(lambda s: s[0].enable_caching)
    base = machine_with(factories, setups=setups, name="RecordedEmbedsBase")

    class RecordedEmbedsRun(base):
        @precondition(lambda self: self.num_added < MAX_REQUESTS)
        @rule(data=st.data())
        def add_request(self, data):
            spec = data.draw(request_specs(self.num_added, self.driver.pool.max_model_len))
            if data.draw(st.integers(0, 3)):  # three arrivals in four carry embeddings
                variant = data.draw(st.sampled_from((0, 0, 0, 1)))  # 1: other rows for the same tokens
                rows = tuple(bytes((t % 251, variant, 7, 11)) * 2 for t in spec.prompt)
                spec = EmbedsRequestSpec(**spec.__dict__, embeds=rows)
            self.num_added += 1
            self.driver.add(spec)

    return RecordedEmbedsRun


def _machine(feature: str, env_holder: dict, directory: Path, runs: list[RecordedRun]) -> type:
    if feature == "prompt-embeds":
        return _embeds_machine({"vllm": scheduler_recorder(env_holder, directory, runs, feature)})
    if feature == "streaming-input":
        from kvref.models.machines.scheduler import Lockstep
        from kvref.models.machines.scheduler_sessions import SessionLockstep, SessionMachine

        class Driver(SessionLockstep):
            def compare(self, what: str) -> None:
                # not the polled counts: make_stats() would reset the counters the recorder reads
                # from update_from_output's return value (the metrics endpoint's view)
                Lockstep.compare(self, what)

        return type("RecordedSessionRun", (SessionMachine,),
                    {"driver_class": Driver,
                     "factories": {"vllm": scheduler_recorder(env_holder, directory, runs, feature)}})
    if feature == "structured-output":
        from kvref.models.machines.scheduler import Lockstep, machine_with, scheduler_setups
        from kvref.models.machines.scheduler_structured_output import (StructuredOutputLockstep,
                                                                       StructuredOutputMachine)

        def factory(pool, config, oracle):  # vLLM's grammars answer from the driver's oracle
            return scheduler_recorder(env_holder, directory, runs, feature, grammar_oracle=oracle)(pool, config)

        class Driver(StructuredOutputLockstep):
            def compare(self, what: str) -> None:
                # not make_stats(): it would reset the counters the recorder reads from
                # update_from_output's return value (the metrics endpoint's view)
                Lockstep.compare(self, what)

        base = machine_with({"vllm": factory}, setups=scheduler_setups(consistent=True, spec=None),
                            name="RecordedStructuredOutputBase", spec=True)
        return type("RecordedStructuredOutputRun", (StructuredOutputMachine, base), {"driver_class": Driver})
    if feature == "aux-output":
        from kvref.impl.vllm.scheduler import VllmEnv
        from kvref.models.machines.scheduler import machine_with
        from kvref.models.machines.scheduler_aux_output import AuxOutputMachine
        from kvref.models.machines.scheduler_cache_controls import CacheControlsLockstep

        if env_holder.get("env") is None:
            env_holder["env"] = VllmEnv(aux_output=True)  # a tiny MoE model: vLLM's requirement
        base = machine_with({"vllm": scheduler_recorder(env_holder, directory, runs, feature, use_v2_model_runner=True)},
                            setups=_aux_setups(), name="RecordedAuxOutputBase")
        return type("RecordedAuxOutputRun", (AuxOutputMachine, base), {"driver_class": CacheControlsLockstep})
    if feature == "prefix-replay":
        from kvref.models.machines.scheduler import machine_with
        from kvref.models.machines.scheduler_cache_controls import CacheControlsLockstep, CacheControlsMachine
        base = machine_with({"vllm": scheduler_recorder(env_holder, directory, runs, feature)},
                            setups=_replay_setups(), name="RecordedPrefixReplayBase")
        return type("RecordedPrefixReplayRun", (CacheControlsMachine, base), {"driver_class": CacheControlsLockstep})
    if feature in LAYOUT_FEATURES:
        from kvref.models.machines.scheduler import machine_with
        from kvref.models.machines.scheduler_cache_controls import CacheControlsLockstep
        from kvref.models.machines.scheduler_layouts import LayoutsMachine
        base = machine_with({"vllm": scheduler_recorder(env_holder, directory, runs, feature)},
                            setups=_layout_setups(feature), name="RecordedLayoutBase")
        return type("RecordedLayoutRun", (LayoutsMachine, base), {"driver_class": CacheControlsLockstep})
    if feature == "prefix-cache-reset":
        from kvref.models.machines.scheduler import machine_with
        from kvref.models.machines.scheduler_cache_controls import CacheControlsLockstep, CacheControlsMachine

        base = machine_with({"vllm": scheduler_recorder(env_holder, directory, runs, feature)},
                            setups=_reset_setups(), name="RecordedResetBase")
        return type("RecordedResetRun", (CacheControlsMachine, base),
                    {"driver_class": CacheControlsLockstep, "reset_while_running": _reset_while_running()})
    if feature == "multimodal":
        from kvref.models.machines.scheduler_encoder import EncoderMachine

        def factories_for(budget, v2):
            return {"vllm": scheduler_recorder(env_holder, directory, runs, feature, encoder_budget=budget,
                                               use_v2_model_runner=v2)}

        return type("RecordedEncoderRun", (EncoderMachine,), {"factories_for": staticmethod(factories_for)})
    if feature == "stop-conditions":
        from kvref.models.machines.scheduler_stop import StopMachine

        return type("RecordedStopRun", (StopMachine,),
                    {"factories": {"vllm": scheduler_recorder(env_holder, directory, runs, feature)}})
    if feature == "lora":
        from kvref.models.machines.scheduler_lora import LoraMachine

        def lora_factories(max_loras):
            return {"vllm": scheduler_recorder(env_holder, directory, runs, feature, max_loras=max_loras)}

        return type("RecordedLoraRun", (LoraMachine,), {"factories_for": staticmethod(lora_factories)})
    from kvref.models.machines.scheduler import machine_with

    setups = _hash_lookahead_setups() if feature == "hash-lookahead" else _checkpoint_setups()
    return machine_with({"vllm": scheduler_recorder(env_holder, directory, runs, feature)}, setups=setups,
                        name="RecordedFeatureRun", spec=True)


def record_feature_runs(directory: str | os.PathLike, feature: str, examples: int, seed: int = 0,
                        steps: int = 40, strict: bool = True) -> list[RecordedRun]:
    """Record ``examples`` generated runs of vLLM's scheduler using ``feature`` (one of
    :data:`GENERATED`) into ``directory``.

    Raises the machine's failure (an AssertionError) when vLLM's run broke one of the machine's own
    checks (liveness at teardown) — unless not ``strict`` (a vLLM with a planted fault): the runs
    recorded up to then are returned. The seed alone fixes the draws.
    """
    from kvref.models.machines.scheduler import run_lockstep_machine
    from kvref.spec.errors import InvalidFieldError, check_int

    if feature not in GENERATED:
        raise InvalidFieldError("feature", feature, "one of " + ", ".join(GENERATED))
    check_int("examples", examples, minimum=1)
    check_int("steps", steps, minimum=2)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    runs: list[RecordedRun] = []
    machine = closing_targets(_machine(feature, {}, directory, runs))
    ok, failure, _ = run_lockstep_machine(machine, examples, steps=steps, min_steps=steps // 2, seed=seed,
                                          reproducible=False, shrink=False)
    if not ok and strict:
        raise AssertionError(f"a generated {feature} run failed the machine's own checks:\n" + failure)
    return runs


__all__ = ["AUX_FEATURES", "EMBEDS_FEATURES", "FEATURES", "GENERATED", "LAYOUT_FEATURES", "REPLAY_FEATURES",
           "SO_FEATURES", "SESSION_FEATURES", "record_feature_runs"]
