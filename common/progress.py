"""Start-up progress: a long phase says what it does and how long it usually takes, then keeps
saying it is alive until it ends, so a user never watches a silent terminal.

Contract: `with phase("converting the bundled model", about="about 1 min, once"):` says
"<what> (<about>) ..." on entry, "  ... <what>: <n> s" every `interval` seconds (8 s by default)
while the block runs, and "<what>: done in <t> s" on exit ("failed after <t> s" when it raises,
"interrupted after <t> s" on Ctrl-C).
Lines go to `say` (default: stderr). Standard library only, so that the Makefile can run this
file as a script before any virtual environment exists:

    python3 common/progress.py "installing torch" "about 1 min, once" -- pip install torch

runs the command with its output passed through and the same heartbeat while it is silent.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

HEARTBEAT_SECONDS = 8.0  # under the promised 10 s between lines, with room for a slow print


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class _Heartbeat:
    """A daemon thread that says "<what>: <n> s" whenever `interval` seconds pass without `touch()`."""

    def __init__(self, what: str, say: Callable[[str], None], interval: float):
        self.what, self.say, self.interval = what, say, interval
        self.start = self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"heartbeat: {what}")

    def touch(self) -> None:
        self.last = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(max(0.1, self.last + self.interval - time.monotonic())):
            if time.monotonic() - self.last >= self.interval:
                self.say(f"  ... {self.what}: {time.monotonic() - self.start:.0f} s")
                self.touch()

    def __enter__(self) -> "_Heartbeat":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@contextmanager
def phase(what: str, about: str | None = None, say: Callable[[str], None] | None = None,
          interval: float = HEARTBEAT_SECONDS) -> Iterator[_Heartbeat]:
    """The phase's heartbeat is yielded: `touch()` it when the work prints its own progress."""
    say = say or _stderr
    say(f"{what} ({about}) ..." if about else f"{what} ...")
    with _Heartbeat(what, say, interval) as beat:
        try:
            yield beat
        except KeyboardInterrupt:  # Ctrl-C (or SIGTERM, which the server turns into one): not a failure
            say(f"{what}: interrupted after {time.monotonic() - beat.start:.1f} s")
            raise
        except BaseException:
            say(f"{what}: failed after {time.monotonic() - beat.start:.1f} s")
            raise
    say(f"{what}: done in {time.monotonic() - beat.start:.1f} s")


def run_command(what: str, about: str | None, command: list[str]) -> int:
    """Run `command` as one phase; its output is passed through and resets the heartbeat."""
    with phase(what, about) as beat:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        for raw in proc.stdout:
            beat.touch()
            sys.stderr.buffer.write(raw)
            sys.stderr.flush()
        code = proc.wait()
        if code:
            raise SystemExit(code)
    return code


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--" not in args or args.index("--") not in (1, 2) or args.index("--") == len(args) - 1:
        sys.exit('usage: progress.py "what" ["about"] -- command [args...]')
    sep = args.index("--")
    sys.exit(run_command(args[0], args[1] if sep == 2 else None, args[sep + 1:]))
