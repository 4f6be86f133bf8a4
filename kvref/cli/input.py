"""Reading a JSON input file for the command line: every way it can be broken is one
:class:`~kvref.spec.errors.InvalidFieldError` naming the flag, the file and the position.

``json.loads`` fails in more ways than ``JSONDecodeError``: an integer of more than 4,300 digits
is a plain ``ValueError`` (no ``lineno``; ``kvref verify --baseline`` crashed reading the
position), nesting a few thousand levels deep is a ``RecursionError`` (a traceback from every
subcommand that reads JSON), invalid UTF-8 a ``UnicodeDecodeError`` whose text names no file.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvref.spec.errors import InvalidFieldError

#: nesting deeper than this is refused before parsing (Python's parser recurses per level)
MAX_JSON_DEPTH = 200


def read_text(flag: str, path: Any, what: str = "file") -> str:
    """The file's UTF-8 text; unreadable, a folder or not UTF-8 named with the flag."""
    if not isinstance(path, str) or not path:
        raise InvalidFieldError(flag, path, f"a {what} path")
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except IsADirectoryError:
        raise InvalidFieldError(flag, path, f"a {what}, not a folder") from None
    except OSError as exc:
        raise InvalidFieldError(flag, path, f"a readable {what} ({exc.strerror or exc})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidFieldError(f"{flag} {path}: byte {exc.start}", data[exc.start:exc.start + 4],
                                f"UTF-8 text ({exc.reason})") from None


def parse_json(flag: str, where: str, text: str) -> Any:
    """``json.loads(text)``; ``where`` (a path) and the line/column name a problem."""
    depth = _max_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise InvalidFieldError(f"{flag} {where}", f"{depth} levels of nesting",
                                f"JSON nested at most {MAX_JSON_DEPTH} deep")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidFieldError(f"{flag} {where}: line {exc.lineno} column {exc.colno}",
                                text[exc.pos:exc.pos + 20], f"JSON ({exc.msg})") from None
    except RecursionError:  # pragma: no cover - the depth check comes first
        raise InvalidFieldError(f"{flag} {where}", "deeply nested JSON", "JSON nested less deep") from None
    except ValueError as exc:  # e.g. an int of more than sys.get_int_max_str_digits() digits
        m = re.search(r"\d{1000,}", text)
        pos = _line_col(text, m.start()) if m else ""
        raise InvalidFieldError(f"{flag} {where}{pos}", (m.group(0)[:20] + "...") if m else text[:20],
                                f"JSON numbers Python can read ({exc})") from None


def read_json(flag: str, path: str, what: str = "JSON file") -> Any:
    return parse_json(flag, path, read_text(flag, path, what))


def _line_col(text: str, pos: int) -> str:
    line = text.count("\n", 0, pos) + 1
    return f": line {line} column {pos - (text.rfind(chr(10), 0, pos) + 1) + 1}"


def _max_depth(text: str) -> int:
    """Deepest ``[``/``{`` nesting outside strings (linear, no recursion)."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return 0
    depth = deepest = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest
