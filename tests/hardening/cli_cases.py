"""The CLI fuzz catalogue: wrong values, broken files and impossible sizes for every subcommand.

Each case is an argv (``{tmp}`` is replaced by a scratch folder holding the case's files) and the
exit status kvref must answer with: 2 for bad input (usage, values, files), 1 for a finding, 0 for
a clean run. The tests (``test_cli_fuzz.py``) run them in-process through ``kvref.cli.main``; run
this module (``python -m tests.hardening.cli_cases``) to run them as subprocesses with a time and
memory limit and count tracebacks, hangs and wrong exit statuses (the figures in the issue notes).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

#: a valid trace: a 1-group full-attention pool, one request added, admitted and finished
GOOD_TRACE = {
    "format": "kvref-trace", "version": 1, "note": "",
    "pool_config": {
        "num_blocks": 8, "max_model_len": 16, "scheduler_block_size": 4, "hash_block_size": 4,
        "max_in_flight_tokens": None, "enable_caching": True, "watermark": 0.0, "use_eagle": False,
        "groups": [{"layer_names": ["l0"], "is_eagle_group": False,
                    "kv_cache_spec": {"type": "FullAttentionSpec", "block_size": 4, "num_kv_heads": 1,
                                      "head_size": 4, "dtype": "bfloat16"}}]},
    "ops": [{"op": "add", "rid": "r0", "prompt": [1, 2, 3, 4, 5], "max_tokens": 2, "cache_salt": None},
            {"op": "admit", "rid": "r0", "chunk": 5, "full_sequence_must_fit": True, "reserved_blocks": 0,
             "in_flight": False, "token": 7},
            {"op": "finish", "rid": "r0"}],
}


def _trace(**edits) -> str:
    """GOOD_TRACE with ``path=value`` edits (``pool_config.num_blocks``, ``ops.1.chunk``)."""
    obj = json.loads(json.dumps(GOOD_TRACE))
    for path, value in edits.items():
        *head, last = path.split("__")
        node = obj
        for key in head:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
        elif value is _DELETE:
            del node[last]
        else:
            node[last] = value
    return json.dumps(obj)


_DELETE = object()

GOOD_LAYOUT = {"name": "tiny", "defaults": {"block_size": 16, "dtype": "bfloat16", "num_kv_heads": 2, "head_size": 64},
               "pattern": [{"kind": "full", "count": 2}], "repeat": 2,
               "engine": {"derived_max_model_len": 4096, "max_model_len": 1024}, "available_memory": "1GiB"}


def _layout(**edits) -> str:
    obj = json.loads(json.dumps(GOOD_LAYOUT))
    for key, value in edits.items():
        if key.startswith("p0_"):
            obj["pattern"][0][key[3:]] = value
        elif key.startswith("d_"):
            obj["defaults"][key[2:]] = value
        elif key.startswith("e_"):
            obj["engine"][key[2:]] = value
        else:
            obj[key] = value
    return json.dumps(obj)


@dataclass
class Case:
    name: str
    argv: list[str]
    expect: int = 2
    files: dict[str, str | bytes] = field(default_factory=dict)
    #: too slow for the in-process CI run (kept for the subprocess measurement)
    slow: bool = False
    #: needs vLLM importable
    needs_vllm: bool = False


def cases() -> list[Case]:
    out: list[Case] = []
    add = out.append

    # -- kvref (top level) and argparse usage errors
    add(Case("no-command", []))
    add(Case("unknown-command", ["bogus"]))
    add(Case("unknown-flag", ["size", "--bogus"]))
    add(Case("verify-bad-profile", ["verify", "--profile", "huge"]))
    add(Case("verify-bad-only", ["verify", "--only", "bogus"]))
    add(Case("verify-bad-skip", ["verify", "--skip", "bogus", "--only", "spec"]))
    add(Case("verify-bad-seed", ["verify", "--seed", "abc"]))
    add(Case("verify-unwritable-junit", ["verify", "--only", "spec", "--junit-xml", "/proc/kvref/x.xml"]))
    add(Case("verify-junit-is-dir", ["verify", "--only", "spec", "--junit-xml", "{tmp}"]))
    add(Case("verify-unwritable-out", ["verify", "--only", "spec", "--out", "/proc/kvref-out"]))
    add(Case("verify-out-is-file", ["verify", "--only", "spec", "--out", "{tmp}/f.txt"], files={"f.txt": "x"}))
    add(Case("verify-missing-baseline", ["verify", "--only", "spec", "--baseline", "{tmp}/none.json"]))
    add(Case("verify-corrupt-baseline", ["verify", "--only", "spec", "--baseline", "{tmp}/b.json"],
             files={"b.json": "{not json"}))
    add(Case("verify-baseline-array", ["verify", "--only", "spec", "--baseline", "{tmp}/b.json"],
             files={"b.json": "[1, 2]"}))
    add(Case("verify-shrink-negative", ["verify", "--only", "spec", "--shrink-seconds", "-1"]))
    add(Case("verify-shrink-nan", ["verify", "--only", "spec", "--shrink-seconds", "nan"]))
    add(Case("verify-spec-ok", ["verify", "--only", "spec", "--json"], expect=0))

    # -- kvref size: flags
    add(Case("size-no-config", ["size"]))
    add(Case("size-missing-file", ["size", "{tmp}/none.json"]))
    add(Case("size-directory", ["size", "{tmp}"]))
    add(Case("size-bad-example", ["size", "--example", "bogus"]))
    add(Case("size-memory-garbage", ["size", "--example", "llama3_8b", "--available-memory", "lots"]))
    add(Case("size-memory-negative", ["size", "--example", "llama3_8b", "--available-memory", "-5GiB"]))
    add(Case("size-memory-inf", ["size", "--example", "llama3_8b", "--available-memory", "inf"]))
    # sizes that only enter arithmetic: a plan (0) or "cannot serve" (1), never a traceback
    add(Case("size-memory-huge", ["size", "--example", "llama3_8b", "--available-memory", "1e300"], expect=(0, 1)))
    add(Case("size-memory-huge-int", ["size", "--example", "llama3_8b", "--available-memory", "9" * 400]))
    add(Case("size-block-size-0", ["size", "--example", "llama3_8b", "--available-memory", "1GiB", "--block-size", "0"]))
    add(Case("size-block-size-neg", ["size", "--example", "llama3_8b", "--available-memory", "1GiB", "--block-size", "-16"]))
    add(Case("size-block-size-huge", ["size", "--example", "llama3_8b", "--available-memory", "1GiB",
                                      "--block-size", str(10**30)], expect=(1, 2)))
    add(Case("size-override-huge", ["size", "--example", "llama3_8b", "--num-gpu-blocks-override", str(10**30)], expect=(0, 1, 2)))
    add(Case("size-override-neg", ["size", "--example", "llama3_8b", "--num-gpu-blocks-override", "-3"]))
    add(Case("size-mml-garbage", ["size", "--example", "llama3_8b", "--available-memory", "1GiB", "--max-model-len", "x"]))
    add(Case("size-mml-zero", ["size", "--example", "llama3_8b", "--available-memory", "1GiB", "--max-model-len", "0"]))
    add(Case("size-mml-huge", ["size", "--example", "llama3_8b", "--available-memory", "1GiB",
                               "--max-model-len", str(10**30)], expect=(1, 2)))
    add(Case("size-dtype-bogus", ["size", "--example", "llama3_8b", "--available-memory", "1GiB", "--kv-cache-dtype", "int3"]))
    add(Case("size-max-seqs-0", ["size", "--example", "llama3_8b", "--available-memory", "1GiB", "--max-num-seqs", "0"]))
    add(Case("size-dcp-0", ["size", "--example", "llama3_8b", "--available-memory", "1GiB", "--dcp", "0"]))
    add(Case("size-concurrent-0", ["size", "--example", "llama3_8b", "--available-memory", "1GiB",
                                   "--max-concurrent-batches", "0"]))
    add(Case("size-unwritable-plot", ["size", "--example", "llama3_8b", "--available-memory", "1GiB",
                                      "--plot", "/proc/kvref/plan.png"]))
    add(Case("size-unwritable-plot-fits", ["size", "--example", "llama3_8b", "--available-memory", "16GiB",
                                           "--plot", "/proc/kvref/plan.png"]))
    add(Case("size-plot-is-dir", ["size", "--example", "llama3_8b", "--available-memory", "1GiB", "--plot", "{tmp}"]))
    add(Case("size-ok", ["size", "{tmp}/l.json", "--json"], expect=0, files={"l.json": _layout()}))
    add(Case("size-too-small", ["size", "{tmp}/l.json", "--available-memory", "1KiB", "--json"], expect=1,
             files={"l.json": _layout()}))

    # -- kvref size: layout files
    def layout(name, text, *extra, expect=2):
        add(Case(f"layout-{name}", ["size", "{tmp}/l.json", *extra], expect=expect, files={"l.json": text}))

    layout("empty", "")
    layout("not-json", "{nope")
    layout("array", "[1, 2]")
    layout("binary", b"\xff\xfe\x00\x01garbage")
    layout("count-huge", _layout(p0_count=10**12))
    layout("count-bigint", _layout(p0_count=10**30))
    layout("repeat-huge", _layout(repeat=10**12))
    layout("repeat-bigint", _layout(repeat=10**30))
    layout("count-float", _layout(p0_count=2.5))
    layout("count-zero", _layout(p0_count=0))
    layout("count-string", _layout(p0_count="3"))
    layout("kind-list", _layout(p0_kind=["full"]))
    layout("kind-dict", _layout(p0_kind={"a": 1}))
    layout("kind-bogus", _layout(p0_kind="bogus"))
    layout("kind-missing", json.dumps({**GOOD_LAYOUT, "pattern": [{"count": 1}]}))
    layout("name-markup", _layout(name="bad[/]name"), expect=0)
    layout("name-markup2", _layout(name="[bold red]x[/bold red][/]"), expect=0)
    layout("name-list", _layout(name=["a"]), expect=0)
    layout("pattern-empty", _layout(pattern=[]))
    layout("pattern-dict", _layout(pattern={"kind": "full"}))
    layout("pattern-entry-int", _layout(pattern=[3]))
    layout("tail-dict", _layout(tail={"kind": "full"}))
    layout("defaults-list", _layout(defaults=[1]))
    layout("block-size-string", _layout(d_block_size="16"))
    layout("block-size-neg", _layout(d_block_size=-16))
    layout("block-size-huge", _layout(d_block_size=10**30), expect=(1, 2))
    layout("block-size-float", _layout(d_block_size=16.0))
    layout("dtype-bogus", _layout(d_dtype="int3"))
    layout("dtype-list", _layout(d_dtype=["bfloat16"]))
    layout("heads-zero", _layout(d_num_kv_heads=0))
    layout("heads-huge", _layout(d_num_kv_heads=10**30), expect=(1, 2))
    layout("head-size-none", _layout(d_head_size=None))
    layout("unknown-field", _layout(p0_bogus=1))
    layout("swa-window-string", _layout(p0_kind="sliding_window", p0_sliding_window="big"))
    layout("swa-window-missing", _layout(p0_kind="sliding_window"))
    layout("swa-window-list", _layout(p0_kind="sliding_window", p0_sliding_window=[1, 2]))
    layout("mamba-shapes-int", _layout(p0_kind="mamba", p0_shapes=5, p0_dtypes=["float16"]))
    layout("mamba-shapes-nested", _layout(p0_kind="mamba", p0_shapes=[[[1]]], p0_dtypes=["float16"]))
    layout("mamba-dtypes-bogus", _layout(p0_kind="mamba", p0_shapes=[[2, 3]], p0_dtypes=["bogus"]))
    layout("mamba-shapes-neg", _layout(p0_kind="mamba", p0_shapes=[[-2, 3]], p0_dtypes=["float16"]))
    layout("engine-list", _layout(engine=[1]))
    layout("engine-unknown", _layout(e_bogus=1))
    layout("engine-mml-string", _layout(e_max_model_len="long"))
    layout("engine-mml-huge", _layout(e_max_model_len=10**30, e_derived_max_model_len=10**30), expect=(1, 2))
    layout("engine-mml-float", _layout(e_max_model_len=1024.5))
    layout("engine-seqs-list", _layout(e_max_num_seqs=[1]))
    layout("engine-prefix-string", _layout(e_enable_prefix_caching="yes"))
    layout("memory-object", _layout(available_memory={"x": 1}))
    layout("memory-list", _layout(available_memory=[1]))
    layout("memory-bool", _layout(available_memory=True))
    layout("memory-float", _layout(available_memory=1e300), expect=(0, 2))
    add(Case("layout-toml-broken", ["size", "{tmp}/l.toml"], files={"l.toml": "name = [unclosed"}))
    add(Case("layout-toml-binary", ["size", "{tmp}/l.toml"], files={"l.toml": b"\xff\xfe"}))

    # -- kvref prove
    add(Case("prove-timeout-inf", ["prove", "T1", "--timeout", "inf"]))
    add(Case("prove-timeout-nan", ["prove", "T1", "--timeout", "nan"]))
    add(Case("prove-timeout-neg", ["prove", "T1", "--timeout", "-1"]))
    add(Case("prove-timeout-zero", ["prove", "T1", "--timeout", "0"]))
    add(Case("prove-timeout-huge", ["prove", "T1", "--timeout", "1e30"]))
    add(Case("prove-timeout-text", ["prove", "T1", "--timeout", "soon"]))
    add(Case("prove-bad-theorem", ["prove", "T99"]))
    add(Case("prove-bad-variant", ["prove", "--variant", "bogus"]))
    add(Case("prove-unwritable-out", ["prove", "--variant", "pre-41069-override-ignored", "--out", "/proc/kvref-out"]))
    add(Case("prove-out-is-file", ["prove", "--variant", "pre-41069-override-ignored", "--out", "{tmp}/f"],
             files={"f": "x"}))
    add(Case("prove-t1-ok", ["prove", "T1", "--json"], expect=0))

    # -- kvref explore
    add(Case("explore-bad-scope", ["explore", "--scope", "bogus"]))
    add(Case("explore-set-no-eq", ["explore", "--set", "num_blocks"]))
    add(Case("explore-set-unknown", ["explore", "--set", "bogus=1"]))
    add(Case("explore-set-max-tokens-int", ["explore", "--set", "max_tokens=5"]))
    add(Case("explore-set-prompts-int", ["explore", "--set", "prompts=3"]))
    add(Case("explore-set-salts-int", ["explore", "--set", "salts=3"]))
    add(Case("explore-set-num-blocks-neg", ["explore", "--set", "num_blocks=-1"]))
    add(Case("explore-set-num-blocks-text", ["explore", "--set", "num_blocks=abc"]))
    add(Case("explore-set-num-blocks-bool", ["explore", "--set", "num_blocks=true"]))
    add(Case("explore-set-num-blocks-400", ["explore", "--set", "num_blocks=400", "--max-seconds", "20"],
             expect=(0, 2), slow=True))
    add(Case("explore-set-num-blocks-huge", ["explore", "--set", f"num_blocks={10**8}"]))
    add(Case("explore-set-block-size-0", ["explore", "--set", "block_size=0"]))
    add(Case("explore-set-mml-huge", ["explore", "--set", f"max_model_len={10**30}"]))
    add(Case("explore-set-batched-huge", ["explore", "--set", f"max_num_batched_tokens={10**30}"]))
    add(Case("explore-set-window-huge", ["explore", "--set", f"sliding_window={10**30}"]))
    add(Case("explore-set-aborts-text", ["explore", "--set", "aborts=maybe"]))
    add(Case("explore-set-name-int", ["explore", "--set", "name=3", "--scope", "tight"], expect=0))  # a label
    add(Case("explore-set-offload-bogus", ["explore", "--scope", "offload", "--set", "num_cpu_blocks=-2"]))
    add(Case("explore-set-offload-huge", ["explore", "--scope", "offload", "--set", f"num_gpu_blocks={10**9}"]))
    add(Case("explore-set-connector-bogus", ["explore", "--scope", "connector", "--set", "bogus=1"]))
    add(Case("explore-workers-huge", ["explore", "--workers", str(10**30)]))
    add(Case("explore-workers-neg", ["explore", "--workers", "-1"]))
    add(Case("explore-workers-zero", ["explore", "--workers", "0"]))  # auto is spelt auto
    add(Case("explore-workers-text", ["explore", "--workers", "many"]))
    add(Case("explore-workers-true", ["explore", "--workers", "true"]))
    add(Case("explore-max-depth-neg", ["explore", "--max-depth", "-1"]))
    add(Case("explore-max-states-neg", ["explore", "--max-states", "-5"]))
    add(Case("explore-max-seconds-nan", ["explore", "--max-seconds", "nan"]))
    add(Case("explore-max-seconds-neg", ["explore", "--max-seconds", "-1"]))
    add(Case("explore-against-bogus", ["explore", "--against", "bogus"]))
    add(Case("explore-against-empty", ["explore", "--against", ","]))
    add(Case("explore-against-offload", ["explore", "--scope", "offload", "--against", "torch"]))
    add(Case("explore-tight-ok", ["explore", "--scope", "tight", "--json"], expect=0))

    # -- kvref mutants
    add(Case("mutants-budget-0", ["mutants", "--only", "pool.touch_no_ref", "--budget", "0"]))
    add(Case("mutants-budget-neg", ["mutants", "--only", "pool.touch_no_ref", "--budget", "-3"]))
    add(Case("mutants-budget-huge", ["mutants", "--only", "pool.touch_no_ref", "--budget", str(10**30)]))
    add(Case("mutants-only-bogus", ["mutants", "--only", "bogus"]))
    add(Case("mutants-checks-bogus", ["mutants", "--only", "pool.touch_no_ref", "--checks", "bogus"]))
    add(Case("mutants-min-rate-2", ["mutants", "--list", "--min-rate", "2"]))
    add(Case("mutants-min-rate-nan", ["mutants", "--list", "--min-rate", "nan"]))
    add(Case("mutants-list-ok", ["mutants", "--list"], expect=0))
    # --list used to ignore --only/--checks: a typo listed everything and exited 0
    add(Case("mutants-list-only-bogus", ["mutants", "--list", "--only", "bogus"]))
    add(Case("mutants-list-checks-bogus", ["mutants", "--list", "--checks", "bogus"]))
    add(Case("mutants-list-only-one", ["mutants", "--list", "--only", "pool.touch_no_ref"], expect=0))

    # -- kvref replay: files
    def replay(name, text, *extra, fname="t.json", expect=2):
        add(Case(f"replay-{name}", ["replay", "{tmp}/" + fname, "--kinds", "reference", *extra], expect=expect,
                 files={fname: text}))

    add(Case("replay-missing", ["replay", "{tmp}/none.json"]))
    add(Case("replay-directory", ["replay", "{tmp}"]))
    add(Case("replay-kinds-bogus", ["replay", "{tmp}/t.json", "--kinds", "bogus"], files={"t.json": _trace()}))
    add(Case("replay-kinds-empty", ["replay", "{tmp}/t.json", "--kinds", ","], files={"t.json": _trace()}))
    replay("ok", _trace(), expect=0)
    replay("empty", "")
    replay("not-json", "{nope")
    replay("binary", b"\xff\xfe\x00garbage")
    replay("array", "[]")
    replay("format-wrong", _trace(format="other"))
    replay("version-wrong", _trace(version=7))
    replay("ops-missing", _trace(ops=_DELETE))
    replay("ops-dict", _trace(ops={"a": 1}))
    replay("op-unknown", _trace(ops__0__op="fly"))
    replay("op-not-object", _trace(ops__0=5))
    replay("op-missing-field", json.dumps({**GOOD_TRACE, "ops": [{"op": "add", "rid": "r0"}]}))
    replay("prompt-int", _trace(ops__0__prompt=5))
    replay("prompt-strings", _trace(ops__0__prompt=["a", "b"]))
    replay("prompt-empty", _trace(ops__0__prompt=[]))
    replay("prompt-huge", _trace(ops__0__prompt=list(range(100)) * 10), expect=(0, 2))
    replay("max-tokens-neg", _trace(ops__0__max_tokens=-1))
    replay("max-tokens-string", _trace(ops__0__max_tokens="2"))
    replay("rid-int", _trace(ops__0__rid=5))
    replay("rid-unknown", _trace(ops__1__rid="zz"), expect=0)  # an op on an unknown request is skipped
    replay("chunk-neg", _trace(ops__1__chunk=-4))
    replay("chunk-huge", _trace(ops__1__chunk=10**30))
    replay("chunk-string", _trace(ops__1__chunk="5"))
    replay("fit-string", _trace(ops__1__full_sequence_must_fit="yes"))
    replay("reserved-neg", _trace(ops__1__reserved_blocks=-1))
    replay("token-string", _trace(ops__1__token="x"))
    replay("external-neg", _trace(ops__1__external=-3))
    replay("salt-int", _trace(ops__0__cache_salt=5))
    replay("pool-missing", _trace(pool_config=_DELETE))
    replay("pool-int", _trace(pool_config=1))
    replay("num-blocks-huge", _trace(pool_config__num_blocks=10**8))
    replay("num-blocks-bigint", _trace(pool_config__num_blocks=10**30))
    replay("num-blocks-zero", _trace(pool_config__num_blocks=0))
    replay("num-blocks-string", _trace(pool_config__num_blocks="8"))
    replay("num-blocks-float", _trace(pool_config__num_blocks=8.0))
    replay("groups-null", _trace(pool_config__groups=None))
    replay("groups-empty", _trace(pool_config__groups=[]))
    replay("group-int", _trace(pool_config__groups=[1]))
    replay("group-no-spec", _trace(pool_config__groups=[{"layer_names": ["l0"]}]))
    replay("group-names-int", _trace(pool_config__groups=[{"layer_names": 5, "kv_cache_spec":
                                                          GOOD_TRACE["pool_config"]["groups"][0]["kv_cache_spec"]}]))
    replay("spec-type-bogus", _trace(pool_config__groups__0__kv_cache_spec={"type": "Bogus"}))
    replay("spec-unknown-field", _trace(pool_config__groups__0__kv_cache_spec={
        **GOOD_TRACE["pool_config"]["groups"][0]["kv_cache_spec"], "bogus": 1}))
    replay("spec-block-size-string", _trace(pool_config__groups__0__kv_cache_spec={
        **GOOD_TRACE["pool_config"]["groups"][0]["kv_cache_spec"], "block_size": "4"}))
    replay("spec-shapes-int", _trace(pool_config__groups__0__kv_cache_spec={
        "type": "MambaSpec", "block_size": 4, "shapes": 5, "dtypes": ["float16"]}))
    replay("pool-unknown-field", _trace(pool_config__bogus=1))
    replay("mml-string", _trace(pool_config__max_model_len="16"))
    replay("watermark-string", _trace(pool_config__watermark="0.1"))
    replay("caching-string", _trace(pool_config__enable_caching="yes"))
    replay("eagle-string", _trace(pool_config__use_eagle="yes"))
    replay("inflight-huge", _trace(pool_config__max_in_flight_tokens=10**30), expect=(0, 2))
    replay("mml-huge", _trace(pool_config__max_model_len=10**12), expect=(0, 2))
    replay("note-object", _trace(note={"a": 1}), expect=0)
    add(Case("replay-py-not-run", ["replay", "{tmp}/r.py"],
             files={"r.py": "import pathlib\npathlib.Path(__file__).with_suffix('.ran').write_text('ran')\n"
                            "def test_x():\n    pass\n"}))
    add(Case("replay-txt", ["replay", "{tmp}/r.txt"], files={"r.txt": "hello"}))
    # -- kvref check-run (recorded vLLM runs)
    add(Case("check-run-missing", ["check-run", "{tmp}/none.kvtrace.gz"]))
    add(Case("check-run-directory", ["check-run", "{tmp}"]))
    add(Case("check-run-text", ["check-run", "{tmp}/r.kvtrace"], files={"r.kvtrace": "hello\n"}))
    add(Case("check-run-bad-gzip", ["check-run", "{tmp}/r.kvtrace.gz"], files={"r.kvtrace.gz": b"\x1f\x8bnot gzip"}))
    add(Case("check-run-json-array", ["check-run", "{tmp}/r.kvtrace"], files={"r.kvtrace": "[1, 2]\n"}))
    add(Case("check-run-empty", ["check-run", "{tmp}/r.kvtrace"], files={"r.kvtrace": ""}))
    add(Case("check-run-starvation-neg", ["check-run", "{tmp}/r.kvtrace", "--starvation-steps", "-1"],
             files={"r.kvtrace": ""}))
    # -- kvref watch (live KV-event streams; every case is rejected before any socket waits)
    add(Case("watch-wildcard", ["watch", "tcp://*:5557"]))
    add(Case("watch-not-zmq", ["watch", "http://127.0.0.1:5557"]))
    add(Case("watch-port-range", ["watch", "tcp://127.0.0.1:70000"]))
    add(Case("watch-no-port", ["watch", "tcp://127.0.0.1"]))
    add(Case("watch-bad-replay", ["watch", "tcp://127.0.0.1:5557", "--replay-endpoint", "5558"]))
    add(Case("watch-negative-seconds", ["watch", "tcp://127.0.0.1:5557", "--seconds", "-1"]))
    add(Case("watch-nan-seconds", ["watch", "tcp://127.0.0.1:5557", "--seconds", "nan"]))
    add(Case("watch-zero-batches", ["watch", "tcp://127.0.0.1:5557", "--batches", "0"]))
    add(Case("watch-bad-decoder", ["watch", "tcp://127.0.0.1:5557", "--decoder", "pickle"]))
    # -- kvref demo publish (issue #25; every case is rejected before vLLM is imported or a socket bound)
    add(Case("demo-no-subcommand", ["demo"]))
    add(Case("demo-publish-not-zmq", ["demo", "publish", "http://127.0.0.1:5557"]))
    add(Case("demo-publish-port-range", ["demo", "publish", "tcp://127.0.0.1:70000"]))
    add(Case("demo-publish-same-replay", ["demo", "publish", "tcp://127.0.0.1:5557", "--replay-endpoint",
                                          "tcp://127.0.0.1:5557"]))
    add(Case("demo-publish-negative-hold", ["demo", "publish", "tcp://127.0.0.1:5557", "--hold", "-1"]))
    add(Case("demo-publish-nan-interval", ["demo", "publish", "tcp://127.0.0.1:5557", "--interval", "nan"]))
    add(Case("demo-publish-bad-fault", ["demo", "publish", "tcp://127.0.0.1:5557", "--fault", "nosuch"]))
    # -- found by the flag walk (cli_flag_fuzz.py): every subcommand, the same classes of input
    deep = "[" * 10_000 + "]" * 10_000
    add(Case("walk-replay-deep-json", ["replay", "{tmp}/t.json"], files={"t.json": deep}))
    add(Case("walk-size-deep-json", ["size", "{tmp}/l.json"], files={"l.json": deep}))
    add(Case("walk-size-deep-toml", ["size", "{tmp}/l.toml"], files={"l.toml": "a = " + "[" * 5000 + "]" * 5000}))
    add(Case("walk-baseline-huge-int", ["verify", "--only", "spec", "--baseline", "{tmp}/b.json"],
             files={"b.json": '{"kvref_baseline": ' + "9" * 5000 + "}"}))
    add(Case("walk-from-json-empty-path", ["mutants", "--target", "vllm", "--from-json", ""]))
    add(Case("walk-from-json-list", ["mutants", "--target", "vllm", "--from-json", "{tmp}/r.json"],
             files={"r.json": "[1]"}))
    add(Case("walk-against-dashdash", ["explore", "--against=--"]))
    add(Case("walk-kinds-dashdash", ["replay", "{tmp}/t.json", "--kinds=--"], files={"t.json": _trace()}))
    add(Case("walk-plot-empty", ["size", "--example", "llama3_8b", "--available-memory", "16GiB", "--plot", ""]))
    add(Case("walk-mutants-list-json", ["mutants", "--list", "--json"], expect=0))
    add(Case("walk-check-run-out-unwritable", ["check-run", "{tmp}/r.kvtrace", "--out", "/proc/kvref/x"],
             files={"r.kvtrace": ""}))
    return out


def materialize(case: Case, tmp: str) -> list[str]:
    """Write the case's files under ``tmp``; the argv with ``{tmp}`` filled in."""
    import os

    for name, content in case.files.items():
        mode = "wb" if isinstance(content, bytes) else "w"
        with open(os.path.join(tmp, name), mode) as fh:
            fh.write(content)
    return [a.replace("{tmp}", tmp) for a in case.argv]


