"""What ``kvref check-run`` and ``--properties-only`` catch on generated KV-connector runs (issue #28).

``record DIR``: for each planted fault (the demo faults of ``kvref/impl/vllm/demo_faults.py`` but
``short-lookahead``, which needs a drafter, plus ``unfenced-free``: vLLM's
``_request_blocks_can_be_freed`` always yes, i.e. ``defer_block_free``'s step fence ignored) and
pristine, record ``--examples`` generated connector runs of vLLM's own scheduler
(``models/run_check/connector_runs.py``) into ``DIR/<fault>/<seed>``.

``check DIR``: check every recorded run (the machine's known vLLM hangs and lost updates left out)
with replay and with ``--properties-only``; print per fault the runs and how many each flags. Run it
with ``PYTHONPATH`` pointing at an older kvref tree to measure that checker on the same traces.

    .venv/bin/python benchmarks/bench_check_run_connector.py record /tmp/conn --examples 40 --seeds 2,3,4
    .venv/bin/python benchmarks/bench_check_run_connector.py check /tmp/conn
    .venv/bin/python benchmarks/bench_check_run_connector.py record /tmp/pause --generator pause --seeds 1,2

``--seeds``: the generator honours its seed (#28), so several seeds draw more runs per fault.
``--generator pause``: runs with scheduler pause states (``models/run_check/pause_runs.py``) and
two pause faults (``pause-ignored``, ``pause-all-as-new``) instead of ``unfenced-free``.
``--generator connector-pause``: connector runs with pause states (``record_connector_runs(...,
pause=True)``), the two pause faults and ``unfenced-free``.
``--generator connector-align``: connector runs on FA + Mamba "align" pools (``MAMBA_ALIGN_KINDS``:
copy-on-write state blocks, divergent hybrid hits), ``unfenced-free`` beside the demo faults.

``--generator demo-mtp``: the ``spec-decode-mtp`` demo workload (multi-module MTP), sync and async,
one run each per seed, with every demo fault (the drafter's ``short-lookahead`` and
``short-runway`` included).

``--generator multimodal|lora|hash-lookahead|mamba-checkpoint|streaming-input|prefix-cache-reset|prompt-embeds|prefix-replay|rswa|circular-buffer``:
generated runs of the feature
(``models/run_check/feature_runs.py``: the conform-scheduler machines' draws) with the feature's own
planted fault (``kvref/impl/vllm/record_faults.py``) beside the demo faults (#28).

``--no-demo-faults``: record pristine and the generator's own faults only (session 17's campaign,
#28: the three session features, seeds 0-9)::

    for g in streaming-input prefix-cache-reset; do
        .venv/bin/python benchmarks/bench_check_run_connector.py record /tmp/s17/$g --generator $g \
            --examples 20 --seeds 0,1,2,3,4,5,6,7,8,9 --no-demo-faults; done
    .venv/bin/python benchmarks/bench_check_run_connector.py record /tmp/s17/prompt-embeds \
        --generator prompt-embeds --examples 10 --seeds 0,1,2,3,4,5,6,7,8,9 --no-demo-faults
    .venv/bin/python benchmarks/bench_check_run_connector.py check /tmp/s17/streaming-input

Session 18 (#28) re-recorded the reset campaign the same way (``/tmp/s18/prefix-cache-reset``): its
headers carry what the free-queue check needs on sliding-window pools (retention interval, the
coordinator's cache rounding, each group's hit alignment), which older traces lack.

``check`` prints, per fault, the runs, those ``kvref check-run`` flags (replay and properties),
those ``--properties-only`` flags, and those whose replay diverges (or crashes) on its own.

``as-before DIR OUT``: copy DIR's traces adding to each header what the session-11 recorder named
unmodelled there (``mamba_align_mode (with a KV connector)``, ``kv_connector_divergent_hybrid_hits``
on Mamba pools with prefix caching, ``prefill_lookahead`` for multi-module MTP; session 12's:
``multimodal`` / ``lora`` on requests with items / an adapter, ``hash_lookahead_tokens``,
``mamba_shared_prefix_checkpoint``), so an older checker
(``PYTHONPATH``) checks the same runs as it saw them then (#28)::

    .venv/bin/python benchmarks/bench_check_run_connector.py record /tmp/align --generator connector-align --seeds 2,3,4
    .venv/bin/python benchmarks/bench_check_run_connector.py as-before /tmp/align /tmp/align_before
"""

from __future__ import annotations

import argparse
import glob
import os
import shutil
from collections import Counter


