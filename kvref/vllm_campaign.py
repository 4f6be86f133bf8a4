"""The vLLM-side mutant campaign: faults in *vLLM's own* KV-cache source, and does
``kvref verify --against vllm`` notice?

The reference-side campaign (:mod:`kvref.models.mutants.campaign`) asks whether kvref's checks
catch faults in kvref's reference. Users care about the other direction: someone changes vLLM's
``v1/core``, ``v1/core/sched``, ``v1/simple_kv_offload`` or the offloading connector's scheduler —
does the conformance suite flag a change that breaks behaviour, and stay quiet on a refactor that
does not?

For each :class:`~kvref.models.mutants.vllm_source.overlay.SourceFault` of the catalogue
(:mod:`kvref.models.mutants.vllm_source.catalogue`) this module

1. builds an overlay of the installed vLLM with that one file edited
   (:func:`~kvref.models.mutants.vllm_source.overlay.build_overlay`; the installed files are untouched),
2. runs ``kvref verify --against vllm --only <vLLM-facing checks> --exitfirst --json`` in a
   subprocess whose ``PYTHONPATH`` puts the overlay first, under a per-fault time limit, and
3. reads back which check failed first, how long it took, and a *probe* written by the subprocess
   at exit: that ``vllm`` was imported from the overlay and that the mutated module loaded is the
   edited copy (same sha256) — a fault whose edit never became live is reported as such, not as a
   survivor or a kill.

Outcomes: ``killed`` (some check *failed*), ``survived`` (every check passed), ``error`` (no
failure but a check errored — e.g. the edit broke an import; not a kill), ``timeout``,
``not-live`` (the mutated module was never imported from the overlay). A neutral refactor is
*flagged* when it is killed; the campaign fails on any flagged neutral or on a recall of the bug
faults (historic + classic) below the goal.

Run it: ``kvref mutants --target vllm [--faults ID,...] [--class ...] [--profile ...]``;
``--generated N [--modules PATH,...]`` runs faults generated from vLLM's source instead
(:func:`generated_faults`, class ``generated``: outside the recall goal, reported apart).
Internally ``python -m kvref.vllm_campaign --probe ...`` is the subprocess entry point.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from collections.abc import Callable, Iterable

from kvref.checks import vllm_checks
from kvref.models.mutants.vllm_source.overlay import (
    CLASSES, GENERATED, NEUTRAL, Edit, SourceFault, build_overlay, file_sha256, installed_vllm_dir,
)
from kvref.spec.errors import InvalidFieldError

#: the checks the campaign runs by default: the default checks of ``kvref verify`` that drive the
#: installed vLLM (flagged ``vllm`` in :data:`kvref.checks.CHECKS`), in verify's order
VLLM_CHECKS = vllm_checks()

#: recall goal on the bug faults (historic + classic) — issue #13
RECALL_GOAL = 0.95

#: per-fault wall-clock limit by profile (seconds): a clean run takes ~1 min (fast) on 2 cores
DEFAULT_TIMEOUT = {"fast": 300, "ci": 900, "nightly": 3600}

KILLED, SURVIVED, ERROR, TIMEOUT, NOT_LIVE = "killed", "survived", "error", "timeout", "not-live"


@dataclass
class FaultResult:
    fault: SourceFault | None
    outcome: str
    seconds: float
    killed_by: str | None = None
    checks: dict[str, str] = field(default_factory=dict)
    check_seconds: dict[str, float] = field(default_factory=dict)
    detail: str = ""
    live: bool | None = None

    @property
    def flagged(self) -> bool:
        return self.outcome == KILLED

    def to_row(self) -> dict:
        f = self.fault
        return {"id": f.id if f else "(clean)", "class": f.kind if f else "", "bug": f.bug if f else None,
                "behaviour": f.behaviour if f else "", "file": f.path if f else "", "outcome": self.outcome,
                "killed_by": self.killed_by, "seconds": round(self.seconds, 1), "live": self.live,
                "checks": self.checks, "detail": self.detail[:300],
                # a generated fault is not in the catalogue: its row carries what rebuilds it
                **({"description": f.description, "edits": [[e.old, e.new] for e in f.edits]}
                   if f and f.kind == GENERATED else {})}


@dataclass
class CampaignResult:
    results: list[FaultResult]
    checks: tuple[str, ...]
    profile: str
    seed: int
    seconds: float
    baseline: FaultResult | None = None
    dropped_checks: dict[str, str] = field(default_factory=dict)

    def of(self, *kinds: str) -> list[FaultResult]:
        return [r for r in self.results if r.fault and r.fault.kind in kinds]

    def recall(self, *kinds: str) -> float | None:
        """Killed / run among the faults of ``kinds`` (None when there are none)."""
        rs = self.of(*kinds)
        return sum(r.outcome == KILLED for r in rs) / len(rs) if rs else None

    @property
    def bug_recall(self) -> float | None:
        return self.recall("historic", "classic")

    @property
    def false_positives(self) -> list[FaultResult]:
        return [r for r in self.of(NEUTRAL) if r.flagged]

    @property
    def survivors(self) -> list[FaultResult]:
        return [r for r in self.of("historic", "classic") if r.outcome != KILLED]

    def ok(self, goal: float = RECALL_GOAL) -> bool:
        rec = self.bug_recall
        return not self.false_positives and (rec is None or rec >= goal) and not self.dropped_checks

    def summary(self) -> str:
        def pct(kinds):
            rs = self.of(*kinds)
            k = sum(r.outcome == KILLED for r in rs)
            return f"{k}/{len(rs)}" + (f" ({100 * k / len(rs):.1f} %)" if rs else "")

        neutral = self.of(NEUTRAL)
        text = (f"vLLM source faults, profile {self.profile}, seed {self.seed}: historic {pct(['historic'])}, "
                f"classic {pct(['classic'])}, all bug faults {pct(['historic', 'classic'])} killed; "
                f"neutral refactors flagged {len(self.false_positives)}/{len(neutral)}; {self.seconds:.0f} s")
        generated = self.of(GENERATED)
        if generated:
            text += (f"; generated: {sum(r.outcome == KILLED for r in generated)} killed of {len(generated)} "
                     "(survivors may be equivalent mutants)")
        if self.dropped_checks:
            text += "; checks failing on the clean vLLM (left out): " + ", ".join(self.dropped_checks)
        return text

    def to_dict(self) -> dict:
        return {"profile": self.profile, "seed": self.seed, "seconds": round(self.seconds, 1),
                "checks": list(self.checks), "bug_recall": self.bug_recall,
                "recall": {k: self.recall(k) for k in CLASSES if k != NEUTRAL},
                "false_positives": [r.fault.id for r in self.false_positives],
                "survivors": [r.fault.id for r in self.survivors],
                "generated_survivors": [r.fault.id for r in self.of(GENERATED) if r.outcome != KILLED],
                "dropped_checks": self.dropped_checks,
                "baseline": self.baseline.to_row() if self.baseline else None,
                "faults": [r.to_row() for r in self.results]}

    @classmethod
    def from_dict(cls, d: dict, faults: Iterable[SourceFault]) -> "CampaignResult":
        """Rebuild a result from :meth:`to_dict` output (``--json``), e.g. to render saved runs."""
        by_id = {f.id: f for f in faults}
        rows = []
        for row in d["faults"]:
            if row["id"] not in by_id and row.get("class") == GENERATED and row.get("edits"):
                by_id[row["id"]] = SourceFault(row["id"], row["file"], tuple(Edit(o, n) for o, n in row["edits"]),
                                               GENERATED, row.get("description") or "", behaviour="generated")
            if row["id"] not in by_id:
                raise InvalidFieldError("fault id", row["id"], "an id of the vLLM fault catalogue")
            rows.append(FaultResult(by_id[row["id"]], row["outcome"], row["seconds"], row.get("killed_by"),
                                    row.get("checks") or {}, {}, row.get("detail") or "", row.get("live")))
        return cls(rows, tuple(d["checks"]), d["profile"], d["seed"], d["seconds"], None,
                   d.get("dropped_checks") or {})

    def summary_markdown(self) -> str:
        """Recall per class, false positives, kills per check and the survivors grouped by the
        behaviour they live in (what the generators should reach next)."""
        lines = ["| class | faults | killed | recall | survived | error / not-live / timeout |", "|---|---|---|---|---|---|"]
        for kinds, name in ((("historic",), "historic"), (("classic",), "classic"),
                            (("historic", "classic"), "**all bug faults**")):
            rs = self.of(*kinds)
            k = sum(r.outcome == KILLED for r in rs)
            lines.append(f"| {name} | {len(rs)} | {k} | {100 * k / len(rs):.1f} % | "
                         f"{sum(r.outcome == SURVIVED for r in rs)} | "
                         f"{sum(r.outcome in (ERROR, NOT_LIVE, TIMEOUT) for r in rs)} |" if rs else f"| {name} | 0 | | | | |")
        generated = self.of(GENERATED)
        if generated:
            k = sum(r.outcome == KILLED for r in generated)
            lines.append(f"| generated (survivors may be equivalent) | {len(generated)} | {k} | "
                         f"{100 * k / len(generated):.1f} % | {sum(r.outcome == SURVIVED for r in generated)} | "
                         f"{sum(r.outcome in (ERROR, NOT_LIVE, TIMEOUT) for r in generated)} |")
        neutral = self.of(NEUTRAL)
        lines.append(f"| neutral (must pass) | {len(neutral)} | flagged: {len(self.false_positives)} | | "
                     f"passed: {sum(r.outcome == SURVIVED for r in neutral)} | "
                     f"{sum(r.outcome in (ERROR, NOT_LIVE, TIMEOUT) for r in neutral)} |")
        by_check: dict[str, int] = {}
        for r in self.results:
            if r.outcome == KILLED and r.fault.kind != NEUTRAL:
                by_check[r.killed_by] = by_check.get(r.killed_by, 0) + 1
        lines += ["", "First failing check: " + ", ".join(f"`{c}` {n}" for c, n in
                                                          sorted(by_check.items(), key=lambda kv: -kv[1]))]
        if self.survivors:
            lines += ["", "Survivors by behaviour:"]
            groups: dict[str, list[FaultResult]] = {}
            for r in self.survivors:
                groups.setdefault(r.fault.behaviour, []).append(r)
            for behaviour, rs in sorted(groups.items()):
                lines.append(f"* {behaviour}: " + ", ".join(
                    f"`{r.fault.id}`" + (f" ({r.fault.bug})" if r.fault.bug else "")
                    + (f" [{r.outcome}]" if r.outcome != SURVIVED else "") for r in rs))
        return "\n".join(lines)

    def to_markdown(self) -> str:
        lines = ["| fault | class | bug | behaviour | outcome | first failing check | s |",
                 "|---|---|---|---|---|---|---|"]
        for r in self.results:
            f = r.fault
            out = r.outcome if f.kind != NEUTRAL else ("**FLAGGED**" if r.flagged else f"not flagged ({r.outcome})")
            if f.kind != NEUTRAL and r.outcome != KILLED:
                out = f"**{r.outcome.upper()}**"
            lines.append(f"| `{f.id}` | {f.kind} | {f.bug or ''} | {f.behaviour} | {out} | {r.killed_by or ''} "
                         f"| {r.seconds:.0f} |")
        return "\n".join(lines)

    def render(self) -> str:
        lines = [f"{'fault':40} {'class':8} {'outcome':9} {'killed by':20} {'s':>5}"]
        for r in self.results:
            f = r.fault
            lines.append(f"{f.id:40} {f.kind:8} {r.outcome:9} {r.killed_by or '':20} {r.seconds:5.0f}"
                         + (f"  {r.detail[:100]}" if r.outcome in (ERROR, NOT_LIVE, TIMEOUT) else ""))
        return "\n".join(lines + ["", self.summary()])


# --------------------------------------------------------------------------------------------
# one fault: overlay + subprocess


def _verify_options() -> set[str]:
    """The option strings ``kvref verify`` accepts here (older trees lack ``--exitfirst`` and
    ``--shrink-seconds``; the campaign then runs every check and shrinks as verify does)."""
    import argparse

    from kvref.cli.verify import add_parser

    p = add_parser(argparse.ArgumentParser().add_subparsers())
    return {o for a in p._actions for o in a.option_strings}


def verify_argv(checks: Iterable[str], profile: str, seed: int, out_dir: str) -> list[str]:
    """``kvref verify`` arguments for one fault: stop at the first failing check (its time is the
    time to detection), and bound shrinking — a kill needs a failure, not a minimal trace."""
    argv = ["verify", "--against", "vllm", "--only", *checks, "--json", "--profile", profile,
            "--seed", str(seed), "--out", out_dir]
    options = _verify_options()
    if "--exitfirst" in options:
        argv.append("--exitfirst")
    if "--shrink-seconds" in options:
        argv += ["--shrink-seconds", "1"]
    return argv


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_fault(fault: SourceFault | None, checks: Iterable[str] = VLLM_CHECKS, profile: str = "fast",
              seed: int = 0, timeout: float | None = None, vllm_dir: str | None = None) -> FaultResult:
    """Apply ``fault`` (None: the clean vLLM, through the same overlay) and run the checks on it.

    Raises :class:`~kvref.models.mutants.vllm_source.overlay.FaultDoesNotApplyError` when the fault's
    text does not match the installed vLLM.
    """
    checks = tuple(checks)
    timeout = timeout or DEFAULT_TIMEOUT[profile]
    root = tempfile.mkdtemp(prefix="kvref_vllm_mutant_")
    t0 = time.perf_counter()
    try:
        os.mkdir(os.path.join(root, "overlay"))
        ov = build_overlay(fault, os.path.join(root, "overlay"), vllm_dir)
        report = os.path.join(root, "report.json")
        cmd = [sys.executable, "-m", "kvref.vllm_campaign", "--probe", fault.module if fault else "vllm",
               "--report", report, "--", *verify_argv(checks, profile, seed, os.path.join(root, "out"))]
        env = ov.env()
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env.setdefault("TRANSFORMERS_OFFLINE", "1")
        env.pop("KVREF_HYPOTHESIS_PROFILE", None)
        with open(os.path.join(root, "log.txt"), "wb") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return FaultResult(fault, TIMEOUT, time.perf_counter() - t0,
                                   detail=f"no verdict within {timeout:.0f} s")
            except BaseException:
                _kill_group(proc)
                raise
        seconds = time.perf_counter() - t0
        if not os.path.exists(report):
            with open(os.path.join(root, "log.txt"), errors="replace") as f:
                tail = f.read()[-600:]
            return FaultResult(fault, ERROR, seconds, detail=f"the verify subprocess exited {proc.returncode} "
                                                             f"without a report: {tail}")
        with open(report) as f:
            rep = json.load(f)
        return _result_from_report(fault, ov, rep, seconds)
    finally:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


def _result_from_report(fault, ov, rep: dict, seconds: float) -> FaultResult:
    probe = rep.get("probe") or {}
    verdict = rep.get("verify")
    in_overlay = bool(probe.get("vllm_file", "").startswith(ov.root + os.sep))
    live = None
    if fault is None:
        live = in_overlay
    elif probe.get("module_file"):
        live = (probe["module_file"] == ov.mutated and probe.get("module_sha256") == file_sha256(ov.mutated))
    if verdict is None:
        return FaultResult(fault, ERROR, seconds, live=live, detail=rep.get("error") or "no verify output")
    checks = {c["name"]: c["status"] for c in verdict["checks"]}
    secs = {c["name"]: round(c.get("seconds") or 0.0, 1) for c in verdict["checks"]}
    failed = [c for c in verdict["checks"] if c["status"] == "failed"]
    errored = [c for c in verdict["checks"] if c["status"] == "error"]
    if not in_overlay:
        return FaultResult(fault, NOT_LIVE, seconds, None, checks, secs, live=False,
                           detail=f"vllm was imported from {probe.get('vllm_file')!r}, not the overlay")
    if failed and live is not False:
        first = failed[0]
        detail = (first.get("details") or [first.get("summary", "")])[0]
        return FaultResult(fault, KILLED, seconds, first["name"], checks, secs, detail=str(detail), live=live)
    if not live:
        why = ("the mutated module was never imported" if live is None
               else f"the loaded {fault.module} is not the edited copy ({probe.get('module_file')})")
        return FaultResult(fault, NOT_LIVE, seconds, None, checks, secs, detail=why, live=live)
    if errored:
        return FaultResult(fault, ERROR, seconds, None, checks, secs, live=live,
                           detail=f"{errored[0]['name']}: {errored[0].get('summary', '')}")
    return FaultResult(fault, SURVIVED, seconds, None, checks, secs, live=live)


# --------------------------------------------------------------------------------------------
# generated faults (issue #22): the unbiased sample


def generated_faults(n: int, seed: int = 0, modules: Iterable[str] | None = None) -> list[SourceFault]:
    """``n`` faults generated from the installed vLLM's KV-cache modules
    (:func:`kvref.models.mutants.vllm_source.generated.generate`): the modules of
    ``kvref/data/reach_modules.toml`` (or ``modules``, paths relative to the vllm package such as
    ``v1/core/block_pool.py``, each one of them), minus what ``kvref/data/reach_exclusions.toml``
    excludes. Same vLLM files and seed, same faults."""
    from kvref.models.mutants.vllm_source.generated import generate
    from kvref.reach_exclusions import collapse
    from kvref.reach_modules import resolve_modules

    listed = resolve_modules()
    by_rel = {rel[len("vllm/"):]: path for rel, path in listed.by_rel().items()}
    if modules is None:
        chosen = sorted(by_rel)
    else:
        chosen = list(dict.fromkeys(modules))
        for m in chosen:
            if m not in by_rel:
                raise InvalidFieldError("--modules", m, "files of kvref's vLLM KV-cache module list, relative "
                                        "to the vllm package (e.g. v1/core/block_pool.py; kvref/data/"
                                        "reach_modules.toml)")
    sources = {}
    for m in chosen:
        with open(by_rel[m], encoding="utf-8") as fh:
            sources[m] = fh.read()
    return generate(sources, n, seed, module_exclusions(), collapse, listed=by_rel)


def module_exclusions() -> dict:
    """The reviewed exclusion file (``kvref/data/reach_exclusions.toml``) per module, keyed by the
    path relative to the vllm package, as the generator takes it (entries of one module merged)."""
    from kvref.models.mutants.vllm_source.generated import ModuleExclusions
    from kvref.reach_exclusions import load_exclusions

    excl: dict[str, ModuleExclusions] = {}
    for e in load_exclusions():
        path = e.module[len("vllm/"):]
        old = excl.get(path, ModuleExclusions())
        excl[path] = ModuleExclusions(old.whole_module or e.whole_module, old.functions | set(e.functions),
                                      old.blocks | set(e.blocks))
    return excl


# --------------------------------------------------------------------------------------------
# the campaign


def select_faults(faults: Iterable[SourceFault], ids: Iterable[str] | None = None,
                  kinds: Iterable[str] | None = None) -> list[SourceFault]:
    """Faults by id (in the order given) and/or class; unknown ids or classes raise InvalidFieldError."""
    faults = list(faults)
    by_id = {f.id: f for f in faults}
    if kinds:
        kinds = list(kinds)
        for k in kinds:
            if k not in CLASSES:
                raise InvalidFieldError("--class", k, " / ".join(CLASSES))
        faults = [f for f in faults if f.kind in kinds]
    if ids:
        ids = list(ids)
        unknown = [i for i in ids if i not in by_id]
        if unknown:
            raise InvalidFieldError("--faults", ",".join(unknown), "ids of the vLLM fault catalogue "
                                    "(kvref mutants --target vllm --list)")
        wanted = set(ids)
        faults = [by_id[i] for i in ids if by_id[i] in faults] if kinds else [by_id[i] for i in ids]
        faults = [f for f in faults if f.id in wanted]
    return faults


#: runs faults (None: the clean vLLM) with the checks, calling back with each result as it comes;
#: returns the results in the faults' order
FaultRunner = Callable[[list, tuple, "Callable[[FaultResult], None]"], list]


def run_campaign(faults: Iterable[SourceFault], checks: Iterable[str] = VLLM_CHECKS, profile: str = "fast",
                 seed: int = 0, timeout: float | None = None, baseline: bool = True,
                 progress: Callable[[str], None] | None = None, runner: FaultRunner | None = None,
                 where: str = "") -> CampaignResult:
    """Run every fault; first the clean vLLM through an empty overlay (``baseline``): a check that
    fails there cannot tell a fault from the clean state and is left out (and the campaign is
    then not ``ok``). ``runner``: how faults are run (default: :func:`run_fault` one after the
    other here; ``kvref mutants --target vllm --ray`` ships each as a Ray unit, kvref.ray_mutants,
    #27); ``where`` is said after "clean vLLM (baseline)"."""
    checks = tuple(checks)
    selectable = vllm_checks(default_only=False)
    for c in checks:
        if c not in selectable:
            raise InvalidFieldError("--checks", c, "checks of kvref verify that drive vLLM: " + ", ".join(selectable))
    if profile not in DEFAULT_TIMEOUT:
        raise InvalidFieldError("--profile", profile, "fast / ci / nightly")
    faults = list(faults)
    vllm_dir = installed_vllm_dir()
    for f in faults:  # every fault must apply before anything runs
        with open(os.path.join(vllm_dir, f.path), encoding="utf-8") as fh:
            f.apply_to(fh.read())
    t0 = time.perf_counter()
    say = progress or (lambda s: None)
    if runner is None:
        def runner(batch, checks, on_result):
            out = []
            for f in batch:
                out.append(run_fault(f, checks, profile, seed, timeout, vllm_dir))
                on_result(out[-1])
            return out
    base, dropped = None, {}
    if baseline:
        say(f"clean vLLM (baseline){where} ...")
        [base] = runner([None], checks, lambda r: None)
        say(f"clean vLLM: {base.outcome} ({base.seconds:.0f} s) {base.detail[:120]}")
        if base.outcome == TIMEOUT:
            dropped = {"*": base.detail}
            return CampaignResult([], checks, profile, seed, time.perf_counter() - t0, base, dropped)
        dropped = {name: status for name, status in base.checks.items() if status in ("failed", "error")}
        # --exitfirst stopped at the first failing check: run the rest again without it
        while dropped and base.outcome in (KILLED, ERROR):
            rest = tuple(c for c in checks if c not in dropped)
            if not rest:
                break
            [base] = runner([None], rest, lambda r: None)
            more = {n: s for n, s in base.checks.items() if s in ("failed", "error")}
            if not more:
                break
            dropped.update(more)
        checks = tuple(c for c in checks if c not in dropped)
        if dropped:
            say(f"left out (failing on the clean vLLM): {dropped}")
    done = [0]

    def said(r: FaultResult) -> None:
        done[0] += 1
        say(f"[{done[0]}/{len(faults)}] {r.fault.id} ({r.fault.kind}): {r.outcome}"
            + (f" by {r.killed_by}" if r.killed_by else "") + f" in {r.seconds:.0f} s"
            + (f" — {r.detail[:100]}" if r.outcome in (ERROR, NOT_LIVE, TIMEOUT) else ""))

    results = runner(faults, checks, said)
    return CampaignResult(results, checks, profile, seed, time.perf_counter() - t0, base, dropped)


# --------------------------------------------------------------------------------------------
# subprocess entry point: run kvref verify in-process, then write what was verified and a probe


def _probe(module: str) -> dict:
    """Where ``vllm`` and the mutated module were loaded from (read from sys.modules: no import)."""
    out: dict = {}
    vllm = sys.modules.get("vllm")
    out["vllm_file"] = getattr(vllm, "__file__", None) or ""
    mod = sys.modules.get(module)
    path = getattr(mod, "__file__", None)
    if path:
        out["module_file"] = path
        out["module_sha256"] = file_sha256(path)
    return out


def _parse_verify_json(text: str) -> dict | None:
    start = text.rfind('{\n  "ok"')
    if start < 0:
        return None
    try:
        return json.JSONDecoder().raw_decode(text[start:])[0]
    except ValueError:
        return None


def _probe_main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvref.vllm_campaign")
    p.add_argument("--probe", required=True, help="dotted module whose loaded file to report")
    p.add_argument("--report", required=True, help="where to write the JSON report")
    p.add_argument("verify_args", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    rest = args.verify_args[1:] if args.verify_args[:1] == ["--"] else args.verify_args
    from kvref import cli

    buf = io.StringIO()
    rc, error = None, None
    try:
        with contextlib.redirect_stdout(buf):
            rc = cli.main(rest)
    except BaseException as exc:  # noqa: BLE001 — reported, the parent decides
        error = f"{type(exc).__name__}: {exc}"
    report = {"rc": rc, "error": error, "verify": _parse_verify_json(buf.getvalue()), "probe": _probe(args.probe)}
    with open(args.report, "w") as f:
        json.dump(report, f)
    return 0


if __name__ == "__main__":  # pragma: no cover — the campaign's subprocess
    sys.exit(_probe_main(sys.argv[1:]))
