"""Memoized index lookups: the two questions the drafter asks the trie, answered once per prefix.

Tool-call traffic asks the same prefixes again and again (function names, argument keys, paths), and
a marisa predictive search costs microseconds of Python-level overhead, so answers are kept in two
bounded dictionaries (oldest entries evicted first). The index is immutable once loaded, so cached
answers never go stale; a reloaded index gets a new IndexLookup.
"""
from __future__ import annotations

from ngram.index_file import NgramIndex
from ngram.match import scan_keys


class IndexLookup:
    def __init__(self, index: NgramIndex, scan_limit: int, max_entries: int = 65536):
        self.index = index
        self.scan_limit = scan_limit
        self.max_entries = max_entries
        self._exists: dict[str, bool] = {}
        self._rows: dict[str, list] = {}

    def has_prefix(self, prefix: str) -> bool:
        hit = self._exists.get(prefix)
        if hit is None:
            hit = next(self.index.trie.iterkeys(prefix), None) is not None
            _remember(self._exists, prefix, hit, self.max_entries)
        return hit

    def scan(self, prefix: str) -> list[tuple[str, int]]:
        """(key, frequency) rows below `prefix` (see match.scan_keys). Callers must not mutate them."""
        rows = self._rows.get(prefix)
        if rows is None:
            rows = scan_keys(self.index.trie, self.index.counts, prefix, self.scan_limit)
            _remember(self._rows, prefix, rows, self.max_entries)
        return rows


def _remember(cache: dict, key, value, limit: int) -> None:
    if len(cache) >= limit:
        del cache[next(iter(cache))]  # dicts keep insertion order: this is the oldest entry
    cache[key] = value
