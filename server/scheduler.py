"""A fair FIFO queue in front of the engine, with as many workers as the engine runs requests at once.

Contract: `Scheduler(workers=1, max_waiting=64)`: `workers` threads each run one job at a time,
taking jobs in arrival order (the engine's `parallel` lanes: server/engine.py; each request's
output is the one it gets alone, server/batcher.py says why). `Scheduler.submit(work)` returns a
`Job`, or raises `QueueFull` when `workers + max_waiting` jobs are already running or waiting (the
server answers 429 with Retry-After): a job an idle worker is about to take does not count against
`max_waiting`, so `max_waiting=0` still runs `workers` jobs at once. `work(cancelled)` is a
synchronous callable returning an iterator (the engine's `generate`), run on a worker thread;
`async for item in job` receives what it yields, in order, and re-raises what it raises.
`job.cancel()` (a client disconnected) drops a job still waiting at once (its slot is free for the
next request, and its iteration ends) and stops a running one at its next step: the worker checks
the flag between items and also hands it to the engine as its `cancelled` callback; the other jobs
never notice. `running` and `waiting` count the jobs of each kind. `cancel_all()` (the server is
stopping) cancels every job and makes `submit` raise `ShuttingDown` from then on.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any, Callable, Iterator

_ITEM, _END = 0, 1
# A job's state, changed only under its scheduler's lock: it waits in the queue, a worker runs it,
# or it left the queue without running (cancelled while waiting) or ended.
WAITING, RUNNING, DONE = "waiting", "running", "done"


class Job:
    def __init__(self, work: Callable[[Callable[[], bool]], Iterator[Any]], loop: asyncio.AbstractEventLoop,
                 on_cancel: Callable[["Job"], None] | None = None):
        self.work = work
        self.loop = loop
        self.items: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()
        self._on_cancel = on_cancel
        self.state = WAITING
        self.submitted = time.perf_counter()
        self.started: float | None = None      # perf_counter when the worker picked it up

    def cancel(self) -> None:
        self._cancel.set()
        if self._on_cancel is not None:
            self._on_cancel(self)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def _put(self, kind: int, value: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, (kind, value))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancel()

    def __aiter__(self):
        return self

    async def __anext__(self):
        kind, value = await self.items.get()
        if kind == _ITEM:
            return value
        self.items.put_nowait((kind, value))  # stay finished on further calls
        if value is not None:
            raise value
        raise StopAsyncIteration


class QueueFull(Exception):
    """More requests wait than the scheduler admits."""


class ShuttingDown(Exception):
    """The server is stopping: no new request is taken."""


class Scheduler:
    def __init__(self, workers: int = 1, max_waiting: int = 64) -> None:
        self.workers, self.max_waiting = max(1, int(workers)), int(max_waiting)
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        # Reentrant: cancel_all runs in a signal handler, on the event loop's thread, which may be
        # inside submit's `with self._lock` when the signal lands.
        self._lock = threading.RLock()
        self.waiting = 0
        self.running = 0
        self._live: set[Job] = set()  # submitted and not yet ended: what cancel_all stops
        self.stopping = False         # cancel_all was called: the server is shutting down

    def start(self) -> None:
        if not self._threads:
            self._threads = [threading.Thread(target=self._run, name=f"sailfish-engine-{i}", daemon=True)
                             for i in range(self.workers)]
            for t in self._threads:
                t.start()

    def stop(self) -> None:
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join(timeout=30)
        self._threads = []

    def submit(self, work: Callable[[Callable[[], bool]], Iterator[Any]]) -> Job:
        job = Job(work, asyncio.get_running_loop(), on_cancel=self._drop_waiting)
        with self._lock:
            if self.stopping:
                raise ShuttingDown("the server is shutting down")
            # Jobs past the idle workers are the ones that wait: waiting + running - workers of them.
            if self.waiting + self.running >= self.workers + self.max_waiting:
                raise QueueFull(f"{self.waiting + self.running - self.workers} requests are waiting "
                                f"(at most {self.max_waiting}) and {self.running} running")
            self.waiting += 1
            self._live.add(job)
        self._queue.put(job)
        return job

    def _drop_waiting(self, job: Job) -> None:
        """A cancelled job that has not started leaves the count and ends now; the worker that later
        takes it from the queue skips it."""
        with self._lock:
            if job.state != WAITING:
                return
            job.state = DONE
            self.waiting -= 1
            self._live.discard(job)
        job._put(_END, None)

    def cancel_all(self) -> None:
        """Cancel every waiting and running request (the server is stopping): each running one ends
        at its next step, so shutting down does not wait for whole generations."""
        with self._lock:
            self.stopping = True
            live = list(self._live)
        for job in live:
            job.cancel()

    def retry_after(self) -> int:
        """Seconds a refused client should wait: about one request's turn per waiting batch."""
        return max(1, -(-self.waiting // self.workers))

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if job.cancelled:   # dropped while it waited, or its cancel has yet to drop it: one of us does
                self._drop_waiting(job)
                continue
            with self._lock:
                if job.state != WAITING:   # dropped since (`_drop_waiting`)
                    continue
                self.waiting -= 1
                job.state = RUNNING
                self.running += 1
            job.started = time.perf_counter()
            error = None
            try:
                it = job.work(lambda: job.cancelled)
                try:
                    for item in it:
                        job._put(_ITEM, item)
                        if job.cancelled:
                            break
                finally:
                    close = getattr(it, "close", None)
                    if close is not None:
                        close()
            except BaseException as e:  # handed to the request; the worker keeps serving
                error = e
            finally:
                with self._lock:
                    self.running -= 1
            self._ended(job, error)

    def _ended(self, job: Job, error: BaseException | None) -> None:
        with self._lock:
            job.state = DONE
            self._live.discard(job)
        job._put(_END, error)
