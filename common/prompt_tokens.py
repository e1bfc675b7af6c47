"""Prompt tokenization that reuses the tokens of earlier prompts: an agent resends its whole
conversation every turn, and tokenizing it again is the largest cost of a cached turn before the
model runs (about 1.5 us a token on one core of a 2-core machine here: 75 ms for a 50k-token
conversation, against a few milliseconds for the turn's new text).

Contract: `PromptTokens(tokenizer, max_chars=..., max_kept=...)`; `encode(text)` returns exactly
`tokenizer.encode(text, add_special_tokens=False)` as a list, token for token. It keeps the latest
prompts (text, ids and their cut points) while they hold at most `max_chars` characters and number at
most `max_kept`, least recently used out. A text that shares a prefix with a kept one takes the
kept ids up to the last cut point that prefix settles, and tokenizes only the rest. `summary()`:
the counts of prompts, of tokens taken from kept prompts and of tokens tokenized (for /metrics).
Thread-safe; the tokenizing itself runs outside the lock.

Why the reuse is exact: a cut point is where an added token starts, one the tokenizer matches in
the raw text (not normalized, not stripping the whitespace before it, not whole-word only): the
special tokens, and on Gemma's tokenizers the newline runs too, so that a conversation rendered as
plain text (the built-in format on the bundled Gemma 3 tokenizer) has a cut at every line. Hugging
Face tokenizers find added tokens first, leftmost-longest, and normalize and tokenize
the text between them piece by piece, each piece on its own; so the ids before an added token's
match depend only on the text before it, and the match itself on at most `margin` characters (the
longest added token) from where it starts. A cut at character c is taken when the shared prefix
reaches c + margin: every match starting at or before c then lies inside the shared text, so both
texts are cut into the same pieces up to c, and the rest is tokenized from c, starting with the
same added token (tests/test_prompt_tokens.py checks this against whole tokenization on random
texts, edits at and around every cut, and conversations as the chat formats render them).
Tokenizers without offsets (slow, Python ones) tokenize every text whole.
"""
from __future__ import annotations

import bisect
import threading
from array import array
from collections import OrderedDict

# Characters compared at a time when looking for the shared prefix (a slice comparison is a memcmp).
_CHUNK = 4096


class _Kept:
    """One prompt: its text, ids (an array: 8 bytes a token, where a list of ints takes about 36),
    and cut points (character offset, token index), ascending."""
    __slots__ = ("text", "ids", "cut_chars", "cut_tokens")

    def __init__(self, text: str, ids: array, cut_chars: array, cut_tokens: array):
        self.text, self.ids, self.cut_chars, self.cut_tokens = text, ids, cut_chars, cut_tokens


def shared_prefix(a: str, b: str) -> int:
    """The length of the longest common prefix of a and b."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i:i + _CHUNK] == b[i:i + _CHUNK]:
        i += _CHUNK
    i = min(i, n)
    lo, hi = i, min(i + _CHUNK, n)  # the first differing chunk: bisect it (shared up to lo)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[i:mid] == b[i:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PromptTokens:
    def __init__(self, tokenizer, max_chars: int = 8_000_000, max_kept: int = 32):
        self.tokenizer = tokenizer
        self.max_chars, self.max_kept = max_chars, max_kept
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.cut_ids = frozenset(i for i, t in added.items() if not t.normalized and not t.lstrip and not t.single_word)
        self.margin = max((len(t.content) for t in added.values()), default=0)
        # offsets come only from fast tokenizers; without cut tokens there is nothing to reuse
        self.reuses = bool(getattr(tokenizer, "is_fast", False)) and bool(self.cut_ids)
        self._kept: OrderedDict[int, _Kept] = OrderedDict()
        self._next_key = 0
        self._chars = 0
        self._lock = threading.Lock()
        self.prompts = self.reused_tokens = self.encoded_tokens = 0

    def encode(self, text: str) -> list[int]:
        if not self.reuses:
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            with self._lock:
                self.prompts += 1
                self.encoded_tokens += len(ids)
            return ids
        with self._lock:
            key, source, start_char, start_token = self._best_base(text)
        enc = self.tokenizer(text[start_char:], add_special_tokens=False, return_offsets_mapping=True)
        fresh, offsets = enc["input_ids"], enc["offset_mapping"]
        if source is None:
            ids, cut_chars, cut_tokens = array("l", fresh), array("q"), array("q")
        else:  # the kept prompt's ids and cut points before the cut, then the fresh ones
            k = bisect.bisect_left(source.cut_chars, start_char)
            ids = source.ids[:start_token]
            ids.extend(fresh)
            cut_chars, cut_tokens = source.cut_chars[:k], source.cut_tokens[:k]
        for j, token in enumerate(fresh):
            if token in self.cut_ids:
                cut_chars.append(start_char + offsets[j][0])
                cut_tokens.append(start_token + j)
        with self._lock:
            self.prompts += 1
            self.reused_tokens += start_token
            self.encoded_tokens += len(fresh)
            # a next turn continues its source (it holds at least the source's first half): the new
            # prompt serves every later turn the source would, so the source goes
            if source is not None and start_char >= len(source.text) // 2 and self._kept.get(key) is source:
                del self._kept[key]
                self._chars -= len(source.text)
            self._keep(_Kept(text, ids, cut_chars, cut_tokens))
        return ids.tolist()

    def summary(self) -> dict:
        with self._lock:
            return {"prompts": self.prompts, "reused_tokens": self.reused_tokens,
                    "encoded_tokens": self.encoded_tokens, "kept": len(self._kept), "kept_chars": self._chars}

    def _best_base(self, text: str) -> tuple[int | None, _Kept | None, int, int]:
        """(its key, the kept prompt, character, token) to continue `text` from: the kept prompt
        whose settled cut lies furthest in (marked most recently used); (None, None, 0, 0) where no
        kept prompt settles a cut."""
        best = (None, None, 0, 0)
        for key, kept in self._kept.items():
            settled = shared_prefix(kept.text, text) - self.margin
            i = bisect.bisect_right(kept.cut_chars, settled) - 1 if settled >= 0 else -1
            if i >= 0 and (best[1] is None or kept.cut_chars[i] > best[2]):
                best = (key, kept, kept.cut_chars[i], kept.cut_tokens[i])
        if best[0] is not None:
            self._kept.move_to_end(best[0])
        return best

    def _keep(self, kept: _Kept) -> None:
        """Keep `kept`, newest, then drop the least recently used while over a limit (a text longer
        than `max_chars` is not kept)."""
        if len(kept.text) > self.max_chars:
            return
        self._kept[self._next_key] = kept
        self._next_key += 1
        self._chars += len(kept.text)
        while self._chars > self.max_chars or len(self._kept) > self.max_kept:
            _, old = self._kept.popitem(last=False)
            self._chars -= len(old.text)
