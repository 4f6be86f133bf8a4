"""The OffloadingConnector's per-step budget for synchronous loads (vLLM
``OffloadingConnectorScheduler._reserve_sync_load``, ``kv_connector_extra_config``'s
``sync_load_budget_bytes``; 0 = every load is asynchronous).

A hit that fits the step's remaining budget is loaded *synchronously*: the worker copies it before
this step's forward pass, so the request runs in the same step (``get_num_new_matched_tokens``
answers ``load_kv_async=False``) instead of waiting in ``WAITING_FOR_REMOTE_KVS``. A load costs
``hit tokens * kv_bytes_per_token`` (every offloaded group's bytes per token on one worker, which
overestimates windowed and recurrent groups: they load less). A hit that leaves no token to compute
stays asynchronous (the request could not be scheduled). A reservation is made at lookup time and
kept for the whole step, even if the allocation after it fails; a request looked up again in the
step first drops its own reservation from the set (not its bytes, as vLLM).

Why it matters to the connector: the blocks of a synchronous load are allocated *and hashed* at
once (``delay_cache_blocks=False``), so the load's first block is found by position, not by a
missing hash; its keys are not "being loaded" for other requests (the copy ends before anyone else
can look); a store of the request may run beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvref.spec.errors import InvalidFieldError, check_int


@dataclass
class SyncLoadBudget:
    """``budget_bytes`` per step (0: off); ``kv_bytes_per_token`` of the offloaded groups."""

    budget_bytes: int = 0
    kv_bytes_per_token: int = 0
    reserved: set[str] = field(default_factory=set)  # requests loading synchronously this step
    used_bytes: int = 0

    def __post_init__(self) -> None:
        check_int("sync_load_budget_bytes", self.budget_bytes, minimum=0)
        check_int("kv_bytes_per_token", self.kv_bytes_per_token, minimum=0)

    def reserve(self, req_id: str, num_computed_tokens: int, num_hit_tokens: int | None, num_tokens: int) -> bool:
        """Whether ``req_id``'s hit loads synchronously; reserves its bytes if so."""
        if not isinstance(req_id, str):
            raise InvalidFieldError("req_id", req_id, "a request id (str)")
        check_int("num_computed_tokens", num_computed_tokens, minimum=0)
        check_int("num_hit_tokens", num_hit_tokens, minimum=0, allow_none=True)
        check_int("num_tokens", num_tokens, minimum=0)
        self.reserved.discard(req_id)
        if not self.budget_bytes or not num_hit_tokens or num_computed_tokens + num_hit_tokens >= num_tokens:
            return False
        cost = num_hit_tokens * self.kv_bytes_per_token
        if self.used_bytes + cost > self.budget_bytes:
            return False
        self.used_bytes += cost
        self.reserved.add(req_id)
        return True

    def end_step(self) -> None:
        self.reserved = set()
        self.used_bytes = 0

    def check_invariants(self) -> None:
        """O9 (docs/invariants.md): the step's reservations fit its budget."""
        assert 0 <= self.used_bytes <= max(self.budget_bytes, 0), "O9: sync loads over the step's budget"
        assert not self.reserved or self.used_bytes > 0 or self.kv_bytes_per_token == 0, \
            "O9: a sync load reserved no bytes"
