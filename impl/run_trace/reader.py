"""Streaming reader: one record at a time, each checked, errors naming the file and the line.

Memory stays bounded whatever the trace's length: the file is decompressed as a stream and
records are yielded as they are parsed. A trace whose writer was killed (no ``end`` record, a
gzip stream cut short, a half-written last line) is read up to its last complete record and
flagged :attr:`TraceReader.truncated`; everything else that is wrong (not a kvref trace, a newer
major version, a record of the wrong shape, a line that is not JSON) raises
:class:`~kvref.impl.run_trace.format.TraceFormatError`, which the CLI turns into exit status 2.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import zlib
from collections.abc import Iterator

from kvref.spec.errors import InvalidFieldError

from .format import TraceFormatError, validate_header, validate_record
from .writer import _fspath

#: the longest line a trace may hold. A step record of a large batch (ids of every scheduled
#: request, block ids, token ids of new requests) is a few MiB at most; a longer line is a corrupt
#: or hostile file, refused before it is read into memory whole (issue #15)
MAX_LINE_CHARS = 64 << 20

_GZIP_MAGIC = b"\x1f\x8b"


def _open_binary(path: str):
    f = open(path, "rb")
    magic = f.read(2)
    f.seek(0)
    if magic == _GZIP_MAGIC:
        return gzip.GzipFile(fileobj=f, mode="rb")
    if magic == b"\x28\xb5":
        f.close()
        raise TraceFormatError(f"{path}: compression", "zstd",
                               "gzip or uncompressed JSON lines (zstd needs Python >= 3.14; decompress it first)")
    return f


class TraceReader:
    """Read a run trace.

    Args:
        path: a ``*.gz`` or plain JSON-lines trace.
        validate: check every record's shape (True; False skips it for trusted traces).

    Attributes:
        header: the checked header (read on construction).
        truncated: after iterating, True when the trace ended without an ``end`` record.
        truncation: why it is considered truncated, in words.
        num_records: records read so far (header excluded).
    """

    def __init__(self, path: str | os.PathLike, validate: bool = True) -> None:
        self.path = _fspath(path)
        if type(validate) is not bool:
            raise InvalidFieldError("validate", validate, "True or False")
        self.validate = validate
        self.truncated = False
        self.truncation = ""
        self.num_records = 0
        self.end: dict | None = None
        try:
            self._raw = _open_binary(self.path)
        except OSError as exc:
            raise InvalidFieldError("path", self.path, f"a readable run trace ({exc.strerror or exc})") from exc
        self._text = io.TextIOWrapper(self._raw, encoding="utf-8", newline="\n")
        try:
            first = self._text.readline(MAX_LINE_CHARS + 1)
        except (OSError, EOFError, zlib.error, UnicodeDecodeError) as exc:
            self.close()
            raise TraceFormatError(f"{self.path}: line 1", type(exc).__name__, f"a readable trace header ({exc})") from exc
        if not first.endswith("\n"):
            self.close()
            if len(first) > MAX_LINE_CHARS:
                raise TraceFormatError(f"{self.path}: line 1", f"{len(first)}+ characters",
                                       f"a header line of at most {MAX_LINE_CHARS} characters")
            raise TraceFormatError(f"{self.path}: line 1", first[:80], "a complete header line (the file is empty or cut)")
        try:
            header = json.loads(first)
        except ValueError as exc:
            self.close()
            raise TraceFormatError(f"{self.path}: line 1", first[:80], f"a JSON header ({exc})") from exc
        try:
            self.header = validate_header(header, f"{self.path}: line 1")
        except TraceFormatError:
            self.close()
            raise

    def __enter__(self) -> TraceReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._text.close()
        except Exception:  # noqa: BLE001 - closing a broken stream
            pass

    def records(self) -> Iterator[tuple[int, dict]]:
        """Yield ``(line_number, record)``; line numbers count from 1 with the header as line 1."""
        line_no = 1
        loads = json.loads
        text = self._text
        validate = self.validate
        path = self.path
        while True:
            try:
                line = text.readline(MAX_LINE_CHARS + 1)
            except EOFError:
                self._truncate(f"the compressed stream ends early after line {line_no}")
                return
            except (OSError, zlib.error) as exc:
                raise TraceFormatError(f"{path}: line {line_no + 1}", type(exc).__name__,
                                       f"a readable compressed stream ({exc})") from exc
            if not line:
                if self.end is None:
                    self._truncate(f"no end record after line {line_no} (the recording process did not shut down cleanly)")
                return
            line_no += 1
            if len(line) > MAX_LINE_CHARS:  # a line longer than any record: not read into memory whole
                raise TraceFormatError(f"{path}: line {line_no}", f"{len(line)}+ characters",
                                       f"a record line of at most {MAX_LINE_CHARS} characters")
            if not line.endswith("\n"):
                self._truncate(f"line {line_no} is cut off")
                return
            try:
                rec = loads(line)
            except ValueError as exc:
                raise TraceFormatError(f"{path}: line {line_no}", line[:80], f"one JSON object ({exc})") from exc
            if validate:
                t = validate_record(rec, f"{path}: line {line_no}")
            else:
                t = rec.get("t") if isinstance(rec, dict) else None
            if self.end is not None:
                raise TraceFormatError(f"{path}: line {line_no}", t, "nothing after the end record")
            self.num_records += 1
            if t == "end":
                self.end = rec
            yield line_no, rec

    def check_invariants(self) -> None:
        assert not (self.truncated and self.end is not None), "a trace with an end record is not truncated"
        assert self.truncated == bool(self.truncation)
        assert self.num_records >= (self.end is not None)

    def _truncate(self, why: str) -> None:
        self.truncated = True
        self.truncation = why
