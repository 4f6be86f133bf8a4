"""One local Ray cluster for the ``--ray`` test modules after tests/cli/test_ray.py (which starts and
ends its own): 2 CPUs, no dashboard, on 127.0.0.1 only; started once per session (a start costs
~7 s on the 2 shared cores)."""

from __future__ import annotations

import os

import pytest

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray's import: every address 127.0.0.1
ray = pytest.importorskip("ray", reason="Ray not installed: pip install 'kvref[ray]' (requirements/test.txt pins it)")


@pytest.fixture(scope="session")
def ray_cluster():
    """The cluster's address (127.0.0.1:port), for ``--ray`` in a subprocess."""
    from kvref.ray_runner import loopback_only

    for k, v in {"VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1",
                 "TRANSFORMERS_OFFLINE": "1"}.items():
        os.environ.setdefault(k, v)
    loopback_only(ray)
    if ray.is_initialized():  # a cluster another module's in-process run left behind
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False,
             logging_level="warning")
    address = ray.get_runtime_context().gcs_address
    assert address.startswith("127.0.0.1:") and {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
    yield address
    ray.shutdown()
