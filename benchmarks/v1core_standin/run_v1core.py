"""Issue #23's "done when": vLLM 0.33.0's own v1/core unit tests with kvref's reference standing in.

Runs vLLM's unmodified ``tests/v1/core`` (from its sdist) twice with pytest: once as shipped, once
with the ``kvref_standin`` plugin beside this file, which binds vLLM's ``KVCacheManager`` (also the
name vLLM's ``Scheduler`` builds) to kvref's reference behind a translating adapter. Then prints:

* how many tests pass on vLLM;
* how many of those pass with the stand-in, and how many of these built a stand-in (a test that
  never builds a KV cache manager -- planning, encoder cache -- passes without running kvref);
* the tests that pass on vLLM and fail with the stand-in, grouped by cause: the feature the
  stand-in names (``kvref stand-in: <feature>``) or else the exception's first line.

Usage (2 shared cores: ~2 min per pass for the whole folder)::

    .venv/bin/python benchmarks/v1core_standin/run_v1core.py \
        --sdist /work/vllm-src/vllm-0.33.0 [--out /tmp/v1core] [--only-standin] [PATH ...]

PATH are test paths relative to the sdist (default ``tests/v1/core``). The tests are run from a
scratch folder whose ``tests`` links to the sdist's, so ``import vllm`` finds the installed vLLM,
not the sdist's source tree. Tests are never copied.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_LOGGING_LEVEL": "WARNING", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_OFFLINE": "1"}


def run_pytest(workdir: Path, paths: list[str], xml: Path, standin: bool, usage: Path) -> None:
    cmd = [sys.executable, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider", "--noconftest",
           "--continue-on-collection-errors", "-W", "ignore", f"--junit-xml={xml}", "--tb=line"]
    env = dict(os.environ, **ENV)
    if standin:
        cmd += ["-p", "kvref_standin"]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH", "")]))
        env["KVREF_STANDIN_USAGE"] = str(usage)
    subprocess.run(cmd, cwd=workdir, env=env, stdout=subprocess.DEVNULL, check=False)


def outcomes(xml: Path) -> dict[str, tuple[str, str]]:
    """node id -> (outcome, first message line) from a JUnit report."""
    out: dict[str, tuple[str, str]] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        file = case.get("classname", "").replace(".", "/")
        nodeid = f"{file}.py::{case.get('name')}"
        status, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                status = "skipped" if tag == "skipped" else "failed"
                message = (node.get("message") or node.text or "").strip()
                break
        out[nodeid] = (status, message)
    return out


def cause(message: str) -> str:
    """The group a failure belongs to: the stand-in's named gap, else the exception's first line."""
    gap = re.search(r"kvref stand-in: ([^\n'\"]+)", message)
    if gap:
        return "missing: " + gap.group(1).strip()
    line = message.splitlines()[0] if message else "(no message)"
    line = re.sub(r"0x[0-9a-f]+", "0x…", line)
    line = re.sub(r"\d+", "N", line)
    return line[:140]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sdist", default="/work/vllm-src/vllm-0.33.0", help="vLLM 0.33.0 sdist with its tests")
    ap.add_argument("--out", default="/tmp/kvref-v1core", help="scratch folder (reports, the tests link)")
    ap.add_argument("--only-standin", action="store_true", help="reuse the vLLM pass of an earlier run")
    ap.add_argument("--show", type=int, default=3, help="example tests printed per failure group")
    ap.add_argument("paths", nargs="*", default=["tests/v1/core"])
    args = ap.parse_args(argv)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    link = out / "tests"
    if not link.exists():
        link.symlink_to(Path(args.sdist) / "tests")
    vllm_xml, standin_xml, usage = out / "vllm.xml", out / "standin.xml", out / "usage.json"
    if not (args.only_standin and vllm_xml.exists()):
        run_pytest(out, args.paths, vllm_xml, False, usage)
    run_pytest(out, args.paths, standin_xml, True, usage)

    on_vllm, with_ref = outcomes(vllm_xml), outcomes(standin_xml)
    built = json.loads(usage.read_text()) if usage.exists() else {}
    passing = sorted(n for n, (s, _) in on_vllm.items() if s == "passed")
    ok = [n for n in passing if with_ref.get(n, ("missing", ""))[0] == "passed"]
    through = [n for n in ok if built.get(n, 0) > 0]
    groups: dict[str, list[str]] = collections.defaultdict(list)
    for n in passing:
        status, message = with_ref.get(n, ("failed", "not run with the stand-in"))
        if status != "passed":
            groups[cause(message)].append(n)

    print(f"collected (vLLM run): {len(on_vllm)}")
    print(f"pass on vLLM: {len(passing)}")
    print(f"pass with the kvref stand-in: {len(ok)} ({100 * len(ok) / max(1, len(passing)):.1f} %)")
    print(f"  of which built a stand-in (ran kvref's reference): {len(through)} "
          f"({100 * len(through) / max(1, len(passing)):.1f} % of vLLM's passes)")
    print(f"fail with the stand-in: {sum(map(len, groups.values()))}, by cause:")
    for key, names in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        print(f"  {len(names):4d}  {key}")
        for n in names[:args.show]:
            print(f"          {n}")
    (out / "summary.json").write_text(json.dumps(
        {"pass_on_vllm": len(passing), "pass_with_standin": len(ok), "through_kvref": len(through),
         "groups": groups}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
