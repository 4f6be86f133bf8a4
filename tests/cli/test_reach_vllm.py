"""``kvref verify --reach`` and ``--changed-since`` driving the installed vLLM (#22), each in a
subprocess (coverage.py must start before vLLM is imported, and ``--changed-since`` needs a vLLM
checkout first on ``PYTHONPATH``). One cheap check (startup-liveness, fast profile) per run."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys

import pytest

from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1"}


def _verify(args, tmp_path, pythonpath=None):
    env = {**os.environ, **ENV}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-m", "kvref.cli", "verify", "--against", "vllm", "--only",
                           "startup-liveness", "--out", str(tmp_path / "out"), *args],
                          capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    return proc


def _function_count(path):
    tree = ast.parse(open(path, encoding="utf-8").read())
    return sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(tree))


def test_reach_counts_functions_executed_and_not_applies_and_validates_exclusions(tmp_path):
    require_vllm()
    excl = tmp_path / "excl.toml"
    excl.write_text(
        '[[exclude]]\nmodule = "vllm/v1/core/kv_cache_manager.py"\nfunctions = ["KVCacheManager.allocate_slots"]\n'
        'reason = "needs-gpu"\nwhy = "wrong on purpose: it runs"\n'
        '[[exclude]]\nmodule = "vllm/v1/core/block_pool.py"\nfunctions = ["BlockPool.no_such_method"]\n'
        'reason = "needs-gpu"\nwhy = "wrong on purpose: it does not exist"\n'
        '[[exclude]]\nmodule = "vllm/v1/core/sched/scheduler.py"\nfunctions = ["Scheduler.update_draft_token_ids"]\n'
        'reason = "outside-kv-cache"\nwhy = "test entry"\n')
    proc = _verify(["--reach", str(tmp_path / "reach"), "--reach-exclusions", str(excl), "--json"], tmp_path)
    assert proc.stdout.startswith("{"), proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert proc.returncode == 1, proc.stderr[-2000:]  # the stale entries fail the reach row
    rows = {c["name"]: c for c in out["checks"]}
    assert rows["startup-liveness"]["status"] == "passed"
    assert rows["reach"]["status"] == "failed"
    reach = out["reach"]
    assert {(s["module"], s["function"]) for s in reach["stale_exclusions"]} == {
        ("vllm/v1/core/kv_cache_manager.py", "KVCacheManager.allocate_slots"),
        ("vllm/v1/core/block_pool.py", "BlockPool.no_such_method")}
    assert reach["checks"] == ["startup-liveness"]
    mods = {m["module"]: m for m in reach["modules"]}
    # every function of a module is counted (ast is the oracle), executed or not
    for rel in ("vllm/v1/core/kv_cache_manager.py", "vllm/v1/core/sched/scheduler.py"):
        assert mods[rel]["functions"] == _function_count(os.path.join(reach["vllm_root"], rel))
    kvm = {f["name"]: f for f in mods["vllm/v1/core/kv_cache_manager.py"]["function_details"]}
    assert kvm["KVCacheManager.allocate_slots"]["executed"]
    assert kvm["KVCacheManager.allocate_slots"]["checks"] == ["startup-liveness"]
    assert kvm["KVCacheManager.allocate_slots"]["excluded"] is None  # a stale entry excludes nothing
    assert 0 < mods["vllm/v1/core/kv_cache_manager.py"]["functions_executed"] < mods[
        "vllm/v1/core/kv_cache_manager.py"]["functions"]
    sched = {f["name"]: f for f in mods["vllm/v1/core/sched/scheduler.py"]["function_details"]}
    draft = sched["Scheduler.update_draft_token_ids"]
    assert not draft["executed"] and draft["excluded"] == "outside-kv-cache"
    # the figure is the sum of the modules, the excluded share that one function
    fig = reach["figure"]
    assert fig["total"] == sum(m["units"] for m in reach["modules"])
    assert fig["covered"] == sum(m["covered"] for m in reach["modules"])
    assert fig["excluded"] == draft["statements"] + draft["branches"] > 0
    assert fig["counted"] == fig["total"] - fig["excluded"]
    assert abs(fig["percent"] - 100 * fig["covered"] / fig["counted"]) < 0.01
    assert rows["reach"]["summary"].startswith(f"2 problem(s) with the reach lists; reach {fig['percent']:.1f} % of ")
    for key in ("html", "functions_html", "listing"):
        assert os.path.isfile(reach[key]), key
    listing = open(reach["listing"], encoding="utf-8").read()
    assert "Scheduler.update_draft_token_ids" in listing and "MISSED" in listing


def _checkout(tmp_path, vllm_dir):
    """A git checkout whose vllm/ is the installed package: files symlinked (800 MB of binaries are
    not copied), the two files the test edits copied for real."""
    co = tmp_path / "co"
    co.mkdir()
    subprocess.run(["cp", "-rs", vllm_dir, str(co / "vllm")], check=True)
    edited = ["vllm/v1/core/block_pool.py", "vllm/v1/core/sched/utils.py"]
    for rel in edited:
        target = os.path.realpath(co / rel)
        os.remove(co / rel)
        shutil.copyfile(target, co / rel)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=co, check=True)
    subprocess.run([*git, "add", "-A", "."], cwd=co, check=True)
    subprocess.run([*git, "commit", "-qm", "vLLM as installed"], cwd=co, check=True)
    return co


def _edit(path, anchor, line):
    """Insert ``line`` before the first line starting with ``anchor`` (same indentation); its number."""
    text = open(path, encoding="utf-8").read().splitlines(keepends=True)
    i = next(i for i, t in enumerate(text) if t.strip().startswith(anchor))
    indent = text[i][:len(text[i]) - len(text[i].lstrip())]
    text.insert(i, indent + line + "\n")
    open(path, "w", encoding="utf-8").write("".join(text))
    return i + 1


def test_changed_since_reports_checked_and_unchecked_changed_functions(tmp_path):
    vllm = require_vllm()
    co = _checkout(tmp_path, os.path.dirname(os.path.realpath(vllm.__file__)))
    # BlockPool.get_new_blocks runs whenever a request gets blocks; check_stop only in the scheduler
    ran = _edit(co / "vllm/v1/core/block_pool.py", "if num_blocks > self.get_num_free_blocks():",
                "num_blocks = int(num_blocks)")
    unrun = _edit(co / "vllm/v1/core/sched/utils.py", "sampling_params = request.sampling_params",
                  "max_model_len = int(max_model_len)")
    bad = _verify(["--changed-since", "no-such-ref"], tmp_path, pythonpath=str(co))
    assert bad.returncode == 2
    assert bad.stderr.strip().count("\n") == 0 and "--changed-since" in bad.stderr and "no-such-ref" in bad.stderr
    proc = _verify(["--changed-since", "HEAD", "--reach", str(tmp_path / "reach"), "--json"], tmp_path,
                   pythonpath=str(co))
    assert proc.stdout.startswith("{"), proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    assert out["reach"]["vllm_root"] == str(co)  # the checkout's vLLM was the one measured
    assert proc.returncode == 1, proc.stderr[-2000:]  # an unchecked change fails the changed-since row
    rows = {c["name"]: c for c in out["checks"]}
    assert rows["changed-since"]["status"] == "failed"
    changed = {(c["module"], c["function"]): c for c in out["reach"]["changed_since"]["functions"]}
    assert set(changed) == {("vllm/v1/core/block_pool.py", "BlockPool.get_new_blocks"),
                            ("vllm/v1/core/sched/utils.py", "check_stop")}
    hit = changed[("vllm/v1/core/block_pool.py", "BlockPool.get_new_blocks")]
    assert hit["checked"] and hit["changed_lines"] == [ran] and hit["checks"] == ["startup-liveness"]
    assert hit["calls"]["startup-liveness"] > 0
    miss = changed[("vllm/v1/core/sched/utils.py", "check_stop")]
    assert not miss["checked"] and miss["changed_lines"] == [unrun] and miss["calls"] == {}
    assert miss["verdict"] == "kvref did not check this change"
    assert "sched/utils.py:check_stop — kvref did not check this change" in rows["changed-since"]["summary"]
