"""The n-gram drafter: longest-suffix matching over the index, the live context and the overlay.

Contract (the session is an ngram.draft.DrafterSession):
    drafter = NgramDrafter(index_or_None, DrafterConfig(...))
    session = drafter.session()                         # one per request
    session.prepare(prompt_ids)                         # before the prefill (indexes a long prompt)
    draft = session.propose(context_ids, max_tokens)    # context = prompt + tokens committed so far
    session.feedback(drafted=len(draft), accepted=n)    # after verification
    session.finish(final_context_ids)                   # the completion joins the online overlay
`propose` never returns more than `max_tokens` tokens, and returns an empty Draft (source "none")
when no source matches at least `min_match` tokens with confidence above the cut-off.

A session serves one growing context: it encodes only the tokens appended since its last call (a
context that does not extend the previous one is encoded anew, only as much of it as is kept: past
2 x context_window tokens the text is cut back to the last context_window) and hands that text to
its sources (ngram.sources), each of which keeps its last match to follow or bound the next one.

Choice between sources (index, live context, online overlay): the longer match wins (it conditions
on more context), then the larger expected accepted length (the sum of cumulative confidences), as
if every source were asked every step. They are asked lazily: the source whose last draft was
accepted in full first, then in that order; once the best draft fills the request, the remaining
sources are skipped if its match is `trusted_match` tokens or longer, and otherwise each one whose
`bound` (its longest possible match) cannot exceed the best one's. A source whose match is shorter
than the best so far is searched (its state is kept for the next step) but not drafted from.
Draft length can adapt per session: a fully accepted draft raises the session's limit by `grow`, a
partly rejected one lowers it by one (never below `min_draft`), as transformers' assisted decoding
does. By default min_draft = max_draft, so it does not: how much of a draft to verify is the
engine's decision (its cost model weighs the draft's confidences against the verify cost curve),
and a second limit in the drafter only cut drafts the cost model would have verified. The defaults
(min_draft 16, min_match 1, max_match 32, cut-off 0.1; before: 2, 2, 16, 0.3) were chosen on replay:
BFCL held-out tau 6.77 -> 7.56, bench.long_context's chained agent conversations 6.66 -> 7.26, and
the same decode tokens/s on the bundled model's CPU engine (the cost model cuts the longer drafts).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ngram.codec import decode, encode
from ngram.context_index import ContextIndexCache
from ngram.draft import EMPTY_DRAFT, Draft
from ngram.index_file import NgramIndex
from ngram.lookup import IndexLookup
from ngram.overlay import Overlay
from ngram.match import prompt_lookup
from ngram.sources import ContextSource, IndexSource, OverlaySource, Source
from ngram.tree import merge


@dataclass(frozen=True)
class DrafterConfig:
    max_draft: int = field(default=16, metadata={"help": 'longest draft proposed'})
    min_draft: int = field(default=16, metadata={"help": 'the adaptive limit never drops below this (default: max_draft, no adaptive limit)'})
    grow: int = field(default=2, metadata={"help": 'added to the limit after a fully accepted draft'})
    min_match: int = field(default=1, metadata={"help": 'shortest suffix match that may propose'})
    trusted_match: int = field(default=6, metadata={"help": 'a full draft matching this many tokens ends the search of sources'})
    max_match: int = field(default=32, metadata={"help": 'longest suffix considered (index keys bound it too)'})
    confidence_cutoff: float = field(default=0.1, metadata={"help": 'stop where the cumulative confidence would fall below this'})
    scan_limit: int = field(default=16, metadata={"help": 'index keys examined per continuation (the heaviest first)'})
    context_window: int = field(default=262_144, metadata={"help": 'how far back (tokens) the live-context lookup searches'})
    context_occurrences: int = field(default=8, metadata={"help": 'most recent context occurrences that vote'})
    overlay_tokens: int = field(default=262_144, metadata={"help": 'online overlay of served completions (0: off)'})
    use_index: bool = field(default=True, metadata={"help": 'propose from the n-gram index (--no-use-index: context and overlay only)'})
    use_context: bool = field(default=True, metadata={"help": "propose from the request's own context (--no-use-context: index and overlay only)"})
    tool_schema: bool = field(default=True, metadata={"help": "draft a tool call's function and parameter names from the request's own declarations (server/tool_schema.py; --no-tool-schema: off)"})
    tree: bool = field(default=False, metadata={"help": "propose token trees: where the chosen draft leaves room, the other sources' continuations as branches (off by default: measured, no gain; see ngram/tree.py)"})


# A source's proposal before it becomes a Draft: (encoded tokens, cumulative confidences, source, match length).
_NO_CANDIDATE: tuple = ("", [], "none", 0)


class NgramDrafter:
    """Holds the index and the settings; all per-request state lives in DraftSession."""

    def __init__(self, index: NgramIndex | None = None, config: DrafterConfig | None = None):
        self.index = index
        self.config = config or DrafterConfig()
        max_match = self.config.max_match
        if index is not None:  # a match must leave room in the keys for continuation tokens
            max_match = min(max_match, index.params.key_tokens - 16)
        self.max_index_match = max_match
        self.lookup = (IndexLookup(index, self.config.scan_limit, max_draft=self.config.max_draft,
                                   cutoff=self.config.confidence_cutoff, longest=max_match)
                       if index is not None else None)
        self.overlay = Overlay(self.config.overlay_tokens) if self.config.overlay_tokens > 0 else None
        # finished sessions' context position indexes, for the next turn of their conversations
        self.context_indexes = ContextIndexCache()

    def session(self) -> "DraftSession":
        return DraftSession(self)

    def propose(self, context_ids, max_tokens: int) -> Draft:
        """One-off proposal (a fresh session); engines should hold a session per request."""
        return DraftSession(self).propose(context_ids, max_tokens)


class DraftSession:
    """Per-request state: the encoded context, its sources (ngram.sources), adaptive limit, counters."""

    def __init__(self, drafter: NgramDrafter):
        cfg = drafter.config
        self.drafter = drafter
        self.limit = cfg.max_draft
        self.drafted = 0
        self.accepted = 0
        self._text = ""
        self._seen = 0          # context tokens consumed (the text may keep only the last ones)
        self._last_id = -1
        self._prompt_end = -1  # text offset where generation started (set by the first propose)
        self._sticky = ""       # the source whose last draft was accepted in full
        self._last_source = ""
        self._trusted_match = cfg.trusted_match
        self._tree = cfg.tree
        # The index first: its followed rows usually give the longest match. Measured on the BFCL
        # held-out replay (tau, all turns): asking every source every step 6.68; this lazy search
        # with trusted_match 6 6.71 at about 60% of the cost (8: 6.68, 4: 6.67). Stopping at the
        # first full draft instead cost either 10% of tau with the context first (multi-turn 9.0 vs
        # 11.6) or, with the index first, 40% on outputs that copy their own context (the bundled
        # model's agentic workload, 5.7 vs 9.5).
        sources: list[Source] = []
        if cfg.use_index and drafter.index is not None:
            sources.append(IndexSource(drafter.lookup, drafter.max_index_match, cfg))
        if cfg.use_context:
            sources.append(ContextSource(cfg, drafter.context_indexes))
        if drafter.overlay is not None:
            sources.append(OverlaySource(drafter.overlay, cfg))
        self._sources = sources

    def propose(self, context_ids, max_tokens: int) -> Draft:
        max_tokens = min(max_tokens, self.limit)
        if max_tokens <= 0 or len(context_ids) == 0:
            return EMPTY_DRAFT
        self._sync(context_ids)
        text, seen = self._text, self._seen
        sources = self._sources
        if self._sticky and sources[0].name != self._sticky:
            sources = sorted(sources, key=lambda s: s.name != self._sticky)
        best, best_key = _NO_CANDIDATE, (0, 0.0)
        trusted = self._trusted_match
        others = [] if self._tree else None  # every source's continuation: a tree's branches
        for source in sources:
            if len(best[0]) == max_tokens and (best_key[0] >= trusted or best_key[0] >= source.bound(text, seen)):
                continue  # a full draft, trusted, or whose match this source cannot outgrow
            k = source.search(text, seen)
            # The longer match wins, then the larger expected accepted length: a shorter match than
            # the best so far cannot win, so it needs no walk unless it may branch a tree (its state
            # is kept for the next step either way).
            if k and (k >= best_key[0] or others is not None):
                drafted, confs = source.draft(text, k, max_tokens)
                if others is not None and drafted:
                    others.append((drafted, confs))
                key = (k, sum(confs))
                if key > best_key:
                    best, best_key = (drafted, confs, source.name, k), key
        drafted, confs, source, match_length = best
        self._last_source = source
        if not drafted:
            return EMPTY_DRAFT
        if others is not None and len(others) > 1:
            tree = merge(drafted, confs, [o for o in others if o[0] != drafted], max_tokens)
            if tree is not None:
                return Draft(decode(tree[0]), tree[1], source, match_length, tree[2])
        return Draft(decode(drafted), confs, source, match_length)

    def prepare(self, context_ids) -> None:
        """Encode the prompt and let each source index it (a long context's position index takes
        the previous turn's and adds the new tokens), so the first propose does not."""
        if len(context_ids):
            self._sync(context_ids)
            for source in self._sources:
                source.prepare(self._text)

    def finish(self, context_ids=None) -> None:
        """The request is complete (`context_ids`: its final prompt + completion, when the last
        tokens were never proposed from): the generated tokens, with a few prompt tokens before
        them so that a completion's start can be matched too, join the drafter's online overlay."""
        if context_ids is not None and len(context_ids) and self._prompt_end >= 0:
            self._sync(context_ids)
        for source in self._sources:
            source.finish(self._text)
        overlay = self.drafter.overlay
        if overlay is not None and 0 <= self._prompt_end < len(self._text):
            overlay.add(self._text[max(0, self._prompt_end - OVERLAY_ANCHOR_TOKENS) :])
        self._prompt_end = -1

    def feedback(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        cfg = self.drafter.config
        self.drafted += drafted
        self.accepted += accepted
        if accepted >= drafted:
            self.limit = min(cfg.max_draft, self.limit + cfg.grow)
            self._sticky = self._last_source
        else:
            self._sticky = ""
            self.limit = max(cfg.min_draft, self.limit - 1)

    def _sync(self, context_ids) -> None:
        """Bring the encoded text up to date with the context (append-only in the common case)."""
        n = len(context_ids)
        seen = self._seen
        window = self.drafter.config.context_window
        if seen and n >= seen and context_ids[seen - 1] == self._last_id:  # it extends the context seen last
            if n > seen:
                text = self._text
                self._text = ""  # `text` is now the only reference: += can extend it in place
                text += encode(context_ids[seen:])
                self._text = text
                self._last_id = int(context_ids[n - 1])
        else:  # a new context: only the part that would be kept is encoded
            self._text = encode(context_ids[-window:] if n > 2 * window else context_ids)
            for source in self._sources:
                source.reset()
            self._prompt_end = len(self._text)
            self._last_id = int(context_ids[n - 1])
        self._seen = n
        if len(self._text) > 2 * window:  # bound memory and search time on very long contexts
            drop = len(self._text) - window
            self._text = self._text[drop:]
            self._prompt_end -= drop
            for source in self._sources:
                source.shift(drop)


# Prompt tokens kept before each completion added to the overlay.
OVERLAY_ANCHOR_TOKENS = 6


class PromptLookupDrafter:
    """The baseline: transformers' prompt lookup over the request's own context, fixed length."""

    def __init__(self, max_draft: int = 10, max_ngram: int = 2):
        self.max_draft = max_draft
        self.max_ngram = max_ngram

    def session(self) -> "PromptLookupDrafter":
        return self  # stateless

    def propose(self, context_ids, max_tokens: int) -> Draft:
        ctx = np.asarray(context_ids, dtype=np.int64)
        tokens = prompt_lookup(ctx, min(max_tokens, self.max_draft), self.max_ngram)
        return _draft(tokens, [1.0] * len(tokens), "prompt-lookup", self.max_ngram if tokens else 0)

    def feedback(self, drafted: int, accepted: int) -> None:
        pass

    def prepare(self, context_ids) -> None:
        pass  # stateless: nothing to prepare

    def finish(self, context_ids=None) -> None:
        pass  # stateless: nothing to learn from a finished request


def _draft(tokens: list[int], confs: list[float], source: str, match_length: int) -> Draft:
    if not tokens:
        return EMPTY_DRAFT
    return Draft(tokens, confs, source, match_length)
