"""check-run replays streaming-input sessions, ``reset_prefix_cache`` through the scheduler and
prompt embeddings (issue #28, session 16, format 6).

The recorder named a ``resumable`` arrival (and every update of a session) ``streaming_input`` and
check-run stopped the replay there; a ``reset`` record on a run without a KV connector stopped it
too. The reference models both (impl/reference/scheduler_sessions.py; ``Scheduler.reset_prefix_cache``,
compared with vLLM in conform-scheduler), so the recorder now writes ``add.resumable`` (an update is an
``add`` with the session's id) and the replay follows sessions and resets step by step. A request with
prompt embeddings was named ``prompt_embeds``; the reference's block hashes take the embedding rows, so
the recorder writes a digest per row (``add.embeds``) and the replay hashes those. What the
reference does not model beside a session (a KV connector, speculative decoding, multimodal items,
the priority policy) is still named.

Generated runs (:mod:`kvref.models.run_check.feature_runs`: the conform-scheduler session and
cache-controls machines' draws, recorded from vLLM's ``Scheduler`` / ``AsyncScheduler`` through
``scheduler_cls``) agree step by step; the same draws on a vLLM with a fault planted in the path
(:mod:`kvref.impl.vllm.record_faults`) are flagged by the replay. Seeded, a fixed number of runs.
"""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
from kvref.models.run_check import check_trace
from kvref.models.run_check.feature_runs import EMBEDS_FEATURES, SESSION_FEATURES, record_feature_runs

from kvref import cli
from kvref.impl.vllm.record_faults import FEATURE_FAULTS
from tests.record.traces import pristine_and_faulty_runs, read_lines, rewrite
from tests.vllm_env import require_vllm

#: feature -> (seed, examples): draws that reach the feature's path and the planted fault
DRAWS = {"streaming-input": (0, 10), "prefix-cache-reset": (0, 10), "prompt-embeds": (0, 5)}
FEATURES = SESSION_FEATURES + EMBEDS_FEATURES
STEPS = 30
FAULT = {feature: name for name, (feature, _) in FEATURE_FAULTS.items() if feature in FEATURES}
#: the property findings a pristine run may carry, each vLLM 0.33.0's own hang (the replay agrees):
#: waiting sessions hold the KV blocks the first of them needs (docs/record.md), or a head-of-line
#: request the full-ISL reservation never admits on a tight pool
KNOWN_HANGS = ("streaming-input sessions", "head-of-line hang of vLLM #39734")
#: feature -> the run property its planted fault breaks (flagged without the replay)
PROPERTY_BROKEN = {"streaming-input": "past_tokens", "prefix-cache-reset": "admission_order",
                   "prompt-embeds": "wrong_hit"}


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """feature -> (pristine runs, runs of the same draws on a vLLM with the fault planted)."""
    return pristine_and_faulty_runs(tmp_path_factory, DRAWS, FAULT, STEPS)


def _shows(lines: list) -> Counter:
    """What a trace shows of sessions and resets."""
    c: Counter = Counter()
    seen: set = set()
    sessions: set = set()
    embeds: dict = {}
    for rec in lines[1:]:
        if rec["t"] == "add" and rec.get("embeds"):
            c["embeds"] += 1
            embeds.setdefault((rec["prompt"], rec["embeds"][:12]), []).append(rec["id"])
        if rec["t"] == "add":
            c["updates"] += rec["id"] in seen
            c["finishing_updates"] += rec["id"] in seen and not rec.get("resumable")
            if rec.get("resumable") and rec["id"] not in seen:
                sessions.add(rec["id"])
            seen.add(rec["id"])
        elif rec["t"] == "sched":
            # a session admitted again on the blocks it kept: a "new" row with computed tokens
            c["resumed_on_blocks"] += sum(1 for rid, c0, _b in rec["new"] if rid in sessions and c0)
            c["embeds_hits"] += sum(1 for rid, c0, _b in rec["new"] if c0 and any(rid in v for v in embeds.values()))
            c["reset_preemptions"] += sum(w == "reset_prefix_cache" for w in (rec.get("pre_why") or {}).values())
        elif rec["t"] == "reset":
            c["resets"] += 1
            c["resets_running"] += bool(rec.get("running"))
    c["sessions"] = len(sessions)
    return c


