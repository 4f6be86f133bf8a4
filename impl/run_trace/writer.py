"""Streaming writer: JSON lines, gzip-compressed in a background thread, readable while written.

Recording runs inside vLLM's engine-core process, on the thread that calls ``schedule()``; that
thread must pay as little as possible. It encodes each record as one JSON line (C code, a few
tens of microseconds for a 128-request step) and appends it to a buffer; every ``chunk_records``
lines the buffer goes to a writer thread that compresses and writes it. zlib releases the GIL
while it deflates, so compression runs beside the engine thread. (Encoding in the writer thread
was tried and measured worse: the C JSON encoder holds the GIL, and the engine thread then waits
for it in switch-interval slices — a convoy that cost more than the encoding.) Each chunk ends with
a zlib sync flush, so a reader can read every complete chunk of a trace that is still being
written or whose process was killed (the reader then reports the trace as truncated). The queue to the writer thread is
bounded: if the disk cannot keep up, the engine thread waits rather than memory growing.
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
import zlib
from typing import Any

from kvref.spec.errors import InvalidFieldError

from .format import validate_header

_dumps = json.JSONEncoder(separators=(",", ":")).encode


def compression_for(path: str) -> str:
    """``"gzip"`` for ``*.gz``, ``"none"`` for ``*.jsonl`` / anything else without a known suffix."""
    if not isinstance(path, str):
        raise InvalidFieldError("path", path, "a file path (str)")
    if path.endswith(".zst") or path.endswith(".zstd"):
        raise InvalidFieldError("path", path, "a *.gz (gzip) or uncompressed path: zstd is not in Python's "
                                "standard library before 3.14, and kvref's trace format is stdlib-only")
    return "gzip" if path.endswith(".gz") else "none"


def _fspath(path: object) -> str:
    """``os.fspath`` for a file path; bytes paths and other objects are input errors."""
    try:
        out = os.fspath(path)
    except TypeError:
        out = None
    if not isinstance(out, str) or not out or "\x00" in out:
        raise InvalidFieldError("path", path, "a file path (str or os.PathLike)")
    return out


class TraceWriter:
    """Write one run trace.

    Args:
        path: output file; ``*.gz`` is gzip-compressed, anything else is plain JSON lines.
        header: the header object (checked with the reader's own validation before anything runs).
        compresslevel: zlib level (1: fastest; traces compress about 10x even so).
        chunk_records: buffered lines handed to the writer thread at a time.
        background: compress and write in a thread (False: inline, for tests and tools).
        flush_seconds: also hand over the buffer when this long passed since the last hand-over
            (checked on :meth:`tick`), so a quiet server's trace is readable within seconds.
    """

    def __init__(self, path: str | os.PathLike, header: dict, *, compresslevel: int = 1,
                 chunk_records: int = 256, background: bool = True, flush_seconds: float = 2.0) -> None:
        self.path = _fspath(path)
        validate_header(header, self.path)
        if type(compresslevel) is not int or not 0 <= compresslevel <= 9:
            raise InvalidFieldError("compresslevel", compresslevel, "an int in [0, 9]")
        if type(chunk_records) is not int or chunk_records < 1:
            raise InvalidFieldError("chunk_records", chunk_records, "a positive int")
        if type(flush_seconds) not in (int, float) or not 0 < flush_seconds < float("inf"):
            raise InvalidFieldError("flush_seconds", flush_seconds, "a finite number of seconds > 0")
        if type(background) is not bool:
            raise InvalidFieldError("background", background, "True or False")
        self._compressor = (zlib.compressobj(compresslevel, zlib.DEFLATED, 31)
                            if compression_for(self.path) == "gzip" else None)
        try:
            self._file = open(self.path, "wb")
        except OSError as exc:
            raise InvalidFieldError("path", self.path, f"a writable file path ({exc.strerror or exc})") from exc
        self._buf: list[str] = []  # encoded lines not yet handed to the writer
        self._chunk_records = chunk_records
        self._flush_seconds = flush_seconds
        self._last_flush = time.monotonic()
        self.num_records = 0
        self.closed = False
        self._error: BaseException | None = None
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        if background:
            self._queue = queue.Queue(maxsize=8)
            self._thread = threading.Thread(target=self._run, name="kvref-trace-writer", daemon=True)
            self._thread.start()
        self._buf.append(_dumps(header))

    # ---- engine-thread side -------------------------------------------------------------------
    def write(self, record: dict[str, Any]) -> None:
        """Append one record (a JSON-serialisable dict with a type ``"t"``)."""
        if type(record) is not dict:
            raise InvalidFieldError("record", record, 'a JSON-serialisable dict with a type "t"')
        try:
            line = _dumps(record)
        except (TypeError, ValueError) as exc:
            raise InvalidFieldError("record", record, f'a JSON-serialisable dict with a type "t" ({exc})') from exc
        self.write_line(line)

    def write_line(self, line: str) -> None:
        """Append one record already encoded as a JSON object on one line."""
        if type(line) is not str or "\n" in line:
            raise InvalidFieldError("line", line, "one JSON object on one line (str, no newline)")
        buf = self._buf
        buf.append(line)
        self.num_records += 1
        if len(buf) >= self._chunk_records:
            self._hand_over()

    def tick(self) -> None:
        """Hand over the buffer if ``flush_seconds`` passed (cheap; call once per step)."""
        if self._buf and time.monotonic() - self._last_flush >= self._flush_seconds:
            self._hand_over()

    def flush(self) -> None:
        """Everything written so far reaches the file (waits for the writer thread)."""
        self._hand_over()
        if self._queue is not None:
            self._queue.join()
        self._raise_pending()

    def close(self, end: dict[str, Any] | None = None) -> None:
        """Write ``end`` (if given), flush, finish the gzip stream and close. Idempotent."""
        if self.closed:
            return
        if end is not None:
            self.write(end)
        self._hand_over()
        if self._queue is not None:
            self._queue.put(None)
            assert self._thread is not None
            self._thread.join()
        try:
            self._raise_pending()
            if self._compressor is not None:
                self._file.write(self._compressor.flush(zlib.Z_FINISH))
        finally:
            self.closed = True
            self._file.close()

    def _hand_over(self) -> None:
        self._raise_pending()
        if not self._buf:
            return
        data = self._buf
        self._buf = []
        self._last_flush = time.monotonic()
        if self._queue is not None:
            self._queue.put(data)
        else:
            self._write_chunk(data)

    def _raise_pending(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise OSError(f"kvref trace writer could not write {self.path}: {err}") from err

    # ---- writer-thread side -------------------------------------------------------------------
    def _write_chunk(self, lines: list[str]) -> None:
        raw = ("\n".join(lines) + "\n").encode()
        if self._compressor is not None:
            raw = self._compressor.compress(raw) + self._compressor.flush(zlib.Z_SYNC_FLUSH)
        self._file.write(raw)
        self._file.flush()

    def _run(self) -> None:
        assert self._queue is not None
        while True:
            data = self._queue.get()
            try:
                if data is None:
                    return
                if self._error is None:
                    self._write_chunk(data)
            except BaseException as exc:  # noqa: BLE001 - surfaced on the engine thread
                self._error = exc
            finally:
                self._queue.task_done()

    def check_invariants(self) -> None:
        assert len(self._buf) < self._chunk_records + 1, "buffer past its hand-over size"
        assert not self.closed or self._file.closed
        if self._thread is not None:
            assert self.closed or self._thread.is_alive()
