"""The replay finishes failed-load requests in the order the recorded vLLM did (issue #28).

vLLM 0.33.0's ``update_from_output`` finishes the requests whose load failed by iterating one set
(``finish_requests(error_req_ids)``) and then walks ``finished_recving``, another set; both orders
follow the recording process's hash seed. The replay used one merged rank for both, in which the
``finished_recving`` order wins where they disagree, so the reference handed the connector its
``request_finished`` calls in another order than vLLM on about one run in four (a flaky divergence
of ``tests/record/test_record_connector.py`` on pristine vLLM). The error finishes now keep their
own recorded order."""

from __future__ import annotations

from kvref.impl.reference.scheduler_connector import _in_order
from kvref.models.run_check.connector import kv_output


def test_error_finishes_keep_their_recorded_order_when_the_transfer_list_disagrees():
    kvo = kv_output({"r": ["r4", "r3"], "f": ["r3", "r4"]}, fin=[["r3", "error"], ["r4", "error"]])
    assert kvo.error_order == ("r3", "r4")
    assert list(_in_order({"r3", "r4"}, kvo, errors=True)) == ["r3", "r4"]
    # finished_recving keeps the transfer list's own order
    assert list(_in_order({"r3", "r4"}, kvo)) == ["r4", "r3"]


def test_without_a_recorded_error_order_the_merged_order_serves():
    kvo = kv_output({"r": ["b", "a"]})
    assert kvo.error_order == ()
    assert list(_in_order({"a", "b"}, kvo, errors=True)) == ["b", "a"]
