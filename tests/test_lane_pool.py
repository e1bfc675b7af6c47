"""server/lane_pool.py: a request gets the free lane whose cache holds most of its prompt; with
none free it waits; without `held_prefix` the order is first come, first served."""
from __future__ import annotations

import threading
import time

from server.lane_pool import LanePool


class Lane:
    def __init__(self, name: str, held: list[int]):
        self.name, self.held = name, held

    def held_prefix(self, prompt: list[int]) -> int:
        n = 0
        while n < min(len(self.held), len(prompt)) and self.held[n] == prompt[n]:
            n += 1
        return n


def test_the_lane_holding_the_prompt_is_chosen():
    a, b, c = Lane("a", [1, 2]), Lane("b", [5, 6, 7]), Lane("c", [])
    pool = LanePool([a, b, c])
    assert pool.take([5, 6, 7, 8]) is b
    assert pool.take([9]) is a  # nothing held anywhere: the one free longest
    pool.give(b)
    assert pool.take([5, 6]) is b and pool.free == 1


def test_without_held_prefix_first_come_first_served_and_take_waits():
    pool = LanePool(["x", "y"])
    assert pool.take([1]) == "x" and pool.take([1]) == "y" and pool.free == 0
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.take([1])))
    waiter.start()
    time.sleep(0.05)
    assert not got  # no lane free: it waits
    pool.give("x")
    waiter.join(timeout=5)
    assert got == ["x"]
