"""Memoized index lookups: the questions the drafter asks the trie, answered once per prefix.

- `has_prefix(s)`: does s occur in the corpus;
- `scan(s)`: the heaviest keys below s (match.scan_keys);
- `draft(s)`: the index's draft after a context ending in the matched suffix s: the frequency-
  weighted walk over scan(s) with the confidence cut-off, continued past the keys' end by scanning
  again from the extended text, up to `max_draft` tokens. A draft for fewer tokens is a prefix of it
  (the walk decides token by token), so one answer serves every requested length.

Tool-call traffic asks the same prefixes again and again (function names, argument keys, paths), and
a marisa predictive search costs microseconds of Python-level overhead, so answers are kept in
bounded dictionaries (oldest entries evicted first). The index is immutable once loaded, so cached
answers never go stale; a reloaded index gets a new IndexLookup.
"""
from __future__ import annotations

from ngram.index_file import NgramIndex
from ngram.match import scan_keys, walk


class IndexLookup:
    def __init__(self, index: NgramIndex, scan_limit: int, max_entries: int = 65536, max_draft: int = 16,
                 cutoff: float = 0.3, longest: int = 16):
        self.index = index
        self.scan_limit = scan_limit
        self.max_entries = max_entries
        self.max_draft, self.cutoff, self.longest = max_draft, cutoff, longest
        self._exists: dict[str, bool] = {}
        self._rows: dict[str, list] = {}
        self._drafts: dict[str, tuple] = {}

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


    def draft(self, prefix: str) -> tuple[str, list]:
        """(drafted tokens as encoded text, cumulative confidences) after `prefix` (see the module
        docstring). Callers must not mutate the list."""
        hit = self._drafts.get(prefix)
        if hit is None:
            hit = self._walk(prefix)
            _remember(self._drafts, prefix, hit, self.max_entries)
        return hit

    def _walk(self, prefix: str) -> tuple[str, list]:
        drafted, confs = walk(self.scan(prefix), len(prefix), self.max_draft, self.cutoff)
        return self.extend(prefix, drafted, confs, self.max_draft)

    def extend(self, prefix: str, drafted: str, confs: list, max_tokens: int) -> tuple[str, list]:
        """Continue a walk that stopped at the end of the keys it followed (a scan reads at most
        key_tokens - len(prefix) tokens ahead) by scanning again from the extended text."""
        while drafted and len(drafted) < max_tokens:
            # prefix + drafted occurs (the walk followed keys), so any suffix of it does too
            extended = (prefix + drafted)[-self.longest:]
            base = confs[-1]
            more, more_conf = walk(self.scan(extended), len(extended), max_tokens - len(drafted), self.cutoff / base)
            if not more:
                break
            drafted += more
            confs = confs + [base * c for c in more_conf]
        return drafted, confs


def _remember(cache: dict, key, value, limit: int) -> None:
    if len(cache) >= limit:
        del cache[next(iter(cache))]  # dicts keep insertion order: this is the oldest entry
    cache[key] = value