@pytest.mark.vllm
@pytest.mark.parametrize("feature", FEATURES)
def test_pristine_runs_are_replayed_step_by_step(recorded, feature, tmp_path, capsys):
    pristine, _ = recorded(feature)
    shows: Counter = Counter()
    followed = 0
    for run in pristine:
        lines = read_lines(run.path)
        assert lines[0]["unmodelled"] == [] and not any(rec.get("x") for rec in lines[1:]), run.path
        r = check_trace(run.path, check_invariants_every=1)
        if r.empty or not any(rec["t"] == "add" for rec in lines[1:]):
            continue
        assert r.followed and r.divergence is None and r.crash is None, (
            run.path, r.stopped_because, r.divergence and r.divergence.table())
        assert r.steps_compared == r.summary["steps"]
        p = check_trace(run.path, properties_only=True)
        # the properties hold alone, but for vLLM's own hangs (findings, which the replay agrees with)
        assert all(f.kind == "starvation" and any(h in f.message for h in KNOWN_HANGS) for f in p.findings), (
            run.path, [(f.kind, f.message) for f in p.findings[:3]])
        if r.verdict == "agrees" and not followed:
            assert cli.main(["check-run", str(run.path), "--out", str(tmp_path / "cx")]) == 0
            assert "verdict: agrees" in capsys.readouterr().out
        followed += 1
        shows.update(_shows(lines))
    assert followed >= (6 if feature in SESSION_FEATURES else 4), followed
    if feature == "prompt-embeds":  # embeddings on most arrivals, prefix hits among them
        assert shows["embeds"] >= 20 and shows["embeds_hits"] >= 3, shows
    elif feature == "streaming-input":  # sessions, their updates and ends, turns resumed on kept blocks
        assert shows["sessions"] >= 20 and shows["updates"] >= 20 and shows["finishing_updates"] >= 5, shows
        assert shows["resumed_on_blocks"] >= 5, shows
    else:  # resets, some preempting the running requests
        assert shows["resets"] >= 4 and shows["resets_running"] >= 2 and shows["reset_preemptions"] >= 2, shows


@pytest.mark.vllm
@pytest.mark.parametrize("feature", FEATURES)
def test_a_fault_planted_in_the_path_is_flagged_by_the_replay_and_the_properties(recorded, feature, tmp_path,
                                                                               capsys):
    """The replay flags the fault; ``--properties-only`` too, by the property the fault breaks
    (session 17, #28): a session resumed with its final sampled token kept schedules past the tokens
    it has; preempted requests a reset put back in reverse come back out of waiting-queue order; a hit
    between prompts whose embeddings differ holds other content."""
    _, faulty = recorded(feature)
    flagged = []
    props: Counter = Counter()
    for run in faulty:
        r = check_trace(run.path)
        if r.empty:
            continue
        assert r.followed or r.divergence is not None or r.crash is not None, (run.path, r.stopped_because)
        if r.divergence is not None:
            flagged.append(run.path)
            props.update({f.kind for f in check_trace(run.path, properties_only=True).findings})
    assert flagged, f"no {feature} run with {FAULT[feature]} planted was flagged"
    assert props[PROPERTY_BROKEN[feature]] >= 1, props
    assert cli.main(["check-run", str(flagged[0]), "--out", str(tmp_path / "cx")]) == 1
    assert capsys.readouterr().out.strip().endswith("verdict: FINDINGS")


@pytest.mark.vllm
def test_a_version_5_streaming_arrival_still_stops_the_replay(recorded, tmp_path):
    """A version-5 recorder named a session ``streaming_input`` on its arrival (no ``resumable``):
    such a trace still reads, and its replay stops there and says why, as before."""
    pristine, _ = recorded("streaming-input")
    run = next(r for r in pristine if _shows(read_lines(r.path))["sessions"])

    def as_v5(rec):
        if rec["t"] == "add" and rec.pop("resumable", None):
            rec["x"] = ["streaming_input"]
        return rec

    old = rewrite(run.path, tmp_path / "v5.kvtrace.gz", as_v5, version=5)
    r = check_trace(old)
    assert not r.followed and r.divergence is None and "streaming_input" in r.stopped_because, r.stopped_because


def _scheduler(connector=None, spec=None, policy="fcfs"):
    return SimpleNamespace(connector=connector, vllm_config=SimpleNamespace(speculative_config=spec),
                           scheduler_config=SimpleNamespace(policy=policy))


def _request(resumable=True, mm=()):
    return SimpleNamespace(resumable=resumable, mm_features=list(mm), sampling_params=None, pooling_params=None,
                           use_structured_output=False, prompt_embeds=None, prompt_token_ids=[1, 2],
                           kv_transfer_params=None)


