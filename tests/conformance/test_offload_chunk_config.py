"""The OffloadingConnector's chunk-size options against vLLM's ``build_offloading_config`` (the
sweep conform-offload-worker runs first, :func:`kvref.models.machines.offload_worker.run_chunk_configs`),
a planted fault in it, and the vLLM 0.33.0 finding the sweep leaves out: a ``block_size`` of 0 tokens
is accepted (0 blocks per chunk; the connector then fails to start with ZeroDivisionError), a
negative multiple too (-2 blocks per chunk for -8 tokens)."""

from __future__ import annotations

import random

import pytest

from kvref.models.offload.world_common import OffloadInvariantError
from tests.conformance.offloading_faults import planted_edit
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


def test_chunk_options_agree_with_vllm():
    require_vllm()
    from kvref.models.machines.offload_worker import run_chunk_configs

    out = run_chunk_configs(random.Random(0), 70)  # every value in every form
    assert out["chunk_configs"] == 70 and 10 <= out["chunk_configs_refused"] <= 60, out


def test_a_planted_chunk_option_fault_is_flagged():
    require_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import config

    from kvref.models.machines.offload_worker import run_chunk_configs

    with planted_edit(config, "build_offloading_config", "if blocks_per_chunk <= 0:", "if blocks_per_chunk < 0:"):
        with pytest.raises(OffloadInvariantError, match="'blocks_per_chunk': 0"):
            run_chunk_configs(random.Random(0), 70)


def test_vllm_accepts_a_chunk_of_zero_or_negative_tokens():
    """vLLM finding (kept, reported): ``block_size`` <= 0 passes ``build_offloading_config``'s
    multiple-of-the-block check; kvref refuses it by name."""
    require_vllm()
    from kvref.impl.reference.offload.chunk_config import blocks_per_chunk
    from kvref.impl.vllm.offload import vllm_kv_cache_manager
    from kvref.impl.vllm.offload_worker import vllm_offloading_chunk_config
    from kvref.models.offload.offloading_connector_world import OffloadingConfig
    from kvref.spec.errors import InvalidFieldError

    cfg = OffloadingConfig()
    _, kcfg, _ = vllm_kv_cache_manager(cfg)
    assert vllm_offloading_chunk_config(cfg, kcfg, {"block_size": 0})[0] == 0
    assert vllm_offloading_chunk_config(cfg, kcfg, {"block_size": -8})[0] == -2
    for tokens in (0, -8):
        with pytest.raises(InvalidFieldError, match="block_size"):
            blocks_per_chunk({"block_size": tokens}, [4])
