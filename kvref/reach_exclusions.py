"""The reviewed exclusion file of the reach report (issue #22): which unexecuted vLLM functions do
not count against the figure, and why.

Only two reasons are allowed — code outside KV-cache management (structured output, the encoder
cache, logging and metrics printing, pooling, ...) and code that cannot run without a GPU. Every
other unexecuted function stays counted as missed: a gap to close by modelling and generating, not
by naming it here. An entry that names a module or function that does not exist, or a function the
checks did execute, is *stale* (:func:`kvref.reach_report.apply_exclusions`): it excludes nothing and the report fails
until the entry is fixed, so the file cannot drift into silent exclusions.

``blocks`` names code *inside* a function that is outside KV-cache management — the scheduler's
encoder-cache connector or structured-output branches sit in the middle of ``Scheduler.schedule``,
which is KV-cache code. An entry is the header of an ``if``/``elif`` statement, compared with its
whitespace collapsed; what it excludes is that statement's body (its statements and the branches
that start in it or enter it), never the header, which runs and stays counted. A header that
matches nothing, or matches a body some check executed, is stale like a function.

Format (TOML)::

    [[exclude]]
    module = "vllm/v1/core/encoder_cache_manager.py"
    functions = ["EncoderCacheManager.free"]      # coverage.py's qualified names; or
    # whole_module = true                          # every line of the file (a GPU-only module); or
    # blocks = ["if self.ec_connector is not None:"]   # the bodies of these if/elif statements
    reason = "outside-kv-cache"                    # or "needs-gpu"
    why = "what it is and why the checks cannot run it"
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib import resources

from kvref.spec.errors import InvalidFieldError

#: the packaged, reviewed file
EXCLUSIONS_RESOURCE = "data/reach_exclusions.toml"

#: the only reasons an unexecuted function may be excluded for, and how the report names them
REASONS = {
    "outside-kv-cache": "outside KV-cache management",
    "needs-gpu": "needs a GPU",
}


@dataclass(frozen=True)
class Exclusion:
    """One entry: ``functions`` of ``module`` (or the whole module), with its reason."""

    module: str
    functions: tuple[str, ...]
    whole_module: bool
    reason: str
    why: str
    #: if/elif headers whose bodies are excluded (whitespace-collapsed)
    blocks: tuple[str, ...] = ()

    def names(self) -> tuple[str, ...]:
        if self.whole_module:
            return ("<whole module>",)
        return self.functions or tuple(f"block `{b}`" for b in self.blocks)


def collapse(text: str) -> str:
    """A header's text with its whitespace collapsed, none just inside parentheses and no trailing
    comma before a closing one (how ``blocks`` entries are compared with the source)."""
    return " ".join(text.split()).replace("( ", "(").replace(" )", ")").replace(",)", ")")


def load_exclusions(path: str | None = None) -> tuple[Exclusion, ...]:
    """Parse an exclusion file (the packaged one when ``path`` is None); a malformed file or an
    entry with a reason other than :data:`REASONS` is an :class:`InvalidFieldError`."""
    field = "--reach-exclusions"
    if path is None:
        text = resources.files("kvref").joinpath(EXCLUSIONS_RESOURCE).read_text(encoding="utf-8")
        where = EXCLUSIONS_RESOURCE
    else:
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidFieldError(field, path, f"a readable UTF-8 TOML file ({exc})") from None
        where = path
    return parse_exclusions(text, where)


def parse_exclusions(text: str, where: str = "exclusions") -> tuple[Exclusion, ...]:
    """Parse the TOML text of an exclusion file (``where`` names it in errors)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InvalidFieldError("--reach-exclusions", where, f"valid TOML ({exc})") from None
    entries = data.get("exclude", [])
    if not isinstance(entries, list):
        raise InvalidFieldError(f"{where}: exclude", entries, "an array of [[exclude]] tables")
    out = []
    for i, e in enumerate(entries):
        at = f"{where}: exclude[{i}]"
        if not isinstance(e, dict):
            raise InvalidFieldError(at, e, "a table")
        unknown = set(e) - {"module", "functions", "whole_module", "blocks", "reason", "why"}
        if unknown:
            raise InvalidFieldError(f"{at}", sorted(unknown)[0],
                                    "module, functions, whole_module, blocks, reason, why")
        module = e.get("module")
        if not isinstance(module, str) or not module.startswith("vllm/") or not module.endswith(".py"):
            raise InvalidFieldError(f"{at}.module", module, "a file path under vllm/ ending in .py")
        whole = e.get("whole_module", False)
        if not isinstance(whole, bool):
            raise InvalidFieldError(f"{at}.whole_module", whole, "true or false")
        functions = e.get("functions", [])
        if not isinstance(functions, list) or not all(isinstance(f, str) and f for f in functions):
            raise InvalidFieldError(f"{at}.functions", functions, "a list of qualified function names")
        blocks = e.get("blocks", [])
        if not isinstance(blocks, list) or not all(isinstance(b, str) and b.strip() for b in blocks):
            raise InvalidFieldError(f"{at}.blocks", blocks, "a list of if/elif header lines")
        bad = [b for b in blocks if not collapse(b).startswith(("if ", "elif ")) or not collapse(b).endswith(":")]
        if bad:
            raise InvalidFieldError(f"{at}.blocks", bad[0], "an if/elif header, e.g. 'if self.x is not None:'")
        if whole + bool(functions) + bool(blocks) != 1:
            raise InvalidFieldError(f"{at}.functions", functions, "a non-empty list, or whole_module = true, "
                                    "or a non-empty blocks list (exactly one of the three)")
        reason = e.get("reason")
        if reason not in REASONS:
            raise InvalidFieldError(f"{at}.reason", reason, "one of " + ", ".join(REASONS) + " (any other "
                                    "unexecuted function is a gap, counted as missed)")
        why = e.get("why")
        if not isinstance(why, str) or not why.strip():
            raise InvalidFieldError(f"{at}.why", why, "what the code is and why the checks cannot run it")
        out.append(Exclusion(module, tuple(functions), whole, reason, why.strip(),
                             tuple(collapse(b) for b in blocks)))
    return tuple(out)
