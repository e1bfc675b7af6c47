"""Peer drafters behind Sailfish's drafter interface, for side-by-side replay (`--peers`) and benchmarks.
Not Sailfish's drafter (that is ngram/), so kept beside the replay command that compares against them.

SuffixDecoding (the `arctic-inference` package, imported only when used).

Contract: `SuffixDecodingDrafter(turns, max_draft, max_spec_factor=1.0, use_tree_spec=False)` seeds SuffixDecodingCache's global tree with the
same token turns a Sailfish index holds (each as a finished request), so both drafters start from the
same knowledge. `session()` starts a request (the previous one is stopped, which adds its response to
the global tree, as vLLM does); `propose(context, n)` first adds the tokens committed since the last
call, then speculates from the last <= 64 tokens. Per arctic-inference's notes, `max_spec_tokens` is
always passed. `max_spec_factor` lets a draft run up to that many times the matched length (its best
setting is 4, not the default 1); with `use_tree_spec` a draft is a token tree (Draft.parents) of at
most max_draft tokens, verified as vLLM's suffix decoding does: the longest root path that matches.
"""
from __future__ import annotations

import itertools

import numpy as np

from ngram.draft import EMPTY_DRAFT, Draft

PATTERN_TOKENS = 64


class SuffixDecodingDrafter:
    def __init__(self, turns, max_draft: int = 8, min_token_prob: float = 0.1, max_spec_factor: float = 1.0,
                 use_tree_spec: bool = False):
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=64)
        self.max_draft = max_draft
        self.min_token_prob = min_token_prob
        self.max_spec_factor, self.use_tree_spec = max_spec_factor, use_tree_spec
        self._ids = itertools.count()
        self._active = None
        for turn in turns:
            rid = ("seed", next(self._ids))
            self.cache.start_request(rid, np.zeros(0, dtype=np.int32))
            self.cache.add_active_response(rid, np.asarray(turn, dtype=np.int32))
            self.cache.stop_request(rid)

    def session(self) -> "_SuffixSession":
        if self._active is not None:
            self._active.close()
        self._active = _SuffixSession(self, next(self._ids))
        return self._active


class _SuffixSession:
    def __init__(self, drafter: SuffixDecodingDrafter, rid):
        self.drafter, self.rid = drafter, rid
        self.seen = None  # context length already known to the cache
        self.open = False

    def propose(self, context_ids, max_tokens: int) -> Draft:
        cache = self.drafter.cache
        ctx = np.asarray(context_ids, dtype=np.int32)
        if self.seen is None:
            cache.start_request(self.rid, ctx)
            self.open, self.seen = True, len(ctx)
        elif len(ctx) > self.seen:
            cache.add_active_response(self.rid, ctx[self.seen:])
            self.seen = len(ctx)
        n = min(max_tokens, self.drafter.max_draft)
        if n <= 0:
            return EMPTY_DRAFT
        d = self.drafter
        draft = cache.speculate(self.rid, ctx[-PATTERN_TOKENS:], max_spec_tokens=n, min_token_prob=d.min_token_prob,
                                max_spec_factor=d.max_spec_factor, use_tree_spec=d.use_tree_spec)
        tokens = np.asarray(draft.token_ids[:n], dtype=np.int32)
        if not len(tokens):
            return EMPTY_DRAFT
        probs = np.asarray(draft.probs[: len(tokens)], dtype=np.float32)
        parents = list(draft.parents[:n]) if d.use_tree_spec else None
        return Draft(tokens, probs, "suffix", int(draft.match_len), parents)

    def prepare(self, context_ids) -> None:
        pass  # the request starts at the first propose (start_request takes the whole context)

    def feedback(self, drafted: int, accepted: int) -> None:
        pass

    def finish(self, context_ids=None) -> None:
        pass  # the response joins the global tree when the next session() stops this request

    def close(self) -> None:
        if self.open:
            self.drafter.cache.stop_request(self.rid)
            self.open = False
