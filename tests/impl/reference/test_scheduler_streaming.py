"""kvref's streaming-session rules (:mod:`kvref.impl.reference.scheduler_streaming`), issue #22:
the rules vLLM 0.33.0 applies when a resumable request's turn stops and an update arrives."""

from __future__ import annotations

from collections import deque

import pytest

from kvref.impl.reference import scheduler_streaming as ss
from kvref.impl.request import Request, RequestStatus
from kvref.spec.errors import InvalidFieldError


def _session(state: ss.SessionState, outputs=(7, 8, 9), computed=4, placeholders=1, in_flight=2) -> Request:
    r = Request("s", [1, 2, 3], max_tokens=3, output_token_ids=list(outputs))
    r.num_computed_tokens, r.num_output_placeholders, r.num_in_flight_tokens = computed, placeholders, in_flight
    r.status = RequestStatus.RUNNING
    state.queues["s"] = deque()
    return r


def test_a_stopped_session_without_updates_waits_holding_its_frontier():
    state = ss.SessionState()
    r = _session(state)
    assert ss.handle_stopped_request(r, state) is False
    assert r.num_computed_tokens == 3  # the materialized frontier: computed minus placeholders
    assert (r.num_output_placeholders, r.num_stale_output_tokens, r.drop_stale_output) == (0, 2, True)
    assert state.waiting_for_input == {"s"} and state.num_waiting_for_streaming_input == 1
    state.check_invariants({"s"})


def test_an_update_drops_the_final_sampled_token_and_extends_the_prompt():
    state = ss.SessionState()
    r = _session(state)
    ss.handle_stopped_request(r, state)
    assert ss.add_update(state, r, ss.StreamingUpdate((5, 6), 4, 2.0)) == "applied"
    assert r.prompt_token_ids == [1, 2, 3, 7, 8, 5, 6]  # 9, sampled but never computed, is gone
    assert r.output_token_ids == [] and r.max_tokens == 4 and r.arrival_time == 2.0
    assert r.status == RequestStatus.WAITING and not state.waiting_for_input


def test_updates_queue_while_the_session_runs_and_none_finishes_it():
    state = ss.SessionState()
    r = _session(state)
    assert ss.add_update(state, r, ss.StreamingUpdate((5,), 2)) == "queued"
    assert ss.add_update(state, r, None) == "queued"
    assert ss.handle_stopped_request(r, state) is False  # the first update applies at once
    assert r.prompt_token_ids == [1, 2, 3, 7, 8, 5] and state.queues["s"] == deque([None])
    r.output_token_ids = [4]
    assert ss.handle_stopped_request(r, state) is True  # the queued None finishes the session
    assert "s" not in state.queues


def test_a_finishing_update_of_a_waiting_session_asks_for_an_abort():
    state = ss.SessionState()
    r = _session(state)
    ss.handle_stopped_request(r, state)
    assert ss.add_update(state, r, None) == "finish"
    ss.forget(state, "s")
    assert state.num_waiting_for_streaming_input == 0 and not state.queues


def test_a_request_that_is_no_session_just_finishes():
    state = ss.SessionState()
    r = Request("x", [1], output_token_ids=[2])
    assert ss.handle_stopped_request(r, state) is True
    assert r.output_token_ids == [2]


def test_bad_input_names_the_field():
    state = ss.SessionState()
    r = _session(state, computed=3, placeholders=0)
    with pytest.raises(InvalidFieldError, match="num_computed_tokens"):
        r.num_computed_tokens = 6  # beyond the final sampled token
        ss.update_request_as_session(r, ss.StreamingUpdate((1,), 1))
    with pytest.raises(InvalidFieldError, match="request_id"):
        ss.add_update(state, Request("other", [1]), None)
    with pytest.raises(InvalidFieldError, match="max_tokens"):
        ss.StreamingUpdate((1,), 0)


def test_invariants_catch_a_waiting_session_with_queued_updates():
    state = ss.SessionState()
    r = _session(state)
    ss.handle_stopped_request(r, state)
    state.queues["s"].append(None)
    with pytest.raises(AssertionError, match="Q11"):
        state.check_invariants({"s"})
