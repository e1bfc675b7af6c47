"""server/scheduler.py's admission and counts, on its own (real threads, no model): a burst at idle
workers is admitted up to workers + max_waiting, max_waiting=0 still runs every worker, a job
cancelled while it waits frees its slot at once and ends, and the counts return to zero."""
from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from server.scheduler import QueueFull, Scheduler


def _held(release: threading.Event, started: list):
    """work for a job: says it started, then yields one item once `release` is set."""
    def work(cancelled):
        started.append(1)
        release.wait(30)
        yield "done"
    return work


async def _drain(job) -> list:
    return [item async for item in job]


def _run(workers: int, max_waiting: int, body) -> Any:
    """asyncio.run(body(scheduler, release, started)) on a started Scheduler, stopped after; `release`
    lets held jobs finish (set on the way out too), `started` counts the jobs that began running."""
    async def main():
        scheduler = Scheduler(workers, max_waiting)
        scheduler.start()
        release, started = threading.Event(), []
        try:
            return await body(scheduler, release, started)
        finally:
            release.set()
            scheduler.stop()
    return asyncio.run(main())


async def _one_running(scheduler: Scheduler, release: threading.Event, started: list):
    """A job submitted and held running on a worker."""
    job = scheduler.submit(_held(release, started))
    while not started:
        await asyncio.sleep(0.01)
    return job


def _burst(workers: int, max_waiting: int, jobs: int) -> tuple[int, int]:
    """Submit `jobs` jobs at once to idle workers: (admitted, refused); every admitted one finishes."""
    async def body(scheduler, release, started):
        admitted, refused = [], 0
        for _ in range(jobs):
            try:
                admitted.append(scheduler.submit(_held(release, started)))
            except QueueFull:
                refused += 1
        release.set()
        assert [await _drain(job) for job in admitted] == [["done"]] * len(admitted)
        assert scheduler.waiting == 0 and scheduler.running == 0
        return len(admitted), refused
    return _run(workers, max_waiting, body)


@pytest.mark.parametrize("workers,max_waiting", [(4, 2), (4, 0), (1, 1), (2, 5)])
def test_a_burst_at_idle_workers_is_admitted_up_to_workers_plus_max_waiting(workers, max_waiting):
    """Jobs bound for idle workers do not count against max_waiting (they used to: 4 idle workers
    with max_waiting 2 admitted 2 of 4 jobs sent at once, and max_waiting 0 refused every job)."""
    jobs = workers + max_waiting + 3
    assert _burst(workers, max_waiting, jobs) == (workers + max_waiting, 3)


def test_a_job_cancelled_while_waiting_frees_its_slot_and_ends():
    async def body(scheduler, release, started):
        running = await _one_running(scheduler, release, started)
        waiting = scheduler.submit(_held(release, started))
        with pytest.raises(QueueFull):
            scheduler.submit(_held(release, started))
        assert (scheduler.running, scheduler.waiting) == (1, 1)
        waiting.cancel()   # its client went away
        assert scheduler.waiting == 0
        assert await asyncio.wait_for(_drain(waiting), 5) == []   # it ends without running
        replacement = scheduler.submit(_held(release, started))   # the slot is free again
        waiting.cancel()   # a second cancel changes nothing
        assert (scheduler.running, scheduler.waiting) == (1, 1)
        release.set()
        assert await _drain(running) == ["done"] and await _drain(replacement) == ["done"]
        assert len(started) == 2   # the cancelled job never ran
        assert (scheduler.running, scheduler.waiting) == (0, 0)
    _run(1, 1, body)


def test_cancel_all_ends_waiting_jobs_at_once():
    async def body(scheduler, release, started):
        running = await _one_running(scheduler, release, started)
        waiting = [scheduler.submit(_held(release, started)) for _ in range(3)]
        scheduler.cancel_all()
        assert scheduler.waiting == 0
        assert [await asyncio.wait_for(_drain(job), 5) for job in waiting] == [[], [], []]
        release.set()
        assert await _drain(running) == ["done"]   # a running job ends at its next item
        assert len(started) == 1 and scheduler.running == 0
    _run(1, 4, body)
