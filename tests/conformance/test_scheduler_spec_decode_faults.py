"""The spec-decode lock-step has teeth: faults planted in vLLM's own speculative-decoding code are
reported as divergences, and a behaviour-preserving refactor is not (issue #22).

Each fault is one exact text edit of one method of vLLM 0.33.0's ``Scheduler`` /
``AsyncScheduler`` (or ``SpecDecodingStats``), compiled in-process from the installed source and
patched onto the class for one run of ``conform-spec-decode``'s machine (fixed seed, no
shrinking). The installed files are never touched. The edits are classic faults (a dropped
rollback, an off-by-one, a wrong comparison, a dropped reset) in every rule the reference models.
"""

from __future__ import annotations

import inspect
import sys
import textwrap

import pytest

from kvref.models.machines.scheduler import run_scheduler_machine
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

#: (id, class name, method, old, new): each ``old`` occurs exactly once in the method
FAULTS = (
    ("rollback-dropped", "Scheduler", "update_from_output",
     "request.num_computed_tokens -= num_rejected", "request.num_computed_tokens -= 0"),
    ("placeholder-rollback-dropped", "Scheduler", "update_from_output",
     "request.num_output_placeholders -= num_rejected", "request.num_output_placeholders -= 0"),
    ("prefill-chunk-drafts-kept", "Scheduler", "update_draft_token_ids",
     "if request.is_prefill_chunk:", "if False:"),
    ("running-lookahead-dropped", "Scheduler", "schedule",
     "num_lookahead_tokens=self.num_lookahead_tokens,", "num_lookahead_tokens=0,"),
    ("padding-room-off-by-one", "Scheduler", "schedule",
     "+ self.num_sampled_tokens_per_step\n                            <= self.max_model_len",
     "+ self.num_sampled_tokens_per_step\n                            < self.max_model_len"),
    ("drafts-cut-off-by-one", "Scheduler", "schedule",
     "spec_token_ids = spec_token_ids[:num_scheduled_spec_tokens]",
     "spec_token_ids = spec_token_ids[:num_scheduled_spec_tokens - 1]"),
    ("drafts-unused-wrong-comparison", "Scheduler", "_drafts_unused",
     "return min_num_output_tokens >= request.max_tokens", "return min_num_output_tokens > request.max_tokens"),
    ("preemption-keeps-drafts", "Scheduler", "_preempt_request",
     "        if request.spec_token_ids:\n            request.spec_token_ids = []\n", ""),
    ("async-placeholders-miss-drafts", "AsyncScheduler", "_update_after_schedule",
     "self.num_sampled_tokens_per_step + cur_num_spec_tokens", "self.num_sampled_tokens_per_step"),
    ("invalid-drafts-counted", "Scheduler", "make_spec_decoding_stats",
     "num_draft_tokens -= num_invalid_spec_tokens.get(request_id, 0)", "num_draft_tokens -= 0"),
    ("stats-per-position-off-by-one", "SpecDecodingStats", "observe_draft",
     "for i in range(num_accepted_tokens):", "for i in range(max(num_accepted_tokens - 1, 0)):"),
)
NEUTRAL = ("accepted-args-swapped", "Scheduler", "update_from_output",
           "num_accepted = max(len(generated_token_ids) - num_sampled, 0)",
           "num_accepted = max(0, len(generated_token_ids) - num_sampled)")


@pytest.fixture(scope="module")
def vllm_classes():
    require_vllm()
    from kvref.impl.vllm.scheduler import load_vllm  # noqa: PLC0415 - imports vLLM once per module

    v = load_vllm()
    from vllm.v1.spec_decode.metrics import SpecDecodingStats  # noqa: PLC0415

    return {"Scheduler": v["Scheduler"], "AsyncScheduler": v["AsyncScheduler"],
            "SpecDecodingStats": SpecDecodingStats}


def _plant(monkeypatch, classes, cls_name: str, method: str, old: str, new: str) -> None:
    """Compile ``method`` with one edit in its module's namespace and patch it onto the class."""
    cls = classes[cls_name]
    fn = cls.__dict__[method]
    src = inspect.getsource(fn)  # as in the file: the edits quote its indentation
    assert src.count(old) == 1, f"{cls_name}.{method}: the fault's text occurs {src.count(old)} times"
    # zero-argument super() needs the class cell a def inside the class body gets
    src = textwrap.dedent(src.replace(old, new)).replace("super()", f"super({cls_name}, self)")
    module = sys.modules[cls.__module__]
    namespace: dict = {}
    exec(compile(src, inspect.getsourcefile(fn), "exec"), module.__dict__, namespace)  # noqa: S102
    monkeypatch.setattr(cls, method, namespace[method])


def _run():
    # derandomized: the same traces in every process. Hypothesis labels strategies by their code,
    # so editing the machine's strategies moves the traces: 40 examples stopped reaching the
    # _drafts_unused boundary after the EAGLE setups changed, 80 reach every fault (about 2 s each)
    return run_scheduler_machine(with_vllm=True, examples=profile_examples(80, 80), reproducible=True,
                                 shrink=False, spec=True)


@pytest.mark.parametrize("fault", FAULTS, ids=[f[0] for f in FAULTS])
def test_planted_spec_decode_fault_is_found(vllm_classes, monkeypatch, fault):
    _plant(monkeypatch, vllm_classes, *fault[1:])
    if fault[0] == "padding-room-off-by-one":
        # the generated traces rarely land a padded admission exactly at max_model_len; the
        # boundary trace of test_scheduler_spec_decode does (its two sides are compared there)
        from kvref.impl.reference.scheduler import Scheduler
        from kvref.impl.vllm.scheduler import VllmEnv, VllmScheduler
        from kvref.models.machines.scheduler import Divergence
        from tests.conformance.test_scheduler_spec_decode import padding_boundary_trace

        env = VllmEnv()
        with pytest.raises(Divergence):
            padding_boundary_trace({"vllm": lambda p, c: VllmScheduler(p, c, env),
                                    "ref": lambda p, c: Scheduler(p, c)}, 12)
        return
    run = _run()
    assert not run.ok, f"{fault[0]} survived {run.summary}"
    assert "Divergence" in run.failure or "vllm" in run.failure, run.failure


def test_neutral_refactor_is_not_flagged(vllm_classes, monkeypatch):
    _plant(monkeypatch, vllm_classes, *NEUTRAL[1:])
    run = _run()
    assert run.ok, run.failure
