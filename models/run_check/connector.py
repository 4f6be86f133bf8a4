"""The replay's KV connector: answers what the recorded connector answered, and checks the questions.

A recorded KV-connector run (format 4, :mod:`kvref.impl.vllm.record_connector`) carries, on the
record of each scheduler call, what vLLM's scheduler asked its connector and what it answered. The
replay gives the reference scheduler a :class:`TraceConnector` loaded with that list
(:meth:`TraceConnector.expect`) before making the same call: the reference's own questions are
answered from it *in order*, and each question must be the one vLLM asked — the same request, the
same block-aligned local hit, the same block table and external tokens at allocation, the same
clipped block table at ``request_finished``. A question vLLM did not ask, or one it asked that the
reference did not (:meth:`TraceConnector.leftover`), is a :class:`ConnectorMismatch`: vLLM's
scheduler drove its connector differently from the reference (issue #28).

For vLLM's ``MultiConnector`` the trace also holds each child's answer; :func:`multi_violation`
checks them against the composition rules (the reference's
:class:`~kvref.impl.reference.scheduler_connector_multi.MultiScriptedConnector` states them): an
oracle for ``multi_connector.py`` independent of the scheduler.
"""

from __future__ import annotations

from kvref.impl.reference.scheduler_connector import (
    FAIL,
    KV_CONSUMER,
    KV_PRODUCER,
    RECOMPUTE,
    BlockIdsT,
    ConnectorConfig,
    KVConnectorOutput,
    SchedulerConnector,
)
from kvref.spec.errors import InvalidFieldError

_NAMES = {"m": "get_num_new_matched_tokens", "a": "update_state_after_alloc", "f": "request_finished",
          "p": "has_pending_block_frees", "r": "reset_cache", "w": "get_loaded_kv_cache_group_ids"}


class ConnectorMismatch(Exception):
    """The reference asked the connector something other than what vLLM asked at this point."""

    def __init__(self, message: str, recorded, reference) -> None:
        super().__init__(message)
        self.message = message
        self.recorded = recorded
        self.reference = reference


def connector_config(header_connector: dict) -> ConnectorConfig:
    """The reference's connector knobs from the header's ``connector`` (vLLM's ``kv_both`` role
    defers frees as a consumer does, and delivery is recorded explicitly)."""
    if not isinstance(header_connector, dict):
        raise InvalidFieldError("connector", header_connector, "the header's connector object")
    role = header_connector.get("kv_role")
    return ConnectorConfig(kv_role=KV_PRODUCER if role == KV_PRODUCER else KV_CONSUMER,
                           kv_load_failure_policy=FAIL if header_connector.get("kv_load_failure_policy") == FAIL
                           else RECOMPUTE,
                           requires_kv_delivery=bool(header_connector.get("requires_kv_delivery", False)),
                           divergent_local_hybrid_hits=bool(header_connector.get("divergent_local_hybrid_hits")),
                           hisparse_host_pool=bool(header_connector.get("hisparse_host_pool")))


def _groups(block_ids) -> list[list[int]]:
    return [list(g) for g in block_ids]


def kv_output(kvo: dict | None, fin=()) -> KVConnectorOutput | None:
    """An ``update`` record's ``kvo`` as the reference's ``KVConnectorOutput``, with the order in
    which vLLM iterated the ids (``fin``: the error finishes, then the recorded lists)."""
    if not kvo:
        return None
    order = _merged_order([list(kvo.get("r", ())), list(kvo.get("s", ())), [rid for rid, _ in fin]])
    return KVConnectorOutput(finished_sending=tuple(kvo.get("s", ())), finished_recving=tuple(kvo.get("r", ())),
                             failed_recving=tuple(kvo.get("f", ())), invalid_block_ids=tuple(kvo.get("i", ())),
                             order=tuple(order), error_order=tuple(rid for rid, _ in fin))


