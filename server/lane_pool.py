"""Which lane serves a request: the free one whose cache already holds most of its prompt.

Contract: `LanePool(lanes)` holds the engine's backend lanes (one per request running at once).
`take(prompt_ids)` blocks until a lane is free, then returns the free lane with the longest
`lane.held_prefix(prompt_ids)` (how many of the prompt's first tokens its cache holds in place; a
backend without the method counts 0), on ties the one that has been free longest; `give(lane)`
returns it. `free` counts the free lanes.

Why: a lane of the GPU fast path keeps its last sequence live in its own cache
(server/fast_prefix.py), so an agent's next turn resumes there in place; on another lane it would
be prefilled again, or copied from the kept sequences once its lane had moved on. The CPU int8
path's lanes keep finished sequences in their shared store (server/cpu_backend.py), so for them
the order is plain first come, first served.
"""
from __future__ import annotations

import threading


class LanePool:
    def __init__(self, lanes: list):
        self._free = list(lanes)  # longest free first
        self._cv = threading.Condition()

    @property
    def free(self) -> int:
        with self._cv:
            return len(self._free)

    def take(self, prompt_ids: list[int]):
        with self._cv:
            while not self._free:
                self._cv.wait()
            best = max(range(len(self._free)), key=lambda i: (_held(self._free[i], prompt_ids), -i))
            return self._free.pop(best)

    def give(self, lane) -> None:
        with self._cv:
            self._free.append(lane)
            self._cv.notify()


def _held(lane, prompt_ids: list[int]) -> int:
    held = getattr(lane, "held_prefix", None)
    return held(prompt_ids) if held is not None else 0
