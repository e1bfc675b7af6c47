"""The kept sequences of the prefix cache: token ids with their KV, least recently used first out.

Contract: `PrefixStore(budget_bytes)` holds `KeptSequence`s whose `nbytes` sum to at most the
budget. `best(prompt)` returns the kept sequence sharing the longest common prefix with the prompt
(and its length); `pop` takes one out (the caller owns its KV now); `put` keeps one, evicting the
least recently used until the budget holds (a sequence larger than the whole budget is not kept).
`hold(owner, n)` / `set_held(owner, n)` count memory a live cache keeps for the prefix cache
outside the kept sequences (the fast path's checkpoints) against the same budget.
The KV object is opaque here: each backend (server/eager_backend.py, server/fast_path.py) stores
its own kind and states its size. `record(reused, computed)` counts one request's prompt tokens
for the statistics that `/metrics`, `/health` and `usage` report.

Why the longest common prefix and not an exact match: an agent resends the whole conversation,
and a client may re-render the last assistant turn (other whitespace, a normalised tool call), so
the new prompt leaves the kept sequence somewhere inside its last turn; everything before that
point is still exact and reused.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass
class KeptSequence:
    tokens: np.ndarray   # int32 ids of the positions the KV holds, in order
    kv: object           # the backend's own state for those positions
    nbytes: int          # what the KV costs in memory (counted against the budget)
    generated: int = 0   # how many of the last tokens were generated rather than prompted


@dataclass
class PrefixStats:
    requests: int = 0
    hits: int = 0                # requests that reused at least one token
    reused_tokens: int = 0
    computed_tokens: int = 0     # prompt tokens prefilled
    evictions: int = 0
    peak_bytes: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two int arrays."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class PrefixStore:
    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self._entries: OrderedDict[int, KeptSequence] = OrderedDict()  # oldest first
        self._next = 0
        self.stats = PrefixStats()
        # Lanes serving requests at once share one store (server/cpu_backend.py): reuse, keep and
        # summary hold this lock, so a kept sequence is taken over by one request only.
        self.lock = threading.RLock()
        # Bytes live caches hold against the budget outside the kept sequences (the fast path's
        # checkpoints of the sequence it is serving, server/fast_prefix.py), by owner.
        self._held: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values())

    @property
    def held_bytes(self) -> int:
        return sum(self._held.values())

    def hold(self, owner, nbytes: int) -> bool:
        """Count `nbytes` more against the budget for `owner` (a live cache), evicting the least
        recently used kept sequences to fit; False, with nothing counted, when it cannot fit."""
        with self.lock:
            if self.held_bytes + nbytes > self.budget:  # no eviction could make room
                return False
            self._evict_to_fit(nbytes)
            self._held[id(owner)] = self._held.get(id(owner), 0) + nbytes
            self.stats.peak_bytes = max(self.stats.peak_bytes, self.bytes + self.held_bytes)
            return True

    def set_held(self, owner, nbytes: int) -> None:
        """What `owner` holds now (after it dropped some, or took a kept sequence's over); kept
        sequences are evicted, least recently used first, until the budget holds again."""
        with self.lock:
            self._held[id(owner)] = nbytes
            self._evict_to_fit(0)

    def _evict_to_fit(self, nbytes: int) -> None:
        """Evict the least recently used kept sequences until `nbytes` more fit beside what is held."""
        while self._entries and self.bytes + self.held_bytes + nbytes > self.budget:
            self._entries.popitem(last=False)
            self.stats.evictions += 1

    def entries(self) -> list[KeptSequence]:
        return list(self._entries.values())

    def best(self, prompt: np.ndarray) -> tuple[KeptSequence | None, int]:
        """The kept sequence with the longest common prefix (most recent on ties), and that length."""
        best, best_len = None, 0
        for entry in reversed(self._entries.values()):
            n = common_prefix(entry.tokens, prompt)
            if n > best_len:
                best, best_len = entry, n
        return best, best_len

    def pop(self, entry: KeptSequence) -> None:
        for key, e in self._entries.items():
            if e is entry:
                del self._entries[key]
                return
        raise KeyError("not a kept sequence of this store")

    def touch(self, entry: KeptSequence) -> None:
        """Mark as just used (moves to the back of the eviction order)."""
        for key, e in self._entries.items():
            if e is entry:
                self._entries.move_to_end(key)
                return

    def put(self, entry: KeptSequence) -> bool:
        """Keep `entry`, evicting the least recently used to fit; False when it alone exceeds the budget."""
        if entry.nbytes > self.budget - self.held_bytes or len(entry.tokens) == 0:
            return False
        self._evict_to_fit(entry.nbytes)
        self._entries[self._next] = entry
        self._next += 1
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.bytes + self.held_bytes)
        return True

    def clear(self) -> None:
        self._entries.clear()

    def reuse(self, prompt: np.ndarray, take_over, copy_prefix) -> tuple[object | None, int]:
        """(KV to start `prompt` from, how many of its tokens that KV holds) for a backend's start,
        counted by `record`; (None, 0) when nothing is shared. The longest common prefix is reused
        up to all but the prompt's last token (whose logits are needed). When the prompt holds the
        kept sequence's whole prompt (an agent's next turn, or the same prompt again: a retry), the
        kept KV is taken over with no copy (`take_over(kv, reused)` trims it and returns it: that
        sequence's continuation is replaced by the new one's, which is kept in turn when it
        finishes); otherwise `copy_prefix(kv, reused)` copies the shared part and the kept sequence
        stays for its own continuation."""
        with self.lock:
            return self._reuse(prompt, take_over, copy_prefix)

    def _reuse(self, prompt: np.ndarray, take_over, copy_prefix) -> tuple[object | None, int]:
        entry, shared = self.best(prompt)
        reused = min(shared, len(prompt) - 1)
        kv = None
        if entry is not None and reused > 0:
            if shared >= len(entry.tokens) - entry.generated:
                self.pop(entry)
                kv = take_over(entry.kv, reused)
            else:
                self.touch(entry)
                kv = copy_prefix(entry.kv, reused)
        else:
            reused = 0
        self.record(reused, len(prompt) - reused)
        return kv, reused

    def keep(self, tokens, kv, held: int, nbytes: int, generated: int) -> None:
        """A backend's finished sequence: `tokens` must be the ids of the `held` positions its KV holds."""
        tokens = np.asarray(tokens, dtype=np.int32)
        if len(tokens) != held:
            raise AssertionError(f"finish with {len(tokens)} tokens, but the cache holds {held}")
        with self.lock:
            self.put(KeptSequence(tokens.copy(), kv, nbytes, generated))

    def record(self, reused: int, computed: int) -> None:
        s = self.stats
        s.requests += 1
        s.hits += reused > 0
        s.reused_tokens += reused
        s.computed_tokens += computed

    def summary(self) -> dict:
        """What /health shows: budget, use, peak, entries, counters."""
        with self.lock:
            return {"budget_bytes": self.budget, "bytes": self.bytes, "held_bytes": self.held_bytes,
                    "entries": len(self), **self.stats.as_dict()}

