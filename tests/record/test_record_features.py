"""check-run replays multimodal requests, LoRA, lookahead block hashes and the Mamba shared-prefix
checkpoint (issue #28).

The recorder named all four unmodelled and check-run fell back to the run properties from line 1.
Now the header carries their settings (encoder limits, ``max_loras``, the V2 runner,
``num_hash_lookahead_tokens``, the checkpoint switch), arrivals their items and adapters, steps their
encoder inputs and evictions, and the replay follows them on the reference configured the same way.

Generated runs of each feature (the conform-scheduler machines' draws, :mod:`kvref.models.run_check.
feature_runs`) are recorded from vLLM's own ``Scheduler`` / ``AsyncScheduler`` through
``scheduler_cls``: every one is replayed step by step and agrees, and holds every property alone. The
same draws recorded from a vLLM with a fault planted in the feature's path are flagged by the replay:

* LoRA: the adapter left out of the block hashes (``_gen_lora_extra_hash_keys`` returns nothing):
  prefix hits across adapters;
* multimodal: the encoder cache never reports a hit (``check_and_update_cache``): items encoded
  again (or vLLM crashes);
* lookahead hashes: the engine's block hasher built without the lookahead tokens;
* the Mamba checkpoint: vLLM's scheduler ignoring it (chunks stop at the junction's block floor).

Seeded, with a fixed number of runs: every profile records the same runs.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter

import pytest
from kvref.models.run_check import check_trace
from kvref.models.run_check.feature_runs import FEATURES, record_feature_runs

from kvref import cli
from kvref.impl.vllm.record_faults import FEATURE_FAULTS
from tests.record.traces import assert_agrees_and_holds, pristine_and_faulty_runs, read_lines
from tests.vllm_env import require_vllm

pytestmark = pytest.mark.vllm

#: feature -> (seed, runs): draws that reach the feature's path and the planted fault (checked below)
DRAWS = {"lora": (0, 6), "multimodal": (0, 6), "hash-lookahead": (0, 6), "mamba-checkpoint": (0, 8)}
STEPS = 30
#: the fault planted in each feature's path (kvref/impl/vllm/record_faults.py)
FAULT = {feature: name for name, (feature, _) in FEATURE_FAULTS.items()}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """feature -> (pristine runs, runs of the same draws on a vLLM with the fault planted)."""
    return pristine_and_faulty_runs(tmp_path_factory, DRAWS, FAULT, STEPS)


def _shows(path) -> Counter:
    """What a trace shows of the features."""
    c: Counter = Counter()
    for rec in read_lines(path)[1:]:
        if rec["t"] == "add":
            c["lora"] += bool(rec.get("lora"))
            c["mm"] += bool(rec.get("mm"))
        elif rec["t"] == "sched":
            for k in ("enc", "efree", "eupd"):
                c[k] += bool(rec.get(k))
        elif rec["t"] == "update":
            stats = rec.get("stats") or {}
            c["skipped_waiting"] += bool(stats.get("skip"))
            c["hits"] += bool(stats.get("h"))
            c["error_fin"] += sum(why == "error" for _, why in rec["fin"])
    return c


@pytest.mark.parametrize("feature", FEATURES)
def test_feature_runs_are_replayed_step_by_step(recorded, feature, tmp_path, capsys):
    pristine, _ = recorded(feature)
    shows: Counter = Counter()
    followed = 0
    for run in pristine:
        lines = read_lines(run.path)
        header = lines[0]
        assert header["unmodelled"] == [], header["unmodelled"]
        r = check_trace(run.path, check_invariants_every=1)
        if r.empty or not any(rec["t"] == "add" for rec in lines[1:]):
            continue
        if not followed:  # the report says the reference followed every step
            assert cli.main(["check-run", str(run.path), "--out", str(tmp_path / "cx")]) == 0
            out = capsys.readouterr().out
            assert f"reference: agrees on all {r.summary['steps']} steps" in out and "verdict: agrees" in out, out
        assert_agrees_and_holds(run.path, r)
        followed += 1
        shows.update(_shows(run.path))
        pool, sched = header["pool"], header["scheduler"]
        shows["lookahead_pool"] += pool["num_hash_lookahead_tokens"] > 0
        shows["checkpoint_pool"] += pool["mamba_shared_prefix_checkpoint"]
        shows["max_loras"] += sched["max_loras"] is not None
        shows["encoder_budget"] += sched["encoder"]["compute_budget"] > 0
        shows["v2"] += sched["use_v2_model_runner"]
    assert followed >= 4
    if feature == "lora":  # adapters on arrivals, and requests max_loras held back (vLLM's deferred_waiting)
        assert shows["lora"] >= 10 and shows["skipped_waiting"] >= 10 and shows["max_loras"] == followed, shows
    elif feature == "multimodal":  # items encoded, evicted, installed by the V2 runner
        assert shows["mm"] >= 10 and shows["enc"] >= 10 and shows["efree"] >= 5 and shows["eupd"] >= 5, shows
        assert shows["encoder_budget"] == followed and 0 < shows["v2"] < followed, shows
        # an item identifier reused with another embedding count: vLLM rejects the request, which
        # scheduled nothing, and finishes it as an error in the next update (the replay saw only
        # scheduled requests' finishes before session 14)
        assert shows["error_fin"] >= 1, shows
    elif feature == "hash-lookahead":
        assert shows["lookahead_pool"] == followed and shows["hits"] >= 3, shows
    else:
        assert shows["checkpoint_pool"] == followed, shows


@pytest.mark.parametrize("feature", FEATURES)
def test_a_fault_planted_in_the_feature_is_flagged(recorded, feature, tmp_path, capsys):
    """No false green: the same draws on a vLLM with the fault are flagged by the replay (a
    divergence, or vLLM's crash), exit 1 from ``kvref check-run``."""
    _, faulty = recorded(feature)
    flagged = []
    props = 0
    for run in faulty:
        r = check_trace(run.path)
        if r.empty:
            continue
        assert r.followed or r.divergence is not None or r.crash is not None, (run.path, r.stopped_because)
        if r.verdict != "agrees":
            flagged.append(run.path)
            props += check_trace(run.path, properties_only=True).verdict != "properties hold"
    assert flagged, f"no {feature} run with the planted fault was flagged"
    assert cli.main(["check-run", str(flagged[0]), "--out", str(tmp_path / "cx")]) == 1
    assert capsys.readouterr().out.strip().endswith(("verdict: FINDINGS", "verdict: CRASH"))
    if feature in ("lora", "hash-lookahead"):  # a hit on other content: the hit-content property too
        assert props >= 1


def _without(header: dict, feature: str) -> None:
    if feature == "lora":
        header["scheduler"]["max_loras"] = None
    elif feature == "multimodal":
        header["scheduler"]["encoder"] = {"compute_budget": 0, "cache_size": 0, "disable_chunked_mm_input": False}
    elif feature == "hash-lookahead":
        header["pool"]["num_hash_lookahead_tokens"] = 0
        header["pool"]["use_eagle"] = True  # the block drop a drafter without lookahead hashes has
    else:
        header["pool"]["mamba_shared_prefix_checkpoint"] = False


@pytest.mark.parametrize("feature", FEATURES)
def test_a_replay_without_the_recorded_setting_diverges(recorded, feature, tmp_path):
    """The replay reads the feature's setting from the header: taken away, some run diverges
    (the replay does not silently agree, nor fall back to the properties)."""
    pristine, _ = recorded(feature)
    diverged = 0
    for run in pristine:
        with gzip.open(run.path, "rt") as f:
            header, *body = f.readlines()
        header = json.loads(header)
        _without(header, feature)
        bad = tmp_path / run.path.name
        with gzip.open(bad, "wt") as f:
            f.write(json.dumps(header) + "\n")
            f.writelines(body)
        r = check_trace(bad)
        assert r.followed or r.divergence is not None, r.stopped_because
        diverged += r.divergence is not None
    assert diverged >= 1


def test_anonymized_multimodal_and_lora_runs_are_replayed(tmp_path, monkeypatch):
    """KVREF_RECORD_ANONYMIZE: item identifiers, adapter names and paths become keyed hashes (equal
    stays equal), so the replay still agrees and no identifier or adapter name is in the file."""
    require_vllm()
    monkeypatch.setenv("KVREF_RECORD_ANONYMIZE", "1")
    for feature in ("multimodal", "lora"):
        followed = 0
        for run in record_feature_runs(tmp_path / feature, feature, 4, seed=0, steps=STEPS):
            with gzip.open(run.path, "rt") as f:
                text = f.read()
            assert json.loads(text.split("\n", 1)[0])["anonymized"] is True
            assert '"img' not in text and '"/adapters/' not in text and '"sql"' not in text
            r = check_trace(run.path)
            if r.empty:
                continue
            assert r.followed and r.verdict == "agrees", (r.findings[:2], r.divergence and r.divergence.table())
            followed += 1
        assert followed >= 2


@pytest.mark.parametrize("workload", ["multimodal", "lora", "eagle-lookahead-hash"])
def test_the_feature_demo_workloads_are_replayed(workload, tmp_path):
    """The demo workloads of the four features' first three (``kvref demo record --workload ...``:
    image chat under an encoder budget, adapters under max_loras, EAGLE with lookahead hashes) are
    recorded from vLLM's AsyncScheduler and followed step by step, their features shown."""
    require_vllm()
    from kvref.demo import record_demo

    run = record_demo(tmp_path / f"{workload}.kvtrace.gz", workload, None, True, seed=0, ticks=120)
    assert run.crashed is None
    r = check_trace(run.path, check_invariants_every=1)
    assert r.followed and r.verdict == "agrees", (r.findings[:2], r.divergence and r.divergence.table())
    assert r.steps_compared == r.summary["steps"] > 80 and r.summary["block_checks"] == "on"
    assert check_trace(run.path, properties_only=True).verdict == "properties hold"
    shows = _shows(run.path)
    want = {"multimodal": ("enc", "efree"), "lora": ("lora", "skipped_waiting"),
            "eagle-lookahead-hash": ("hits",)}[workload]
    assert all(shows[k] >= 5 for k in want), shows
