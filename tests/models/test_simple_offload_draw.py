"""The SimpleCPU offload cases a seed draws are the same in every process (issue #22).

``SimpleOffloadConfig.random`` seeds its side generator from ``rng``'s state; that state ends in
``gauss_next`` (None), and Python 3.11 hashes None by its address, so hashing the whole state gave
a different scheduling mode / KV-events draw in each process: conform-offload's SimpleCPU cases,
and the vLLM code they reach, changed from run to run of one seed. Two interpreters with different
``PYTHONHASHSEED`` (and so different address layouts) must draw the same configurations.
"""

from __future__ import annotations

import os
import subprocess
import sys

_DRAW = ("import random\n"
         "from kvref.models.offload.simple_cpu_world import SimpleOffloadConfig\n"
         "rng = random.Random(0)\n"
         "print([SimpleOffloadConfig.random(rng) for _ in range(12)])\n")


def _draw(hash_seed: str) -> str:
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    return subprocess.run([sys.executable, "-c", _DRAW], env=env, capture_output=True, text=True,
                          check=True, timeout=120).stdout


def test_simple_offload_configs_are_the_same_in_every_process():
    first = _draw("1")
    assert "SimpleOffloadConfig(" in first
    assert _draw("2") == first
    assert _draw("3") == first
