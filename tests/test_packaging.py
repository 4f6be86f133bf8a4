"""`pip install .` must ship every folder under its kvref.* name (package-dir mapping)."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import kvref.cli

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contains_every_layer_and_imports_outside_the_repo(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(ROOT)], check=True, capture_output=True)
    wheel = next(tmp_path.glob("kvref-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("kvref/spec/__init__.py", "kvref/spec/kv_cache_interface.py", "kvref/impl/interface.py",
                   "kvref/impl/reference/__init__.py", "kvref/impl/torch/__init__.py",
                   "kvref/impl/vllm/__init__.py", "kvref/impl/vllm/api.py", "kvref/impl/run_trace/__init__.py",
                   "kvref/impl/torch/triton_kernels/__init__.py", "kvref/models/run_check/__init__.py",
                   "kvref/models/mutants/vllm_source/catalogue.py", "kvref/models/machines/scheduler.py",
                   "kvref/models/__init__.py", "kvref/proofs/__init__.py", "kvref/cli/__init__.py",
                   "kvref/examples/llama3_8b.json", "kvref/examples/gemma3_27b_like.toml"):
        assert module in names, f"{module} missing from the wheel"
    for init in (ROOT / "models").rglob("__init__.py"):  # every models/ sub-package ships
        module = "kvref/" + init.relative_to(ROOT).as_posix()
        assert module in names, f"{module} missing from the wheel (pyproject's packages list)"
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    out = subprocess.run([sys.executable, "-I", "-c",
                          f"import sys; sys.path.insert(0, {str(site)!r}); import kvref.spec, kvref.impl.interface;"
                          "print(kvref.spec.__file__)"],
                         cwd=tmp_path, check=True, capture_output=True, text=True).stdout
    assert out.strip().startswith(str(site))


def test_every_subcommand_module_is_importable():
    for name in kvref.cli.SUBCOMMAND_MODULES:
        __import__(name)
    parser = kvref.cli.build_parser()
    assert "verify" in parser.format_help()
