"""Every public entry point of the packages users import, found by walking them (not by hand).

Public means: a class or function whose name has no leading underscore, defined in kvref (not
re-exported from the stdlib or torch), in one of :data:`PACKAGES` or their modules (Triton
kernels excluded: another suite owns them), and for a class every method defined on it (not
inherited, no leading underscore, properties are attributes). Exceptions are raised, not called.
Keys are dotted ``module.Class``, ``module.Class.method`` and ``module.function``.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

#: packages walked module by module
PACKAGES = ("kvref.spec", "kvref.impl.reference", "kvref.impl.reference.offload", "kvref.impl.torch",
            "kvref.impl.run_trace", "kvref.impl.reference.offload.p2p", "kvref.impl.reference.offload.tiering")
#: single modules users import besides those
MODULES = ("kvref.impl.interface", "kvref.impl.request", "kvref.impl.scheduler_types", "kvref.record",
           "kvref.models.conformance.trace", "kvref.impl.vllm.kv_events", "kvref.impl.vllm.record")
#: sub-packages never walked (the Triton kernels belong to their own suite)
SKIP = ("kvref.impl.torch.triton_kernels",)


def module_names() -> list[str]:
    names = list(MODULES)
    for pkg in PACKAGES:
        names.append(pkg)
        for info in pkgutil.iter_modules(importlib.import_module(pkg).__path__):
            full = f"{pkg}.{info.name}"
            if not info.name.startswith("_") and full not in SKIP and not info.ispkg:
                names.append(full)
    return names


def _defined_in_kvref(obj) -> bool:
    return str(getattr(obj, "__module__", "") or "").startswith("kvref")


def discover() -> dict[str, str]:
    """key -> ``"class"``, ``"method"`` or ``"function"``."""
    found: dict[str, str] = {}
    for modname in module_names():
        mod = importlib.import_module(modname)
        names = getattr(mod, "__all__", None) or [n for n in vars(mod) if not n.startswith("_")]
        for name in names:
            obj = getattr(mod, name, None)
            if not _defined_in_kvref(obj):
                continue
            key = f"{obj.__module__}.{obj.__qualname__}"
            if inspect.isclass(obj):
                if issubclass(obj, BaseException) or key in found:
                    continue
                found[key] = "class"
                for mname, member in vars(obj).items():
                    if mname.startswith("_"):
                        continue
                    if inspect.isfunction(member) or isinstance(member, (staticmethod, classmethod)):
                        found[f"{key}.{mname}"] = "method"
            elif inspect.isfunction(obj):
                found.setdefault(key, "function")
    return found


def qualified(fn) -> str:
    """The discovery key of a callable from the catalogue (class, function or bound method)."""
    fn = getattr(fn, "__func__", fn)
    return f"{fn.__module__}.{fn.__qualname__}"


if __name__ == "__main__":  # pragma: no cover - a listing for humans
    for k, v in sorted(discover().items()):
        print(v, k)
