"""`kvref verify` on the vLLM people have: dev versions, a moved API, deliberate behaviour changes.

Everything here patches the *imported* vLLM in-process (monkeypatch, undone after each test); the
installed files are never touched.
"""

from __future__ import annotations

import json
import os

import pytest

from kvref import cli
from kvref.impl.vllm import installed
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm():
    return require_vllm()


@pytest.fixture
def fresh_description():
    installed.describe_installed_vllm.cache_clear()
    yield
    installed.describe_installed_vllm.cache_clear()


def _verify(capsys, *argv):
    rc = cli.main(["verify", "--json", *argv])
    out = json.loads(capsys.readouterr().out)
    return rc, out, {c["name"]: c for c in out["checks"]}


def test_dev_version_runs_every_check_and_reports_what_it_checked(vllm, monkeypatch, capsys, fresh_description):
    monkeypatch.setattr(vllm, "__version__", "0.33.1.dev12+gdeadbee")
    for against in ([], ["--against", "vllm"]):
        rc, out, checks = _verify(capsys, "--only", "conform-kv-manager", *against)
        assert rc == 0, out
        assert checks["conform-kv-manager"]["status"] == "passed"  # not skipped, not failed
        assert out["vllm"]["version"] == "0.33.1.dev12+gdeadbee"
        assert out["vllm"]["git_commit"] == "deadbee"
        assert out["vllm"]["path"] == os.path.dirname(vllm.__file__)
        assert out["vllm"]["reference_version"] == "0.33.0"


def test_describe_names_a_checkout_commit_and_the_modelled_version(fresh_description, monkeypatch):
    info = installed.VllmInstall(True, "0.34.0rc1", "/src/vllm/vllm", "0123456789abcdef0123", True)
    text = info.describe()
    assert "0.34.0rc1" in text and "/src/vllm/vllm" in text and "0123456789ab" in text and "dirty" in text
    assert "kvref models 0.33.0" in text
    assert installed.VllmInstall(True, "0.33.0", "/x").describe() == "vLLM 0.33.0 at /x"
    assert installed._commit_from_version("0.33.1.dev12+gdeadbee.d20261124") == "deadbee"
    assert installed._commit_from_version("0.33.0") is None


def test_junit_and_table_name_the_vllm(vllm, monkeypatch, capsys, tmp_path, fresh_description):
    monkeypatch.setattr(vllm, "__version__", "0.33.1.dev3+gabc1234")
    xml = tmp_path / "r.xml"
    assert cli.main(["verify", "--only", "conform-kv-manager", "--junit-xml", str(xml)]) == 0
    table = capsys.readouterr().out
    assert "0.33.1.dev3+gabc1234" in table.replace("\n", "")
    text = xml.read_text()
    assert 'name="vllm.version" value="0.33.1.dev3+gabc1234"' in text
    assert 'name="vllm.git_commit" value="abc1234"' in text


def test_a_renamed_method_is_an_error_naming_it_and_other_checks_still_run(vllm, monkeypatch, capsys):
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    monkeypatch.setattr(KVCacheManager, "allocate_slots_v2", KVCacheManager.allocate_slots, raising=False)
    monkeypatch.delattr(KVCacheManager, "allocate_slots")
    rc, out, checks = _verify(capsys, "--only", "spec", "conform-kv-manager", "conform-planning", "--against", "vllm")
    assert rc == 1
    kv = checks["conform-kv-manager"]
    assert kv["status"] == "error"
    assert "KVCacheManager" in kv["summary"] and "'allocate_slots'" in kv["summary"]
    assert checks["conform-planning"]["status"] == "passed"  # does not bind to the KV cache manager
    assert checks["spec"]["status"] == "passed"


def test_a_changed_signature_is_an_error_naming_the_parameter(vllm, monkeypatch, capsys):
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    original = KVCacheManager.allocate_slots

    def allocate_slots(self, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None,
                       num_lookahead_tokens=0, num_external_computed_tokens=0, delay_cache_blocks=False,
                       full_sequence_must_fit=False, has_scheduled_reqs=True):  # reserved_blocks dropped
        return original(self, request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                        num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks)

    monkeypatch.setattr(KVCacheManager, "allocate_slots", allocate_slots)
    rc, out, checks = _verify(capsys, "--only", "conform-kv-manager", "startup-liveness")
    assert rc == 1
    for name in ("conform-kv-manager", "startup-liveness"):
        assert checks[name]["status"] == "error"
        assert "'reserved_blocks'" in checks[name]["summary"]


def _fifo_uncached_blocks(monkeypatch):
    """A deliberate behaviour change: freed *uncached* blocks go to the back of the free queue
    (FIFO) instead of the front (vLLM 0.33.0 reuses them LIFO, for GPU locality)."""
    from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue

    monkeypatch.setattr(FreeKVCacheBlockQueue, "prepend_n", FreeKVCacheBlockQueue.append_n)


def _free_count_off_by_one(monkeypatch):
    """A second, unrelated change: the pool's free-block counter counts one block too many."""
    from vllm.v1.core.block_pool import BlockPool

    original = BlockPool.get_num_free_blocks
    monkeypatch.setattr(BlockPool, "get_num_free_blocks", lambda self: original(self) + 1)


