"""vLLM 0.33.0's SharedOffloadRegion (the CPU offload tier's /dev/shm region) vs kvref's layout
(#22): generated regions agree and reach splitting, refused creations and views, kept mappings;
planted faults in vLLM's code are found. Cases come from a seeded ``random.Random``."""

from __future__ import annotations

import pytest

from kvref.models.machines.shared_offload_region import run_region_cases
from tests.conftest import profile_examples
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def Region():
    require_vllm()
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    return SharedOffloadRegion


def test_generated_regions_agree_and_reach_every_path(Region):
    totals = run_region_cases(0, profile_examples(40, 200))
    for key in ("regions", "segmented", "views", "refused_views", "retained", "refused_creations", "prefilled",
                "fallback_populate", "failed_collectives", "late_creator_failures", "refused_populates",
                "second_cleanups", "stale_stubs"):
        assert totals[key] > 0, (key, totals)


def test_a_view_one_byte_off_is_found(Region, monkeypatch):
    import torch

    original = Region.create_next_worker_view

    def shifted(self, tensor_page_size):
        v = original(self, tensor_page_size)
        return torch.as_strided(self._base, v.shape, v.stride(), v.storage_offset() + 1)

    monkeypatch.setattr(Region, "create_next_worker_view", shifted)
    with pytest.raises(AssertionError, match="SharedOffloadRegion"):
        run_region_cases(0, 40)


def test_files_left_behind_are_found(Region, monkeypatch):
    """Never removed: the files outlive cleanup, and a failed creator's joiners wait for a file
    nobody will size (vLLM gives up after a timeout, shortened here)."""
    from kvref.impl.vllm import shared_region

    monkeypatch.setattr(shared_region, "JOIN_TIMEOUT_S", 0.5)
    monkeypatch.setattr(Region, "_unlink", lambda self: None)
    with pytest.raises(AssertionError, match="exist|left|creator failing"):
        run_region_cases(0, 40)


def test_a_fallback_prefault_that_loses_bytes_is_found(Region, monkeypatch):
    """Old kernels pre-fault page by page; a fallback writing zeros instead of keeping the bytes
    an earlier worker stored there loses its KV."""
    import mmap

    import numpy as np
    import vllm.v1.kv_offload.cpu.shared_offload_region as mod

    def zeroing(mmap_obj, offset, length):
        np.frombuffer(mmap_obj, dtype=np.uint8)[offset:offset + length:mmap.PAGESIZE] = 0

    monkeypatch.setattr(mod, "_fallback_populate_write", zeroing)
    with pytest.raises(AssertionError, match="lost them"):
        run_region_cases(0, 8)


def test_a_leaked_descriptor_is_found(Region, monkeypatch):
    """A region that never closes its file descriptor (at cleanup or after a failed construction)."""
    import os
    import types

    import vllm.v1.kv_offload.cpu.shared_offload_region as mod

    leaky = types.SimpleNamespace(**{k: getattr(os, k) for k in dir(os) if not k.startswith("__")})
    leaky.close = lambda fd: None
    monkeypatch.setattr(mod, "os", leaky)
    with pytest.raises(AssertionError, match="descriptors"):
        run_region_cases(0, 8)


def test_a_mapping_never_unmapped_is_found(Region, monkeypatch):
    """A region that never unmaps (at cleanup or after a failed construction): planted, closing the
    mapping does nothing."""
    import mmap
    import types

    import vllm.v1.kv_offload.cpu.shared_offload_region as mod

    kept = []

    class NoClose(mmap.mmap):
        def close(self):
            kept.append(self)  # stays mapped for the rest of the test

    shim = types.SimpleNamespace(**{k: getattr(mmap, k) for k in dir(mmap) if not k.startswith("__")})
    shim.mmap = NoClose
    monkeypatch.setattr(mod, "mmap", shim)
    with pytest.raises(AssertionError, match="mapped"):
        run_region_cases(0, 8)
