"""The drafter's sources of continuations (index trie, live context, online overlay), one interface.

Contract: see `Source`. A DraftSession holds one object per source and hands it `text`, its encoded
context (only the last tokens of a long one, see ngram.drafter), and `seen`, the context tokens it
has consumed. `source.state` (a `Followed`) holds the last match's rows. Rows that still agree with
the tokens appended since are exactly the occurrences of the new, longer suffix (a match grows by at
most the appended tokens), so while some remain a search is a filter, not a lookup. Otherwise the
last match bounds the next one: every part of an occurring string occurs, so a fresh match is at
most the last one plus the appended tokens (a search that found nothing had a match below
min_match). Searches start from that bound, and the session skips a source whose bound cannot beat
its best draft. The overlay's bound is exact while the overlay is unchanged and every candidate
occurrence is examined (ngram.overlay); beyond that it is a heuristic, the one the lazy choice was
measured with.
"""
from __future__ import annotations

from typing import Protocol

from ngram.context_index import ContextIndex, ContextIndexCache
from ngram.lookup import IndexLookup
from ngram.match import context_match, context_rows, follow_rows, longest_index_match, overlay_rows, walk
from ngram.overlay import SEPARATOR, Overlay

# How far past a match a context or overlay row reaches: later steps can follow it without a search.
ROW_TOKENS = 32
# Longer contexts are searched through their position index (ngram.context_index), not scanned.
EXACT_SEARCH_TOKENS = 8192
INDEX_CANDIDATES = 32  # most recent occurrences of the key extended into a match


class Source(Protocol):
    name: str          # the Draft's source: "index", "context" or "overlay"
    state: "Followed"  # the per-session state: the last match and its rows

    # The longest match a search now could return (see the module docstring); no side effects.
    def bound(self, text: str, seen: int) -> int: ...
    # The longest suffix match now (0: none), kept in the state.
    def search(self, text: str, seen: int) -> int: ...
    # (encoded tokens, cumulative confidences) after the match `search` just returned.
    def draft(self, text: str, k: int, max_tokens: int) -> tuple[str, list]: ...
    def reset(self) -> None: ...  # a new context: forget the state
    def shift(self, dropped: int) -> None: ...  # the text lost its first `dropped` tokens
    def prepare(self, text: str) -> None: ...  # a new prompt (the session's text), before the first search
    def finish(self, text: str) -> None: ...  # the request is over; `text` is its final context


class Followed:
    """A source's last rows (continuations that agree with the context up to `depth`) and the text
    length they were valid for."""

    __slots__ = ("rows", "depth", "text_at")

    def __init__(self) -> None:
        self.rows: list = []
        self.depth = -1  # the last match length (0: none, -1: never searched), which bounds the next one
        self.text_at = 0

    def follow(self, text: str) -> tuple[int, list]:
        """(depth, rows) that still agree with `text`, (0, []) when none do; callers check for rows first."""
        appended = text[self.text_at :]
        if not appended:
            return self.depth, self.rows
        rows = follow_rows(self.rows, self.depth, appended)
        return (self.depth + len(appended), rows) if rows else (0, [])

    def keep(self, rows: list, depth: int, text_len: int) -> None:
        self.rows, self.depth, self.text_at = rows, depth, text_len

    def shift(self, dropped: int) -> None:
        self.text_at = max(0, self.text_at - dropped)


class _RowSource:
    """What the sources share: followed rows first, else `_fresh`; drafts walk the rows (match.walk)."""

    name = ""

    def __init__(self, cfg) -> None:  # cfg: a DrafterConfig
        self.state = Followed()
        self.cutoff, self.min_match, self.max_match = cfg.confidence_cutoff, cfg.min_match, cfg.max_match

    def bound(self, text: str, seen: int) -> int:
        state = self.state  # followed rows grow by at most the tokens appended since
        return state.depth + len(text) - state.text_at if state.rows else self._fresh_bound(len(text), seen)

    def search(self, text: str, seen: int) -> int:
        state = self.state
        k, rows = state.follow(text) if state.rows else (0, [])
        if not rows:
            k, rows = self._fresh(text, seen)
        state.keep(rows, k, len(text))
        return k if rows else 0

    def draft(self, text: str, k: int, max_tokens: int) -> tuple[str, list]:
        return walk(self.state.rows, k, max_tokens, self.cutoff)

    def reset(self) -> None:
        self.state = Followed()

    def shift(self, dropped: int) -> None:
        self.state.shift(dropped)

    def prepare(self, text: str) -> None:
        pass

    def finish(self, text: str) -> None:
        pass


class IndexSource(_RowSource):
    """The index trie: a fresh match is the longest one (match.longest_index_match, the bound probed
    first) and its draft IndexLookup.draft, memoized per matched suffix (tool-call traffic matches the
    same suffixes again and again); followed rows are walked, then continued past the keys' end
    (IndexLookup.extend)."""

    name = "index"

    def __init__(self, lookup: IndexLookup, longest: int, cfg) -> None:
        super().__init__(cfg)
        self.lookup, self.longest = lookup, longest
        self.fresh = False  # the last search matched anew rather than following rows

    def _fresh_bound(self, text_len: int, seen: int) -> int:
        state = self.state
        if state.depth < 0:  # never searched
            return self.longest
        return min(self.longest, max(state.depth, self.min_match - 1) + text_len - state.text_at)

    def search(self, text: str, seen: int) -> int:
        state, n = self.state, len(text)
        k, rows = state.follow(text) if state.rows else (0, [])
        self.fresh = not rows
        if rows:
            state.keep(rows, k, n)
            return k
        lookup, longest = self.lookup, self.longest
        k = longest_index_match(lookup.has_prefix, text[-longest:], self.min_match, longest,
                                min(n, self._fresh_bound(n, seen)))
        state.keep(lookup.scan(text[-k:]) if k else [], k, n)  # k is kept even when its occurrences end keys
        return k  # even with no rows: such a match still wins over shorter ones (and drafts nothing)

    def draft(self, text: str, k: int, max_tokens: int) -> tuple[str, list]:
        if self.fresh:  # a draft for fewer tokens is a prefix of the memoized one
            drafted, confs = self.lookup.draft(text[-k:])
            return drafted[:max_tokens], confs[:max_tokens]
        drafted, confs = walk(self.state.rows, k, max_tokens, self.cutoff)
        return self.lookup.extend(text[-k:], drafted, confs, max_tokens)


