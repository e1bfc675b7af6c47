"""The copy bound: the most target tokens per verify that ANY drafter copying text can reach.

Contract: `copy_bound(chains, seed_turns, max_draft, learn=False) -> ngram.replay.ReplayStats`, on the same
turns and with the same acceptance rule as `ngram.replay.replay_turn`, for a drafter that knows
the target and proposes, at each verify, the longest prefix of the true continuation (at most
`max_draft` tokens) that occurs as one contiguous run anywhere in what a training-free drafter
can copy from: the seed turns (the index) and the request's tokens so far (its context and the
tokens already generated).

Why it bounds every contender of bench.long_context: n-gram, suffix-tree and prompt-lookup
drafters (Sailfish's, SuffixDecoding, prompt lookup) all propose continuations of text they have
seen, so each draft, and each root path of a tree, is a contiguous run of that text. A draft can
be accepted only as far as it equals the target, so it is accepted no further than the longest
such run, which is what this drafter proposes; it loses nothing by proposing a chain, because a
tree's accepted path is itself one run. (Turns the drafters learned online are earlier turns of
the same chain, so inside the context already.) Where the turns are separate requests that the
drafters learn from one after another (ngram.replay.replay over BFCL's held-out turns: each turn's
completion joins the drafter's online overlay), `learn=True` counts every earlier turn, its whole
context and its target, among what can be copied: a looser bound than the drafters' own overlays
(which keep the completion and a few tokens before it), so still one no contender passes.

Runs are found by hashing every k-gram (k = 1..max_draft) with a 64-bit polynomial hash; a run
occurs in the context before position a iff its first occurrence ends at or before a.
"""
from __future__ import annotations

import numpy as np

from ngram.replay import ReplayStats

_P = np.uint64(0x100000001B3)  # FNV-style odd multiplier; uint64 arithmetic wraps
_SEPARATOR = np.int64(-7)      # between seed turns: never a token, so no run crosses it


def _kgram_hashes(tokens: np.ndarray, max_k: int) -> list[np.ndarray]:
    """hashes[k-1][j] = hash(tokens[j : j + k]) for every j with j + k <= len(tokens)."""
    t = tokens.astype(np.uint64) + np.uint64(1)
    out, h = [], t.copy()
    with np.errstate(over="ignore"):
        for k in range(1, max_k + 1):
            if k > 1:
                h = h[:-1] * _P + t[k - 1:]
            out.append(h)
    return out


def _first_end(hashes: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(sorted unique hashes, the end position of each one's first occurrence)."""
    values, first = np.unique(hashes, return_index=True)
    return values, first + k


def _lookup(values: np.ndarray, payload: np.ndarray, keys: np.ndarray, missing: int) -> np.ndarray:
    at = np.minimum(np.searchsorted(values, keys), max(len(values) - 1, 0))
    found = values[at] == keys if len(values) else np.zeros(len(keys), bool)
    return np.where(found, payload[at] if len(values) else missing, missing)


def seed_kgrams(seed_turns, max_draft: int) -> list[np.ndarray]:
    """The sorted k-gram hashes (k = 1..max_draft) of the seed turns, none crossing two turns."""
    seed = (np.concatenate([np.append(np.asarray(t, np.int64), _SEPARATOR) for t in seed_turns])
            if len(seed_turns) else np.zeros(0, np.int64))
    return [np.unique(h) for h in _kgram_hashes(seed, max_draft)]


class _Learned:
    """The k-grams of every turn of a replay (context and target, none crossing two turns), each with
    the first turn it occurs in: a k-gram counts as learned before turn i iff that turn is < i."""

    def __init__(self, turns: list[tuple[np.ndarray, np.ndarray]], max_k: int):
        parts, owner = [], []
        for i, (ctx, target) in enumerate(turns):
            text = np.concatenate([np.asarray(ctx, np.int64), np.asarray(target, np.int64), [_SEPARATOR]])
            parts.append(text)
            owner.append(np.full(len(text), i, np.int64))
        text = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        owner = np.concatenate(owner) if owner else np.zeros(0, np.int64)
        self.sets = []
        for k, h in enumerate(_kgram_hashes(text, max_k), start=1):
            values, first = np.unique(h, return_index=True)  # the first occurrence is in the earliest turn
            self.sets.append((values, owner[first]))
        self.turn = 0  # the turn being replayed

    def before(self, k: int, keys: np.ndarray) -> np.ndarray:
        values, first_turn = self.sets[k - 1]
        return _lookup(values, first_turn, keys, 1 << 62) < self.turn


def copyable_lengths(ctx: np.ndarray, target: np.ndarray, seed_sets: list[np.ndarray],
                     learned: _Learned | None = None) -> np.ndarray:
    """out[i] = the longest k <= len(seed_sets) such that target[i : i+k] occurs in the seed (or in
    an earlier turn, with `learned`) or lies wholly inside ctx + target[:i] (what a drafter has seen
    when it drafts target[i])."""
    max_k = len(seed_sets)
    full = np.concatenate([ctx, target]).astype(np.int64)
    n_ctx, n = len(ctx), len(target)
    out = np.zeros(n, np.int64)
    alive = np.ones(n, bool)  # a (k-1)-run was copyable, so a k-run may be
    starts = np.arange(n_ctx, n_ctx + n)
    for k, h in enumerate(_kgram_hashes(full, max_k), start=1):
        inside = alive & (starts + k <= len(full))
        keys = h[starts[inside]]
        values, ends = _first_end(h, k)
        ok = _lookup(values, ends, keys, 1 << 62) <= starts[inside]
        if len(seed_sets[k - 1]):
            ok |= np.isin(keys, seed_sets[k - 1])
        if learned is not None:
            ok |= learned.before(k, keys)
        alive[:] = False
        alive[np.flatnonzero(inside)[ok]] = True
        out[alive] = k
        if not alive.any():
            break
    return out


def copy_bound(chains, seed_turns, max_draft: int, learn: bool = False) -> ReplayStats:
    seed_sets = seed_kgrams(seed_turns, max_draft)
    learned = _Learned([t for chain in chains for t in chain], max_draft) if learn else None
    stats = ReplayStats()
    for chain in chains:
        for ctx, target in chain:
            lengths = copyable_lengths(ctx, target, seed_sets, learned)
            if learned is not None:
                learned.turn += 1
            n, pos = len(target), 0
            while pos < n:
                k = int(min(lengths[pos], max_draft, n - pos))
                stats.verify_steps += 1
                stats.drafted += k
                stats.accepted += k
                stats.draft_lengths.append(k)
                pos += min(k + 1, n - pos)
            stats.turns += 1
            stats.target_tokens += n
    return stats
