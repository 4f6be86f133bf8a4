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
    for key in ("regions", "segmented", "views", "refused_views", "retained", "refused_creations"):
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
    monkeypatch.setattr(Region, "_unlink", lambda self: None)
    with pytest.raises(AssertionError, match="exist|left"):
        run_region_cases(0, 40)
