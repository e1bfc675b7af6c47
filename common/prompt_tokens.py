"""Prompt tokenization that reuses the tokens of earlier prompts: an agent resends its whole
conversation every turn, and tokenizing it again is the largest cost of a cached turn before the
model runs (about 1-2 us a token on one core of a 2-core machine here: 65 ms for a 77k-token
conversation, against a few milliseconds for the turn's new text).

Contract: `PromptTokens(tokenizer, max_chars=..., max_kept=...)`; `encode(text)` returns exactly
`tokenizer.encode(text, add_special_tokens=False)` as a list, token for token. It keeps recent
prompts (text, ids and their cut points) while they hold at most `max_chars` characters and number at
most `max_kept`, least recently used out. A text that shares a prefix with a kept one takes the
kept ids up to the last cut point that prefix settles, and tokenizes only the rest; a text sent
again as it was takes all of them. A prompt no text could continue (no cut a margin before its end)
is not kept, and a kept prompt goes when a newer one serves every text it could (an agent's next
turn replaces the turn before; a branch keeps both). `summary()`: the counts of prompts, of tokens
taken from kept prompts and of tokens tokenized, and what is kept (for /metrics). Thread-safe; the
tokenizing itself runs outside the lock.

Why the reuse is exact: a cut point is where an added token starts, one the tokenizer matches in
the raw text (not normalized, not stripping the whitespace before it, not whole-word only). On
Gemma's tokenizers that is every added token: the special tokens, newline and tab runs, HTML-like
tags, so a conversation rendered as plain text (the built-in format on the bundled Gemma 3
tokenizer) has a cut at every line. Hugging Face tokenizers find added tokens first,
leftmost-longest, and normalize and tokenize the text between them piece by piece, each piece on
its own; so the ids before an added token's match depend only on the text before it, and the match
itself on at most `margin` characters (the longest added token) from where it starts. A cut at
character c is taken when the shared prefix reaches c + margin: every match starting at or before c
then lies inside the shared text, so both texts are cut into the same pieces up to c, and the rest
is tokenized from c, starting with the same added token. A cut is recorded only where the token's
text starts at its offset (a post-processor that trims or shifts offsets gives none).
tests/test_prompt_tokens.py checks all this against whole tokenization on random texts edited at
random places and at, just before and just after cuts, and on conversations as the chat formats
render them; with the margin removed the same check finds differences. Tokenizers without offsets
(slow, Python ones) tokenize every text whole.
"""
from __future__ import annotations

import bisect
import threading
from array import array
from collections import OrderedDict

# Characters compared at a time when looking for the shared prefix (a slice comparison is a memcmp).
_CHUNK = 4096


class _Kept:
    """One prompt: its text, ids (an array: 4 bytes a token, where a list of ints takes about 36),
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
        # token id -> its text, for the added tokens that cut (see the module's contract)
        self.cuts = {i: t.content for i, t in added.items() if not t.normalized and not t.lstrip and not t.single_word}
        self.margin = max((len(t.content) for t in added.values()), default=0)
        # offsets come only from fast tokenizers; without cut tokens there is nothing to reuse
        self.reuses = bool(getattr(tokenizer, "is_fast", False)) and bool(self.cuts)
        self._kept: OrderedDict[int, _Kept] = OrderedDict()
        self._next_key = 0
        self._chars = 0
        self._lock = threading.Lock()
        self.prompts = self.reused_tokens = self.encoded_tokens = 0

    def encode(self, text: str) -> list[int]:
        if not self.reuses:
            ids = list(self.tokenizer.encode(text, add_special_tokens=False))
            self._count(0, len(ids))
            return ids
        with self._lock:
            key, source, shared, start_char, start_token = self._best_base(text)
        if source is not None and shared == len(text) == len(source.text):  # sent again as it was
            self._count(len(source.ids), 0)
            return source.ids.tolist()
        enc = self.tokenizer(text[start_char:], add_special_tokens=False, return_offsets_mapping=True)
        fresh, offsets = enc["input_ids"], enc["offset_mapping"]
        if source is None:
            ids, cut_chars, cut_tokens = array("i", fresh), array("q"), array("q")
        else:  # the kept prompt's ids and cut points before the cut, then the fresh ones
            k = bisect.bisect_left(source.cut_chars, start_char)
            ids = source.ids[:start_token]
            ids.extend(fresh)
            cut_chars, cut_tokens = source.cut_chars[:k], source.cut_tokens[:k]
        for j, token in enumerate(fresh):
            at = start_char + offsets[j][0]
            # a cut where the token's text starts there (a tokenizer whose offsets are trimmed or
            # shifted, as some post-processors make them, gives none)
            if token in self.cuts and text.startswith(self.cuts[token], at):
                cut_chars.append(at)
                cut_tokens.append(start_token + j)
        self._count(start_token, len(fresh))
        with self._lock:
            self._keep(_Kept(text, ids, cut_chars, cut_tokens), key, source, shared)
        return ids.tolist()

    def summary(self) -> dict:
        with self._lock:
            return {"prompts": self.prompts, "reused_tokens": self.reused_tokens,
                    "encoded_tokens": self.encoded_tokens, "kept": len(self._kept), "kept_chars": self._chars}

    def _count(self, reused: int, encoded: int) -> None:
        with self._lock:
            self.prompts += 1
            self.reused_tokens += reused
            self.encoded_tokens += encoded

    def _best_base(self, text: str) -> tuple[int | None, _Kept | None, int, int, int]:
        """(its key, the kept prompt, the characters it shares with `text`, the character and token
        to continue `text` from): the kept prompt whose settled cut lies furthest in (marked most
        recently used), or (None, None, 0, 0, 0) where no kept prompt settles a cut."""
        best = (None, None, 0, 0, 0)
        for key, kept in self._kept.items():
            shared = shared_prefix(kept.text, text)
            settled = shared - self.margin
            i = bisect.bisect_right(kept.cut_chars, settled) - 1 if settled >= 0 else -1
            if i >= 0 and (best[1] is None or kept.cut_chars[i] > best[3]):
                best = (key, kept, shared, kept.cut_chars[i], kept.cut_tokens[i])
        if best[0] is not None:
            self._kept.move_to_end(best[0])
        return best

    def _keep(self, kept: _Kept, source_key: int | None, source: _Kept | None, shared: int) -> None:
        """Keep `kept`, newest, unless nothing could reuse it (no cut a margin before its end) or it
        is longer than `max_chars`; then drop its source where `kept` serves every text the source
        could (they share the source's text up to its last usable cut and a margin beyond, and `kept`
        has the same ids and cuts there), and the least recently used while over a limit."""
        if self._last_usable_cut(kept) is None or len(kept.text) > self.max_chars:
            return
        if source is not None and self._kept.get(source_key) is source:
            last = self._last_usable_cut(source)
            if last is None or shared >= last + self.margin:
                del self._kept[source_key]
                self._chars -= len(source.text)
        self._kept[self._next_key] = kept
        self._next_key += 1
        self._chars += len(kept.text)
        while self._chars > self.max_chars or len(self._kept) > self.max_kept:
            _, old = self._kept.popitem(last=False)
            self._chars -= len(old.text)

    def _last_usable_cut(self, kept: _Kept) -> int | None:
        """The last cut a text could continue `kept` from (one sharing all of it settles cuts up to
        a margin before its end), None if there is none."""
        i = bisect.bisect_right(kept.cut_chars, len(kept.text) - self.margin) - 1
        return kept.cut_chars[i] if i >= 0 else None
