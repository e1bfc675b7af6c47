"""The capture half of the learning loop: completed chat requests appended to a JSONL trace log.

Contract: `TraceLog(directory, max_bytes).append(messages, tools)` writes one line
`{"messages": [...], "tools": [...]}` (OpenAI chat format, the request's messages followed by the
assistant message as the client received it), which `index.traces` reads and `make index` indexes.
Files are `sailfish-<UTC time>-<pid>.jsonl`, created readable and writable by the user only (0600,
in a 0700 directory); a file past `max_bytes` is closed and the next line starts a new one. A
failed write is logged as a warning and never raised: capture must not fail a request. A line is
written whole or not at all (a short write is cut back off), so the file stays valid JSONL.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger("sailfish.trace_log")


class TraceLog:
    def __init__(self, directory: Path, max_bytes: int = 64 * 1024 * 1024):
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._path: Path | None = None
        self._seq = 0
        self.failed = 0

    @property
    def path(self) -> Path | None:
        return self._path

    def append(self, messages: list[dict], tools: list[dict]) -> bool:
        line = (json.dumps({"messages": messages, "tools": tools}, ensure_ascii=False) + "\n").encode()
        try:
            with self._lock:
                path = self._current(len(line))
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                try:
                    _write_whole_line(fd, line)
                finally:
                    os.close(fd)
            return True
        except Exception as e:  # capture is best effort
            self.failed += 1
            log.warning("trace log write to %s failed (%s); the request is unaffected", self.directory, e)
            return False

    def _current(self, incoming: int) -> Path:
        if self._path is None or not self._path.exists() or self._path.stat().st_size + incoming > self.max_bytes:
            if not self.directory.exists():
                self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
            self._seq += 1
            self._path = self.directory / f"sailfish-{stamp}-{os.getpid()}-{self._seq}.jsonl"
        return self._path


def _write_whole_line(fd: int, line: bytes) -> None:
    """Append `line` whole or not at all: a short write (a full disk, a file-size limit) is continued,
    and one that cannot finish is cut back off, so the log never holds a broken line for the next
    record to be glued onto. Callers hold the log's lock (the only writer of the file)."""
    start = os.fstat(fd).st_size
    done = 0
    try:
        while done < len(line):
            n = os.write(fd, line[done:])
            if n <= 0:
                raise OSError(f"wrote {done} of {len(line)} bytes")
            done += n
    except OSError:
        if done:
            os.ftruncate(fd, start)
        raise
