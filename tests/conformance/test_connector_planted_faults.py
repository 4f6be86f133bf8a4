"""The connector lock-step has teeth: classic faults planted in vLLM 0.33.0's *own* connector
paths (monkeypatched for the test's duration) are each found by the generated traces (#22).

Each fault is a wrapper around vLLM's method that re-creates a plausible bug; the same machine
that passes on pristine vLLM (test_connector_conformance.py) must report a divergence, an
invariant breach, a liveness failure or vLLM crashing.
"""

from __future__ import annotations

import pytest

from kvref.models.machines.scheduler_connector import run_connector_machine
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def _sched_cls():
    require_vllm()
    from vllm.v1.core.sched.scheduler import Scheduler

    return Scheduler


def no_last_token_rewind(monkeypatch):
    """A whole-prompt load is promoted without recomputing its last token."""
    cls = _sched_cls()
    real = cls._update_waiting_for_remote_kv

    def patched(self, request):
        n = request.num_computed_tokens
        real(self, request)
        if n == request.num_tokens:
            request.num_computed_tokens = n

    monkeypatch.setattr(cls, "_update_waiting_for_remote_kv", patched)


def failed_recv_keeps_tokens(monkeypatch):
    """A failed receive (recompute policy) keeps the tokens it never loaded as computed."""
    cls = _sched_cls()
    real = cls._handle_failed_recving

    def patched(self, failed_req_ids):
        before = {rid: self.requests[rid].num_computed_tokens for rid in failed_req_ids if rid in self.requests}
        out = real(self, failed_req_ids)
        for rid, n in before.items():
            self.requests[rid].num_computed_tokens = n
        return out

    monkeypatch.setattr(cls, "_handle_failed_recving", patched)


def unclipped_table_to_connector(monkeypatch):
    """``request_finished`` gets the whole block table, not the blocks of computed tokens."""
    require_vllm()
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    monkeypatch.setattr(KVCacheManager, "get_block_ids_for_computed_tokens",
                        lambda self, request_id, num_computed_tokens: self.get_block_ids(request_id))


def sends_never_free(monkeypatch):
    """``finished_sending`` is ignored: a delayed free never happens."""
    cls = _sched_cls()
    real = cls._update_from_kv_xfer_finished

    def patched(self, out):
        sending, out.finished_sending = out.finished_sending, set()
        try:
            real(self, out)
        finally:
            out.finished_sending = sending

    monkeypatch.setattr(cls, "_update_from_kv_xfer_finished", patched)


def abort_frees_loading_blocks(monkeypatch):
    """Aborting a request mid-load frees its blocks at once (the connector still writes them)."""
    cls = _sched_cls()
    real = cls.finish_requests

    def patched(self, request_ids, finished_status):
        ids = (request_ids,) if isinstance(request_ids, str) else list(request_ids or ())
        for rid in ids:
            r = self.requests.get(rid)
            if r is not None and r.status.name == "WAITING_FOR_REMOTE_KVS":
                self.finished_recving_kv_req_ids.add(rid)
        return real(self, request_ids, finished_status)

    monkeypatch.setattr(cls, "finish_requests", patched)


def no_load_reservation(monkeypatch):
    """Async loads are admitted without the in-flight prefills' reservation."""
    cls = _sched_cls()
    monkeypatch.setattr(cls, "_inflight_prefill_reserved_blocks", lambda self: 0)


FAULTS = [no_last_token_rewind, failed_recv_keeps_tokens, unclipped_table_to_connector, sends_never_free,
          abort_frees_loading_blocks, no_load_reservation]


@pytest.mark.parametrize("fault", FAULTS, ids=[f.__name__ for f in FAULTS])
def test_planted_fault_is_found(fault, monkeypatch):
    fault(monkeypatch)
    run = run_connector_machine(with_vllm=True, examples=profile_examples(200, 300), shrink=False, seed=0)
    assert not run.ok, f"{fault.__name__} survived {run.traces} traces: {fault.__doc__}"
