"""kvref.impl.vllm.loopback_port: a port a vLLM component binds itself, kept out of the ephemeral range."""

from __future__ import annotations

import socket

from kvref.impl.vllm import loopback_port


def test_the_port_is_free_and_below_the_ephemeral_range():
    low = loopback_port._ephemeral_low()
    for _ in range(20):
        port = loopback_port.free_loopback_port()
        assert 1025 <= port < low
        with socket.create_server(("127.0.0.1", port)):  # bindable: nothing holds it
            pass


def test_a_taken_port_is_never_handed_out(monkeypatch):
    held = socket.create_server(("127.0.0.1", 0))
    taken = held.getsockname()[1]
    draws = iter([taken, taken, taken + 1 if taken < 65535 else taken - 1])
    monkeypatch.setattr(loopback_port.random.SystemRandom, "randrange", lambda self, a, b: next(draws))
    try:
        assert loopback_port.free_loopback_port() != taken
    finally:
        held.close()
