"""A plain, replayable trace: a pool config and a list of scheduler-level operations, as JSON.

A failing state-machine run is saved as one of these, so it can be replayed later against any
set of implementations (``kvref replay FILE``) without Hypothesis. The format is deliberately
boring: one JSON object

.. code-block:: json

    {"format": "kvref-trace", "version": 1,
     "pool_config": {"num_blocks": 16, "groups": [{"layer_names": ["l0"], "is_eagle_group": false,
                     "kv_cache_spec": {"type": "FullAttentionSpec", "block_size": 4, ...}}], ...},
     "ops": [{"op": "add", "rid": "r0", "prompt": [1, 2, 3], "max_tokens": 4, "cache_salt": null},
             {"op": "admit", "rid": "r0", "chunk": 8, "full_sequence_must_fit": true, ...}, ...]}

Replay one with ``kvref replay FILE [--kinds reference,vllm]`` or
``python -m kvref.models.conformance.differential FILE``.

The operations (``OP_FIELDS``) are the ones :mod:`kvref.models.conformance.differential` knows how to apply;
see there for what each does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvref.impl.interface import PoolConfig
from kvref.spec import kv_cache_interface as kci
from kvref.spec.errors import InvalidFieldError, KVRefError

FORMAT = "kvref-trace"
VERSION = 1

#: the largest pool a trace may name: replay builds every block of every implementation compared
#: (a Python object per block in the reference), and the state machines save pools of tens of blocks
MAX_TRACE_BLOCKS = 1 << 20
#: the largest count any int field of an op may hold (tokens, chunk, reserved blocks)
_MAX_OP_INT = 1 << 31


class TraceFormatError(InvalidFieldError):
    """A trace file (or one of its values) is not a valid trace: the message names the file, the
    position (``ops[3].chunk``), the value and what is allowed. Input, never a finding."""


def _int_range(lo: int, hi: int):
    def check(v: Any) -> bool:
        return type(v) is int and lo <= v <= hi
    return check, f"an int in [{lo}, {hi}]"


#: what each op field may hold; a trace is data, checked field by field before anything runs
_ARG_CHECKS: dict[str, tuple[Any, str]] = {
    "rid": (lambda v: isinstance(v, str) and 0 < len(v) <= 256, "a request id (a non-empty str)"),
    "prompt": (lambda v: isinstance(v, list) and 0 < len(v) <= _MAX_OP_INT
               and all(type(t) is int and 0 <= t < _MAX_OP_INT for t in v),
               f"a non-empty list of token ids (ints in [0, {_MAX_OP_INT}))"),
    "max_tokens": _int_range(1, _MAX_OP_INT),
    "cache_salt": (lambda v: v is None or isinstance(v, str), "a str or null"),
    "chunk": _int_range(1, _MAX_OP_INT),
    "full_sequence_must_fit": (lambda v: isinstance(v, bool), "true or false"),
    "reserved_blocks": _int_range(0, _MAX_OP_INT),
    "in_flight": (lambda v: isinstance(v, bool), "true or false"),
    "token": _int_range(0, _MAX_OP_INT - 1),
    "lookahead": _int_range(0, _MAX_OP_INT),
    "external": _int_range(0, _MAX_OP_INT),
    "reset_running_requests": (lambda v: isinstance(v, bool), "true or false"),
    "block_ids": (lambda v: isinstance(v, list) and len(v) <= MAX_TRACE_BLOCKS
                  and all(type(b) is int and 0 <= b < MAX_TRACE_BLOCKS for b in v),
                  f"a list of block ids (ints in [0, {MAX_TRACE_BLOCKS}))"),
    # a KV connector's asynchronous load (WAITING_FOR_REMOTE_KVS): blocks allocated, caching delayed
    "async_load": (lambda v: isinstance(v, bool), "true or false"),
    # >= 0: reserve all free blocks but this many (admission at the pool's boundary); -1: use reserved_blocks
    "reserve_slack": _int_range(-1, _MAX_OP_INT),
    # block-hash inputs of a request (issue #23): multimodal items [identifier, offset, length], a LoRA
    # adapter [name, id, path], prompt embeddings (one hex row per prompt token), a session id, and
    # whether it skips reading the prefix cache (prompt logprobs, pooling)
    "mm": (lambda v: isinstance(v, list) and len(v) <= 64 and all(
        isinstance(f, list) and len(f) == 3 and isinstance(f[0], str) and 0 < len(f[0]) <= 256
        and type(f[1]) is int and type(f[2]) is int and 0 <= f[1] < _MAX_OP_INT and 0 < f[2] < _MAX_OP_INT
        for f in v), "a list of [identifier (str), offset (int >= 0), length (int >= 1)]"),
    "lora": (lambda v: v is None or (isinstance(v, list) and len(v) == 3 and isinstance(v[0], str) and v[0]
                                     and type(v[1]) is int and 1 <= v[1] < _MAX_OP_INT
                                     and isinstance(v[2], str) and v[2]),
             "null or [lora_name (str), lora_int_id (int >= 1), lora_path (str)]"),
    "embeds": (lambda v: v is None or (isinstance(v, list) and all(
        isinstance(r, str) and 0 < len(r) <= 1024 and len(r) % 2 == 0
        and all(c in "0123456789abcdef" for c in r) for r in v)),
               "null or a list of hex strings (one embedding row per prompt token)"),
    "session_id": (lambda v: v is None or isinstance(v, str), "a str or null"),
    "skip_reading": (lambda v: isinstance(v, bool), "true or false"),
    # kv_cache_report_mode "full": a prefix-cache hit is announced in KV events too
    "report_full": (lambda v: isinstance(v, bool), "true or false"),
    # load_done: -1 the load succeeded; >= 0 it failed and only the first this-many tokens of the loaded
    # prefix are valid (rounded down to scheduler_block_size; vLLM's failed_recving path, KV zeroing)
    "valid_tokens": _int_range(-1, _MAX_OP_INT),
    # finish/preempt: a KV connector holds the request's get_blocks() view across the free
    "hold_view": (lambda v: isinstance(v, bool), "true or false"),
    # connector_lookup: the aligned endpoint a connector's hit truncates the local hit to
    "truncate": _int_range(0, _MAX_OP_INT),
}

#: every op name and its fields (all required; values are JSON scalars or lists of ints)
OP_FIELDS: dict[str, tuple[str, ...]] = {
    "add": ("rid", "prompt", "max_tokens", "cache_salt"),
    "admit": ("rid", "chunk", "full_sequence_must_fit", "reserved_blocks", "in_flight", "token"),  # + external
    "step": ("rid", "chunk", "lookahead", "in_flight", "token"),
    "process": ("rid",),
    "preempt": ("rid",),
    "finish": ("rid",),
    "new_step": (),
    "reset_prefix_cache": ("reset_running_requests",),
    "evict_blocks": ("block_ids",),
    "load_done": ("rid",),
    "connector_lookup": ("rid", "truncate"),
    "make_prefix_cache_stats": (),
}

#: optional fields and their defaults (added after version 1 was first written; older traces omit them)
OP_DEFAULTS: dict[str, dict[str, Any]] = {
    "admit": {"external": 0, "async_load": False, "reserve_slack": -1},
    "add": {"mm": [], "lora": None, "embeds": None, "session_id": None, "skip_reading": False,
            "report_full": False},
    "finish": {"hold_view": False},
    "preempt": {"hold_view": False},
    "load_done": {"valid_tokens": -1},
}

#: optional fields left out of an op's one-line form while they hold their default (issue #23's)
_QUIET_DEFAULTS = frozenset({"mm", "lora", "embeds", "session_id", "skip_reading", "hold_view", "report_full",
                             "valid_tokens"})

_SPEC_TYPES = {cls.__name__: cls for cls in (
    kci.FullAttentionSpec, kci.MLAAttentionSpec, kci.SlidingWindowSpec, kci.ChunkedLocalAttentionSpec,
    kci.CrossAttentionSpec, kci.MambaSpec, kci.RSWASpec, kci.SinkFullAttentionSpec, kci.CircularBufferSpec,
    kci.SlidingWindowMLASpec)}


def _path(path: object) -> Path:
    """A file path (str or os.PathLike) as a Path; anything else is an input error."""
    if not isinstance(path, (str, os.PathLike)) or not str(path) or "\x00" in str(path):
        raise InvalidFieldError("path", path, "a file path (str or os.PathLike)")
    out = Path(path)
    if not isinstance(out, Path):  # a PathLike whose __fspath__ gives bytes
        raise InvalidFieldError("path", path, "a file path (str or os.PathLike)")
    return out


@dataclass(frozen=True)
class Op:
    """One operation: ``name`` (a key of ``OP_FIELDS``) and its arguments."""

    name: str
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or self.name not in OP_FIELDS:
            raise InvalidFieldError("op", self.name, "one of " + ", ".join(OP_FIELDS))
        if type(self.args) is not dict or not all(isinstance(k, str) for k in self.args):
            raise InvalidFieldError(f"{self.name}.args", self.args, "a dict of argument name (str) -> value")
        for k, v in OP_DEFAULTS.get(self.name, {}).items():
            self.args.setdefault(k, v)
        optional = tuple(OP_DEFAULTS.get(self.name, {}))
        missing = [f for f in OP_FIELDS[self.name] if f not in self.args]
        extra = [f for f in self.args if f not in OP_FIELDS[self.name] + optional]
        if missing or extra:
            raise InvalidFieldError(f"{self.name}.args", sorted(self.args),
                                    f"exactly the fields {list(OP_FIELDS[self.name])}")
        for name, value in self.args.items():
            ok, allowed = _ARG_CHECKS[name]
            if not ok(value):
                raise InvalidFieldError(f"{self.name}.{name}", value, allowed)

    def __getattr__(self, item: str) -> Any:
        try:
            return self.__dict__["args"][item]
        except KeyError:
            raise AttributeError(item) from None

    def to_json(self) -> dict[str, Any]:
        return {"op": self.name, **self.args}

    @classmethod
    def from_json(cls, obj: Any) -> "Op":
        if not isinstance(obj, dict) or "op" not in obj:
            raise InvalidFieldError("ops[i]", obj, 'an object with an "op" field')
        args = {k: v for k, v in obj.items() if k != "op"}
        if isinstance(args.get("prompt"), (list, tuple)):
            args["prompt"] = list(args["prompt"])
        if not isinstance(obj["op"], str):
            raise InvalidFieldError("op", obj["op"], "one of " + ", ".join(OP_FIELDS))
        return cls(obj["op"], args)

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.args.items() if k != "prompt"
                         and not (k in _QUIET_DEFAULTS and v == OP_DEFAULTS[self.name][k]))
        if "prompt" in self.args:
            args += f", prompt=<{len(self.args['prompt'])} tokens>"
        return f"{self.name}({args})"


def spec_to_json(spec: kci.KVCacheSpec) -> dict[str, Any]:
    name = type(spec).__name__
    if name not in _SPEC_TYPES:
        raise InvalidFieldError("kv_cache_spec", name, "one of " + ", ".join(_SPEC_TYPES))
    out: dict[str, Any] = {"type": name}
    for f in dataclasses.fields(spec):
        if f.init:
            v = getattr(spec, f.name)
            out[f.name] = [list(s) for s in v] if f.name == "shapes" else (list(v) if isinstance(v, tuple) else v)
    return out


def spec_from_json(obj: Any) -> kci.KVCacheSpec:
    if not isinstance(obj, dict) or obj.get("type") not in _SPEC_TYPES:
        raise InvalidFieldError("kv_cache_spec", obj, "an object whose type is one of " + ", ".join(_SPEC_TYPES))
    cls = _SPEC_TYPES[obj["type"]]
    kwargs = {k: v for k, v in obj.items() if k != "type"}
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise InvalidFieldError(f"{cls.__name__}.{unknown[0]}", kwargs[unknown[0]],
                                "one of the fields " + ", ".join(sorted(known)))
    if isinstance(kwargs.get("shapes"), list):
        kwargs["shapes"] = tuple(tuple(s) if isinstance(s, list) else s for s in kwargs["shapes"])
    if isinstance(kwargs.get("dtypes"), list):
        kwargs["dtypes"] = tuple(kwargs["dtypes"])
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field missing
        raise InvalidFieldError(cls.__name__, obj, f"the fields of {cls.__name__} ({exc})") from None


def pool_config_to_json(pc: PoolConfig) -> dict[str, Any]:
    if not isinstance(pc, PoolConfig):
        raise InvalidFieldError("pool_config", pc, "a PoolConfig")
    out: dict[str, Any] = {}
    for f in dataclasses.fields(pc):
        v = getattr(pc, f.name)
        if f.name == "groups":
            v = [{"layer_names": list(g.layer_names), "kv_cache_spec": spec_to_json(g.kv_cache_spec),
                  "is_eagle_group": g.is_eagle_group} for g in v]
        out[f.name] = v
    return out


def pool_config_from_json(obj: Any) -> PoolConfig:
    if not isinstance(obj, dict) or not isinstance(obj.get("groups"), list):
        raise InvalidFieldError("pool_config", obj, "an object with a groups list")
    known = {f.name for f in dataclasses.fields(PoolConfig)}
    unknown = sorted(set(obj) - known)
    if unknown:
        raise InvalidFieldError(f"pool_config.{unknown[0]}", obj[unknown[0]], "one of the fields " + ", ".join(sorted(known)))
    num_blocks = obj.get("num_blocks")
    if type(num_blocks) is int and num_blocks > MAX_TRACE_BLOCKS:
        raise InvalidFieldError("pool_config.num_blocks", num_blocks,
                                f"at most {MAX_TRACE_BLOCKS} blocks (replay builds every block of every implementation)")
    kwargs = dict(obj)
    groups = []
    for i, g in enumerate(obj["groups"]):
        if not isinstance(g, dict) or "layer_names" not in g or "kv_cache_spec" not in g:
            raise InvalidFieldError(f"pool_config.groups[{i}]", g, "an object with layer_names and kv_cache_spec")
        names = g["layer_names"]
        groups.append(kci.KVCacheGroupSpec(tuple(names) if isinstance(names, list) else names,
                                           spec_from_json(g["kv_cache_spec"]),
                                           is_eagle_group=g.get("is_eagle_group", False)))
    kwargs["groups"] = tuple(groups)
    try:
        return PoolConfig(**kwargs)
    except TypeError as exc:  # a required field missing
        raise InvalidFieldError("pool_config", sorted(obj), f"the fields of PoolConfig ({exc})") from None


@dataclass
class Trace:
    """A pool config and the operations applied to it, in order."""

    pool_config: PoolConfig
    ops: list[Op] = field(default_factory=list)
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, "note": self.note,
                "pool_config": pool_config_to_json(self.pool_config),
                "ops": [op.to_json() for op in self.ops]}

    @classmethod
    def from_json(cls, obj: Any) -> "Trace":
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise InvalidFieldError("format", obj.get("format") if isinstance(obj, dict) else obj,
                                    f"{FORMAT!r} (a kvref trace file)")
        if obj.get("version") != VERSION:
            raise InvalidFieldError("version", obj.get("version"), f"{VERSION}")
        if not isinstance(obj.get("ops"), list):
            raise InvalidFieldError("ops", obj.get("ops"), "a list of operations")
        pool = pool_config_from_json(obj.get("pool_config"))
        ops = []
        for i, o in enumerate(obj["ops"]):
            try:
                ops.append(Op.from_json(o))
            except InvalidFieldError as exc:  # name the position: ops[3].chunk
                field = exc.field.split(".", 1)[1] if "." in exc.field else exc.field
                where = f"ops[{i}]" if field == "ops[i]" else f"ops[{i}].{field}"
                raise InvalidFieldError(where, exc.value, exc.allowed) from None
        return cls(pool, ops, note=str(obj.get("note", "")))

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def loads(cls, text: str) -> "Trace":
        if not isinstance(text, (str, bytes, bytearray)):
            raise InvalidFieldError("trace", text, "the text of a trace file (JSON)")
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidFieldError("trace", text[:40], f"valid JSON ({exc})") from None
        return cls.from_json(obj)

    def save(self, path: str | Path) -> Path:
        path = _path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        except OSError as exc:
            raise InvalidFieldError("path", str(path), f"a writable file path ({exc.strerror or exc})") from None
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        """Read a trace file: data only, nothing in it is executed. Every problem (unreadable, not
        UTF-8, not JSON, a wrong value) is a :class:`TraceFormatError` naming the file and where."""
        path = _path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except IsADirectoryError:
            raise TraceFormatError(str(path), str(path), "a trace file (.json), not a folder") from None
        except OSError as exc:
            raise TraceFormatError(str(path), str(path), f"a readable trace file ({exc.strerror or exc})") from None
        except UnicodeDecodeError as exc:
            raise TraceFormatError(f"{path}: byte {exc.start}", repr(exc.object[exc.start:exc.start + 4]),
                                   "UTF-8 JSON text") from None
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"{path}: line {exc.lineno} column {exc.colno}", text[exc.pos:exc.pos + 20],
                                   f"JSON ({exc.msg})") from None
        try:
            return cls.from_json(obj)
        except KVRefError as exc:
            field = getattr(exc, "field", None)
            if field is None:
                raise TraceFormatError(str(path), "", str(exc)) from None
            raise TraceFormatError(f"{path}: {field}", exc.value, exc.allowed) from None

    def digest(self) -> str:
        """A short content hash (file names for saved traces)."""
        return hashlib.sha256(self.dumps().encode()).hexdigest()[:12]
