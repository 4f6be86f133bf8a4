"""The CLI flag walk: every subcommand x every option that takes a value x wrong values of its kind.

``cli_cases.py`` is a hand-written catalogue: it covers what its author thought of. This module
walks the parser ``kvref.cli.build_parser`` builds, so an option added tomorrow is fuzzed without
anyone listing it. Each option gets a *kind* from its argparse declaration (``type=int``,
``type=float``, ``choices``, a path by its ``metavar``/``dest``, a byte count, ``--set`` pairs, free
text) and the kind's wrong values; every positional that names a file gets broken files (missing,
a folder, ``/dev/null``, binary junk, empty, invalid UTF-8, huge numbers, nesting 10,000 deep,
``NaN``, a list, a truncated copy); every field of every packaged Hugging Face ``config.json``
(``kvref/examples/hf_configs``) gets the wrong types; plus valid-but-extreme sizes.

The oracle is the same for every case (:func:`judge`): it ends (a watchdog), exits 0/1/2/3, prints
no traceback; a 2 prints exactly one ``error`` line naming the flag (or the file) and what is
allowed; ``--json`` stdout parses (or is empty on a 2). A value that cannot mean anything for its
kind (``x`` for an int, ``nan`` for seconds, a missing input file) must be a 2.

``python -m tests.hardening.cli_flag_fuzz [--all] [PREFIX...]`` runs the cases in-process and
prints the counts per class (subcommand x input class): the figures in docs/hardening.md.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from importlib import resources

#: base argv per subcommand: a quick valid run (small budgets) that each option is added to
BASES: dict[str, list[str]] = {
    "verify": ["verify", "--only", "spec"],
    "size": ["size", "--example", "llama3_8b", "--available-memory", "1GiB"],
    "prove": ["prove", "T1", "--timeout", "5"],
    "explore": ["explore", "--scope", "tight", "--max-seconds", "1"],
    # --list: the arguments are checked, nothing long runs (a real campaign takes ~20 s)
    "mutants": ["mutants", "--list"],
    "replay": ["replay", "{tmp}/t.json", "--kinds", "reference"],
    "check-run": ["check-run", "{tmp}/run.kvtrace.gz", "--properties-only"],
    "watch": ["watch", "tcp://127.0.0.1:{port}", "--seconds", "0.2", "--quiet"],
}
#: options that need another base to be read at all
OPTION_BASES: dict[tuple[str, str], list[str]] = {
    ("size", "--tensor-parallel-size"): ["size", "--hf-config", "qwen3-8b", "--gpu-memory", "80GiB"],
    ("size", "--kernel-block-size"): ["size", "--hf-config", "qwen3-8b", "--gpu-memory", "80GiB"],
    ("size", "--mamba-cache-dtype"): ["size", "--hf-config", "qwen3-next-80b-a3b-instruct", "--gpu-memory", "80GiB"],
    ("size", "--mamba-ssm-cache-dtype"): ["size", "--hf-config", "qwen3-next-80b-a3b-instruct",
                                          "--gpu-memory", "80GiB"],
    ("size", "--allow-chunked-local-hybrid"): ["size", "--hf-config", "llama-4-scout-17b-16e-instruct",
                                               "--gpu-memory", "80GiB"],
    ("size", "--hf-config"): ["size", "--gpu-memory", "80GiB"],
    ("size", "--example"): ["size", "--available-memory", "1GiB"],
    ("size", "--gpu-memory"): ["size", "--example", "llama3_8b", "--model-memory", "1GiB"],
    ("size", "--gpu-memory-utilization"): ["size", "--example", "llama3_8b", "--gpu-memory", "80GiB"],
    ("size", "--model-memory"): ["size", "--example", "llama3_8b", "--gpu-memory", "80GiB"],
    ("size", "--kv-cache-memory"): ["size", "--example", "llama3_8b"],
    ("size", "--available-memory"): ["size", "--example", "llama3_8b"],
    ("size", "--plot"): ["size", "--example", "llama3_8b", "--available-memory", "16GiB"],
    ("prove", "--out"): ["prove", "--variant", "pre-41069-override-ignored"],
    ("prove", "--variant"): ["prove"],
    ("mutants", "--faults"): ["mutants", "--target", "vllm", "--list"],
    ("mutants", "--class"): ["mutants", "--target", "vllm", "--list"],
    ("mutants", "--from-json"): ["mutants", "--target", "vllm"],
    ("mutants", "--fault-timeout"): ["mutants", "--target", "vllm", "--list"],
    ("mutants", "--profile"): ["mutants", "--target", "vllm", "--list"],
    ("mutants", "--seed"): ["mutants", "--target", "vllm", "--list"],
    ("mutants", "--generated"): ["mutants", "--target", "vllm", "--list"],
    ("mutants", "--modules"): ["mutants", "--target", "vllm", "--generated", "2", "--list"],
}
#: flags whose value the base already sets: the fuzzed one replaces it
_VALUED_BASE_FLAGS = {"--only", "--available-memory", "--timeout", "--scope", "--max-seconds", "--kinds",
                      "--seconds", "--example", "--gpu-memory", "--model-memory", "--hf-config"}
#: int options for which a negative value is meaningful (none today)
NEGATIVE_INT_OK: set[tuple[str, str]] = {
    ("verify", "--seed"),  # any int seeds Hypothesis and random.Random
    ("size", "--max-model-len"),  # vLLM's -1: auto-fit
}

# -- the kinds of values and their wrong values -------------------------------------------------
#: (value, must be rejected): a value that cannot mean anything for the kind must exit 2
INT_VALUES = [("-1", True), ("0", False), (str(10**30), False), ("1.5", True), ("nan", True), ("inf", True),
              ("x", True), ("", True), ("0x10", True), ("1e3", True), (" 7", False), ("9" * 5000, True)]
FLOAT_VALUES = [("nan", True), ("inf", True), ("-inf", True), ("-1", True), ("1e309", True), ("", True),
                ("x", True), ("0", False), ("1e-300", False), ("1e30", False), ("0x1p3", True)]
BYTES_VALUES = [("x", True), ("", True), ("-1", True), ("-5GiB", True), ("inf", True), ("nan", True),
                ("1e400", True), ("9" * 400, True), ("1.5.5GiB", True), ("0x10", True), ("16 PiB", True),
                ("0", False), ("1e30", False), ("1", False)]
RATIO_VALUES = [("nan", True), ("inf", True), ("-1", True), ("0", True), ("1.5", True), ("", True), ("x", True),
                ("1e-300", False), ("1", False)]
INT_OR_AUTO_VALUES = [*INT_VALUES, ("AUTO", True), ("auto ", True)]
CHOICE_VALUES = [("bogus", True), ("", True), ("VLLM", True)]
TEXT_VALUES = [("", False), ("bogus", False), ("x" * 5000, False), ("--", False), ("a,b,,", False),
               ("\u00e9\u202e\U0001f600", False), ("../../etc/passwd", False)]
SET_VALUES = [("num_blocks", True), ("=", True), ("=1", True), ("bogus=1", True), ("num_blocks=", True),
              ("num_blocks=x", True), ("num_blocks=1.5", True), ("num_blocks=-1", True), ("num_blocks=nan", True),
              (f"num_blocks={10**30}", True), ("num_blocks=" + "9" * 5000, True), ("block_size=0", True),
              ("max_model_len=0", True), ("num_blocks=[1]", True), ("num_blocks=true", True),
              ("prompts=x", True), ("max_tokens=-1", True), ("max_tokens=[[", True), ("aborts=2", True)]
#: an output path (a file or a folder kvref writes)
OUT_PATHS = [("/proc/kvref/x/y", True), ("{tmp}/file.txt/sub", True), ("", True), ("{tmp}/" + "n" * 300, True),
             ("/dev/null/x", True)]
#: output paths that must be a file (a folder is wrong) / a folder (a file is wrong)
OUT_FILE_EXTRA = [("{tmp}", True), ("{tmp}/out.bogus-ext", False), ("{tmp}/no-suffix", False)]
OUT_DIR_EXTRA = [("{tmp}/file.txt", True), ("/dev/null", True)]


def _deep(n: int = 10_000) -> str:
    return "[" * n + "]" * n


#: broken input files: name -> (file content or None for "no file written", must be rejected)
BROKEN_FILES: dict[str, tuple[str | bytes | None, bool]] = {
    "missing": (None, True),
    "empty": ("", True),
    "binary": (b"\x00\x01\xff\xfe\x80garbage\x00" * 20, True),
    "bad-utf8": (b'{"name": "\xff\xfe\xfa"}', True),
    "not-json": ("{nope", True),
    "list": ("[1, 2, 3]", True),
    "scalar": ("42", True),
    "null": ("null", True),
    "deep": (_deep(), True),
    "deep-object": ('{"a":' * 10_000 + "1" + "}" * 10_000, True),
    "huge-int": ('{"n": ' + "9" * 5000 + "}", True),
    "huge-float": ('{"n": 1e999}', True),
    "nan": ('{"n": NaN}', True),
    "bom": ("\ufeff{}", True),
}
#: special input paths (not written by the case): value, must be rejected
SPECIAL_IN_PATHS = [("{tmp}", True), ("/dev/null", True), ("/proc/kvref/none", True), ("", True),
                    ("{tmp}/" + "n" * 300, True)]


@dataclass
class FuzzCase:
    id: str
    argv: list[str]
    subcommand: str
    klass: str  # input class: int, float, bytes, choice, text, set, out-path, in-path, file, hf-field, extreme, repeat
    flag: str  # the option (or positional) under test
    value: str
    must_reject: bool
    files: dict[str, str | bytes] = field(default_factory=dict)

    @property
    def json(self) -> bool:
        return "--json" in self.argv


# -- the walk ----------------------------------------------------------------------------------------


def subparsers(parser: argparse.ArgumentParser | None = None) -> dict[str, argparse.ArgumentParser]:
    from kvref.cli import build_parser

    parser = parser or build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0 and not isinstance(action, (argparse._HelpAction, argparse._VersionAction))


def kind_of(action: argparse.Action) -> str:
    """The kind of value an option takes, from its declaration alone (no list of flag names)."""
    meta = str(action.metavar or "").upper()
    dest = action.dest
    if action.choices is not None:
        return "choice"
    if action.type is int:
        return "int"
    if action.type is float:
        return "float"
    if "=" in meta:
        return "set"
    if meta == "BYTES":
        return "bytes"
    if meta == "U" or dest.endswith("utilization"):
        return "ratio"
    if meta.startswith("N|") or meta == "N":
        return "int-or-auto"
    if dest in ("out",) or meta in ("DIR",):
        return "out-dir"
    if meta == "PNG" or dest.startswith(("update_", "junit")):
        return "out-file"
    if meta in ("FILE", "PATH", "TRACE") or dest in ("trace", "config", "baseline") or dest.startswith("from_"):
        return "in-file"
    return "text"


def options(parser=None) -> list[tuple[str, argparse.Action, str]]:
    """(subcommand, action, kind) for every option and positional that takes a value."""
    out = []
    for name, sp in subparsers(parser).items():
        for action in sp._actions:
            if takes_value(action):
                out.append((name, action, kind_of(action)))
    return out


def _flag(action: argparse.Action) -> str:
    return max(action.option_strings, key=len) if action.option_strings else action.dest


def _base(sub: str, flag: str) -> list[str]:
    base = list(OPTION_BASES.get((sub, flag), BASES.get(sub, [sub])))
    if flag in _VALUED_BASE_FLAGS and flag in base:  # the fuzzed value replaces the base's
        i = base.index(flag)
        del base[i:i + 2]
    return base


#: files every case's folder holds (the bases point at them)
def base_files() -> dict[str, str | bytes]:
    from tests.hardening.cli_cases import _trace

    return {"t.json": _trace(), "file.txt": "x", "run.kvtrace.gz": _run_trace()}


_RUN_TRACE: list[bytes] = []


def _run_trace() -> bytes:
    """A small recorded run (the reference writes it), gzipped bytes; made once."""
    if not _RUN_TRACE:
        import tempfile

        from kvref.models.run_check.generate import generate_trace

        from tests.record.traces import hybrid_setup

        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "r.kvtrace.gz")
            pool, cfg = hybrid_setup()
            generate_trace(path, pool, cfg, steps=30, seed=7)
            with open(path, "rb") as fh:
                _RUN_TRACE.append(fh.read())
    return _RUN_TRACE[0]


def _values(kind: str) -> list[tuple[str, bool]]:
    return {"int": INT_VALUES, "float": FLOAT_VALUES, "bytes": BYTES_VALUES, "ratio": RATIO_VALUES,
            "int-or-auto": INT_OR_AUTO_VALUES, "choice": CHOICE_VALUES, "text": TEXT_VALUES, "set": SET_VALUES,
            "out-dir": OUT_PATHS + OUT_DIR_EXTRA, "out-file": OUT_PATHS + OUT_FILE_EXTRA}.get(kind, TEXT_VALUES)


def _slug(text: str) -> str:
    s = re.sub(r"[^A-Za-z0-9.+-]+", "_", text)[:24]
    return s if s else "empty"


def _id(*parts: str, value: str = "") -> str:
    tail = _slug(value) + ("~" + hashlib.sha1(value.encode()).hexdigest()[:6] if len(value) > 24 else "")
    return "/".join([*parts, tail]) if value != "" or parts else tail


def flag_cases(parser: argparse.ArgumentParser | None = None) -> list[FuzzCase]:
    out: list[FuzzCase] = []
    for sub, action, kind in options(parser):
        flag = _flag(action)
        if kind == "in-file":
            out.extend(_file_cases(sub, action, flag))
            continue
        if not action.option_strings:  # a positional that is not a file: wrong text in its place
            out.extend(_positional_text_cases(sub, action))
            continue
        base = _base(sub, flag)
        must_int_neg = (sub, flag) not in NEGATIVE_INT_OK
        for value, reject in _values(kind):
            if kind in ("int", "int-or-auto") and value == "-1":
                reject = must_int_neg
            argv = [*base, f"{flag}={value}"]
            out.append(FuzzCase(_id(sub, flag, kind, value=value), argv, sub, kind, flag, value, reject))
            if sub in ("verify", "size", "prove", "explore", "mutants", "check-run", "watch") and value in ("", "x"):
                out.append(FuzzCase(_id(sub, flag, kind, "json", value=value), [*argv, "--json"], sub, kind, flag,
                                    value, reject))
        # repeated: a wrong value then a good one, and the reverse (argparse keeps the last)
        good = _good_value(sub, flag, kind)
        bad = "x"
        if good is not None:
            for order, vals in (("bad-good", (bad, good)), ("good-bad", (good, bad))):
                argv = [*base, *(f"{flag}={v}" for v in vals)]
                reject = order == "good-bad"
                out.append(FuzzCase(_id(sub, flag, "repeat", order), argv, sub, "repeat", flag, vals[-1],
                                    bool(reject)))
    return out


def _good_value(sub: str, flag: str, kind: str) -> str | None:
    return {"int": "1", "float": "1", "bytes": "1GiB", "ratio": "0.5", "int-or-auto": "64",
            "set": "num_blocks=4"}.get(kind)


def _positional_text_cases(sub: str, action: argparse.Action) -> list[FuzzCase]:
    base = [a for a in BASES.get(sub, [sub])]
    out = []
    for value, _ in [*TEXT_VALUES, ("tcp://127.0.0.1:0", False), ("tcp://[::1]:99999", False), ("T99", False)]:
        if value.startswith("-"):  # an option to argparse, not this positional's value
            continue
        if sub == "watch":
            argv = [sub, value, *base[2:]]
        elif sub == "prove":
            argv = [sub, "--timeout", "5", "--", value]
        else:
            argv = [sub, value]
        out.append(FuzzCase(_id(sub, action.dest, "positional", value=value), argv, sub, "positional", action.dest,
                            value, False))
    return out


def _file_cases(sub: str, action: argparse.Action, flag: str) -> list[FuzzCase]:
    """Broken files in an input file's place (a positional or a ``--flag FILE``)."""
    base = _base(sub, flag)
    exts = {"config": (".json", ".toml"), "trace": (".json", ".py", ".kvtrace.gz", ".kvtrace")}.get(action.dest,
                                                                                                   (".json",))
    if sub == "check-run":
        exts = (".kvtrace.gz", ".kvtrace")
    out = []
    for ext in exts:
        for name, (content, reject) in BROKEN_FILES.items():
            fname = f"in{ext}"
            files: dict[str, str | bytes] = {}
            if content is not None:
                data = content.encode() if isinstance(content, str) else content
                files[fname] = gzip.compress(data) if ext.endswith(".gz") else data
            path = "{tmp}/" + fname
            out.append(FuzzCase(_id(sub, flag, "file" + ext, value=name), _with_input(sub, action, base, path), sub,
                                "file", flag, name, reject, files))
        if ext.endswith(".gz"):  # gzip-specific breakage
            for name, data in (("gz-junk", b"\x1f\x8b\x08\x00junk"), ("gz-truncated", gzip.compress(b'{"a": 1}\n' * 50)[:30]),
                               ("gz-of-gz", gzip.compress(gzip.compress(b"{}")))):
                out.append(FuzzCase(_id(sub, flag, "file" + ext, value=name),
                                    _with_input(sub, action, base, "{tmp}/" + f"in{ext}"), sub, "file", flag, name,
                                    True, {f"in{ext}": data}))
    for value, reject in SPECIAL_IN_PATHS:
        out.append(FuzzCase(_id(sub, flag, "path", value=value), _with_input(sub, action, base, value), sub,
                            "in-path", flag, value, reject))
    return out


