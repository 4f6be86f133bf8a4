"""vLLM 0.33.0's fs tier when a store's write fails (#22): a store job the trace fails runs vLLM's
own block writer with writes that come up short (a full disk), so ``_store_block`` raises, removes
its temporary file and the job fails as the reference says; no temporary file may be left behind.
Faults planted in vLLM's write path are found."""

from __future__ import annotations

import pytest

from tests.conformance.tiering_planted import edited
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

IO = "vllm.v1.kv_offload.tiering.fs.io"
LAYOUTS = (("fs",), ("fs", "example"), ("fs", "fs"))


def _traces(seed: int, n: int) -> dict:
    require_vllm()
    from kvref.models.machines.tiering import run_traces

    return run_traces(seed, n, layouts=LAYOUTS)


def test_failed_stores_fail_in_vllms_write_path():
    """Seeded traces (no Hypothesis draw): the same under every profile."""
    stats = _traces(0, 4)
    assert stats["traces"] == 4 and stats["fs_short_writes"] > 0, stats


PLANTED = [
    # a failed store leaves its temporary file behind
    ("_store_block", "            os.remove(tmp_path)\n        except OSError as cleanup_exc:",
     "            pass\n        except OSError as cleanup_exc:"),
    # a short write is not noticed: half a block is published as the block
    ("_store_block", "if written < len(view_slice):", "if False:"),
]


@pytest.mark.parametrize("function,old,new", PLANTED, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(PLANTED)])
def test_planted_faults_are_found(function, old, new):
    require_vllm()
    from kvref.models.machines.tiering import TieringDivergence

    with edited(IO, None, function, old, new), pytest.raises(TieringDivergence):
        _traces(0, 4)
