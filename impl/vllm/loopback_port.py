"""A loopback port for a vLLM component that takes a port number and binds it itself.

vLLM's KVCR tier (``control_ports``) and the P2P side channel (``VLLM_P2P_SIDE_CHANNEL_PORT``) take a
number, not 0, so the harness picks the port before vLLM binds it. A port from ``bind(0)`` is an
ephemeral port that any socket of this or another process (NIXL/UCX's, a parallel test's) may take
in between: seen as ``KVCRStartupError: [Errno 98] Address already in use`` in a loaded test run.
Below the kernel's ephemeral range only an explicit bind takes a port, and the draw is random, so
two processes rarely pick the same one.
"""

from __future__ import annotations

import random
import socket


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_loopback_port(host: str = "127.0.0.1") -> int:
    """A loopback port free now, drawn below the ephemeral range. vLLM's KVCR config takes a port
    number, not 0, so the port is chosen before kvcr binds it; one from ``bind(0)`` is an ephemeral
    port that any socket of this or another process (NIXL/UCX's, a parallel test's) may take in
    between (seen: ``KVCRStartupError: [Errno 98] Address already in use`` under a loaded suite).
    Below the ephemeral range only an explicit bind takes a port, and the draw is random."""
    low = max(1025, min(_ephemeral_low(), 65536) - 12000)
    high = max(low + 1000, _ephemeral_low())
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(low, high)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the whole draw was taken: fall back to the kernel's choice
        s.bind((host, 0))
        return s.getsockname()[1]