def test_a_behaviour_change_is_a_finding_with_one_trace_and_a_replay_line(vllm, monkeypatch, capsys, tmp_path):
    _fifo_uncached_blocks(monkeypatch)
    out_dir = tmp_path / "cex"
    rc, out, checks = _verify(capsys, "--only", "conform-kv-manager", "--against", "vllm", "--out", str(out_dir))
    assert rc == 1
    kv = checks["conform-kv-manager"]
    assert kv["status"] == "failed"
    assert kv["signature"] and not any(ch.isdigit() for ch in kv["signature"])  # id-free form
    assert any("kvref replay" in line for line in kv["details"]) or "kvref replay" in kv["summary"]
    traces = sorted(p.name for p in out_dir.iterdir())
    assert len(traces) == 1, traces  # one trace per distinct finding, not one per shrink step
    assert kv["artifacts"] == [str(out_dir / traces[0])]


def test_baseline_accepts_a_deliberate_change_and_still_fails_a_new_one(vllm, monkeypatch, capsys, tmp_path):
    base = tmp_path / "kvref-baseline.json"
    args = ("--only", "conform-kv-manager", "--against", "vllm", "--out", str(tmp_path / "cex"))
    with monkeypatch.context() as m:
        _fifo_uncached_blocks(m)
        rc, out, checks = _verify(capsys, *args, "--update-baseline", str(base))
        assert rc == 0  # record mode: every difference met is accepted and written down
        entries = json.loads(base.read_text())["accepted"]
        assert entries and {e["check"] for e in entries} == {"conform-kv-manager"}
        assert {e["signature"] for e in entries} == set(checks["conform-kv-manager"]["met_signatures"])
        assert all(e["reason"].startswith("TODO") for e in entries)  # the developer says why

        rc, out, checks = _verify(capsys, *args, "--baseline", str(base))
        assert rc == 0, checks
        assert checks["conform-kv-manager"]["status"] == "accepted"
        assert "accept" in checks["conform-kv-manager"]["summary"]

        _free_count_off_by_one(m)  # a new difference on top of the accepted ones
        rc, out, checks = _verify(capsys, *args, "--baseline", str(base))
        assert rc == 1
        assert checks["conform-kv-manager"]["status"] == "failed"
        assert checks["conform-kv-manager"]["signature"] not in {e["signature"] for e in entries}
        # the counter's first symptom: an invariant or comparison naming the free count, or (since the
        # machine admits at the pool's exact edge) vLLM's own allocation failing on the blocks it
        # thought were free
        sig = checks["conform-kv-manager"]["signature"]
        assert "free" in sig or "allocate_slots" in sig, sig


@pytest.mark.parametrize("text, where", [
    ("{", "line 1 column 2"),
    ('{"kvref_baseline": 2, "accepted": []}', "kvref_baseline"),
    ('{"kvref_baseline": 1, "accepted": [{"check": "x"}]}', "accepted[0].signature"),
    ('{"kvref_baseline": 1, "accepted": [{"check": "x", "signature": "y", "why": 1}]}', "accepted[0].why"),
])
def test_a_broken_baseline_is_an_input_error_naming_file_and_position(tmp_path, capsys, text, where):
    base = tmp_path / "b.json"
    base.write_text(text)
    assert cli.main(["verify", "--only", "spec", "--baseline", str(base)]) == 2
    err = capsys.readouterr().err
    assert str(base) in err and where in err


def _no_prefix_hits(monkeypatch):
    """A deliberate change at the scheduler's level: prefix-cache lookups never hit."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    original = KVCacheManager.get_computed_blocks

    def get_computed_blocks(self, request, *args, **kwargs):
        _blocks, _num_hit, *rest = original(self, request, *args, **kwargs)
        return (self.empty_kv_cache_blocks, 0, *rest)

    monkeypatch.setattr(KVCacheManager, "get_computed_blocks", get_computed_blocks)


def test_scheduler_conformance_searches_past_accepted_differences(vllm, monkeypatch, capsys, tmp_path):
    base = tmp_path / "b.json"
    args = ("--only", "conform-scheduler", "--against", "vllm", "--out", str(tmp_path / "cex"))
    with monkeypatch.context() as m:
        _no_prefix_hits(m)
        rc, out, checks = _verify(capsys, *args)
        assert rc == 1 and checks["conform-scheduler"]["status"] == "failed"
        assert checks["conform-scheduler"]["signature"]
        rc, out, checks = _verify(capsys, *args, "--update-baseline", str(base))
        sigs = {e["signature"] for e in json.loads(base.read_text())["accepted"]}
        assert sigs and sigs == set(checks["conform-scheduler"]["met_signatures"])
        rc, out, checks = _verify(capsys, *args, "--baseline", str(base))
        assert rc == 0, checks
        assert checks["conform-scheduler"]["status"] == "accepted"
        assert "search went on past them" in checks["conform-scheduler"]["summary"]
