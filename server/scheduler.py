"""A fair FIFO queue in front of the synchronous engine.

Contract: one worker thread runs jobs one at a time in arrival order, so each request sees the
engine exactly as it would alone (its output is identical to a solo run). `Scheduler.submit(work)`
returns a `Job`; `work(cancelled)` is a synchronous callable returning an iterator (the engine's
`generate`), run on the worker thread; `async for item in job` receives what it yields, in order,
and re-raises what it raises. `job.cancel()` (a client disconnected) drops a job still waiting and
stops a running one at its next step: the worker checks the flag between items and also hands it
to the engine as its `cancelled` callback.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any, Callable, Iterator

_ITEM, _END = 0, 1


class Job:
    def __init__(self, work: Callable[[Callable[[], bool]], Iterator[Any]], loop: asyncio.AbstractEventLoop):
        self.work = work
        self.loop = loop
        self.items: asyncio.Queue = asyncio.Queue()
        self._cancel = threading.Event()
        self.submitted = time.perf_counter()
        self.started: float | None = None      # perf_counter when the worker picked it up

    def cancel(self) -> None:
        self._cancel.set()

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


class Scheduler:
    def __init__(self) -> None:
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.waiting = 0
        self.running = 0

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="sailfish-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=30)
            self._thread = None

    def submit(self, work: Callable[[Callable[[], bool]], Iterator[Any]]) -> Job:
        job = Job(work, asyncio.get_running_loop())
        self.waiting += 1
        self._queue.put(job)
        return job

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            self.waiting -= 1
            if job.cancelled:
                job._put(_END, None)
                continue
            self.running = 1
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
                self.running = 0
            job._put(_END, error)