def _merged_order(lists: list[list[str]]) -> list[str]:
    """One order of the ids that keeps each list's own order (the reference ranks every list by
    one ``order``). vLLM iterates the error finishes and ``finished_recving`` separately: a request
    whose load failed is in both, and ranking the error finishes first put it ahead of a request
    that vLLM's ``finished_recving`` named before it, so the two loads' blocks went back to the
    pool in the other order (a divergence on a pristine generated run, seed 16, #28). Where the
    lists disagree, the earlier list wins (the transfer lists: their order is the free order)."""
    after: dict[str, set[str]] = {}
    ids: dict[str, None] = {}
    for seq in lists:
        ids.update(dict.fromkeys(seq))
    for seq in lists:
        for a, b in zip(seq, seq[1:]):
            if a == b or _reaches(after, b, a):
                continue  # this list disagrees with an earlier one
            after.setdefault(a, set()).add(b)
    preds = {i: 0 for i in ids}
    for a, bs in after.items():
        for b in bs:
            preds[b] += 1
    out: list[str] = []
    ready = [i for i in ids if not preds[i]]
    while ready:
        i = ready.pop(0)
        out.append(i)
        for b in sorted(after.get(i, ()), key=list(ids).index):
            preds[b] -= 1
            if not preds[b]:
                ready.append(b)
        ready.sort(key=list(ids).index)
    return out