def _recorder(generator: str):
    if generator == "pause":
        from kvref.models.run_check.pause_runs import record_pause_runs

        return record_pause_runs
    from kvref.models.run_check.connector_runs import record_connector_runs

    if generator == "connector-pause":
        return lambda *a, **k: record_connector_runs(*a, pause=True, **k)
    if generator == "demo-mtp":
        from pathlib import Path

        from kvref.demo import record_demo

        def mtp(d, examples, seed, strict):  # examples: unused (one sync and one async run)
            Path(d).mkdir(parents=True, exist_ok=True)
            return [record_demo(os.path.join(d, f"mtp-{a}.kvtrace.gz"), "spec-decode-mtp", None, a, seed=seed,
                                ticks=150) for a in (False, True)]
        return mtp
    if generator == "connector-align":
        from kvref.models.machines.scheduler import MAMBA_ALIGN_KINDS
        from kvref.models.machines.scheduler_connector import connector_setups

        return lambda *a, **k: record_connector_runs(*a, setups=connector_setups(kinds=MAMBA_ALIGN_KINDS), **k)
    if generator in _FEATURES:
        from kvref.models.run_check.feature_runs import record_feature_runs

        return lambda d, examples, seed, strict: record_feature_runs(d, generator, examples, seed=seed, steps=30,
                                                                     strict=strict)
    return record_connector_runs


#: the feature generators (#28) and the fault planted in each one's path
_FEATURES = {"streaming-input": ("session-keeps-final-token",), "prefix-cache-reset": ("reset-preempts-in-order",),
             "prompt-embeds": ("embeds-unhashed",),  # session 16 (#28, format 6)
             "multimodal": ("encoder-never-hits",), "lora": ("lora-unhashed",),
             "hash-lookahead": ("hasher-no-lookahead",), "mamba-checkpoint": ("checkpoint-ignored",),
             # session 20 (#28): SWA bounded replay
             "prefix-replay": ("replay-start-at-hit", "replay-window-short"),
             # session 20 (#28): R-SWA and circular-buffer pools
             "rswa": ("rswa-gap-kept", "rswa-window-short"), "circular-buffer": ("ring-grows",)}
_FEATURE_FAULTS = {f for faults in _FEATURES.values() for f in faults}


def record(root: str, examples: int, seeds=(2,), generator: str = "connector", demo_faults: bool = True) -> None:
    from vllm.v1.core.sched.interface import PauseState
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvref.impl.vllm.demo_faults import FAULTS, plant

    rec = _recorder(generator)
    shutil.rmtree(root, ignore_errors=True)
    planted = {"unfenced-free": ("_request_blocks_can_be_freed", lambda self, request: True),
               # the pause generator's own faults: vLLM's set_pause_state ignored, or PAUSED_ALL taken for PAUSED_NEW
               "pause-ignored": ("set_pause_state", lambda self, state: None),
               "pause-all-as-new": ("set_pause_state", lambda self, state, _set=Scheduler.set_pause_state: _set(
                   self, PauseState.PAUSED_NEW if state == PauseState.PAUSED_ALL else state))}
    extra = {"pause": ("pause-ignored", "pause-all-as-new"), "connector": ("unfenced-free",),
             "connector-align": ("unfenced-free",), "demo-mtp": (),
             "connector-pause": ("pause-ignored", "pause-all-as-new", "unfenced-free"),
             **_FEATURES}[generator]
    # the drafter faults need a drafter, which no generated run has
    drafter = ("short-lookahead", "short-runway")
    # EAGLE drafters in the hash-lookahead and mamba-checkpoint draws: short-lookahead applies there
    eagle = generator in ("hash-lookahead", "mamba-checkpoint")
    demo = tuple(f for f in FAULTS if generator == "demo-mtp" or f not in drafter
                 or (eagle and f == "short-lookahead")) if demo_faults else ()
    for fault in ("pristine",) + extra + demo:
        runs = []
        for seed in seeds:
            d = os.path.join(root, fault, str(seed))
            if fault in _FEATURE_FAULTS:
                from kvref.impl.vllm.record_faults import plant_feature_fault

                with plant_feature_fault(fault):
                    runs = rec(d, examples, seed=seed, strict=False)
            elif fault in planted:
                name, fn = planted[fault]
                orig = getattr(Scheduler, name)
                setattr(Scheduler, name, fn)
                try:
                    runs = rec(d, examples, seed=seed, strict=False)
                finally:
                    setattr(Scheduler, name, orig)
            else:
                with plant(None if fault == "pristine" else fault):
                    runs = rec(d, examples, seed=seed, strict=False)
            with open(os.path.join(d, "skip.txt"), "w") as f:
                f.writelines(os.path.basename(r.path) + "\n" for r in runs
                             if getattr(r, "known_hang", False) or getattr(r, "lost_update", False))


def check(root: str) -> None:
    print("| fault | runs | check-run (replay) | --properties-only | replay diverges |\n|---|---:|---:|---:|---:|")
    for d in sorted(glob.glob(os.path.join(root, "*"))):
        c: Counter = Counter()
        for sd in sorted(glob.glob(os.path.join(d, "*", "skip.txt"))):
            skip = set(open(sd).read().split())
            for p in sorted(glob.glob(os.path.join(os.path.dirname(sd), "*.kvtrace.gz"))):
                if os.path.basename(p) in skip:
                    continue
                _count(c, p)
        print(f"| {os.path.basename(d)} | {c['runs']} | {c['replay']} | {c['props']} | {c['diverged']} |")


