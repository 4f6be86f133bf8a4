"""A pytest plugin: kvref's checks as test items in a vLLM fork's own test run.

    pytest -p kvref.pytest_plugin --kvref [--kvref-profile ci] [--kvref-checks conform-kv-manager,startup-liveness]

Each selected ``kvref verify`` check becomes one test item named ``kvref::<check>``, run against the
vLLM installed in that environment (as ``kvref verify --against vllm``): a failing check fails its
item with the check's summary, details and counterexample files; a check that cannot run (no torch,
say) is skipped with the reason; a check that ran but examined nothing (0 traces, 0 cases) fails its
item as an error, never passes (the same ``run_check`` as ``kvref verify``, issue #25). Without
``--kvref`` the plugin adds nothing.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvref", "kvref: checks of vLLM's KV-cache management")
    group.addoption("--kvref", action="store_true", default=False,
                    help="add kvref's verify checks as test items, against the installed vLLM")
    group.addoption("--kvref-profile", default="fast", choices=("fast", "ci", "nightly"),
                    help="budget of kvref's randomized checks (default: fast)")
    group.addoption("--kvref-checks", default=None, metavar="NAMES",
                    help="comma-separated check names (default: every default check of kvref verify)")
    group.addoption("--kvref-out", default="counterexamples", metavar="DIR",
                    help="where counterexamples and reproducers are written")
    group.addoption("--kvref-baseline", default=None, metavar="FILE",
                    help="findings accepted on purpose (kvref verify --update-baseline FILE writes it)")


class KvrefCheckFailed(Exception):
    """Raised by a check item whose check failed; carries the CheckResult."""

    def __init__(self, result) -> None:
        super().__init__(result.summary)
        self.result = result


class KvrefCheckItem(pytest.Item):
    def __init__(self, *, check, ctx, baseline, **kwargs) -> None:
        super().__init__(**kwargs)
        self.check = check
        self.ctx = ctx
        self.baseline = baseline

    def runtest(self) -> None:
        from kvref.report import ACCEPTED, SKIPPED, UNKNOWN
        from kvref.verify import run_check

        # the same runner as `kvref verify`: bounded shrinking, the baseline applied
        result = run_check(self.check, self.ctx, self.baseline)
        if result.status == ACCEPTED:
            return  # a deliberate difference the baseline lists: passes, as in kvref verify
        if result.status in (SKIPPED, UNKNOWN):
            pytest.skip(f"{result.status}: {result.summary}")
        if result.failing:
            raise KvrefCheckFailed(result)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, KvrefCheckFailed):
            r = excinfo.value.result
            lines = [f"kvref check {r.name}: {r.status}: {r.summary}", *r.details[:40]]
            lines += [f"counterexample: {a}" for a in r.artifacts]
            return "\n".join(lines)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"kvref::{self.check.name}"


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    if not config.getoption("--kvref"):
        return
    from kvref.check_context import VerifyContext
    from kvref.checks import CHECKS, select_checks
    from kvref.spec.errors import InvalidFieldError

    names = config.getoption("--kvref-checks")
    only = [n.strip() for n in names.split(",") if n.strip()] if names else None
    known = {c.name for c in CHECKS}
    for n in only or ():
        if n not in known:
            raise pytest.UsageError(str(InvalidFieldError("--kvref-checks", n, "one of " + ", ".join(sorted(known)))))
    ctx = VerifyContext(profile=config.getoption("--kvref-profile"), against="vllm",
                        out_dir=config.getoption("--kvref-out"))
    from kvref.baseline import Baseline

    path = config.getoption("--kvref-baseline")
    try:
        baseline = Baseline.load(path) if path else Baseline()
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    for check in select_checks(only=only, against="vllm"):
        items.append(KvrefCheckItem.from_parent(session, name=f"kvref::{check.name}", check=check, ctx=ctx,
                                                baseline=baseline))
