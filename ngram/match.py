"""Pure matching kernels over encoded token text (see ngram.codec): every input explicit, no state.

Two sources of continuations:
- the index trie (`longest_index_match`, `scan_keys`): its keys are the token windows starting
  at every indexed position, so "s occurs in the corpus" == "some key starts with s". Every suffix of
  an occurring string occurs too, which makes the longest match binary-searchable.
- the live request's context (`context_match`, `context_rows`): `str.rfind` over the encoded
  context, most recent occurrences first.

Both continue with a frequency-weighted walk over the agreeing set: at each depth the next token is the
one with the most weight among the occurrences that agreed with every token drafted so far; its
confidence is that weight over all weight that continues at that depth, multiplied along the draft;
the walk stops before the cumulative confidence would drop below the cut-off. Ties go to the lower token
id (index) or to the most recent occurrence (context), so results are deterministic.

`prompt_lookup` is transformers' `prompt_lookup_num_tokens` algorithm (the baseline drafter).

`walk`, `follow_rows`, `context_match`, `context_rows` and `overlay_rows` run as C when the extension
ngram/_speedups.c is built (pip install builds it where a compiler exists): an exact port, same
results bit for bit (tests/test_speedups.py), only faster. The Python definitions below are the
reference and the fallback; PYTHON_TWINS keeps them reachable either way. SAILFISH_PURE_PYTHON=1
forces the fallback.
"""
from __future__ import annotations

import numpy as np

from ngram.codec import SPEEDUPS


def longest_index_match(has_prefix, text: str, min_len: int, max_len: int, upper_hint: int | None = None) -> int:
    """Largest k in [min_len, max_len] such that text[-k:] occurs in the index (`has_prefix(s)` says
    whether some key starts with s); 0 if none.

    `upper_hint`: a known upper bound on the answer (a session knows one: the previous match plus the
    tokens appended since); probing it first makes the common, still-matching case one lookup.
    """
    hi = min(max_len, len(text), upper_hint if upper_hint is not None else max_len)
    lo = min_len
    if hi < lo:
        return 0
    if has_prefix(text[-hi:]):
        return hi
    if not has_prefix(text[-lo:]):
        return 0
    hi -= 1
    while lo < hi:  # invariant: text[-lo:] occurs, text[-(hi+1):] does not
        mid = (lo + hi + 1) // 2
        if has_prefix(text[-mid:]):
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
    rows.sort()
    return rows


def walk(rows: list[tuple[str, int]], depth: int, max_tokens: int, cutoff: float) -> tuple[str, list[float]]:
    """The agreeing-set walk over (text, weight) rows, sorted by text, all agreeing up to `depth` and
    longer than it. Returns the drafted tokens as encoded text (see ngram.codec) and their cumulative
    confidences.

    Sorted rows make two things cheap: the stretch on which all rows agree is the common prefix of
    the first and the last row, and the first row holding a tied token has the lowest token id.
    """
    stop = depth + max_tokens
    out: list[str] = []  # drafted stretches, joined at the end
    confs: list[float] = []
    conf = 1.0
    while rows and depth < stop:
        first = rows[0][0]
        if len(rows) == 1:  # one row left: it is the draft, at no cost in confidence
            piece = first[depth:stop]
            out.append(piece)
            confs += [conf] * len(piece)
            break
        last = rows[-1][0]
        end = min(len(first), len(last), stop)
        if first[depth:end] == last[depth:end]:
            same = end
        else:
            same = depth  # they differ before `end`
            while first[same] == last[same]:
                same += 1
        if same > depth:  # every row agrees here: no cost in confidence
            out.append(first[depth:same])
            confs += [conf] * (same - depth)
            depth = same
            if depth >= stop:
                break
            rows = [r for r in rows if len(r[0]) > depth]
            continue
        tally: dict[str, int] = {}
        total = 0
        for text, weight in rows:
            ch = text[depth]
            tally[ch] = tally.get(ch, 0) + weight
            total += weight
        best = max(tally, key=tally.__getitem__)  # ties: the first (lowest) token, see the docstring
        conf *= tally[best] / total
        if conf < cutoff:
            break
        out.append(best)
        confs.append(conf)
        depth += 1
        rows = [r for r in rows if r[0][depth - 1] == best and len(r[0]) > depth]
    return "".join(out), confs


