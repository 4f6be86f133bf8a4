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
``python -m kvref.models.differential FILE``.

The operations (``OP_FIELDS``) are the ones :mod:`kvref.models.differential` knows how to apply;
see there for what each does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvref.impl.interface import PoolConfig
from kvref.spec import kv_cache_interface as kci
from kvref.spec.errors import InvalidFieldError

FORMAT = "kvref-trace"
VERSION = 1

#: every op name and its fields (all required; values are JSON scalars or lists of ints)
OP_FIELDS: dict[str, tuple[str, ...]] = {
    "add": ("rid", "prompt", "max_tokens", "cache_salt"),
    "admit": ("rid", "chunk", "full_sequence_must_fit", "reserved_blocks", "in_flight", "token"),  # + external
    "step": ("rid", "chunk", "lookahead", "in_flight", "token"),
    "process": ("rid",),
    "preempt": ("rid",),
    "finish": ("rid",),
    "new_step": (),
}

#: optional fields and their defaults (added after version 1 was first written; older traces omit them)
OP_DEFAULTS: dict[str, dict[str, Any]] = {
    "admit": {"external": 0},
}

_SPEC_TYPES = {cls.__name__: cls for cls in (
    kci.FullAttentionSpec, kci.MLAAttentionSpec, kci.SlidingWindowSpec, kci.ChunkedLocalAttentionSpec,
    kci.CrossAttentionSpec, kci.MambaSpec)}


@dataclass(frozen=True)
class Op:
    """One operation: ``name`` (a key of ``OP_FIELDS``) and its arguments."""

    name: str
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in OP_FIELDS:
            raise InvalidFieldError("op", self.name, "one of " + ", ".join(OP_FIELDS))
        for k, v in OP_DEFAULTS.get(self.name, {}).items():
            self.args.setdefault(k, v)
        optional = tuple(OP_DEFAULTS.get(self.name, {}))
        missing = [f for f in OP_FIELDS[self.name] if f not in self.args]
        extra = [f for f in self.args if f not in OP_FIELDS[self.name] + optional]
        if missing or extra:
            raise InvalidFieldError(f"{self.name}.args", sorted(self.args),
                                    f"exactly the fields {list(OP_FIELDS[self.name])}")

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
        if "prompt" in args:
            args["prompt"] = list(args["prompt"])
        return cls(obj["op"], args)

    def __str__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.args.items() if k != "prompt")
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
    kwargs = {k: v for k, v in obj.items() if k != "type"}
    if "shapes" in kwargs:
        kwargs["shapes"] = tuple(tuple(s) for s in kwargs["shapes"])
    if "dtypes" in kwargs:
        kwargs["dtypes"] = tuple(kwargs["dtypes"])
    return _SPEC_TYPES[obj["type"]](**kwargs)


def pool_config_to_json(pc: PoolConfig) -> dict[str, Any]:
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
    kwargs = dict(obj)
    kwargs["groups"] = tuple(
        kci.KVCacheGroupSpec(tuple(g["layer_names"]), spec_from_json(g["kv_cache_spec"]),
                             is_eagle_group=g.get("is_eagle_group", False))
        for g in obj["groups"])
    return PoolConfig(**kwargs)


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
        return cls(pool_config_from_json(obj.get("pool_config")), [Op.from_json(o) for o in obj["ops"]],
                   note=str(obj.get("note", "")))

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def loads(cls, text: str) -> "Trace":
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InvalidFieldError("trace", text[:40], f"valid JSON ({exc})") from None
        return cls.from_json(obj)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        return cls.loads(Path(path).read_text())

    def digest(self) -> str:
        """A short content hash (file names for saved traces)."""
        return hashlib.sha256(self.dumps().encode()).hexdigest()[:12]