class ContextSource(_RowSource):
    """The request's own context, searched over its last `context_window` tokens. Up to
    EXACT_SEARCH_TOKENS of them a fresh match is an exact search (match.context_match), bounded by
    the last search's match plus the tokens seen since. Past that, the search goes through the
    text's position index (ngram.context_index, taken from the drafter's cache of finished sessions
    so that a conversation's next turn indexes only its new tokens): the longest extension among the
    most recent occurrences of the longest key that occurs (match.overlay_rows), which costs the
    same at 100k tokens as at 4k. That search is not exact, so its bound is max_match."""

    name = "context"

    def __init__(self, cfg, indexes: ContextIndexCache | None = None) -> None:
        super().__init__(cfg)
        self.window, self.occurrences = cfg.context_window, cfg.context_occurrences
        self.searched = (0, 0)  # (last search's match, tokens seen then); cutting the text back keeps it
        self.indexes = indexes if indexes is not None else ContextIndexCache(size=0)
        self.index: ContextIndex | None = None  # over the session's text, taken at the first indexed search
        self.cut_at_end = False  # a row of the last fresh search ran into the end of the text

    def reset(self) -> None:
        super().reset()
        self.searched = (0, 0)
        self.index = None  # a new text: the next indexed search takes one that fits it
        self.cut_at_end = False

    def search(self, text: str, seen: int) -> int:
        # A row that ran into the end of the text when it was found stops short of what a search
        # now would return (the text has grown past it): search again instead of following it.
        if self.cut_at_end and self.state.rows and len(text) > self.state.text_at:
            self.state.rows = []
        return super().search(text, seen)

    def shift(self, dropped: int) -> None:
        super().shift(dropped)
        self.index = None

    def prepare(self, text: str) -> None:
        if self._indexed_search(len(text)):
            self._index_of(text)

    def finish(self, text: str) -> None:
        """Hand the text's index to the next turn. A session that never searched it takes one now,
        so that the next turn's first search indexes only its new tokens, not the whole context."""
        if self.index is not None or (self._indexed_search(len(text)) and self.indexes.size):
            self.indexes.put(self._index_of(text), text)
            self.index = None

    def _indexed_search(self, text_len: int) -> bool:
        """Whether a search of a text this long goes through the position index."""
        return min(text_len, self.window) > EXACT_SEARCH_TOKENS

    def _index_of(self, text: str) -> ContextIndex:
        """The session's position index, taken from the cache if it has none yet, brought up to `text`."""
        if self.index is None:
            self.index = self.indexes.take(text)
        self.index.extend(text)
        return self.index

    def _fresh_bound(self, text_len: int, seen: int) -> int:
        if self._indexed_search(text_len):
            return self.max_match
        last_k, seen_then = self.searched
        return min(self.max_match, max(last_k, self.min_match - 1) + seen - seen_then)

    def _fresh(self, text: str, seen: int) -> tuple[int, list]:
        start = max(0, len(text) - self.window)
        if self._indexed_search(len(text)):
            k, rows = self._indexed(text, start)
        else:
            k, starts = context_match(text, self.min_match, self.max_match, self.occurrences, start,
                                      self._fresh_bound(len(text), seen))
            self.searched = (k, seen)
            rows = context_rows(text, starts, k, ROW_TOKENS) if k else []
        self.cut_at_end = any(len(row) < k + ROW_TOKENS for row, _ in rows)
        return k, rows

    def _indexed(self, text: str, start: int) -> tuple[int, list]:
        offsets, key_tokens = self._index_of(text).candidates(text, INDEX_CANDIDATES)
        if start:  # past the window: search only text[start:], as a session holding just that would
            view = text[start:]
            offsets = [o - start for o in offsets if o - start >= key_tokens]
        else:
            view = text
        if not offsets:
            return 0, []
        return overlay_rows(view, offsets, text[-self.max_match - 1 :], key_tokens, self.min_match, self.max_match,
                            self.occurrences, INDEX_CANDIDATES, ROW_TOKENS, SEPARATOR)


class OverlaySource(_RowSource):
    """The online overlay of served completions: a fresh match is Overlay.match."""

    name = "overlay"

    def __init__(self, overlay: Overlay, cfg) -> None:
        super().__init__(cfg)
        self.overlay, self.occurrences = overlay, cfg.context_occurrences

    def _fresh_bound(self, text_len: int, seen: int) -> int:
        return self.max_match  # the overlay keeps no match between searches

    def _fresh(self, text: str, seen: int) -> tuple[int, list]:
        return self.overlay.match(text[-self.max_match :], self.min_match, self.max_match, self.occurrences,
                                  ROW_TOKENS)