def as_before(root: str, out: str) -> None:
    """Copy every trace of ``root`` (same layout, skip lists kept) with the header naming what the
    session-11 recorder named unmodelled on such a run."""
    import gzip
    import json

    shutil.rmtree(out, ignore_errors=True)
    for p in glob.glob(os.path.join(root, "**", "*"), recursive=True):
        q = os.path.join(out, os.path.relpath(p, root))
        if os.path.isdir(p):
            os.makedirs(q, exist_ok=True)
            continue
        os.makedirs(os.path.dirname(q), exist_ok=True)
        if not p.endswith(".kvtrace.gz"):
            shutil.copy(p, q)
            continue
        with gzip.open(p, "rt") as f:
            header, *body = f.readlines()
        h = json.loads(header)
        names, conn = h.setdefault("unmodelled", []), h.get("connector")
        mamba = [g["spec"] for g in h["pool"]["groups"] if g["spec"]["type"] == "MambaSpec"]
        if conn is not None and conn.get("divergent_local_hybrid_hits") and mamba and h["pool"].get("enable_caching"):
            names.append("kv_connector_divergent_hybrid_hits")
        if conn is not None and any(m.get("mamba_cache_mode") == "align" for m in mamba):
            names.append("mamba_align_mode (with a KV connector)")
        if int((h.get("spec") or {}).get("num_prefill_lookahead", 0) or 0) > 1:
            names.append("prefill_lookahead")
        if h["pool"].get("num_hash_lookahead_tokens"):  # session 12's recorder (#28)
            names.append("hash_lookahead_tokens")
        if h["pool"].get("mamba_shared_prefix_checkpoint"):
            names.append("mamba_shared_prefix_checkpoint")
        for i, g in enumerate(h["pool"]["groups"]):  # session 19's recorder (#28): SWA bounded replay
            if g["spec"]["type"] == "SlidingWindowMLASpec":
                names.append(f"kv_cache_spec:SlidingWindowMLASpec (group {i})")
                if g["spec"].get("bounded_replay") and "prefix_replay" not in names:
                    names.append("prefix_replay")
        body = [_as_before_line(line) for line in body]
        with gzip.open(q, "wt") as f:
            f.write(json.dumps(h) + "\n")
            f.writelines(body)


def _as_before_line(line: str) -> str:
    """A record as session 12's recorder wrote it: an arrival with items or an adapter named (``x``),
    a step with encoder inputs named (``x``, no enc/efree/eupd), stats without ``skip``."""
    import json

    if line.startswith('{"t":"add"') and ('"mm":' in line or '"lora":' in line):
        rec = json.loads(line)
        rec.setdefault("x", []).extend(n for n, k in (("multimodal", "mm"), ("lora", "lora")) if rec.get(k))
        return json.dumps(rec) + "\n"
    if line.startswith('{"t":"sched"') and ('"enc":' in line or '"efree":' in line or '"eupd":' in line):
        rec = json.loads(line)
        if rec.pop("enc", None):
            rec["x"] = ["encoder_inputs"]
        rec.pop("efree", None)
        rec.pop("eupd", None)
        return json.dumps(rec) + "\n"
    if line.startswith('{"t":"sched"') and '"replay":' in line:  # session 19's recorder wrote no replay_start
        rec = json.loads(line)
        rec.pop("replay")
        return json.dumps(rec) + "\n"
    if line.startswith('{"t":"update"') and '"skip":' in line:
        rec = json.loads(line)
        rec.get("stats", {}).pop("skip", None)
        return json.dumps(rec) + "\n"
    return line


def _count(c: Counter, p: str) -> None:
    """One trace: checked with replay and with ``--properties-only``."""
    from kvref.models.run_check import check_trace

    r = check_trace(p)
    if r.empty:
        return
    c["runs"] += 1
    c["replay"] += not r.ok
    c["diverged"] += r.divergence is not None or r.crash is not None
    c["props"] += not check_trace(p, properties_only=True).ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("record", "check", "as-before"))
    ap.add_argument("root")
    ap.add_argument("out", nargs="?", help="as-before: the copy's directory")
    ap.add_argument("--examples", type=int, default=40)
    ap.add_argument("--seeds", default="2", help="comma-separated seeds (each records --examples runs per fault)")
    ap.add_argument("--no-demo-faults", action="store_true",
                    help="record pristine and the generator's own faults only, not the demo faults")
    ap.add_argument("--generator", choices=("connector", "pause", "connector-pause", "connector-align", "demo-mtp",
                                            *_FEATURES),
                    default="connector",
                    help="connector runs (default), runs with scheduler pause states, or connector runs with them")
    a = ap.parse_args()
    from kvref.quiet import quiet_third_party

    quiet_third_party(False)
    if a.what == "record":
        record(a.root, a.examples, tuple(int(x) for x in a.seeds.split(",")), a.generator, not a.no_demo_faults)
    elif a.what == "as-before":
        if not a.out or os.path.abspath(a.out) == os.path.abspath(a.root):
            ap.error("as-before needs an OUT directory other than ROOT")
        as_before(a.root, a.out)
    else:
        check(a.root)


if __name__ == "__main__":
    main()
