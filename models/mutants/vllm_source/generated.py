"""Source faults generated mechanically from vLLM's KV-cache code, not chosen by us (issue #22).

The catalogue (:mod:`.catalogue`) holds faults someone wrote, and the checks were tuned until they
caught them: its recall says little about a bug nobody anticipated. This module produces an
unbiased sample instead: classic mutation operators applied by AST to every eligible site of the
listed modules, then a seeded sample of ``n`` of them spread over the modules in proportion to
their statement counts. A survivor is either an *equivalent* mutant (the edit changes no
observable behaviour) or a behaviour the checks do not observe; only reading it tells which.

Operators (one line each, chosen by :mod:`ast`, applied to the exact source text):

* ``rel`` — relational flip: ``<``/``<=``, ``>``/``>=``, ``==``/``!=``, ``in``/``not in``,
  ``is``/``is not``;
* ``bool`` — ``and``/``or``; ``not`` — a ``not`` dropped;
* ``inc`` / ``dec`` — an integer literal ``n`` becomes ``n+1`` / ``n-1``;
* ``arith`` — ``+``/``-`` of a binary operation (``x + 1`` becomes ``x - 1``);
* ``minmax`` — ``min``/``max``; ``return`` — ``return True``/``return False``;
* ``if-true`` / ``if-false`` — an ``if``/``elif`` condition forced;
* ``drop`` — an assignment, augmented assignment or call statement replaced by ``pass``.

Never mutated: code outside function bodies (imports, constants and declarations, whose edits
mostly break the import rather than behaviour), functions and ``if`` bodies the reviewed
exclusion file excludes, docstrings and other string constants, f-strings, comments (not in the
AST), logging (``logger.``/``logging.`` calls and anything on their lines), ``assert`` statements,
type annotations and ``if TYPE_CHECKING:`` blocks.

Determinism: sites are enumerated in source order, the per-module sample is drawn from a
:class:`random.Random` seeded with the seed, the file's path and the sha256 of its text, so the
same vLLM file and seed give the same faults on every machine, and an edit to one file leaves the
other files' samples alone.

This module never imports vLLM, nor kvref's top layer: the caller (:func:`kvref.vllm_campaign.
generated_faults`) reads the module list and the exclusion file and passes them in.
"""

from __future__ import annotations

import ast
import hashlib
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from kvref.spec.errors import InvalidFieldError

from .overlay import GENERATED, Edit, SourceFault

#: operator names, in the order sites are listed
OPERATORS = ("rel", "bool", "not", "inc", "dec", "arith", "minmax", "return", "if-true", "if-false", "drop")

_REL_FLIP = {"<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "==", "in": "not in",
             "not in": "in", "is": "is not", "is not": "is"}
_LOGGERS = ("logger", "logging", "_logger", "log")


@dataclass(frozen=True)
class ModuleExclusions:
    """What the reviewed exclusion file takes out of one module.

    Args:
        whole_module: every line of the file.
        functions: qualified names (``Class.method``, ``outer.inner``); a function's nested
            functions go with it.
        blocks: if/elif headers (as ``header_key`` renders them) whose bodies are excluded.
    """

    whole_module: bool = False
    functions: frozenset[str] = frozenset()
    blocks: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Site:
    """One mutation site: ``line`` (1-based) of the file becomes ``new_line``."""

    line: int
    col: int
    operator: str
    old_line: str
    new_line: str
    function: str


def _norm_op(seg: str) -> str:
    return " ".join(seg.replace("(", " ").replace(")", " ").split())


