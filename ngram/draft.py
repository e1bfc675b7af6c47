"""The drafter interface, shared by every drafter and by the engine and the replay that use one.

`Drafter.session()` starts one request's drafting, a `DrafterSession` (see its docstring). A `Draft`
is what a session proposes: `tokens` are the proposed next token ids (a sequence of ints, possibly
empty: the n-gram drafter returns a list, other drafters may return an int array); `confidence[i]` is
the drafter's estimate (0..1) that tokens[:i+1] all match the target; `source` names where the draft
came from ("index", "context", "overlay", "suffix", ... or "none"); `match_length` is the number of
context tokens the drafter matched before proposing. A token tree (several continuations verified in
one forward) sets `parents`: parents[i] is the index of token i's parent in `tokens`, -1 for a child
of the pending token, and parents come before their children; a chain has parents None. A tree's
`confidence[i]` is the estimate for the path to token i. Its main chain (`chain_length`) is its
longest leading run of tokens that form a chain from the pending token; the n-gram drafter lays a
tree out with its chosen continuation there (ngram/tree.py), and an engine that verifies no trees
verifies that chain (`main_chain`).
"""
from __future__ import annotations

from typing import Protocol

import numpy as np


class DrafterSession(Protocol):
    """One request: `prepare` once with the prompt, before its prefill (work that depends only on
    the prompt, done while the target reads it); `propose` a Draft of at most max_tokens tokens
    after the context (prompt + tokens committed so far); `feedback` how many of its tokens were
    verified and accepted; `finish` once when the request is over (`context_ids`: its final prompt
    + completion). Every session has all four: the n-gram drafter's prepare indexes the prompt and
    its finish adds the completion to its online overlay; drafters with nothing to do there (prompt
    lookup, the peers) make them no-ops."""

    def prepare(self, context_ids) -> None: ...
    def propose(self, context_ids, max_tokens: int) -> "Draft": ...
    def feedback(self, drafted: int, accepted: int) -> None: ...
    def finish(self, context_ids=None) -> None: ...


class Drafter(Protocol):
    def session(self) -> DrafterSession: ...


class Draft:
    """A plain slotted class, not a dataclass or arrays: the drafter builds one per step, and on a
    slow CPU a frozen dataclass plus two numpy arrays cost more than the rest of a cheap proposal."""

    __slots__ = ("tokens", "confidence", "source", "match_length", "parents")

    def __init__(self, tokens, confidence, source: str = "none", match_length: int = 0, parents=None):
        self.tokens, self.confidence, self.source, self.match_length = tokens, confidence, source, match_length
        self.parents = parents

    def __len__(self) -> int:
        return len(self.tokens)

    def chain_length(self) -> int:
        """All of a chain; of a tree, the tokens before the first whose parent is not its predecessor."""
        if self.parents is None:
            return len(self.tokens)
        return next((i for i, p in enumerate(self.parents) if p != i - 1), len(self.parents))

    def main_chain(self) -> "Draft":
        """The draft as a chain: a tree cut to its main chain (a chain is returned as it is)."""
        if self.parents is None:
            return self
        k = self.chain_length()
        return Draft(self.tokens[:k], self.confidence[:k], self.source, self.match_length)

    def __repr__(self) -> str:
        return f"Draft({list(self.tokens)}, source={self.source!r}, match_length={self.match_length})"


EMPTY_DRAFT = Draft((), ())


def tree_layout(parents) -> tuple[np.ndarray, np.ndarray]:
    """(depth [M] int64, ancestors [M] int64 bit masks) of a token tree in a Draft's layout, as a
    verifier needs them: parents[0] == -1 (the pending token), 0 <= parents[j] < j; bit i of
    ancestors[j] is set when row i is on row j's path (itself included). At most 64 rows."""
    parents = [int(p) for p in parents]
    m = len(parents)
    if not 1 <= m <= 64 or parents[0] != -1 or any(not 0 <= p < j for j, p in enumerate(parents) if j):
        raise ValueError(f"not a token tree of 1..64 rows (parents[0] == -1, 0 <= parents[j] < j): {parents}")
    depth, bits = [0] * m, [1] + [0] * (m - 1)
    for j in range(1, m):
        depth[j] = depth[parents[j]] + 1
        bits[j] = bits[parents[j]] | (1 << j)
    return np.array(depth, dtype=np.int64), np.array(bits, dtype=np.uint64).view(np.int64)
