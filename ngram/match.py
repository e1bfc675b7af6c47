"""Pure matching kernels over encoded token text (see ngram.codec): every input explicit, no state.

Two sources of continuations:
- the index trie (`longest_index_match`, `index_continuation`): its keys are the token windows starting
  at every indexed position, so "s occurs in the corpus" == "some key starts with s". Every suffix of
  an occurring string occurs too, which makes the longest match binary-searchable.
- the live request's context (`context_match`, `context_continuation`): `str.rfind` over the encoded
  context, most recent occurrences first.

Both continue with a frequency-weighted walk over the agreeing set: at each depth the next token is the
one with the most weight among the occurrences that agreed with every token drafted so far; its
confidence is that weight over all weight that continues at that depth, multiplied along the draft;
the walk stops before the cumulative confidence would drop below the cut-off. Ties go to the token of
the earliest row: for the index, the branch marisa enumerates first (the heavier subtree); for the
context, the most recent occurrence. Results are deterministic for a given index and context.

`prompt_lookup` is transformers' `prompt_lookup_num_tokens` algorithm (the baseline drafter).
"""
from __future__ import annotations

import numpy as np

from ngram.codec import decode_char


def longest_index_match(trie, text: str, min_len: int, max_len: int, upper_hint: int | None = None) -> int:
    """Largest k in [min_len, max_len] such that text[-k:] occurs in the index; 0 if none.

    `upper_hint`: a known upper bound on the answer (a session knows one: the previous match plus the
    tokens appended since); probing it first makes the common, still-matching case one lookup.
    """
    hi = min(max_len, len(text), upper_hint if upper_hint is not None else max_len)
    lo = min_len
    if hi < lo:
        return 0
    if trie.has_keys_with_prefix(text[-hi:]):
        return hi
    if not trie.has_keys_with_prefix(text[-lo:]):
        return 0
    hi -= 1
    while lo < hi:  # invariant: text[-lo:] occurs, text[-(hi+1):] does not
        mid = (lo + hi + 1) // 2
        if trie.has_keys_with_prefix(text[-mid:]):
            lo = mid
        else:
            hi = mid - 1
    return lo


def scan_keys(trie, counts, prefix: str, scan_limit: int) -> list[tuple[str, int]]:
    """(key, frequency) for up to `scan_limit` keys that extend `prefix` by at least one token.

    The trie is built with key frequencies as weights, so marisa enumerates heavier branches first and
    a capped scan keeps the bulk of the distribution. Empty when `prefix` does not occur (or only at
    the very end of keys).
    """
    start = len(prefix)
    rows: list[tuple[str, int]] = []
    for key, key_id in trie.iteritems(prefix):
        if len(key) > start:
            rows.append((key, int(counts[key_id])))
            if len(rows) >= scan_limit:
                break
    return rows


def index_continuation(
    trie, counts, prefix: str, max_tokens: int, cutoff: float, scan_limit: int
) -> tuple[list[int], list[float]]:
    """Frequency-weighted continuation of `prefix` from the keys below it."""
    return walk(scan_keys(trie, counts, prefix, scan_limit), len(prefix), max_tokens, cutoff)


def walk(rows: list[tuple[str, int]], depth: int, max_tokens: int, cutoff: float) -> tuple[list[int], list[float]]:
    """The agreeing-set walk over (text, weight) rows, all of which agree up to `depth`."""
    tokens: list[int] = []
    confs: list[float] = []
    conf = 1.0
    while rows and len(tokens) < max_tokens:
        if len(rows) == 1:  # one continuation left: it is certain given the rows seen
            take = rows[0][0][depth : depth + max_tokens - len(tokens)]
            tokens.extend(decode_char(ch) for ch in take)
            confs.extend([conf] * len(take))
            break
        tally: dict[str, int] = {}
        total = 0
        for text, weight in rows:
            ch = text[depth]
            tally[ch] = tally.get(ch, 0) + weight
            total += weight
        if len(tally) == 1:
            best = text[depth]
        else:
            best = max(tally, key=tally.__getitem__)  # ties: the first row's token (see module doc)
            conf *= tally[best] / total
            if conf < cutoff:
                break
        tokens.append(decode_char(best))
        confs.append(conf)
        depth += 1
        if len(tally) == 1:
            rows = [r for r in rows if len(r[0]) > depth]
        else:
            rows = [r for r in rows if r[0][depth - 1] == best and len(r[0]) > depth]
    return tokens, confs


def context_match(text: str, min_len: int, max_len: int, max_occurrences: int) -> tuple[int, list[int]]:
    """Longest k in [min_len, max_len] such that text[-k:] also occurs ending before the last token.

    Returns (k, starts): start offsets of the continuation after up to `max_occurrences` earlier
    occurrences, most recent first. (0, []) when nothing of length >= min_len matches.
    """
    n = len(text)
    hi = min(max_len, n - 1)
    lo = min_len
    if hi < lo or text.rfind(text[-lo:], 0, n - 1) < 0:
        return 0, []
    while lo < hi:  # invariant: text[-lo:] occurs earlier
        mid = (lo + hi + 1) // 2
        if text.rfind(text[-mid:], 0, n - 1) >= 0:
            lo = mid
        else:
            hi = mid - 1
    pattern = text[-lo:]
    starts: list[int] = []
    end = n - 1
    while len(starts) < max_occurrences:
        at = text.rfind(pattern, 0, end)
        if at < 0:
            break
        starts.append(at + lo)
        end = at + lo - 1
    return lo, starts


def context_continuation(
    text: str, starts: list[int], max_tokens: int, cutoff: float
) -> tuple[list[int], list[float]]:
    """Walk forward from the occurrences' continuation offsets (most recent first)."""
    rows = [(text[s : s + max_tokens], 1) for s in starts]
    rows = [(t, w) for t, w in rows if t]
    return walk(rows, 0, max_tokens, cutoff)


def prompt_lookup(ctx: np.ndarray, max_tokens: int, max_ngram: int = 2) -> list[int]:
    """transformers' PromptLookupCandidateGenerator: the earliest occurrence of the last n-gram
    (n = max_ngram down to 1) that has a continuation; its next `max_tokens` tokens, else nothing."""
    n = ctx.shape[0]
    for size in range(min(max_ngram, n - 1), 0, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ctx, size)
        hits = np.flatnonzero((windows == ctx[n - size :]).all(axis=1))
        for idx in hits:
            start = int(idx) + size
            end = min(start + max_tokens, n)
            if start < end:
                return ctx[start:end].tolist()
    return []
