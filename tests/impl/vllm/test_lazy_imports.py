"""Every kvref.impl.vllm module imports without vLLM (#26; the package docstring promises it).

vLLM is imported lazily, inside the functions that drive it, so that the rest of kvref (and a user
without vLLM) can import any module of this package, and a vLLM whose import fails is reported by
the check that needs it rather than by an ImportError at ``import kvref``. The test imports each
module in a fresh interpreter in which any ``import vllm`` raises.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import kvref.impl.vllm as package

_BLOCK_VLLM = """
import importlib, sys

class _NoVllm:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ImportError(f"vLLM is made unimportable for this test: {name}")
        return None

sys.meta_path.insert(0, _NoVllm())
failed = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
loaded = sorted(m for m in sys.modules if m == "vllm" or m.startswith("vllm."))
print("\\n".join(failed))
print("LOADED_VLLM", loaded)
sys.exit(1 if failed or loaded else 0)
"""


def _modules() -> list[str]:
    return [f"{package.__name__}.{info.name}" for info in pkgutil.iter_modules(package.__path__)]


def test_the_package_lists_its_modules():
    names = _modules()
    assert f"{package.__name__}.record" in names and f"{package.__name__}.scheduler" in names
    assert len(names) >= 20


def test_every_module_imports_without_vllm():
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run([sys.executable, "-c", _BLOCK_VLLM, *_modules()], capture_output=True, text=True,
                         cwd=root, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "LOADED_VLLM []" in out.stdout