def expected(case: Case) -> tuple[int, ...]:
    return case.expect if isinstance(case.expect, tuple) else (case.expect,)


def _measure(timeout: float, mem_gib: int, names: list[str]) -> int:  # pragma: no cover - a tool
    """Run every case as ``kvref`` subprocess; print per-case outcome and the counts per class."""
    import collections
    import os
    import resource
    import subprocess
    import sys
    import tempfile

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (mem_gib << 30, mem_gib << 30))

    counts: collections.Counter = collections.Counter()
    by_group: dict = collections.defaultdict(collections.Counter)
    for case in cases():
        if names and not any(case.name.startswith(n) for n in names):
            continue
        with tempfile.TemporaryDirectory() as tmp:
            argv = materialize(case, tmp)
            try:
                p = subprocess.run([sys.executable, "-m", "kvref.cli", *argv], capture_output=True, text=True, check=False,
                                   timeout=timeout, preexec_fn=limit, env={**os.environ, "COLUMNS": "120"})
                rc, err = p.returncode, p.stderr
                if "Traceback (most recent call last)" in err or "Traceback" in p.stdout:
                    outcome = "traceback"
                elif rc not in expected(case):
                    outcome = f"exit {rc} (want {case.expect})"
                else:
                    outcome = "ok"
                ran = os.path.exists(os.path.join(tmp, "r.ran"))
                if ran:
                    outcome = "executed-code"
            except subprocess.TimeoutExpired:
                outcome, err = "hang", ""
        klass = outcome.split(" (")[0] if not outcome.startswith("exit") else "wrong-exit"
        counts[klass] += 1
        by_group[case.name.split("-")[0]][klass] += 1
        last = (err.strip().splitlines() or [""])[-1][:150]
        print(f"{case.name:34} {outcome:24} {last}", flush=True)
    print("\ntotal:", dict(counts), f"in {sum(counts.values())} runs")
    for g, c in sorted(by_group.items()):
        print(f"  {g:10} {dict(c)}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    import sys

    sys.exit(_measure(float(__import__("os").environ.get("KVREF_FUZZ_TIMEOUT", "60")), 4, sys.argv[1:]))