class _Finder(ast.NodeVisitor):
    """Walks one module and collects :class:`Site`s inside eligible function bodies."""

    def __init__(self, lines: list[str], excl: ModuleExclusions, header_key: Callable[[str], str]):
        self.lines = lines
        self.excl = excl
        self.header_key = header_key
        self.scope: list[str] = []
        self.func_depth = 0
        self.skip_lines: set[int] = set()
        self.sites: list[Site] = []
        self.statements = 0

    # -- scopes ------------------------------------------------------------------------------
    def visit(self, node: ast.AST) -> None:
        if isinstance(node, ast.stmt) and self.func_depth and \
                not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            self.statements += 1  # the sampling weight: statements of eligible function bodies
        super().visit(node)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        # decorators, bases and class-level statements outside methods are never visited
        self.scope.append(node.name)
        for stmt in node.body:
            self.visit(stmt)
        self.scope.pop()

    def _function(self, node) -> None:
        qual = ".".join(self.scope + [node.name])
        # decorators, defaults and annotations of the signature are never visited: no site there
        if any(qual == f or qual.startswith(f + ".") for f in self.excl.functions):
            return
        self.scope.append(node.name)
        self.func_depth += 1
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]  # the docstring
        for stmt in body:
            self.visit(stmt)
        self.func_depth -= 1
        self.scope.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    # -- statements that are never mutated --------------------------------------------------------
    def _skip(self, node: ast.AST) -> None:
        for n in ast.walk(node):
            if hasattr(n, "lineno"):
                self.skip_lines.update(range(n.lineno, (n.end_lineno or n.lineno) + 1))

    def visit_Assert(self, node: ast.Assert) -> None:
        self._skip(node)

    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Constant):  # a bare string (a docstring-like comment)
            return
        if self._is_logging(node.value):
            self._skip(node)
            return
        self._drop(node)
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        self._drop(node)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._drop(node)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:
            self.visit(node.value)

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        return  # an f-string: text, not logic

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        if isinstance(test, ast.Name) and test.id == "TYPE_CHECKING" or \
                isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING":
            self._skip(node)
            return
        excluded = self.excl.blocks and self._header(node) in self.excl.blocks
        if not any(self._is_logging(n) for n in ast.walk(test)):
            self._forced(node)
            self.visit(test)
        for stmt in node.body:
            if excluded:
                self._skip(stmt)
            else:
                self.visit(stmt)
        for stmt in node.orelse:
            self.visit(stmt)

    def visit_Return(self, node: ast.Return) -> None:
        v = node.value
        if isinstance(v, ast.Constant) and isinstance(v.value, bool) and v.lineno == v.end_lineno:
            self._replace(v.lineno, v.col_offset, v.end_col_offset, str(not v.value), "return")
        elif v is not None:
            self.visit(v)

    # -- expressions --------------------------------------------------------------------------
    def visit_Compare(self, node: ast.Compare) -> None:
        prev = node.left
        for op_node, right in zip(node.ops, node.comparators):
            if prev.end_lineno == right.lineno:
                ln = right.lineno
                seg = self.lines[ln - 1][prev.end_col_offset:right.col_offset]
                op = _norm_op(seg)
                if op in _REL_FLIP:
                    start = prev.end_col_offset + seg.index(op.split()[0])
                    end = prev.end_col_offset + len(seg.rstrip(" ("))
                    self._replace(ln, start, end, _REL_FLIP[op], "rel")
            prev = right
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        vals = node.values
        if vals[0].lineno == vals[-1].end_lineno:
            ln = vals[0].lineno
            line = self.lines[ln - 1]
            word, other = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
            spans = []
            for a, b in zip(vals, vals[1:]):
                seg = line[a.end_col_offset:b.col_offset]
                if _norm_op(seg) != word:
                    spans = []
                    break
                i = a.end_col_offset + seg.index(word)
                spans.append((i, i + len(word)))
            if spans:
                new = line
                for s, e in reversed(spans):
                    new = new[:s] + other + new[e:]
                self._add(ln, spans[0][0], "bool", new)
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, ast.Not) and node.lineno == node.operand.lineno:
            line = self.lines[node.lineno - 1]
            seg = line[node.col_offset:node.operand.col_offset]
            if seg.startswith("not") and not seg[3:].strip(" ("):
                self._add(node.lineno, node.col_offset, "not",
                          line[:node.col_offset] + seg[3:].lstrip(" ") + line[node.operand.col_offset:])
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        if isinstance(node.op, (ast.Add, ast.Sub)) and node.left.end_lineno == node.right.lineno \
                and not any(isinstance(x, (ast.JoinedStr, ast.List, ast.Tuple, ast.ListComp))
                            or isinstance(x, ast.Constant) and isinstance(x.value, (str, bytes))
                            for x in (node.left, node.right)):
            ln = node.right.lineno
            seg = self.lines[ln - 1][node.left.end_col_offset:node.right.col_offset]
            sym = "+" if isinstance(node.op, ast.Add) else "-"
            if _norm_op(seg) == sym:
                i = node.left.end_col_offset + seg.index(sym)
                self._replace(ln, i, i + 1, "-" if sym == "+" else "+", "arith")
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        v = node.value
        if type(v) is int and node.lineno == node.end_lineno:
            text = self.lines[node.lineno - 1][node.col_offset:node.end_col_offset]
            try:
                ok = int(text.replace("_", ""), 0) == v
            except ValueError:
                ok = False
            if ok:
                self._replace(node.lineno, node.col_offset, node.end_col_offset, str(v + 1), "inc")
                self._replace(node.lineno, node.col_offset, node.end_col_offset, str(v - 1), "dec")

    def visit_Call(self, node: ast.Call) -> None:
        if self._is_logging(node):
            self._skip(node)
            return
        f = node.func
        if isinstance(f, ast.Name) and f.id in ("min", "max"):
            self._replace(f.lineno, f.col_offset, f.end_col_offset, "max" if f.id == "min" else "min", "minmax")
        self.generic_visit(node)

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.visit(node.body)  # not its parameters' defaults

    # -- helpers ------------------------------------------------------------------------------
    @staticmethod
    def _is_logging(node: ast.AST) -> bool:
        if not isinstance(node, ast.Call):
            return False
        f = node.func
        while isinstance(f, ast.Attribute):
            f = f.value
            if isinstance(f, ast.Name) and f.id in _LOGGERS:
                return True
            if isinstance(f, ast.Attribute) and f.attr in _LOGGERS:
                return True
        return False

    def _header(self, node: ast.If) -> str:
        end, col = node.test.end_lineno, node.test.end_col_offset
        head = self.lines[node.lineno - 1:end]
        head[-1] = head[-1][:col]
        head[0] = head[0][node.col_offset:] if len(head) > 1 else head[0][node.col_offset:col]
        tail, ln = self.lines[end - 1][col:], end
        while ":" not in tail and ln < len(self.lines):
            tail, ln = tail + " " + self.lines[ln], ln + 1
        return self.header_key(" ".join(head) + tail[:tail.find(":") + 1])

    def _forced(self, node: ast.If) -> None:
        t = node.test
        if t.lineno == t.end_lineno and not (isinstance(t, ast.Constant)):
            self._replace(t.lineno, t.col_offset, t.end_col_offset, "True", "if-true")
            self._replace(t.lineno, t.col_offset, t.end_col_offset, "False", "if-false")

    def _drop(self, node: ast.stmt) -> None:
        if isinstance(node, ast.Expr) and not isinstance(node.value, (ast.Call, ast.Await)):
            return
        if node.lineno != node.end_lineno:
            return
        line = self.lines[node.lineno - 1]
        indent = line[:len(line) - len(line.lstrip())]
        rest = line[node.end_col_offset:].strip()
        if node.col_offset != len(indent) or rest and not rest.startswith("#"):
            return  # not alone on its line (`if x: y = 1`, `a = 1; b = 2`)
        self._add(node.lineno, node.col_offset, "drop", indent + "pass")

    def _replace(self, ln: int, start: int, end: int, text: str, operator: str) -> None:
        line = self.lines[ln - 1]
        self._add(ln, start, operator, line[:start] + text + line[end:])

    def _add(self, ln: int, col: int, operator: str, new_line: str) -> None:
        if not self.func_depth or ln in self.skip_lines:
            return
        old = self.lines[ln - 1]
        if new_line != old:
            self.sites.append(Site(ln, col, operator, old, new_line, ".".join(self.scope)))


