"""Registers the torch implementation as kind ``"torch"`` for ``kvref.impl.interface.make_manager``.

Imported on demand by the shared factory (``_BUILTIN_MODULES["torch"]``); importing it needs torch.
"""

from __future__ import annotations

from kvref.impl import interface

from . import make_manager

if hasattr(interface, "register_manager"):
    interface.register_manager("torch", lambda pool_config: make_manager(pool_config))
