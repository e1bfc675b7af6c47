"""The online overlay: completions served since the index was built, in memory, searched per step.

Contract: `overlay.add(encoded_text)` appends one completion (encoded tokens, see ngram.codec);
`overlay.match(tail, min_match, max_match, max_occurrences, ahead)` returns (k, rows) like the live
context source: k is the longest suffix of `tail` (k >= KEY_TOKENS) that occurs in the overlay, rows
are (matched k tokens + up to `ahead` following tokens, weight) for up to `max_occurrences` of its most
recent occurrences, sorted for `match.walk`. Completions never run into each other (a separator that
no token encodes to sits between them).

Memory is bounded: past `max_tokens` the older half is dropped and the position map rebuilt, so the
amortized cost of `add` stays linear in what is added. Lookups go through a map from the last
KEY_TOKENS tokens to the offsets that follow them, so their cost does not grow with the overlay.
The overlay lives in the server process only; nothing in it is written anywhere.
"""
from __future__ import annotations

import threading

from ngram.match import overlay_rows

KEY_TOKENS = 3
SEPARATOR = chr(0x10FFFF)  # above every code point ngram.codec produces
_MAX_CANDIDATES = 16  # most recent occurrences of the last KEY_TOKENS tokens examined


class Overlay:
    def __init__(self, max_tokens: int = 262_144):
        self.max_tokens = max_tokens
        self._text = ""
        self._after: dict[str, list[int]] = {}
        self._lock = threading.Lock()  # add() may come from another thread than match()

    def __len__(self) -> int:
        return len(self._text)

    def add(self, encoded: str) -> None:
        if len(encoded) < KEY_TOKENS + 1:
            return
        with self._lock:
            if len(self._text) + len(encoded) + 1 > self.max_tokens:
                keep = self._text[len(self._text) // 2 :]
                cut = keep.find(SEPARATOR)
                self._text, self._after = "", {}
                if cut >= 0:
                    self._append(keep[cut + 1 :])
            self._append(encoded + SEPARATOR)

    def _append(self, piece: str) -> None:
        start = len(self._text)
        self._text += piece
        text, after = self._text, self._after
        for i in range(max(start, KEY_TOKENS), len(text)):
            key = text[i - KEY_TOKENS : i]
            if SEPARATOR not in key:
                after.setdefault(key, []).append(i)

    def match(self, tail: str, min_match: int, max_match: int, max_occurrences: int, ahead: int) -> tuple[int, list]:
        min_match = max(min_match, KEY_TOKENS)
        if len(tail) < min_match:
            return 0, []
        offsets = self._after.get(tail[-KEY_TOKENS:])
        if not offsets:
            return 0, []
        return overlay_rows(self._text, offsets, tail, KEY_TOKENS, min_match, max_match, max_occurrences,
                            _MAX_CANDIDATES, ahead, SEPARATOR)