def find_sites(text: str, excl: ModuleExclusions = ModuleExclusions(),
               header_key: Callable[[str], str] = lambda s: " ".join(s.split())) -> tuple[list[Site], int]:
    """Every mutation site of one module's ``text`` and the number of statements in its eligible
    function bodies (the sampling weight). Sites on lines skipped (logging, asserts, annotations,
    excluded blocks) are dropped even when found before the skip was known."""
    if excl.whole_module:
        return [], 0
    lines = text.splitlines()
    finder = _Finder(lines, excl, header_key)
    finder.visit(ast.parse(text))
    sites = [s for s in finder.sites if s.line not in finder.skip_lines]
    sites.sort(key=lambda s: (s.line, s.col, OPERATORS.index(s.operator)))
    seen, unique = set(), []
    for s in sites:  # two sites making the same line (`not` of `not not x`) are one fault
        if (s.line, s.new_line) not in seen:
            seen.add((s.line, s.new_line))
            unique.append(s)
    return unique, finder.statements


def _unique_context(lines: list[str], text: str, i: int) -> tuple[int, int]:
    """The smallest window of whole lines around line index ``i`` whose text occurs once."""
    lo, hi = i, i + 1
    while True:
        if text.count("".join(lines[lo:hi])) == 1 or (lo == 0 and hi == len(lines)):
            return lo, hi
        if hi < len(lines) and (hi - i <= i - lo or lo == 0):
            hi += 1
        else:
            lo -= 1


def site_fault(path: str, text: str, site: Site, fault_id: str) -> SourceFault:
    """The :class:`SourceFault` of ``site`` in ``path`` (relative to the vllm package): the mutated
    line plus as many neighbouring lines as make its ``old`` text occur exactly once."""
    lines = text.splitlines(keepends=True)
    i = site.line - 1
    lo, hi = _unique_context(lines, text, i)
    eol = lines[i][len(lines[i].rstrip("\r\n")):]
    new_lines = lines[lo:hi]
    new_lines[i - lo] = site.new_line + eol
    description = (f"generated ({site.operator}) in {site.function or '<module>'}, line {site.line}: "
                   f"{site.old_line.strip()!r} -> {site.new_line.strip()!r}")
    return SourceFault(fault_id, path, (Edit("".join(lines[lo:hi]), "".join(new_lines)),), GENERATED,
                       description, behaviour="generated")


