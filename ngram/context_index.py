"""The live context's position index: where each short n-gram of a request's encoded context occurs,
so that a suffix search costs the same at 100k tokens as at 4k.

Contract: `ContextIndex()` indexes one growing text (encoded tokens, see ngram.codec):
`extend(text)` indexes what `text` adds to the text indexed so far, `rewind(keep)` forgets all but
its first `keep` tokens. `candidates(text, count)` returns, for the longest key length L in
KEY_LENGTHS whose key (text's last L tokens) occurs earlier in the text, the continuation offsets
(the position right after an occurrence, before the text's end) of its up to `count` most recent
occurrences, in text order, and L; ([], 0) when none occurs. `ngram.match.overlay_rows` extends them
into a longest match and rows. `ContextIndexCache` hands a finished session's index to the next turn
of its conversation, so a turn indexes only its new tokens.

Why several key lengths: the longest match at an offset is found by extending backwards from the
occurrences of the last L tokens, but only the most recent `count` are examined. A short key (JSON
punctuation, indentation) occurs thousands of times in an agent's context, and the occurrence that
continues longest (the file a tool call now copies from, 30k tokens back) is rarely among its most
recent ones; a longer key occurs only where a long match can be. Long keys first, then shorter.

Layout. For each key length, the keys of every indexed offset i (i >= L: the code points of
text[i-L:i]; up to 3 tokens packed exactly into an int64, longer keys a 64-bit polynomial hash whose
rare collisions `candidates` filters by comparing the text; either rolls from the previous offset's
key in O(1)) live in a dict for the most recent offsets and in sorted numpy runs (by key, then
offset, so equal keys list their offsets in text order) for the rest. A decode step's few tokens go
to the dict; a new turn's prompt, or a full dict, becomes a new run. Runs merge when the request is
over (ContextIndexCache.put, off the propose path), or at once past MAX_RUNS: a run merges into the
one before it once it holds 1/RUN_RATIO of it (log-structured: run sizes fall at least fourfold from
one run to the next, so there are O(log n) runs, and a merge with the largest, O(n), is rare). A lookup is a dict probe and one binary search per
run, newest first, until enough occurrences are found.
"""
from __future__ import annotations

import threading

import numpy as np

KEY_LENGTHS = (12, 3, 2)     # longest first; the shortest bounds the shortest match found
MERGE_TOKENS = 4096          # offsets kept in the dict before they become a sorted run
RUN_RATIO = 4                # a run merges into the one before it once it holds a quarter of it
MAX_RUNS = 12                # more runs than this merge at once; otherwise between requests
_PACK_BITS = 21              # code points are < 2**21: up to 3 of them pack into an int64 exactly
_HASH_MUL = 0x100000001B3    # FNV-1a's 64-bit prime, as a polynomial base
_MASK = (1 << 64) - 1
_INT64_MAX = (1 << 63) - 1


def _code_points(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)


def _keys(cps: np.ndarray, length: int) -> np.ndarray:
    """keys[j] = the key of cps[j : j + length], for every full window (int64)."""
    n = cps.shape[0] - length + 1
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    if length <= 3:
        out = np.zeros(n, dtype=np.int64)
        for j in range(length):
            out = (out << _PACK_BITS) | cps[j : j + n]
        return out
    h = np.zeros(n, dtype=np.uint64)
    mul = np.uint64(_HASH_MUL)
    with np.errstate(over="ignore"):
        for j in range(length):
            h = h * mul + cps[j : j + n].astype(np.uint64)
    return h.view(np.int64)


def _key(tail: str, length: int) -> int:
    """The key of tail's last `length` tokens, as `_keys` computes it (a Python int in int64 range)."""
    if length <= 3:
        out = 0
        for c in tail[-length:]:
            out = (out << _PACK_BITS) | ord(c)
        return out
    h = 0
    for c in tail[-length:]:
        h = (h * _HASH_MUL + ord(c)) & _MASK
    return h - (1 << 64) if h >= 1 << 63 else h