def _reaches(after: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        x = todo.pop()
        if x == goal:
            return True
        if x not in seen:
            seen.add(x)
            todo.extend(after.get(x, ()))
    return False


class TraceConnector(SchedulerConnector):
    """A connector whose answers come from the trace (see the module docstring).

    Args:
        config: the recorded connector's knobs (:func:`connector_config`).
    """

    def __init__(self, config: ConnectorConfig) -> None:
        if not isinstance(config, ConnectorConfig):
            raise InvalidFieldError("config", config, "a ConnectorConfig")
        self.config = config
        self._script: list[list] = []
        self._pos = 0
        self._where = ""
        self.num_answers = 0

    # ---- the replay's side ----------------------------------------------------------------------
    def expect(self, entries: list | None, where: str) -> None:
        """The recorded answers of the next scheduler call (``where`` names it in a mismatch)."""
        self._script = list(entries or ())
        self._pos = 0
        self._where = where

    def leftover(self) -> None:
        """Raise if vLLM asked more than the reference did during the call."""
        if self._pos < len(self._script):
            e = self._script[self._pos]
            raise ConnectorMismatch(f"vLLM asked its connector {_NAMES[e[0]]} for {e[1]!r} during {self._where}; "
                                    "the reference did not", e[:4], None)

    def _next(self, kind: str, asked: list) -> list:
        if self._pos >= len(self._script):
            raise ConnectorMismatch(f"the reference asks the connector {_NAMES[kind]} {asked!r} during "
                                    f"{self._where}; vLLM did not", None, [kind, *asked])
        e = self._script[self._pos]
        if e[0] != kind:
            raise ConnectorMismatch(f"during {self._where} the reference asks the connector {_NAMES[kind]} "
                                    f"{asked!r}, vLLM asked {_NAMES[e[0]]} {e[1:4]!r}", e[:4], [kind, *asked])
        self._pos += 1
        self.num_answers += 1
        return e

    # ---- the scheduler-side API the reference calls ----------------------------------------------
    def on_new_request(self, request_id: str) -> None:
        pass

    def get_num_new_matched_tokens(self, request_id: str, num_tokens: int,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        e = self._next("m", [request_id, num_computed_tokens])
        if e[1] != request_id or e[2] != num_computed_tokens:
            raise ConnectorMismatch(f"get_num_new_matched_tokens during {self._where}: vLLM asked for {e[1]!r} "
                                    f"with a local hit of {e[2]} tokens, the reference for {request_id!r} with "
                                    f"{num_computed_tokens}", e[1:3], [request_id, num_computed_tokens])
        return e[3], e[4]

    def update_state_after_alloc(self, request_id: str, block_ids: BlockIdsT, num_external_tokens: int) -> None:
        e = self._next("a", [request_id])
        ref = [request_id, _groups(block_ids), num_external_tokens]
        if e[1:4] != ref:
            raise ConnectorMismatch(f"update_state_after_alloc during {self._where}: vLLM gave the connector "
                                    f"{e[1:4]!r}, the reference {ref!r} (request, block ids per group, external "
                                    "tokens)", e[1:4], ref)

    def build_connector_meta(self, scheduled_ids, finished_ids) -> None:
        pass

    def request_finished(self, request_id: str, block_ids: BlockIdsT) -> bool:
        e = self._next("f", [request_id])
        ref = [request_id, _groups(block_ids)]
        # a session-19 recorder wrote a non-HMA connector's empty single group as [] (a request
        # aborted before any allocation, e.g. behind a deferred HiSparse load)
        if e[1:3] != ref and not (e[2] == [] and ref[1] == [[]] and e[1] == request_id):
            raise ConnectorMismatch(f"request_finished during {self._where}: vLLM handed the connector "
                                    f"{e[1:3]!r}, the reference {ref!r} (request, block ids per group)", e[1:3], ref)
        return e[3]

    def get_loaded_kv_cache_group_ids(self, request_id: str, transfer_group_ids: tuple[int, ...],
                                      prefix_cacheable_group_ids: tuple[int, ...]) -> tuple[int, ...]:
        """SWA bounded replay beside a connector (#28, session 20): the groups the connector said its
        load for ``request_id`` restores when vLLM's ``_load_restores_replay_window`` asked (a
        ``["w", id, group ids]`` entry); the reference decides from them whether the load carries
        the window."""
        e = self._next("w", [request_id])
        if e[1] != request_id:
            raise ConnectorMismatch(f"during {self._where} the reference asks which groups {request_id!r}'s load "
                                    f"restores, vLLM asked it for {e[1]!r}", e[:3], ["w", request_id])
        return tuple(e[2])

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        pass

    def has_pending_block_frees(self) -> bool:
        return bool(self._next("p", [])[1])

    def reset_cache(self) -> bool | None:
        return self._next("r", [])[1]

    def check_invariants(self) -> None:
        assert 0 <= self._pos <= len(self._script), "answered past the recorded list"
        assert all(e[0] in _NAMES for e in self._script), "an unknown connector call in the script"


def multi_violation(e: list) -> str | None:
    """Whether a recorded entry's children's answers break vLLM's ``MultiConnector`` rules (None: they
    hold, or the entry has no children). The rules are the reference's ``MultiScriptedConnector``'s."""
    kind = e[0]
    kids = e[5] if kind in ("m", "f") and len(e) > 5 else e[4] if kind == "a" and len(e) > 4 else None
    if kids is None:
        return None
    if kind == "m":
        want: list = [0, False]
        for toks, load_async in kids:
            if toks is None:
                want = [None, False]
                break
            if want[0] == 0 and toks > 0:
                want = [toks, load_async]
        got = [e[3], e[4]]
        if got != want:
            return (f"MultiConnector answered get_num_new_matched_tokens for {e[1]!r} with {got}, its children "
                    f"{kids}: the first child with a hit decides ({want})")
        return None
    if kind == "a":
        nonzero = [k for k in kids if k]
        if nonzero != ([e[3]] if e[3] else []):
            return (f"MultiConnector gave its children {kids} external tokens for {e[1]!r} ({e[3]} in all): only "
                    "the child chosen at lookup loads")
        return None
    if bool(e[3]) != any(kids):
        return (f"MultiConnector answered request_finished for {e[1]!r} with delay={e[3]}, its children {kids}: the "
                "blocks stay while any child still sends them")
    return None


__all__ = ["ConnectorMismatch", "TraceConnector", "connector_config", "kv_output", "multi_violation"]