def follow_rows(rows: list[tuple[str, int]], depth: int, appended: str) -> list[tuple[str, int]]:
    """The rows that continue with `appended` at `depth` and reach past it (order kept)."""
    end = depth + len(appended)
    return [r for r in rows if len(r[0]) > end and r[0][depth:end] == appended]


def context_match(text: str, min_len: int, max_len: int, max_occurrences: int, start: int = 0,
                  upper_hint: int | None = None) -> tuple[int, list[int]]:
    """Longest k in [min_len, max_len] such that text[-k:] also occurs in text[start:] ending before
    the last token.

    Returns (k, starts): start offsets of the continuation after up to `max_occurrences` earlier
    occurrences, most recent first. (0, []) when nothing of length >= min_len matches.
    `upper_hint`: a known upper bound on k (see longest_index_match); it narrows the search.
    """
    n = len(text)
    hi = min(max_len, n - start - 1, upper_hint if upper_hint is not None else max_len)
    lo = min_len
    if hi < lo:
        return 0, []
    found = text.rfind(text[-lo:], start, n - 1)  # the most recent occurrence of text[-lo:]
    if found < 0:
        return 0, []
    while lo < hi:  # invariant: text[-lo:] occurs earlier, most recently at `found`
        mid = (lo + hi + 1) // 2
        at = text.rfind(text[-mid:], start, n - 1)
        if at >= 0:
            lo, found = mid, at
        else:
            hi = mid - 1
    pattern = text[-lo:]
    starts = [found + lo]
    end = found + lo - 1
    while len(starts) < max_occurrences:
        at = text.rfind(pattern, start, end)
        if at < 0:
            break
        starts.append(at + lo)
        end = at + lo - 1
    return lo, starts


def overlay_rows(text: str, offsets: list[int], tail: str, key_tokens: int, min_match: int, max_match: int,
                 max_occurrences: int, candidates: int, ahead: int, separator: str) -> tuple[int, list]:
    """Rows for `walk` from a text searched through a map of key_tokens-grams (ngram.overlay):
    `offsets` are the positions right after occurrences of tail's last key_tokens tokens, in text
    order. The last `candidates` of them are extended backwards against `tail` (up to max_match);
    the longest extension k wins if k >= min_match, and its up to `max_occurrences` most recent
    occurrences become rows (matched k tokens + up to `ahead` tokens, cut at `separator`), weighted
    like context_rows. (0, []) when nothing qualifies."""
    found: list[tuple[int, int]] = []  # (match length, offset), most recent first
    for off in reversed(offsets[-candidates:]):
        k = key_tokens
        limit = min(max_match, off, len(tail))
        while k < limit and text[off - k - 1] == tail[-k - 1]:
            k += 1
        found.append((k, off))
    best = max(k for k, _ in found) if found else 0
    if best < min_match:
        return 0, []
    hits = [off for k, off in found if k == best][:max_occurrences]
    n = len(hits)
    rows = []
    for i, off in enumerate(hits):
        row = text[off - best : off + ahead]
        cut = row.find(separator, best)
        if cut >= 0:
            row = row[:cut]
        if len(row) > best:
            rows.append((row, RECENCY_SCALE + n - i))
    rows.sort()
    return (best, rows) if rows else (0, [])


def context_rows(text: str, starts: list[int], k: int, ahead: int) -> list[tuple[str, int]]:
    """Rows for `walk` from context occurrences (continuation offsets `starts`, most recent first):
    each row is the matched k tokens plus up to `ahead` tokens after them.

    Each occurrence weighs RECENCY_SCALE plus a bonus that is larger the more recent it is, so
    equal counts are won by the most recent occurrence while confidences stay ~count/total.
    """
    n = len(starts)
    rows = [(text[s - k : s + ahead], RECENCY_SCALE + n - i) for i, s in enumerate(starts)]
    return sorted(r for r in rows if len(r[0]) > k)


RECENCY_SCALE = 1000


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


PYTHON_TWINS = {"walk": walk, "follow_rows": follow_rows, "context_match": context_match, "context_rows": context_rows,
                "overlay_rows": overlay_rows}

if SPEEDUPS is not None:  # built, and not switched off (see ngram.codec)
    assert RECENCY_SCALE == 1000  # the C context_rows' default scale
    walk, follow_rows = SPEEDUPS.walk, SPEEDUPS.follow_rows
    context_match, context_rows = SPEEDUPS.context_match, SPEEDUPS.context_rows
    overlay_rows = SPEEDUPS.overlay_rows