class _KeyTable:
    """One key length's offsets: a few sorted numpy runs plus a dict of the most recent ones."""

    __slots__ = ("length", "runs", "recent", "recent_keys", "recent_start", "last", "_drop")

    def __init__(self, length: int) -> None:
        self.length = length
        # sorted runs (keys, offsets), oldest first; offsets[j] follows an occurrence of keys[j], and
        # every offset of a run is above every offset of the runs before it
        self.runs: list[tuple[np.ndarray, np.ndarray]] = []
        self.recent: dict[int, list[int]] = {}  # key -> the offsets after the runs' that follow it
        self.recent_keys: list[int] = []        # the same offsets' keys, in offset order
        self.recent_start = 0                   # the offset of recent_keys[0]
        self.last = (-1, 0)  # (offset, its key as an unsigned 64-bit int): the next key rolls from it
        # rolling a key one token on drops the oldest code point's part: a mask, or its hash term
        self._drop = ((1 << (_PACK_BITS * (length - 1))) - 1 if length <= 3
                      else pow(_HASH_MUL, length - 1, 1 << 64))

    def _roll(self, key: int, out: str, new: str) -> int:
        if self.length <= 3:  # packed: keep the newest length - 1 code points, append one
            return ((key & self._drop) << _PACK_BITS) | ord(new)
        return ((key - ord(out) * self._drop) * _HASH_MUL + ord(new)) & _MASK

    def add(self, text: str, first: int) -> None:
        """Index the offsets first .. len(text) - 1 (offset i follows text[i-L:i])."""
        length, n = self.length, len(text)
        lo = max(first, length)
        if lo >= n:
            return
        if n - lo < 64 and len(self.recent_keys) + n - lo < MERGE_TOKENS:  # a decode step's few tokens
            recent, recent_keys = self.recent, self.recent_keys
            if not recent_keys:
                self.recent_start = lo
            at, key = self.last
            for i in range(lo, n):
                key = self._roll(key, text[i - 1 - length], text[i - 1]) if at == i - 1 else _key(text[i - length : i], length) & _MASK
                at = i
                signed = key - (1 << 64) if key >> 63 else key
                recent.setdefault(signed, []).append(i)
                recent_keys.append(signed)
            self.last = (at, key)
            return
        keys = _keys(_code_points(text[lo - length : n - 1]), length)
        self.last = (n - 1, int(keys[-1]) & _MASK)
        offsets = np.arange(lo, n, dtype=np.int64)
        if self.recent_keys:  # the dict's offsets come right before these: one run for both
            keys = np.concatenate([np.array(self.recent_keys, dtype=np.int64), keys])
            offsets = np.arange(lo - len(self.recent_keys), n, dtype=np.int64)
            self.recent, self.recent_keys = {}, []
        self._push_run(keys, offsets)

    def _push_run(self, keys: np.ndarray, offsets: np.ndarray) -> None:
        """Offsets above every one indexed become the newest run. Runs merge only past MAX_RUNS (a
        request's steps stay cheap); `compact` merges them between requests."""
        order = np.argsort(keys, kind="stable")  # offsets ascend: equal keys stay in text order
        self.runs.append((keys[order], offsets[order]))
        if len(self.runs) > MAX_RUNS:
            self.compact()

    def compact(self) -> None:
        """Merge runs while the newest holds at least 1/RUN_RATIO of the one before it."""
        runs = self.runs
        while len(runs) > 1 and RUN_RATIO * len(runs[-1][0]) >= len(runs[-2][0]):
            (old_keys, old_offsets), (new_keys, new_offsets) = runs[-2], runs.pop()
            at = np.searchsorted(old_keys, new_keys, side="right")  # after equal older keys: text order kept
            runs[-1] = (np.insert(old_keys, at, new_keys), np.insert(old_offsets, at, new_offsets))

    def truncate(self, keep: int) -> None:
        """Forget the offsets from `keep` on: the text past keep is replaced, and they are indexed again."""
        if self.last[0] >= keep:
            self.last = (-1, 0)
        runs = []
        for keys, offsets in self.runs:
            mask = offsets < keep
            if mask.all():
                runs.append((keys, offsets))
            elif mask.any():
                runs.append((keys[mask], offsets[mask]))
        self.runs = runs
        if self.recent_keys:
            self.recent_keys = self.recent_keys[: max(0, keep - self.recent_start)]
            self.recent = {}
            for i, key in enumerate(self.recent_keys, self.recent_start):
                self.recent.setdefault(key, []).append(i)

    def lookup(self, key: int, count: int) -> list[int]:
        """The up to `count` most recent offsets that follow `key`, in text order."""
        found = self.recent.get(key, [])
        for keys, offsets in reversed(self.runs):  # newest first: stop once `count` are found
            if len(found) >= count:
                break
            # integer keys: key's range is [first >= key, first >= key + 1), in one call
            lo, hi = keys.searchsorted(np.array([key, key + 1]) if key < _INT64_MAX else np.array([key, key]))
            if key == _INT64_MAX:
                hi = len(keys)
            if hi > lo:
                found = offsets[max(lo, hi - (count - len(found))) : hi].tolist() + found
        return found[-count:]


