"""Which vLLM is installed: version, where it lives, the git commit when it comes from a checkout.

A vLLM developer runs kvref against *their* vLLM: an editable checkout (``pip install -e``) reports
a setuptools-scm version such as ``0.33.1.dev12+gdeadbee``, nightlies and forks report others. None
of that is a reason to refuse or skip: kvref drives whatever imports, and says exactly what it
drove (version, path, commit) in every report, so a finding can be tied to the code that produced it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import asdict, dataclass
from functools import lru_cache

from kvref.impl.vllm.loader import load_vllm, set_cpu_environment
from kvref.spec.version import MODELLED_VLLM_VERSION as REFERENCE_VLLM_VERSION


@dataclass(frozen=True)
class VllmInstall:
    """What ``import vllm`` gives in this process.

    Args:
        importable: whether ``import vllm`` works.
        version: ``vllm.__version__`` (None when it does not import).
        path: the package directory.
        git_commit: the commit the package was built from, when known (a checkout's HEAD, the
            ``+g<sha>`` of a setuptools-scm version, or pip's ``direct_url.json``).
        git_dirty: the checkout has uncommitted changes under the package (None when unknown).
        error: why it does not import.
    """

    importable: bool
    version: str | None = None
    path: str | None = None
    git_commit: str | None = None
    git_dirty: bool | None = None
    error: str | None = None

    @property
    def is_reference_version(self) -> bool:
        return self.version == REFERENCE_VLLM_VERSION

    def describe(self) -> str:
        """One line for reports: ``vLLM 0.33.1.dev3+gabc1234 at /src/vllm/vllm (git abc1234…, dirty)``."""
        if not self.importable:
            return f"vLLM not importable: {self.error}"
        text = f"vLLM {self.version} at {self.path}"
        if self.git_commit:
            text += f" (git {self.git_commit[:12]}{', dirty' if self.git_dirty else ''})"
        if not self.is_reference_version:
            text += f"; kvref models {REFERENCE_VLLM_VERSION}, so differences are findings about what changed"
        return text

    def to_dict(self) -> dict:
        return {**asdict(self), "reference_version": REFERENCE_VLLM_VERSION}


def _git(path: str, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", path, *args], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _commit_from_checkout(pkg_dir: str) -> tuple[str | None, bool | None]:
    """HEAD and dirtiness of the git work tree the package directory sits in (editable installs)."""
    # The package must be *tracked* by the work tree it sits in: a virtualenv inside some other
    # project's checkout (site-packages under an ignored .venv/) is not a vLLM checkout.
    if _git(pkg_dir, "ls-files", "--error-unmatch", "__init__.py") is None:
        return None, None
    head = _git(pkg_dir, "rev-parse", "HEAD")
    if not head:
        return None, None
    status = _git(pkg_dir, "status", "--porcelain", "--untracked-files=no", "--", ".")
    return head, (bool(status) if status is not None else None)


_SCM_HASH = re.compile(r"\+g([0-9a-f]{7,40})\b")


def _commit_from_version(version: str | None) -> str | None:
    """setuptools-scm local versions carry the short commit: ``0.33.1.dev12+gdeadbee[.d20261124]``."""
    m = _SCM_HASH.search(version or "")
    return m.group(1) if m else None


def _commit_from_direct_url(pkg_dir: str) -> str | None:
    """pip records a VCS install's commit in ``<dist-info>/direct_url.json``."""
    site = os.path.dirname(pkg_dir)
    try:
        names = os.listdir(site)
    except OSError:
        return None
    for name in names:
        if name.startswith("vllm-") and name.endswith(".dist-info"):
            try:
                with open(os.path.join(site, name, "direct_url.json"), encoding="utf-8") as fh:
                    info = json.load(fh)
            except (OSError, ValueError):
                return None
            return (info.get("vcs_info") or {}).get("commit_id")
    return None


@lru_cache(maxsize=1)
def describe_installed_vllm() -> VllmInstall:
    """Import vLLM (once per process) and describe it; never raises."""
    set_cpu_environment()
    try:
        import vllm
    except Exception as exc:  # ImportError, or a broken install raising anything at import
        return VllmInstall(False, error=f"{type(exc).__name__}: {exc}")
    version = str(getattr(vllm, "__version__", None) or "unknown")
    pkg_dir = os.path.dirname(os.path.abspath(getattr(vllm, "__file__", "") or "")) or None
    commit, dirty = _commit_from_checkout(pkg_dir) if pkg_dir else (None, None)
    if commit is None:
        commit = _commit_from_version(version) or (_commit_from_direct_url(pkg_dir) if pkg_dir else None)
    return VllmInstall(True, version=version, path=pkg_dir, git_commit=commit, git_dirty=dirty)


def vllm_available() -> tuple[bool, str]:
    """Whether vLLM imports here (any version), with the one-line description or the reason not."""
    info = describe_installed_vllm()
    return info.importable, info.describe()


def ensure_importable() -> None:
    """Import the vLLM classes kvref drives, through the one loader (:func:`.loader.load_vllm`).

    What a caller runs to learn whether vLLM can be *driven* here, not only imported
    (:func:`describe_installed_vllm` is enough for the latter): raises ImportError naming what is
    missing, or whatever a broken install raises while its modules load.
    """
    load_vllm()