def _allocate(n: int, weights: Mapping[str, int], capacity: Mapping[str, int]) -> dict[str, int]:
    """``n`` split over the modules in proportion to ``weights`` (largest remainder), none above its
    ``capacity``; what a full module cannot take goes to the others, again by weight."""
    quota = {k: 0 for k in weights}
    left = min(n, sum(capacity.values()))
    while left > 0:
        open_ = [k for k in weights if quota[k] < capacity[k] and weights[k] > 0]
        if not open_:
            open_ = [k for k in weights if quota[k] < capacity[k]]
        total = sum(weights[k] for k in open_) or len(open_)
        share = {k: left * (weights[k] or 1) / total for k in open_}
        give = {k: min(int(share[k]), capacity[k] - quota[k]) for k in open_}
        rest = left - sum(give.values())
        for k in sorted(open_, key=lambda k: (-(share[k] - int(share[k])), k)):
            if rest <= 0:
                break
            if quota[k] + give[k] < capacity[k]:
                give[k] += 1
                rest -= 1
        if not sum(give.values()):
            break
        for k in open_:
            quota[k] += give[k]
        left -= sum(give.values())
    return quota


def _stems(paths: Iterable[str]) -> dict[str, str]:
    """A short name per path for ids: the file stem, or ``parent-stem`` where two listed files
    share a stem (``sched-scheduler`` vs ``offloading-scheduler``)."""
    paths = list(paths)
    stem = {p: p.rsplit("/", 1)[-1][:-3] for p in paths}
    counts: dict[str, int] = {}
    for s in stem.values():
        counts[s] = counts.get(s, 0) + 1
    out = {}
    for p in paths:
        parts = p[:-3].split("/")
        out[p] = stem[p] if counts[stem[p]] == 1 else "-".join(parts[-2:])
    return out


def generate(sources: Mapping[str, str], n: int, seed: int = 0,
             exclusions: Mapping[str, ModuleExclusions] | None = None,
             header_key: Callable[[str], str] = lambda s: " ".join(s.split()),
             listed: Iterable[str] | None = None) -> list[SourceFault]:
    """``n`` generated faults over ``sources`` (path relative to the vllm package -> file text).

    Every site of every module is enumerated; each module's share of ``n`` is proportional to its
    eligible statements (:func:`_allocate`); within a module the sample is drawn by a
    :class:`random.Random` seeded with ``seed``, the path and the file's sha256. The result is in
    path, then line order, ids ``gen.<stem>.<line>.<operator>`` (``.c<col>`` appended where one
    line has two sites of an operator). Raises :class:`InvalidFieldError` (``--generated``) when
    ``n`` exceeds the sites there are. ``listed``: every path of the module list (default: those of
    ``sources``), so a stem shared by two listed files is told apart the same way whichever of
    them ``sources`` holds (ids stay stable when ``--modules`` narrows the sample).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise InvalidFieldError("--generated", n, "a number of faults >= 1")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise InvalidFieldError("--seed", seed, "an int >= 0")
    exclusions = exclusions or {}
    sites, weights = {}, {}
    for path in sorted(sources):
        try:
            sites[path], weights[path] = find_sites(sources[path], exclusions.get(path, ModuleExclusions()),
                                                    header_key)
        except SyntaxError as exc:
            raise InvalidFieldError("--modules", path, f"a parsable Python file ({exc})") from None
    available = sum(len(s) for s in sites.values())
    if n > available:
        raise InvalidFieldError("--generated", n, f"at most {available} (the mutation sites of the "
                                f"{len(sources)} module(s))")
    quota = _allocate(n, weights, {p: len(s) for p, s in sites.items()})
    stems = _stems(sorted(set(listed or ()) | set(sources)))
    out = []
    for path in sorted(sources):
        if not quota[path]:
            continue
        sha = hashlib.sha256(sources[path].encode("utf-8")).hexdigest()
        rng = random.Random(f"kvref-generated:{seed}:{path}:{sha}")
        chosen = sorted(rng.sample(range(len(sites[path])), quota[path]))
        picked = [sites[path][i] for i in chosen]
        base = [f"gen.{stems[path]}.{s.line}.{s.operator}" for s in picked]
        for s, b in zip(picked, base):
            fid = b if base.count(b) == 1 else f"{b}.c{s.col}"
            out.append(site_fault(path, sources[path], s, fid))
    return out