def _with_input(sub: str, action: argparse.Action, base: list[str], path: str) -> list[str]:
    if action.option_strings:
        return [*base, f"{_flag(action)}={path}"]
    if sub == "size":
        return ["size", path, "--available-memory", "1GiB"]
    if sub == "replay":
        return ["replay", path, "--kinds", "reference"]
    if sub == "check-run":
        return ["check-run", path, "--properties-only"]
    return [sub, path]


# -- files named by flags whose content the flag walk cannot know: --hf-config and trace edits ----


def hf_examples() -> dict[str, dict]:
    root = resources.files("kvref") / "examples" / "hf_configs"
    return {p.name: json.loads(p.read_text()) for p in sorted(root.iterdir(), key=lambda p: p.name)
            if p.name.endswith(".json")}


#: wrong values for a config.json field (JSON text: NaN is what Python's json writes for nan)
HF_WRONG = [("string", "x"), ("neg", -1), ("zero", 0), ("huge", 10**30), ("null", None), ("list", [1]),
            ("dict", {"a": 1}), ("float", 1.5), ("bool", True), ("nan", float("nan")), ("inf", float("inf")),
            ("deep", [[[[[[[[[[1]]]]]]]]]])]


def hf_cases() -> list[FuzzCase]:
    out: list[FuzzCase] = []
    for fname, config in hf_examples().items():
        stem = fname.rsplit(".", 1)[0]
        for path in _leaf_paths(config):
            for label, value in [*HF_WRONG, ("missing", _MISSING)]:
                edited = _edit(config, path, value)
                where = ".".join(str(p) for p in path)
                out.append(FuzzCase(_id("size", "hf", stem, where, value=label),
                                    ["size", "--hf-config", "{tmp}/config.json", "--gpu-memory", "80GiB", "--json"],
                                    "size", "hf-field", "--hf-config", f"{where}={label}", False,
                                    {"config.json": json.dumps(edited)}))
        text = json.dumps(config)
        for label, data in (("truncated", text[: len(text) // 2]), ("list", json.dumps([config])),
                            ("deep", _deep()), ("binary", b"\x89PNG\r\n\x1a\n" + os.urandom(0) + b"\x00" * 64)):
            out.append(FuzzCase(_id("size", "hf", stem, value=label),
                                ["size", "--hf-config", "{tmp}/config.json", "--gpu-memory", "80GiB"], "size",
                                "hf-file", "--hf-config", label, True, {"config.json": data}))
        # a model folder holding the file, and a folder without one
        out.append(FuzzCase(_id("size", "hf", stem, value="folder"),
                            ["size", "--hf-config", "{tmp}/m", "--gpu-memory", "80GiB"], "size", "hf-file",
                            "--hf-config", "folder", False, {"m/config.json": text}))
    out.append(FuzzCase(_id("size", "hf", value="empty-folder"),
                        ["size", "--hf-config", "{tmp}/e", "--gpu-memory", "80GiB"], "size", "hf-file", "--hf-config",
                        "empty-folder", True, {"e/.keep": ""}))
    return out


_MISSING = object()


def _leaf_paths(obj, prefix=()) -> list[tuple]:
    """Paths of every field (top-level and nested tables, the first item of a list)."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append((*prefix, k))
            if isinstance(v, (dict, list)):
                out.extend(p for p in _leaf_paths(v, (*prefix, k)) if p != (*prefix, k))
    elif isinstance(obj, list) and obj:
        out.append((*prefix, 0))
        if isinstance(obj[0], (dict, list)):
            out.extend(_leaf_paths(obj[0], (*prefix, 0)))
    return out


def _edit(obj, path, value):
    obj = json.loads(json.dumps(obj))
    node = obj
    for key in path[:-1]:
        node = node[key]
    if value is _MISSING:
        node.pop(path[-1])
    else:
        node[path[-1]] = value
    return obj


def extreme_cases() -> list[FuzzCase]:
    """Valid but extreme sizes: a plan (0), "cannot serve" (1) or a limit named (2), never a crash."""
    out = []
    bases = {"hf-qwen3-8b": ["size", "--hf-config", "qwen3-8b", "--gpu-memory", "80GiB"],
             "hf-qwen3-next": ["size", "--hf-config", "qwen3-next-80b-a3b-instruct", "--gpu-memory", "80GiB"],
             "hf-gemma3": ["size", "--hf-config", "gemma-3-27b-it", "--gpu-memory", "80GiB"],
             "example-deepseek": ["size", "--example", "deepseek_v3_like", "--available-memory", "16GiB"]}
    for fname in hf_examples():  # every packaged config.json (the three above in CI, all nightly)
        stem = fname.rsplit(".", 1)[0]
        bases.setdefault(f"hf-all-{stem}", ["size", "--hf-config", stem, "--gpu-memory", "80GiB"])
    extremes = [["--max-model-len", "1"], ["--block-size", "1"], ["--gpu-memory", "1"], ["--kv-cache-memory", "0"],
                ["--kv-cache-memory", "1"], ["--num-gpu-blocks-override", str(10**9)], ["--num-gpu-blocks-override", "1"],
                ["--num-gpu-blocks-override", "0"], ["--max-model-len", "auto"], ["--max-num-seqs", str(10**9)],
                ["--max-num-batched-tokens", "1"], ["--block-size", str(1 << 20)], ["--max-model-len", str(10**12)],
                ["--tensor-parallel-size", "1024"], ["--dcp", "1024"], ["--prefix-match-unit", "1"],
                ["--gpu-memory-utilization", "1e-9"], ["--max-concurrent-batches", str(10**6)],
                ["--kernel-block-size", "1"], ["--block-size", "3"]]
    for bname, base in bases.items():
        for extra in extremes:
            if base[1] == "--example" and extra[0] in ("--tensor-parallel-size", "--kernel-block-size"):
                continue
            if extra[0] == "--gpu-memory" and "--gpu-memory" in base:
                argv = [*base[:-2], *extra]
            else:
                argv = [*base, *extra]
            for js in ((), ("--json",)):
                out.append(FuzzCase(_id("size", "extreme", bname, extra[0], value=extra[1] + "".join(js)),
                                    [*argv, *js], "size", "extreme", extra[0], extra[1], False))
    for extra in (["--set", "num_blocks=128"], ["--set", "max_model_len=1024"], ["--max-depth", "0"],
                  ["--max-states", "0"], ["--max-states", "1"], ["--workers", "256"], ["--max-seconds", "1e-300"]):
        out.append(FuzzCase(_id("explore", "extreme", extra[0], value=extra[1]),
                            ["explore", "--scope", "tight", "--max-seconds", "1", *extra, "--json"], "explore", "extreme",
                            extra[0], extra[1], False))
    return out


def combination_choices(sub: str) -> list[tuple[str, str, list[str]]]:
    """(flag, kind, values) of ``sub``'s options for combinations: each kind's values and a good one
    (the file arguments keep their base; a combination varies the options around them)."""
    out = []
    for s, action, kind in options():
        if s != sub or not action.option_strings or kind == "in-file":
            continue
        values = [v for v, _ in _values(kind)]
        good = _good_value(s, _flag(action), kind)
        out.append((_flag(action), kind, values + ([good] if good is not None else [])))
    return out


def all_cases() -> list[FuzzCase]:
    cases = flag_cases() + hf_cases() + extreme_cases()
    seen: dict[str, int] = {}
    for c in cases:  # ids unique (pytest ids)
        n = seen.get(c.id, 0)
        seen[c.id] = n + 1
        if n:
            c.id = f"{c.id}#{n}"
    return cases


def ci_sample(cases: list[FuzzCase], per_class: int = 4, hf_every: int = 23) -> list[FuzzCase]:
    """A deterministic sample for CI: every flag-walk case (they are cheap), every file case, a
    stable slice of the config.json field edits (hashed ids, so the sample does not shift when a
    fixture is added)."""
    out = []
    for c in cases:
        if (c.klass == "hf-field" or "/hf-all-" in c.id) and int(hashlib.sha1(c.id.encode()).hexdigest(), 16) % hf_every:
            continue
        out.append(c)
    return out


# -- running a case and judging it ----------------------------------------------------------------


def materialize(case: FuzzCase, tmp: str, port: int = 0) -> list[str]:
    for name, content in {**base_files(), **case.files}.items():
        path = os.path.join(tmp, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(content.encode() if isinstance(content, str) else content)
    return [a.replace("{tmp}", tmp).replace("{port}", str(port)) for a in case.argv]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_ERROR_LINE = re.compile(r"^kvref( [\w-]+)?: error: ")


def judge(case: FuzzCase, argv: list[str], rc: int | None, out: str, err: str) -> list[str]:
    """What is wrong with one run (empty: nothing). Classes: hang, traceback, exit, error-line,
    json."""
    problems = []
    if rc is None:
        return ["hang"]
    if "Traceback (most recent call last)" in out + err:
        problems.append("traceback")
    if rc not in (0, 1, 2, 3):  # 3: ran, examined nothing (watch with no batch; issue #25)
        problems.append(f"exit: {rc} not in 0/1/2/3")
    elif case.must_reject and rc != 2:
        problems.append(f"exit: {rc}, want 2 (the value cannot mean anything for {case.flag})")
    if rc == 2:
        lines = [ln for ln in err.splitlines() if _ERROR_LINE.match(ln)]
        if len(lines) != 1:
            problems.append(f"error-line: {len(lines)} 'kvref ...: error:' lines")
        else:
            problems.extend(_names(case, argv, lines[0]))
    if case.json:
        if rc == 2 and out.strip():
            problems.append("json: stdout not empty on exit 2")
        elif rc in (0, 1, 3):
            try:
                json.loads(out)
            except ValueError:
                problems.append("json: stdout is not one JSON document")
    return problems


def _names(case: FuzzCase, argv: list[str], line: str) -> list[str]:
    """The error line names the flag or field, and says what is allowed."""
    low = line.lower()
    flag = case.flag
    names = {flag, flag.lstrip("-"), flag.lstrip("-").replace("-", "_"), flag.upper()}
    if case.klass in ("file", "in-path", "hf-file", "hf-field", "positional"):
        names |= {os.path.basename(a) for a in argv if "/" in a} | {a for a in argv if "/" in a}
        names |= {"config", "trace", "file", "theorem", "endpoint"}
    if case.klass in ("set",):
        key = case.value.split("=", 1)[0]
        if key:
            names.add(key)
    if case.klass == "hf-field":
        names |= {str(p) for p in case.value.split("=")[0].split(".")}
    problems = []
    if not any(n and n.lower() in low for n in names):
        problems.append(f"error-line: names none of {sorted(n for n in names if n)[:6]}: {line[:200]}")
    allowed = ("expected", "choose from", "invalid int value", "invalid float value", "required", "one of",
               "expected one argument", "unrecognized arguments", "must", "allowed", "at most", "at least")
    if not any(a in low for a in allowed):
        problems.append(f"error-line: does not say what is allowed: {line[:200]}")
    return problems


# -- the in-process runner (tests and the measurement) ----------------------------------------------


class Hang(BaseException):
    """Raised by the watchdog; a BaseException so no ``except Exception`` in kvref swallows it."""


def reaches_ray(argv: list[str]) -> bool:
    """Whether ``kvref ARGV`` would start or join a Ray cluster (``--ray`` read as ``auto``).

    Such a run, in this test process, is not the run a user gets: ``--ray`` ships the work to Ray
    workers that first import every local module the driver has loaded
    (kvref.ray_inputs.align_with: the same Hypothesis inputs as locally). In the whole suite the
    driver is pytest with every test and adapter module loaded, and a worker importing all of them
    outlived the hang alarm on CI's two cores (``verify --ray=--``, which argparse reads as
    ``--ray auto``: 165 s in process at load 8, 5 s as a fresh ``kvref``). Values Ray's address
    check refuses stay in process."""
    import contextlib
    import io

    from kvref.cli import build_parser

    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            args, _ = build_parser().parse_known_args(argv)
    except SystemExit:
        return False
    return getattr(args, "ray", None) == "auto"


def run_in_fresh_process(argv: list[str], seconds: int = 180) -> tuple[int | None, str, str]:
    """(exit status or None for a hang, stdout, stderr) of ``kvref ARGV`` in a new interpreter."""
    import subprocess
    import sys

    code = "import sys; from kvref.cli import main; sys.exit(main(sys.argv[1:]))"
    try:
        proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                              timeout=seconds)
    except subprocess.TimeoutExpired as exc:
        def text(b):
            return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        return None, text(exc.stdout), text(exc.stderr)
    return proc.returncode, proc.stdout, proc.stderr


def run_in_process(case: FuzzCase, tmp: str, seconds: int = 60) -> tuple[list[str], int | None, str, str]:
    """(argv, exit status or None for a hang, stdout, stderr) of one case through ``kvref.cli.main``
    (one that :func:`reaches_ray`: through a fresh ``kvref`` process)."""
    import contextlib
    import io
    import signal
    import traceback

    from kvref import cli

    argv = materialize(case, tmp, free_port())
    if reaches_ray(argv):
        return (argv, *run_in_fresh_process(argv, seconds=3 * seconds))
    out, err = io.StringIO(), io.StringIO()

    def fire(signum, frame):
        raise Hang

    old = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    rc: int | None
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli.main(argv)
            except Hang:
                rc = None
            except SystemExit as exc:  # main never lets one out; count it as a wrong status
                rc = exc.code if isinstance(exc.code, int) else 99
            except BaseException:  # noqa: BLE001 - an escape is the finding
                err.write(traceback.format_exc())
                rc = 98
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return argv, rc, out.getvalue(), err.getvalue()


def _measure(names: list[str], everything: bool) -> int:  # pragma: no cover - a tool
    import collections
    import sys
    import tempfile
    import time

    cases = all_cases()
    if not everything:
        cases = ci_sample(cases)
    counts: dict = collections.defaultdict(collections.Counter)
    t0 = time.monotonic()
    bad = 0
    for case in cases:
        if names and not any(case.id.startswith(n) for n in names):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            argv, rc, out, err = run_in_process(case, tmp)
        problems = judge(case, argv, rc, out, err)
        key = f"{case.subcommand} x {case.klass}"
        counts[key]["runs"] += 1
        for klass in {p.split(":")[0] for p in problems}:
            counts[key][klass] += 1
        if problems:
            bad += 1
            last = (err.strip().splitlines() or [""])[-1][:160]
            print(f"FAIL {case.id}: {'; '.join(p[:200] for p in problems)} | rc={rc} | {last}", flush=True)
    total: collections.Counter = collections.Counter()
    print(f"\n{'class':32} runs  traceback hang exit error-line json")
    for key, c in sorted(counts.items()):
        total.update(c)
        print(f"{key:32} {c['runs']:5} {c['traceback']:9} {c['hang']:4} {c['exit']:4} {c['error-line']:10} {c['json']:4}")
    print(f"{'total':32} {total['runs']:5} {total['traceback']:9} {total['hang']:4} {total['exit']:4} "
          f"{total['error-line']:10} {total['json']:4}   ({bad} failing cases, {time.monotonic() - t0:.0f} s)")
    sys.stdout.flush()
    return 1 if bad else 0


if __name__ == "__main__":  # pragma: no cover
    import sys

    args = [a for a in sys.argv[1:] if a != "--all"]
    sys.exit(_measure(args, "--all" in sys.argv[1:]))
