"""Faults planted in vLLM's tiering code for the tiering conformance tests (#22): one method of a
vLLM class, recompiled from its own source with one text edit, swapped in for a ``with`` block
(the installed files are never touched)."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import textwrap


@contextlib.contextmanager
def edited(module_name: str, cls_name: str, method: str, old: str, new: str):
    """``cls_name.method`` of ``module_name`` (a module function when ``cls_name`` is None) with
    ``old`` (found exactly once) replaced by ``new``."""
    module = importlib.import_module(module_name)
    cls = getattr(module, cls_name) if cls_name else module
    func = cls.__dict__[method] if cls_name else getattr(module, method)
    src = inspect.getsource(func)
    assert src.count(old) == 1, (cls_name, method, old)
    src = src.replace(old, new)
    if cls_name:
        src = src.replace("super().", f"super({cls_name}, self).")  # no __class__ cell outside its class
    ns: dict = {}
    exec(compile(textwrap.dedent(src), f"<planted {cls_name}.{method}>", "exec"), vars(module), ns)  # noqa: S102
    setattr(cls, method, ns[method])
    try:
        yield
    finally:
        setattr(cls, method, func)