@pytest.mark.parametrize("setup, named", [
    (dict(), None),
    (dict(connector=object()), "streaming_input (with a KV connector)"),
    (dict(spec=object()), "streaming_input (with speculative decoding)"),
    (dict(policy="priority"), "streaming_input (priority policy)"),
])
def test_the_recorder_names_only_the_sessions_the_reference_does_not_model(setup, named):
    """Cheap (no vLLM): the arrival's unmodelled list for a session (and for an update of one)."""
    from kvref.impl.vllm.record import _request_unmodelled

    for existing, request in ((False, _request()), (True, _request(resumable=False))):
        assert _request_unmodelled(request, existing, _scheduler(**setup)) == ([named] if named else [])
    item = SimpleNamespace(mm_position=SimpleNamespace(is_embed=None))
    assert _request_unmodelled(_request(mm=[item]), False, _scheduler()) == ["streaming_input (multimodal)"]
    assert _request_unmodelled(_request(resumable=False), False, _scheduler(connector=object())) == []
    embeds = _request()
    embeds.prompt_embeds = object()
    assert _request_unmodelled(embeds, False, _scheduler()) == ["streaming_input (prompt embeds)"]
    embeds.resumable = False  # prompt embeddings alone are replayed (add.embeds)
    assert _request_unmodelled(embeds, False, _scheduler()) == []


def test_embeds_digests_keep_equal_rows_equal_and_a_bad_embeds_field_is_named(tmp_path):
    """Cheap (no vLLM): a digest per row, equal rows equal (keyed digests too, under another key:
    an anonymized trace cannot be tested against a guessed embedding); a reader names an ``embeds``
    whose length is not one digest per prompt token."""
    import base64
    import struct

    from kvref.impl.run_trace.format import (EMBED_DIGEST_SIZE, TokenAnonymizer, TraceFormatError, decode_embeds,
                                             embeds_digests)
    from kvref.models.run_check.generate import generate_trace
    from tests.record.traces import hybrid_setup

    data = struct.pack("<6f", 1, 2, 1, 2, 3, 4)  # rows (1, 2), (1, 2), (3, 4)
    plain = decode_embeds(base64.b64encode(embeds_digests(data, 8)).decode())
    keyed = TokenAnonymizer().embeds_digests(data, 8)
    assert len(plain) == 3 and plain[0] == plain[1] != plain[2] and all(len(d) == EMBED_DIGEST_SIZE for d in plain)
    assert keyed[:8] == keyed[8:16] != keyed[16:] and keyed[:8] != plain[0]
    with pytest.raises(ValueError):
        embeds_digests(data, 5)

    pool, cfg = hybrid_setup(num_blocks=None)
    src = str(tmp_path / "src.kvtrace.gz")
    generate_trace(src, pool, cfg, steps=10, seed=2)

    def short(rec):
        if rec["t"] == "add":
            rec["embeds"] = base64.b64encode(b"x" * EMBED_DIGEST_SIZE).decode()  # one row, not one per token
        return rec

    from kvref.impl.run_trace import TraceReader

    out = rewrite(src, tmp_path / "bad.kvtrace.gz", short)
    with pytest.raises(TraceFormatError) as e, TraceReader(out) as reader:
        for _ in reader.records():
            pass
    assert "embeds" in str(e.value) and "one per prompt token" in str(e.value)


@pytest.mark.vllm
def test_anonymized_session_and_embeds_runs_are_replayed(tmp_path, monkeypatch):
    """KVREF_RECORD_ANONYMIZE: a session's updates keep its anonymous id (the recorder forgets an
    id only once vLLM let the request go) and the embeddings' digests are keyed, equal rows still
    equal: the replay agrees with every run."""
    require_vllm()
    monkeypatch.setenv("KVREF_RECORD_ANONYMIZE", "1")
    for feature in ("streaming-input", "prompt-embeds"):
        followed = 0
        shows: Counter = Counter()
        for run in record_feature_runs(tmp_path / feature, feature, 4, seed=3, steps=STEPS):
            lines = read_lines(run.path)
            assert lines[0]["anonymized"] is True
            r = check_trace(run.path)
            if r.empty:
                continue
            assert r.followed and r.divergence is None, (run.path, r.divergence and r.divergence.table())
            followed += 1
            shows.update(_shows(lines))
        assert followed >= 2, feature
        assert shows["updates" if feature == "streaming-input" else "embeds"] >= 5, (feature, shows)
