"""The KVCR config cases build vLLM's tier again on a fresh control port when another process took
the free port first (EADDRINUSE): the full suite once failed conform-tiering's config test that way
while a ``kvref verify`` ran beside it. Any other refusal, or a refusal the reference predicts, is
still the config's verdict."""

from __future__ import annotations

import pytest

from kvref.models.machines.tiering_config import _build_retrying_port_races


class _Build:
    def __init__(self, errors):
        self.errors = list(errors)
        self.ports = []

    def __call__(self, n, tiers, clock, self_describing_events):
        self.ports.append(tiers[1]["control_ports"][0])
        if self.errors:
            raise self.errors.pop(0)
        return "world"


def test_a_port_taken_meanwhile_is_retried_on_a_fresh_port():
    build = _Build([OSError("[Errno 98] Address already in use (while attempting to bind)")])
    cfg = {"type": "kvcr", "control_ports": [1]}
    assert _build_retrying_port_races(build, cfg, True, None) == "world"
    assert len(build.ports) == 2 and build.ports[0] == 1 and build.ports[1] != 1


def test_a_predicted_refusal_or_another_error_is_not_retried():
    addr = OSError("[Errno 98] Address already in use")
    build = _Build([addr])
    with pytest.raises(OSError):
        _build_retrying_port_races(build, {"control_ports": [1]}, True, ("ValueError", "control_ports"))
    assert len(build.ports) == 1
    build = _Build([ValueError("router capabilities")])
    with pytest.raises(ValueError):
        _build_retrying_port_races(build, {"control_ports": [1]}, True, None)
    assert len(build.ports) == 1


def test_three_races_in_a_row_surface():
    build = _Build([OSError("Address already in use")] * 3)
    with pytest.raises(OSError):
        _build_retrying_port_races(build, {"control_ports": [1]}, True, None)
    assert len(build.ports) == 3