class ContextIndex:
    """The tables of one text. It keeps no reference to the text (a session extends its text in
    place, which a second reference would turn into a copy per step): callers pass it in."""

    def __init__(self) -> None:
        self.length = 0  # the text indexed: offsets 0 .. length - 1
        self.tables = [_KeyTable(length) for length in KEY_LENGTHS]

    def extend(self, text: str) -> None:
        """Index text[self.length:]; `text` starts with the text indexed so far (callers know)."""
        if len(text) > self.length:
            for table in self.tables:
                table.add(text, self.length)
            self.length = len(text)

    def rewind(self, keep: int) -> None:
        """Keep the first `keep` tokens' offsets: the text past them is replaced."""
        if keep < self.length:
            for table in self.tables:
                table.truncate(keep)
            self.length = keep

    def candidates(self, text: str, count: int) -> tuple[list[int], int]:
        """See the module docstring; `text` is the indexed text (the last `extend`'s)."""
        for table in self.tables:
            length = table.length
            if len(text) < length:
                continue
            offsets = table.lookup(_key(text, length), count)
            if length > 3:  # a hash key: keep the offsets whose text really matches
                want = text[-length:]
                offsets = [o for o in offsets if text[o - length : o] == want]
            if offsets:
                return offsets, length
        return [], 0


class ContextIndexCache:
    """Finished sessions' indexes, with their final texts, for the next turn of the same conversation
    (an agent resends the conversation with the new messages appended): `take(text)` returns the
    cached index that shares the longest start with `text`, rewound to that start (it is removed from
    the cache: a session owns its index), or a new one; `put(index, text)` keeps one, dropping the
    least recently put past `size`."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._entries: list[tuple[ContextIndex, str]] = []
        self._lock = threading.Lock()  # sessions of concurrent requests may finish on other threads

    def put(self, index: ContextIndex, text: str) -> None:
        if self.size <= 0 or index.length != len(text):
            return
        for table in index.tables:
            table.compact()
        with self._lock:
            self._entries.append((index, text))
            del self._entries[: -self.size]

    def take(self, text: str) -> ContextIndex:
        with self._lock:
            best, best_shared = -1, 0
            for i, (index, cached) in enumerate(self._entries):
                shared = len(cached) if text.startswith(cached) else _common_prefix(cached, text)
                if shared > best_shared:
                    best, best_shared = i, shared
            if best < 0:
                return ContextIndex()
            index, _ = self._entries.pop(best)
        index.rewind(best_shared)
        return index


def _common_prefix(a: str, b: str) -> int:
    """len of the longest common prefix of a and b, by binary search over slice equality (memcmp)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
