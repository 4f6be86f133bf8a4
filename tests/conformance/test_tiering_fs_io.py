"""vLLM 0.33.0's fs tier when a store's write fails (#22): a store job the trace fails runs vLLM's
own block writer with writes that come up short (a full disk), so ``_store_block`` raises, removes
its temporary file and the job fails as the reference says; no temporary file may be left behind.
A successful store may race another writer: the block is published between ``_store_block``'s
"exists?" check and its rename, which fails with ``EEXIST`` (shared filesystems that do not
replace); vLLM counts the block stored and removes its temporary file, as the reference says.
Faults planted in vLLM's write path, and in the reference, are found."""

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
    # a rename that meets EEXIST fails the store (the block another writer published is not counted)
    ("_store_block", "except FileExistsError:", "except ():"),
    # a rename that meets EEXIST leaves the temporary file behind
    ("_store_block", "            with contextlib.suppress(OSError):\n                os.remove(tmp_path)",
     "            pass"),
]


@pytest.mark.parametrize("function,old,new", PLANTED, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(PLANTED)])
def test_planted_faults_are_found(function, old, new):
    require_vllm()
    from kvref.models.machines.tiering import TieringDivergence

    with edited(IO, None, function, old, new), pytest.raises(TieringDivergence):
        _traces(0, 4)


def test_rename_races_count_as_stored():
    """The seeded traces race some stores' renames (its own generator: the traces are unchanged),
    and vLLM agrees with the reference on every one (the job succeeds, the key is stored, no
    temporary file is left, the same number of blocks raced). 4 traces: ~15 s CPU at CI=true."""
    stats = _traces(0, 4)
    assert stats["fs_rename_races"] > 0, stats


def test_reference_failing_a_raced_store_is_found(monkeypatch):
    """The planted fault on the reference's side: a raced rename fails the store."""
    require_vllm()
    from kvref.impl.reference.offload.tiering.fs_tier import FileSystemTier
    from kvref.models.machines.tiering import TieringDivergence

    real = FileSystemTier.finish_job

    def raced_is_failed(self, job_id, io_error=False, rename_race=False):
        return real(self, job_id, io_error or rename_race)

    monkeypatch.setattr(FileSystemTier, "finish_job", raced_is_failed)
    with pytest.raises(TieringDivergence):
        _traces(0, 4)


def test_rename_races_beside_an_obj_tier():
    """An fs tier after an obj tier (whose jobs never race): the races reach the fs tier only and
    agree; the obj tier's finish_job is called as before (a regression of 90640a4's fix)."""
    require_vllm()
    from kvref.models.machines.tiering import run_traces

    stats = run_traces(0, 3, layouts=(("obj", "fs"),))
    assert stats["traces"] == 3 and stats["fs_rename_races"] > 0, stats
